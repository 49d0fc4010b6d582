"""soak: thousands of steps on an adversarial length schedule under a tight budget: does anything run out of memory?"""

from suites import Call, Context, Suite, gb, script

SUITE = Suite(
    name="soak",
    about="safety over a long run whose lengths are built to break a learned memory model (long tails, a "
          "never-seen longer maximum at intervals, monotone ramps): OOMs, steps over the budget, evictions",
    model="GPU: bert-base-uncased architecture from its config (random weights), fp32, AdamW, batch 16; CPU "
          "(logical accounting, exact): a 4-layer BERT of hidden size 32, eager attention, batch 4",
    data="synthetic token ids, lengths from cpu_soak.schedule (seed 0): a log-normal tail, monotone ramps and a "
         "never-seen longer maximum every 250 steps, 32 up to 512 tokens",
    methods=("none", "dynamic", "dynamic-nobackstop", "reactive"),
    budgets=(5,),
    repeats=1,
    steps=2000,
    needs_cuda=False,
    notes="on CPU the budget is logical (exact), halfway between the counted peaks of none and full at 512 "
          "tokens (about 59 MB); there only dynamic and reactive run (with a 5% margin), and the soak times nothing; "
          "dynamic-nobackstop is dynamic with backstop=False",
)
QUICK = SUITE.replace(steps=40)


def calls(suite: Suite, ctx: Context) -> list[Call]:
    methods = [m for m in suite.methods if m != "none"]
    if not ctx.cuda:  # the CPU soak: logical accounting, a tiny model
        sizes = ("--steps", suite.steps, "--jump_every", 10, "--max_len", 64) if ctx.quick else (
            "--steps", suite.steps, "--jump_every", 250)
        # No `none`: a logical budget is exact, so the CPU soak checks the budget and times nothing.
        return [Call("cpu", [script(ctx, "cpu_soak.py", "--output_dir", ctx.folder("cpu"), *sizes, "--methods",
                                    *[m for m in methods if m != "dynamic-nobackstop"])])]
    return [Call(f"r{r}", [script(ctx, "engine_bench.py", "--output_dir", ctx.folder("gpu"), "--phase", "runs",
                                  "--schedule", "adversarial", "--jump_every", 250, "--steps", suite.steps,
                                  "--batch_size", 16, "--budgets", *gb(suite.budgets), "--max_ooms", 200,
                                  "--methods", *methods, "--repeats", 1, "--first_repeat", r, "--gpu_warmup_s", 2, "--prime")],
                 folder="gpu")
            for r in range(suite.repeats)]
