"""planner: what planning costs per step, timed on the host (it is Python before the first block runs)."""

from suites import Call, Context, Suite, script

SUITE = Suite(
    name="planner",
    about="microseconds of the call the step records' planner_us measures (method.decide), on memory models "
          "shaped like the GPU runs': settled, with the model changing every 3 steps, a new bucket, a cache hit",
    model="memory models of bert-base (12 alike blocks) and Conditional DETR with Swin-T / Swin-B backbones "
          "(24 / 36 blocks in 6 groups; Swin-B also with shifted layers apart: 11 groups)",
    data="the engine suite's lengths (batch 32, 32..512 tokens) and the detection suite's multi-scale images "
         "(batch 2, shorter side 480..800), fixed seed",
    methods=("dynamic", "static"),
    repeats=3,
    steps=200,
    gpus=0,
    needs_cuda=False,
    keep=("planner.md", "planner.json"),
    report=False,
    notes="no GPU: the planner is host Python; times move by about ±30% between runs on one machine",
)
QUICK = SUITE.replace(repeats=1, steps=20)


def calls(suite: Suite, ctx: Context) -> list[Call]:
    folder = ctx.folder("planner")
    models = ("--models", "bert-base") if ctx.quick else ()
    return [Call("planner", [script(ctx, "planner_bench.py", "--steps", suite.steps, "--repeats", suite.repeats,
                                    *models, "--json", folder / "planner.json", "--markdown", folder / "planner.md")])]
