"""recompute: what recomputing each block costs in a real backward, against the probe's price of it."""

from suites import Call, Context, Suite, script

#: Plans (blocks checkpointed, by index) for the Swin-T detector; Swin-B's are recompute_bench.py's default.
SWIN_T_PLANS = ("none=", "stage1=0-1", "stage2=2-3", "stage3x4=4-7", "stage3x6=4-9", "stage4=10-11",
                "encoder=12-17", "decoder=18-23", "full=0-23")

SUITE = Suite(
    name="recompute",
    about="per plan, the median forward + backward time less none's on one fixed batch, and per block group the "
          "probe's time and an isolated forward + backward, plain and checkpointed: is the planner's price right?",
    model="the detection suite's Conditional DETR with a Swin-B and a Swin-T backbone, bf16 autocast",
    data="one batch of 16 random images of 896 x 1344 pixels; a loss on the logits and boxes (no matching)",
    methods=("none", "full"),
    repeats=2,
    steps=12,
    keep=("*.json",),
    report=False,
    notes="each plan runs 4 rounds of 3 interleaved steps; each probe 7 times; the whole call runs `repeats` times",
)
QUICK = SUITE.replace(repeats=1)


def calls(suite: Suite, ctx: Context) -> list[Call]:
    folder = ctx.folder("recompute")
    if ctx.quick:
        return [Call("quick", [script(ctx, "recompute_bench.py", "--smoke", "--json", folder / "smoke.json")],
                     folder="recompute")]
    return [Call(f"run{r + 1}", [
        script(ctx, "recompute_bench.py", "--probes", 7, "--json", folder / f"swin-base-run{r + 1}.json"),
        script(ctx, "recompute_bench.py", "--probes", 7, "--config_name", "conditional-detr-swin-tiny",
               "--json", folder / f"swin-tiny-run{r + 1}.json", "--plans", *SWIN_T_PLANS),
    ], folder="recompute") for r in range(suite.repeats)]
