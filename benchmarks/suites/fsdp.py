"""fsdp: a 3-8B decoder sharded by Accelerate's FSDP2 on 2 and 4 GPUs, one cap per rank, each rank planning for its own batches.

Two calls, one per GPU job, each a single ``fsdp_bench.py matrix`` launch (NOTE [One launch,
many configurations] there) that keeps to its wall-clock budget:

* ``x2`` (GPUs 0,1; within 520 s): Llama-3.2-3B full fine-tuning at 0.5 and 0.7 of ``none``'s
  per-rank peak, the same model with LoRA at 0.5, and Accelerate's checkpointing with CPU offload
  for 4 steps (it was 10.9x slower than ``none``: a full run does not fit the budget).
* ``x4-train`` then ``x4`` (GPUs 0-3; within 540 s together): ``memfit train causal-lm`` under
  torchrun with ``--fsdp`` as README.md writes it (the bundled Llama-3.2-1B config, synthetic SFT
  data, 8 steps, the model saved at the end), then Llama-3.2-3B at 0.5 (the same
  configurations as ``x2``: scaling), the injected-OOM check on 4 ranks, Llama-3.2-3B at 0.7 and
  ``static`` at 0.5, then LoRA at 0.5 on Llama-3.2-3B and on Llama-3.1-8B, in that order (what the
  deadline cuts is recorded as not run).

The commands (from the repository root; RAW a scratch folder, OUT the published one):

    python3 benchmarks/run_suite.py fsdp --calls x2 --raw /tmp/fsdp-raw --out $OUT/fsdp-x2
    python3 benchmarks/run_suite.py fsdp --calls x4-train x4 --raw /tmp/fsdp-raw --out $OUT/fsdp-x4

``x2-nodes`` (GPUs 0,1; within 180 s): the same ``memfit train`` command on two node ranks of one host (two
torchrun agents of one rank each, a c10d rendezvous on localhost, each agent on one GPU): issue 61's two nodes.

``x2-nodes-oom`` (GPUs 0,1; within 300 s): the injected-OOM check on two node ranks (``fsdp_bench.py matrix --nodes 2``).
``x2-long`` (GPUs 0,1; within 560 s): Llama-3.1-8B with LoRA on one sequence of 65,536 tokens per rank in 24 GiB per
rank, 6 steps, then HF checkpointing at that cap for 2 (issue 61).

``x2-reach`` (2 GPUs, within 560 s): the smallest per-rank cap, memfit's against each peer's need (``REACH``);
``x2-reach-below`` (within 400 s) the caps below it and the offloading peer's need (``REACH_BELOW``).

``x2-repeats`` and ``x4-repeats`` (2 and 4 GPUs, within 560 s each): the comparison of ``dynamic``
with ``full``, HF checkpointing and Accelerate's activation checkpointing at 0.5 (3B full fine-tuning, 8B LoRA), 2 interleaved repeats, each
configuration's time in collectives measured on one more step (``--profile``).

``x4`` ends with the 4-over-2 table (``x4/scaling.md``) when the x2 job's raw folder is on the
same machine; else, from the two published folders:
``python benchmarks/fsdp_bench.py summarize OUT_X2 OUT_X4 --summary scaling.md``.
"""

import os
import shlex
import time

from suites import Call, Context, Suite, memfit, script

#: seconds a job keeps for publishing its results and for killing a launch past its deadline
_PUBLISH_S, _GRACE_S = 20, 30
#: the jobs' wall-clock budgets (GPU plan): 2 ranks; 4 ranks, the train call included
JOB_S = {"x2": 520, "x4": 540}
#: a shorter session sets them in the environment: ``MEMFIT_FSDP_JOB_S="x2=440,x4=420,x2-repeats=400"``
JOB_S.update({k: int(v) for k, v in (kv.split("=") for kv in filter(None, os.environ.get("MEMFIT_FSDP_JOB_S", "").split(",")))})
#: Peers, memfit only measuring, under the same per-rank cap.
PEERS = ("accelerate-ac", "accelerate-ac-offload", "hf-ckpt")
#: each configuration's methods at a cap, fastest-to-judge first (dynamic, then what it is compared with)
CAPPED = ("dynamic", "full", "accelerate-ac", "hf-ckpt", "static")

