"""engine: bert-base under hard caps of 4, 6 and 8 GB, every memfit method against the swept oracle."""

from suites import Call, Context, Suite, gb, script

SUITE = Suite(
    name="engine",
    about="the engine alone, on one model whose batches vary in length: time over uncapped none, peak vs cap, "
          "OOMs, recomputed blocks and planner µs per step; dynamic against the best fixed-prefix plans (oracle)",
    model="bert-base-uncased architecture from its config (random weights), fp32, AdamW (lr 2e-5)",
    data="synthetic token ids, batch 32, lengths uniform in 32..512 (seed 0): the same batches in every run",
    methods=("none", "full", "static", "dynamic", "oracle"),
    budgets=(4, 6, 8),
    repeats=2,
    steps=200,
    quick_needs_cuda=True,
    notes="full runs at the middle budget only (its plan does not depend on the budget); oracle: per budget, a "
          "sweep under the same cap finds for every 16-token bucket the fewest first-k checkpointed layers whose "
          "two steps leave 3% of the budget free; those plans run as precomputed; overhead: the same model, "
          "batches of the same lengths and the caps of 4 and 6 GB in benchmarks/loop_bench.py, 100 steps, 3 "
          "interleaved repeats in one call: none against plain step by step in turn (alt), dynamic against its own "
          "plans step by step in turn (alt-dynamic), reactive; treatments: dynamic with and without selective recompute and offload (dynamic+all), "
          "3 interleaved repeats; replay-rate: reactive for 1,000 steps at 4 GB",
)
QUICK = SUITE.replace(methods=("none", "full", "dynamic"), budgets=(6,), repeats=1, steps=20)


def calls(suite: Suite, ctx: Context) -> list[Call]:
    common = ("--steps", suite.steps, "--budgets", *gb(suite.budgets), "--gpu_warmup_s", 2)
    methods = [m for m in suite.methods if m != "none"]  # engine_bench runs none uncapped itself
    folder = ctx.folder("engine")
    out = []
    if "oracle" in methods:
        out.append(Call("sweep", [script(ctx, "engine_bench.py", "--output_dir", folder, "--phase", "sweep", *common,
                                         "--methods", "oracle")], folder="engine"))
    # One call per repeat (about 8 minutes each on an H200), all into one folder: the runs read the
    # sweep. `full`'s plan does not depend on the budget: it runs at the middle one only.
    capped = [m for m in methods if m != "full"]
    middle = suite.budgets[len(suite.budgets) // 2]
    for r in range(suite.repeats):
        runs = ("--phase", "runs", "--steps", suite.steps, "--gpu_warmup_s", 2, "--repeats", 1, "--first_repeat", r)
        commands = [script(ctx, "engine_bench.py", "--output_dir", folder, *runs, "--budgets", *gb(suite.budgets),
                           "--methods", *capped, "--prime")]
        if "full" in methods:
            commands.append(script(ctx, "engine_bench.py", "--output_dir", folder, *runs, "--budgets", *gb([middle]),
                                   "--methods", "full", "--skip_none"))
        out.append(Call(f"r{r}", commands, folder="engine"))
    # What memfit costs beyond what it does, paired step by step in one process (loop_bench.py)
    bert = ("--model", "bert-base", "--dtype", "float32", "--lengths", "uniform:32:512", "--batch", 32)
    small = min(suite.budgets)
    out.append(Call("overhead", [script(
        ctx, "loop_bench.py", *bert, "--steps", 12 if ctx.quick else 100, "--steady_from", 2 if ctx.quick else 10,
        "--budgets", "--budget_gb", *suite.budgets[:2], "--repeats", 1 if ctx.quick else 3,
        "--methods", "none", "alt", "dynamic", "alt-dynamic", "reactive", "--time_limit_s", 480,
        "--output_dir", ctx.folder("overhead"))], folder="overhead"))
    # the planner's other treatments (selective recompute, offload) beside recompute alone: they
    # must never make dynamic slower
    out.append(Call("treatments", [script(
        ctx, "loop_bench.py", *bert, "--steps", 12 if ctx.quick else 100, "--steady_from", 2 if ctx.quick else 10,
        "--budgets", "--budget_gb", *suite.budgets[:2], "--repeats", 1 if ctx.quick else 3,
        "--methods", "none", "dynamic", "dynamic+all", "--time_limit_s", 480,
        "--output_dir", ctx.folder("treatments"))], folder="treatments"))
    out.append(Call("replay-rate", [script(
        ctx, "loop_bench.py", *bert, "--steps", 12 if ctx.quick else 1000, "--steady_from", 2 if ctx.quick else 10,
        "--budgets", "--budget_gb", small, "--repeats", 1, "--methods", "none", "reactive", "--time_limit_s", 560,
        "--output_dir", ctx.folder("replay-rate"))], folder="replay-rate"))
    return out
