"""Planner time per step on the CPU: what the step records' ``planner_us`` measures.

The planner's cost does not depend on the GPU: it is Python on the host, before the first
block runs (NOTE [Plan is fixed before forward] in engine/run/controller.py). This script times exactly
the call the controller times (``method.decide(planning, key)``) on memory models shaped
like the GPU runs', so a change to the planner can be measured here in seconds:

* ``bert-base``: 12 identical blocks (one group), batch 32, lengths uniform in 32..512
  (the engine benchmark's schedule), curves with the H200 run's magnitudes;
* ``swin-t-detr`` / ``swin-b-detr``: Conditional DETR with a Swin-T / Swin-B backbone,
  blocks in six groups (the four Swin stages, the encoder and decoder layers: 24 / 36
  blocks), batch 2, multi-scale images (shorter side 480..800, padded to whole windows),
  the detection benchmark's schedule.

For each, ``dynamic`` and ``static`` over the schedule (cache as in a run: one plan per
shape bucket, kept while the model does not change), the same with the model changing every
``--learn_every`` steps (three curves learn a sample, every plan is dropped: the curves refit
and the shapes replan, as after a step that teaches the model), and, apart, a plan for a
never-seen bucket (cache cleared first) and a cache hit. Times are microseconds, median and mean over
``--repeats`` passes.

Usage:
    python benchmarks/planner_bench.py [--steps 200] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from memfit.engine.methods import Dynamic, Static
from memfit.engine.plan.model import Curve
from memfit.engine.plan.planner import Plan
from memfit.engine.plan.planning import Planning

GB = 10**9


def _curve(points, coef, intercept=False, floor=0.0, linear_until=0) -> Curve:
    """A curve with samples ``y = coef · (1, N, N·T, N·T²)`` at the given keys."""
    c = Curve(intercept=intercept, floor=floor, linear_until=linear_until)
    for n, t in points:
        c.add((n, t), coef[0] + coef[1] * n + coef[2] * n * t + coef[3] * n * t * t)
    return c


def bert_planning(budget_bytes: int) -> tuple[Planning, list[tuple[int, int]]]:
    """bert-base fp32, batch 32: per block ~1.5 MB/token saved, 1 kB/token kept when checkpointed."""
    keys = [(32, t) for t in (64, 128, 200, 256, 320, 400, 512)]
    planning = Planning(12, [0] * 12, budget_bytes, int(0.03 * budget_bytes), 8)
    group = planning.model.group_models[0]
    group.bytes["keep"] = _curve(keys, (0, 0, 37_000, 12 * 4 * 4))
    group.bytes["recompute"] = _curve(keys, (0, 0, 3_072, 0))
    group.ms["recompute"] = _curve(keys, (0.1, 0, 2.6e-5, 0), intercept=True)
    planning.model.outside = _curve(keys, (0, 0, 9_000, 0))
    planning.model.transient_full = _curve(keys, (-0.39e9, 0, 57_000, 0), intercept=True, floor=None, linear_until=6)
    planning.model.transient_partial = _curve(keys, (-0.43e9, 0, 18_000, 0), intercept=True, floor=None, linear_until=6)
    planning.model.optimizer_bytes = 0.44e9
    planning.static_bytes = int(2.1e9)
    planning.model.max_key = (32, 512)
    rng = random.Random(0)
    return planning, [(32, rng.randint(32, 512)) for _ in range(10_000)]


def swin_detr_planning(
    depths: tuple[int, ...], embed_dim: int, budget_bytes: int, split: bool = False,
) -> tuple[Planning, list[tuple[int, int]]]:
    """Conditional DETR, Swin backbone: the key is ``(N, H/4 · W/4)`` patches at the first layer.

    ``split``: each stage's shifted layers in a group of their own, saving 8% more (as the
    H200 runs learn them since NOTE [Blocks alike only in name], runtime.py: 11 groups on Swin-B).
    """
    stage = [s for s, d in enumerate(depths) for _ in range(d)]
    shifted = [i % 2 for d in depths for i in range(d)]
    if split:
        groups = [2 * s + h for s, h in zip(stage, shifted)] + [8] * 6 + [9] * 6
    else:
        groups = stage + [4] * 6 + [5] * 6
    planning = Planning(len(groups), groups, budget_bytes, int(0.03 * budget_bytes), 8)
    keys = [(2, (h // 4) * (w // 4)) for h, w in ((560, 784), (672, 1008), (784, 1120), (896, 1344))]
    for g, m in planning.model.group_models.items():
        member = groups.index(g)
        kind = "stage" if member < len(stage) else "encoder" if groups.count(g) == 6 and member < len(stage) + 6 else "decoder"
        s = stage[member] if kind == "stage" else 0
        wider = 1.08 if kind == "stage" and shifted[member] else 1.0
        if kind == "stage":  # stage s: patches / 4**s, channels · 2**s; bf16 activations
            per_patch = 2 * 24 * embed_dim * 2**s / 4**s * wider
        else:  # the detector's encoder (stride-32 features) and decoder (300 queries)
            per_patch = 2 * 24 * 256 / 64 if kind == "encoder" else 0.0
        decoder = kind == "decoder"
        m.bytes["keep"] = _curve(keys, (0, 300_000 if decoder else 0, per_patch, 0))
        m.bytes["recompute"] = _curve(keys, (0, 2 * 300 * 256 if decoder else 0, 2 * embed_dim * 2**s / 4**s if kind == "stage" else 256 / 32, 0))
        m.ms["recompute"] = _curve(keys, (0.05, 0, 1e-6 * 2**s if kind == "stage" else 2e-7, 0), intercept=True)
    planning.model.outside = _curve(keys, (0, 0, 2 * 3 * 16 * 4, 0))
    planning.model.transient_full = _curve(keys, (0.2e9, 0, 800, 0), intercept=True, floor=None, linear_until=6)
    planning.model.transient_partial = _curve(keys, (0.1e9, 0, 600, 0), intercept=True, floor=None, linear_until=6)
    planning.model.optimizer_bytes = 0.3e9
    planning.static_bytes = int(0.5e9)
    planning.model.max_key = keys[-1]
    rng = random.Random(0)
    window = 4 * 7 * 4  # padded to whole windows at every stage: 112 pixels

    def padded(x: int) -> int:
        return -(-x // window) * window

    schedule = []
    for _ in range(10_000):
        short = rng.randrange(480, 801, 32)
        long_ = min(1333, int(short * rng.uniform(1.2, 1.8)))
        h, w = (short, long_) if rng.random() < 0.5 else (long_, short)
        schedule.append((2, (padded(h) // 4) * (padded(w) // 4)))
    return planning, schedule


def _budget_for(planning: Planning, schedule) -> int:
    """Halfway between the peaks of the largest key with nothing and with every block checkpointed."""
    largest = max(schedule, key=lambda k: k[0] * k[1])
    none = planning.static_bytes + planning.model.step_bytes(largest, Plan(()))
    full = planning.static_bytes + planning.model.step_bytes(largest, Plan(planning.all_blocks))
    return int((none + full) / 2)


def _time_us(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def _method(name: str):
    method = Dynamic() if name == "dynamic" else Static()
    method.resume()
    return method


def _learn(planning: Planning, key: tuple[int, int]) -> None:
    """What a step that changes the model does to it: three curves learn a value 3% lower
    at this key (an over-prediction), the plan cache is cleared; curves refit lazily."""
    group = planning.model.group_models[planning.model.groups[0]]
    for curve in (planning.model.outside, group.bytes["keep"], planning.model.transient_partial):
        curve.add(key, 0.97 * curve(key))
    planning.cache.clear()


def bench(build, steps: int, repeats: int, learn_every: int) -> dict:
    out = {}
    planning, schedule = build(10 * GB)
    budget = _budget_for(planning, schedule)
    for name in ("dynamic", "static"):
        per_step, learning, new, hit, n_checkpointed = [], [], [], [], []
        for r in range(repeats):
            planning, schedule = build(budget)
            method = _method(name)
            for key in schedule[:steps]:
                per_step.append(_time_us(lambda: method.decide(planning, key)))
                n_checkpointed.append(len(method.decide(planning, key).plan.blocks))
            planning, schedule = build(budget)
            method = _method(name)
            for i, key in enumerate(schedule[:steps]):
                if i % learn_every == 0:
                    _learn(planning, key)
                learning.append(_time_us(lambda: method.decide(planning, key)))
            for key in schedule[steps : steps + 50]:
                planning.cache.clear()
                new.append(_time_us(lambda: method.decide(planning, key)))
                hit.append(_time_us(lambda: method.decide(planning, key)))
        out[name] = {
            "budget_bytes": budget,
            "per_step_us": {"mean": statistics.mean(per_step), "median": statistics.median(per_step)},
            "per_step_learning_us": {"mean": statistics.mean(learning), "median": statistics.median(learning)},
            "new_bucket_us": {"mean": statistics.mean(new), "median": statistics.median(new)},
            "cache_hit_us": {"mean": statistics.mean(hit), "median": statistics.median(hit)},
            "mean_checkpointed": statistics.mean(n_checkpointed),
            "n_blocks": planning.n_blocks,
        }
    return out


MODELS = {
    "bert-base": bert_planning,
    "swin-t-detr": lambda b: swin_detr_planning((2, 2, 6, 2), 96, b),
    "swin-b-detr": lambda b: swin_detr_planning((2, 2, 18, 2), 128, b),
    "swin-b-detr-split": lambda b: swin_detr_planning((2, 2, 18, 2), 128, b, split=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--learn_every", type=int, default=3, help="the model changes every this many steps (as on the H200, 2026-11-22)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--json", help="write the numbers here")
    parser.add_argument("--markdown", help="write the table here too")
    args = parser.parse_args()
    results = {m: bench(MODELS[m], args.steps, args.repeats, args.learn_every) for m in args.models}
    lines = [
        f"| model | method | blocks | per step µs, settled (mean / median) | per step µs, model changes every "
        f"{args.learn_every} steps (mean / median) | new bucket µs (median) | cache hit µs (median) | blocks checkpointed (mean) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for m, by_method in results.items():
        for name, r in by_method.items():
            lines.append(
                f"| {m} | {name} | {r['n_blocks']} | {r['per_step_us']['mean']:.1f} / {r['per_step_us']['median']:.1f} "
                f"| {r['per_step_learning_us']['mean']:.1f} / {r['per_step_learning_us']['median']:.1f} "
                f"| {r['new_bucket_us']['median']:.1f} | {r['cache_hit_us']['median']:.1f} | {r['mean_checkpointed']:.1f} |"
            )
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