SUITE = Suite(
    name="fsdp",
    about="fine-tuning under FSDP2 through Accelerate with a cap per rank at 0.5 and 0.7 of uncapped none's per-rank "
          "peak: time per step of the slowest rank, every rank's peak vs its cap, OOMs and replays, blocks treated per "
          "rank, dynamic vs the fastest peer that fits, scaling from 2 to 4 GPUs, an injected-OOM check on 4 ranks, "
          "and memfit train causal-lm --fsdp as the README launches it",
    model="Llama-3.2-3B (full fine-tuning and LoRA) and Llama-3.1-8B (LoRA: r 16 on every linear layer, peft), "
          "shapes from memfit/configs with the real 128,256-token vocabulary, random weights, bf16 weights, SDPA, "
          "AdamW (torch's default foreach step); built on the meta device, sharded by Accelerate's FSDP2 "
          "(fully_shard on every decoder layer, embeddings and head, the root; reshard after forward), then "
          "materialised on the GPU",
    data="token ids of lengths uniform in 512-3,072 tokens, batch 3 per rank (3k-9k tokens a step: the activations, "
         "not the optimizer step, set the peak), dynamic padding; each rank draws its own batches (seeded by rank), "
         "the same in every configuration",
    methods=("none", "full", "static", "dynamic"),
    peers=PEERS,
    budgets={"llama-3b": (0.5, 0.7), "llama-3b+lora": (0.5,), "llama-8b+lora": (0.5,)},
    repeats=1,
    steps=12,
    gpus=2,
    carry=("tokenizer",),
    keep=("*/summary.md", "*/scaling.md", "*/oom-check-*/oom_check.rank*.json"),
    notes="budgets are shares of uncapped none's per-rank peak (the largest over the ranks) measured by the same "
          "launch first; time is the slowest rank's median step from step 6 (x2 and x4: one run per configuration, "
          "the job budgets allow no repeats; x2-repeats and x4-repeats: their cells twice, interleaved); a configuration stops after 45 s of steps; before training the ranks "
          "check the cap against the static need (weights, gradients, AdamW state and its foreach step's "
          "temporaries) and skip it together if it does not fit; an error on a rank ends the launch and the "
          "rest run in a new one; the 3B model's logits (128,256 x tokens, about 1.2 MiB a token at their peak) "
          "are a third of its blocks' activations (3.5 MiB a token), so at 0.5 only a plan that checkpoints "
          "nearly every block fits",
)
#: --quick on CPU: 2 gloo ranks, memfit's tiny Llama, 6 steps, a check of the scripts (offload and the
#: Trainer's --fsdp need GPUs: left out); on GPUs: the 1B shape, a few configurations.
QUICK = SUITE.replace(budgets={"tiny": (0.7,)}, steps=6)


def _matrix(ctx: Context, name: str, nproc: int, port: int, configs: list[str], job_s: float, quick: bool,
            steps: int, repeats: int = 1, nodes: int = 1, settings: tuple = (), extra: tuple = ()) -> Call:
    """One ``fsdp_bench.py matrix`` launch that ends ``job_s`` after the suite's calls were made, less
    what publishing and a last kill take (rule 4 of NOTE [One launch, many configurations]); ``settings``
    (on GPUs) instead of the SFT batches'."""
    settings = ("--steps", steps, "--steady_from", 3, "--max_length", 64, "--config_limit_s", 60) if quick and not ctx.cuda \
        else settings or ("--steps", steps, "--steady_from", 6, "--batch_size", 3, "--min_length", 512, "--max_length", 3072,
                          "--config_limit_s", 45)
    end_s = job_s - _PUBLISH_S - _GRACE_S
    command = script(ctx, "fsdp_bench.py", "matrix", "--output_dir", ctx.folder(f"fsdp/{name}"), "--nproc", nproc,
                     "--port", port, "--deadline_s", end_s, "--end_unix_s", round(time.time() + end_s),
                     "--grace_s", _GRACE_S, "--repeats", repeats, "--nodes", nodes, *settings, *extra, *configs)
    return Call(name, [command], folder=f"fsdp/{name}", timeout_s=job_s, env={} if ctx.cuda else {"OMP_NUM_THREADS": "1"})


def _capped(model: str, shares, methods=CAPPED) -> list[str]:
    return [f"{model}/{m}@{s:g}" for s in shares for m in methods]


