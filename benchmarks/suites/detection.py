"""detection: Conditional DETR with Swin-T and Swin-B backbones, multi-scale batches of 16 images, two budgets each."""

from suites import Call, Context, Suite, gb, script

#: Backbone -> budgets in GB: 0.5 and 0.7 x uncapped none's largest peak on an H200 (the largest
#: scales need checkpointing at both; at 0.7 x the smallest need none).
BUDGETS = {"tiny": (17.78, 24.92), "base": (35.49, 49.70)}

SUITE = Suite(
    name="detection",
    about="a detector whose input size varies by scale: dynamic against static and full where the largest "
          "scales do not fit, on a backbone of cheap blocks (Swin-T) and one of costly blocks (Swin-B)",
    model="Conditional DETR with a Swin-T / Swin-B backbone (bundled configs, random weights), bf16 autocast, "
          "AdamW (lr 1e-4; 2e-5 for Swin-B), weight decay 1e-4, gradient clipping 0.1",
    data="synthetic COCO-like images (shapes of three classes on noisy backgrounds), batch 16, shorter side drawn "
         "from 480-800 once per batch (longer side at most 1333), padded to whole Swin windows; seed 42, 4 workers",
    methods=("none", "dynamic", "static", "full"),
    budgets={f"swin-{m}": b for m, b in BUDGETS.items()},
    repeats=4,
    steps=60,
    notes="each call runs none (uncapped) and every method at one budget, two interleaved repeats, after an "
          "untimed none run that primes the machine; benchmarks/step_sums.py prints the paired step differences",
)
QUICK = SUITE.replace(methods=("none", "dynamic", "static"), budgets={"swin-micro": ()}, repeats=2, steps=4)


def calls(suite: Suite, ctx: Context) -> list[Call]:
    methods = [m for m in suite.methods if m != "none"]
    if ctx.quick:  # the micro config on small images, budgets from the uncapped none run (0.6 x its peak)
        return [Call("quick", [script(ctx, "detection_bench.py", "--smoke", "--output_dir", ctx.folder("quick"),
                                      "--methods", *methods, "--repeats", 2)])]
    out = []
    for model, budgets in BUDGETS.items():
        for budget in budgets:
            for first in range(0, suite.repeats, 2):  # two repeats a call: about 6 minutes on an H200
                name = f"swin{model[0]}-{budget:g}GB-r{first}"
                out.append(Call(name, [script(
                    ctx, "detection_bench.py", "--output_dir", ctx.folder(name), "--models", model,
                    "--methods", *methods, "--multi_scale_per", "batch", "--budget_gb", *gb([budget]),
                    "--repeats", min(2, suite.repeats - first), "--steps", suite.steps, "--gpu_warmup_s", 2,
                    "--time_limit_s", 540)]))
    return out
