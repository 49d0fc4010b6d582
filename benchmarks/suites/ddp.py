"""ddp: two GPUs under DDP, one budget per rank, each rank planning for its own lengths."""

from suites import Call, Context, Suite, script, torchrun

SUITE = Suite(
    name="ddp",
    about="the memfit Trainer under torchrun with two ranks whose batches differ in length: per-rank caps, "
          "per-rank plans, and what the lockstep gradient sync (which lets one rank replay an OOM) costs",
    model="bert-base-uncased architecture from its config (random weights), fp32, AdamW (lr 2e-5)",
    data="synthetic token ids, batch 32 per rank, one length per batch: rank 0's uniform in 32..256, rank 1's in "
         "256..512 (fixed seeds); Accelerate hands batch b to rank b % 2",
    methods=("none", "full", "dynamic", "dynamic-ddp-sync"),
    budgets=(6, 8),
    repeats=1,
    steps=60,
    gpus=2,
    keep=("summary.md",),
    notes="configurations: none uncapped, full and dynamic at the low budget, dynamic and dynamic-ddp-sync "
          "(--memfit_lockstep False: DDP's own overlapped sync) at the high one, and a 5-step check of "
          "`accelerate launch` (GPU only); budgets are per rank",
)
#: --quick: a tiny BERT on CPU under gloo, logical budgets of 10 and 16 MB (rank 0 peaks near 7 MB, rank 1 near 23).
QUICK = SUITE.replace(budgets=(0.010, 0.016), steps=12)


def calls(suite: Suite, ctx: Context) -> list[Call]:
    low, high = (f"{b:g}GB" for b in suite.budgets)
    if ctx.quick:
        common = ("--tiny", "--steps", suite.steps, "--batch_size", 4, "--lengths0", "8:32", "--lengths1", "96:160",
                  "--gpu_warmup_s", 0)
    else:
        common = ("--steps", suite.steps, "--batch_size", 32, "--lengths0", "32:256", "--lengths1", "256:512",
                  "--gpu_warmup_s", 2)
    configs = {"none": (), f"full-{low}": ("--method", "full", "--budget", low),
               f"dynamic-{low}": ("--method", "dynamic", "--budget", low),
               f"dynamic-{high}": ("--method", "dynamic", "--budget", high),
               f"dynamic-{high}-ddp-sync": ("--method", "dynamic", "--budget", high, "--ddp_sync")}
    env = {"OMP_NUM_THREADS": "1"} if ctx.quick else {}
    out = []
    for r in range(suite.repeats):
        for i, (config, flags) in enumerate(configs.items()):
            name = config + (f"-r{r}" if suite.repeats > 1 else "")
            flags = flags or ("--method", "none")
            out.append(Call(name, [torchrun(ctx, 2, 29650 + i, "ddp_bench.py", "run", "--output_dir",
                                            ctx.folder(f"ddp/{name}"), *common, *flags)],
                            folder=f"ddp/{name}", timeout_s=180 if ctx.quick else 100, env=env))
    if not ctx.quick:  # accelerate launches several CPU processes only through mpirun
        out.append(Call("accelerate-check", [(
            ctx.python, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
            "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29660",
            *script(ctx, "ddp_bench.py")[1:], "run", "--output_dir", str(ctx.folder("ddp/accelerate-check")),
            *map(str, common), "--steps", "5", "--method", "dynamic", "--budget", low)],
            folder="ddp/accelerate-check", timeout_s=100))
    out.append(Call("summarize", [script(ctx, "ddp_bench.py", "summarize", ctx.folder("ddp"))], folder="ddp"))
    return out