def calls(suite: Suite, ctx: Context) -> list[Call]:
    if ctx.quick:
        model = "llama-1b" if ctx.cuda else "tiny"
        x2 = [f"{model}/none", *_capped(model, (0.7,), ("dynamic", "full", "accelerate-ac")), f"oom-check:{model}"]
        x4 = [f"{model}/none", *_capped(model, (0.7,), ("dynamic", "hf-ckpt", "static")), f"{model}+lora/none",
              f"{model}+lora/dynamic@0.7"]
        train_model, nproc4 = ("Llama-3.2-1B", 4) if ctx.cuda else ("llama-tiny", 2)
        jobs = (600, 600)
    else:
        b = suite.budgets
        # the order is what a short session keeps first: 3B at 0.5 with every method, 0.7 against the
        # peers, LoRA at 0.5 (x2); the train call, 3B at 0.5 and the injected OOM (x4)
        x2 = ["llama-3b/none", *_capped("llama-3b", b["llama-3b"][:1]),
              *_capped("llama-3b", b["llama-3b"][1:], ("dynamic", "accelerate-ac", "hf-ckpt")), "llama-3b+lora/none",
              *_capped("llama-3b+lora", b["llama-3b+lora"], ("dynamic", "accelerate-ac", "hf-ckpt"))]
        x4 = ["llama-3b/none", *_capped("llama-3b", b["llama-3b"][:1], ("dynamic", "full", "accelerate-ac", "hf-ckpt")),
              "oom-check:llama-1b", *_capped("llama-3b", b["llama-3b"][1:], ("dynamic", "accelerate-ac", "hf-ckpt")),
              "llama-3b/static@0.5", "llama-3b+lora/none",
              *_capped("llama-3b+lora", b["llama-3b+lora"], ("dynamic", "accelerate-ac", "hf-ckpt")), "llama-8b+lora/none",
              *_capped("llama-8b+lora", b["llama-8b+lora"], ("dynamic", "accelerate-ac", "hf-ckpt"))]
        train_model, nproc4 = "Llama-3.2-1B", 4
        jobs = (JOB_S["x2"], JOB_S["x4"])
    out = [_matrix(ctx, "x2", 2, 29711, x2, jobs[0], ctx.quick, suite.steps)]
    # memfit train causal-lm as README.md launches it under torchrun (CPU: no --fsdp, which the
    # Trainer runs only on accelerators; the rest of the command is checked)
    fsdp = ("--fsdp", "full_shard auto_wrap", "--fsdp_config",
            '{"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": true}')
    train = (ctx.python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc4), "--master_port", "29790",
             *memfit(ctx, "train", "causal-lm")[1:], "--do_train", "--config_name", train_model, *ctx.tokenizer(),
             *(("--torch_dtype", "bfloat16") if ctx.cuda else ()), "--synthetic", "400", "--per_device_train_batch_size", "4",
             "--max_steps", "8", "--logging_steps", "1", "--report_to", "none", "--output_dir",
             str(ctx.folder("fsdp/x4-train")), "--memory_budget", "20GiB" if ctx.cuda else "2GiB",
             "--memfit_method", "dynamic", *(fsdp if ctx.cuda else ("--use_cpu",)))  # CPU ranks: one job only so
    out.append(Call("x4-train", [train], folder="fsdp/x4-train", timeout_s=150 if ctx.cuda else 300,
                    env={} if ctx.cuda else {"OMP_NUM_THREADS": "1"}))
    # the same command on two node ranks of this host (two torchrun agents of one rank each, a c10d rendezvous on
    # localhost: docs/distributed.md's several nodes), each agent on a GPU of its own
    tail = list(train[train.index("--master_port") + 2:])
    tail[tail.index("--output_dir") + 1] = str(ctx.folder("fsdp/x2-nodes"))
    agent = (ctx.python, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
             "--rdzv_endpoint", "127.0.0.1:29795", "--rdzv_id", "memfit-nodes", *tail)
    node = lambda r: (f"CUDA_VISIBLE_DEVICES={r} " if ctx.cuda else "") + shlex.join(agent)  # noqa: E731
    out.append(Call("x2-nodes", [("bash", "-c", f"{node(0)} & a=$!; {node(1)} & b=$!; wait $a; x=$?; wait $b; exit $((x | $?))")],
                    folder="fsdp/x2-nodes", timeout_s=180 if ctx.cuda else 300, env={} if ctx.cuda else {"OMP_NUM_THREADS": "1"}))
    # an OOM injected in a block's forward on one of two node ranks (one GPU each), replayed by both
    out.append(_matrix(ctx, "x2-nodes-oom", 2, 29797, ["oom-check:llama-1b" if ctx.cuda else "oom-check:tiny"], 300, ctx.quick,
                       suite.steps, nodes=2, extra=("--collective_timeout_s", 30)))
    # issue 61's long context: Llama-3.1-8B with LoRA, one sequence of 65,536 tokens per rank, 24 GiB per rank (host
    # checkpoints and the tiled MLP under FSDP2), then HF checkpointing at the same cap
    long_settings = ("--steps", 6, "--steady_from", 4, "--batch_size", 1, "--min_length", 65536, "--max_length", 65536,
                     "--config_limit_s", 240)
    out.append(_matrix(ctx, "x2-long", 2, 29799, ["llama-8b+lora/dynamic@24GiB", "llama-8b+lora/hf-ckpt@24GiB:2"]
                       if ctx.cuda else ["tiny+lora/dynamic@1GiB"], 560, ctx.quick, 6, settings=long_settings))
    # made with the train call's: its end counts the train call's time too; then, where the x2 job's
    # folder is on this machine (the same --raw), the 4-over-2 table
    x4_call = _matrix(ctx, "x4", nproc4, 29731, x4, jobs[1], ctx.quick, suite.steps)
    scaling = script(ctx, "fsdp_bench.py", "summarize", ctx.folder("fsdp/x4"), ctx.folder("fsdp/x2"), "--summary",
                     ctx.folder("fsdp/x4") / "scaling.md")
    out.append(Call(x4_call.name, [*x4_call.commands, scaling], folder=x4_call.folder, timeout_s=x4_call.timeout_s,
                    env=x4_call.env))
    return out if ctx.quick else out + _repeated_cells(ctx) + [_reach(ctx), _reach_below(ctx)]


