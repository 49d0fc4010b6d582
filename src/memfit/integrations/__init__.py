"""Where users train: the Hugging Face Trainer (hf), several ranks (distributed) and the output folder
a run claims (run_dir). TRL's SFTTrainer is the public module :mod:`memfit.trl`."""
