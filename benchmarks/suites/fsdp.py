"""fsdp: a 3-8B decoder sharded by Accelerate's FSDP2 on 2 and 4 GPUs, one cap per rank, each rank planning for its own batches."""

from suites import Call, Context, Suite, script, torchrun

#: Peers, memfit only measuring, under the same per-rank cap.
PEERS = ("accelerate-ac", "accelerate-ac-offload", "hf-ckpt")

SUITE = Suite(
    name="fsdp",
    about="fine-tuning under FSDP2 through Accelerate with a cap per rank at 0.5 and 0.7 of uncapped none's per-rank "
          "peak: time per step of the slowest rank, every rank's peak vs its cap, OOMs and replays, blocks treated per "
          "rank, scaling from 2 to 4 GPUs, and an injected-OOM check (all ranks replay, weights bitwise equal)",
    model="Llama-3.2-3B's shape for full fine-tuning and Llama-3.1-8B's for LoRA (r 16 on every linear layer, peft), "
          "random weights, vocabulary cut to 32,000, bf16 weights, SDPA, AdamW; Accelerate's FSDP2 plugin: fully_shard "
          "on every decoder layer and the root, reshard after forward",
    data="token ids with memfit train causal-lm's SFT lengths (long-tailed up to 2,048 tokens), batch 4 per rank, "
         "dynamic padding; each rank draws its own batches (seeded by rank), the same in every run",
    methods=("none", "full", "static", "dynamic"),
    peers=PEERS,
    budgets={"ft": (0.5, 0.7), "lora": (0.5, 0.7)},
    repeats=1,
    steps=30,
    gpus=2,
    keep=("summary.md",),
    notes="budgets are shares of uncapped none's per-rank peak (the largest over the ranks), measured by its run "
          "first, so they are per rank; the 4-GPU matrix runs where 4 GPUs are visible, and summary.md gives the "
          "throughput of 4 over 2; time is the slowest rank's median step from step 8 on; memfit methods run a plain "
          "loop through run_step, hooked after Accelerate sharded the model; peers: Accelerate's FSDP2 activation "
          "checkpointing (fsdp_activation_checkpointing), the same with its CPU offload (fsdp_offload_params), and "
          "Hugging Face's gradient_checkpointing_enable; every collective times out after 300 s, so a run fails "
          "instead of hanging",
)
#: --quick: ONE device call on a 2-GPU machine (under 9 minutes): Llama-3.2-1B's shape, full fine-tuning,
#: 10 steps, cap 0.9 of none's peak (its weights, gradients and AdamW state take about 0.8 of that peak per rank at batch 4:
#: half of it is below what training needs before any activation), memfit's dynamic and full and two peers, and the injected-OOM check
#: (on CPU: a 4-layer decoder under gloo, a check of the scripts, offload left out).
QUICK = SUITE.replace(budgets={"ft": (0.9,)}, steps=10)


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def calls(suite: Suite, ctx: Context) -> list[Call]:
    out: list[Call] = []
    if ctx.quick:
        shape = "llama-1b" if ctx.cuda else "tiny"
        rows = [("ft", shape, False)]
        methods = ("dynamic", "full", "accelerate-ac", "hf-ckpt") + (("accelerate-ac-offload",) if ctx.cuda else ())
        worlds = (2,)
        common = ("--steps", suite.steps, "--steady_from", 3) + (() if ctx.cuda else ("--max_length", 256))
        timeout_s = 150
    else:
        rows = [("ft", "llama-3b", False), ("lora", "llama-8b", True)]
        methods = ("full", "static", "dynamic", *PEERS)
        worlds = (2, 4) if _gpus() >= 4 else (2,)
        common = ("--steps", suite.steps, "--steady_from", 8)
        timeout_s = 900
    env = {} if ctx.cuda else {"OMP_NUM_THREADS": "1"}
    port = 29700
    for world in worlds:
        for row, shape, lora in rows:
            flags = ("--shape", shape, *(("--lora",) if lora else ()), *common)
            none = f"{row}-x{world}-none"
            port += 1
            out.append(Call(none, [torchrun(ctx, world, port, "fsdp_bench.py", "run", "--output_dir", ctx.folder(f"fsdp/{none}"),
                                            "--method", "none", *flags)], folder=f"fsdp/{none}", timeout_s=timeout_s, env=env))
            for share in suite.budgets[row]:
                for method in methods:
                    name = f"{row}-x{world}-{method}-{share:g}"
                    port += 1
                    out.append(Call(name, [torchrun(ctx, world, port, "fsdp_bench.py", "run", "--output_dir",
                                                    ctx.folder(f"fsdp/{name}"), "--method", method, *flags, "--reference",
                                                    ctx.folder(f"fsdp/{none}"), "--share", share)],
                                    folder=f"fsdp/{name}", timeout_s=timeout_s, env=env))
    # the injected-OOM check: its own folder, beside the matrix (summarize reads only the matrix)
    shape = "llama-1b" if ctx.cuda else "tiny"
    out.append(Call("oom-check", [torchrun(ctx, 2, port + 1, "fsdp_bench.py", "oom-check", "--output_dir",
                                           ctx.folder("oom-check"), "--shape", shape, "--steps", 10, "--steady_from", 3,
                                           *(() if ctx.cuda else ("--max_length", 256)))],
                    folder="oom-check", timeout_s=240, env=env))
    out.append(Call("summarize", [script(ctx, "fsdp_bench.py", "summarize", ctx.folder("fsdp"))], folder="fsdp"))
    return out