#: the cells run with 2 interleaved repeats (``x2-repeats``, ``x4-repeats``): dynamic against full, HF checkpointing
#: and Accelerate's activation checkpointing at 0.5, full fine-tuning of the 3B shape and LoRA of the 8B one
REPEATED = ("llama-3b/none", "llama-3b/dynamic@0.5", "llama-3b/full@0.5", "llama-3b/hf-ckpt@0.5", "llama-3b/accelerate-ac@0.5",
            "llama-8b+lora/none", "llama-8b+lora/dynamic@0.5", "llama-8b+lora/hf-ckpt@0.5", "llama-8b+lora/accelerate-ac@0.5")


def _repeated_cells(ctx: Context) -> list[Call]:
    """Issue 41's comparison with 2 interleaved repeats, 14 steps each, one call per GPU count, each
    within 560 s (results: nvidia-h100-x2/fsdp and nvidia-h100-x4/fsdp, with the 4-over-2 table from
    ``fsdp_bench.py summarize X4 X2 --summary``)."""
    return [_matrix(ctx, f"x{n}-repeats", n, port, list(REPEATED), JOB_S.get(f"x{n}-repeats", 560), False, 14, repeats=2,
                    extra=("--profile",))
            for n, port in ((2, 29715), (4, 29714))]


#: issue 61's smallest per-rank cap: each peer's need read at a cap that does not bind (its peak: HF checkpointing and
#: Accelerate's recompute every block, so nothing smaller fits them), HF checkpointing again at 0.7 of its need on
#: the 3B shape (2 H200s: 26.73 GiB, s30-5), and memfit at that and below (3B: 16.80 GiB of static need per rank)
REACH = ("llama-3b/hf-ckpt@40GiB:8", "llama-3b/accelerate-ac@40GiB:8", "llama-8b+lora/hf-ckpt@40GiB:8",
         "llama-8b+lora/accelerate-ac@40GiB:8", "llama-3b/dynamic@18.5GiB", "llama-3b/dynamic@17.5GiB",
         "llama-8b+lora/dynamic@18GiB", "llama-8b+lora/dynamic@14GiB", "llama-8b+lora/dynamic@11GiB",
         "llama-3b/hf-ckpt@18.5GiB:4")


#: below s31's reach (``x2-reach-below``): memfit's static check now counts the optimizer step its part runs (the
#: per-tensor step where foreach's do not fit), so the 3B shape is tried under the foreach count (16.80 GiB); the 8B
#: LoRA between 11 GiB (stopped) and 14 (ran); Accelerate's activation checkpointing with its CPU offload, 4 steps
#: (10.9x ``none`` a step in s29), for its need
REACH_BELOW = ("llama-8b+lora/dynamic@13GiB", "llama-3b/dynamic@16GiB", "llama-8b+lora/dynamic@12GiB",
               "llama-3b/dynamic@15GiB", "llama-3b/accelerate-ac-offload@40GiB:4", "llama-8b+lora/accelerate-ac-offload@40GiB:4")


def _reach(ctx: Context) -> Call:
    """``x2-reach`` (2 GPUs, within 560 s): :data:`REACH`, the SFT batches of the other cells, each rank's time in
    collectives profiled."""
    return _matrix(ctx, "x2-reach", 2, 29716, list(REACH), JOB_S.get("x2-reach", 560), False, 12, extra=("--profile",))


def _reach_below(ctx: Context) -> Call:
    """``x2-reach-below`` (2 GPUs, within 400 s): :data:`REACH_BELOW`, the SFT batches of the other cells."""
    return _matrix(ctx, "x2-reach-below", 2, 29717, list(REACH_BELOW), JOB_S.get("x2-reach-below", 400), False, 12)
