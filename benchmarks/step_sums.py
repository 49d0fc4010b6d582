"""Per-method totals, late-step sums and paired step differences of repeats folders.

The numbers the detection results quote beside ``memfit report``'s table: for each method of a
folder with a ``results.jsonl`` whose lines name their step records (a published suite folder such as
``benchmarks/results/nvidia-h200/detection``, or a ``detection_bench.py --repeats N`` folder,
``.../repeats``), each repeat's total time, the sum of
its step records from ``--from_step`` on (after the warm-up and the first occurrence of each
image size), its median step, the mean share of blocks recomputed and the largest peak over
the budget; then, step by step against ``--against`` (default ``static``), the median and
mean difference of ``--method``'s steps (default ``dynamic``) to the median of the other's
repeats at the same step (the same batch), apart for steps the backstop armed and not, with a
95% bootstrap interval of the median and a sign test of how many steps were faster.
A matrix of several budgets gets a row per method and budget, and the differences per budget.
Several folders are pooled, so repeats spread over several GPU calls count as one matrix; a
published suite folder already pools its calls. A table holds one model: give a folder of one
backbone, or ``--model``.

Usage:
    python benchmarks/step_sums.py benchmarks/results/nvidia-h200/detection --model swin-base
    python benchmarks/step_sums.py benchmarks/results/nvidia-h200/detection --model swin-base --calls swinb-35.49GB-r0
    python benchmarks/step_sums.py RAW/swinb-a/swin-base/repeats RAW/swinb-b/swin-base/repeats
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from memfit.engine.records import read_jsonl  # noqa: E402


def _records(folder: Path, steps_file: str) -> list[dict]:
    """The step records a result names (gzipped after the run, or not), or none."""
    path = folder / steps_file
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.is_file():
            return list(read_jsonl(candidate))
    return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", type=Path, nargs="+",
                   help="folders with a results.jsonl, pooled: e.g. the same matrix run in two calls")
    p.add_argument("--model", help="only results whose model contains this (a published folder of several backbones)")
    p.add_argument("--calls", nargs="+", help="only results of these calls of a published folder (their step records "
                                               "are runs/CALL.*)")
    p.add_argument("--from_step", type=int, default=21, help="first step of the late sum (1-based)")
    p.add_argument("--method", default="dynamic")
    p.add_argument("--against", default="static")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    runs: dict[tuple[str, int | None], list[tuple[dict, list[dict]]]] = {}  # per (method, budget)
    for folder in args.folders:
        found = [folder / name for name in ("results.jsonl", "results.jsonl.gz") if (folder / name).is_file()]
        if not found:
            p.error(f"{folder}: no results.jsonl(.gz); give a published folder or a repeats folder (.../swin-base/repeats)")
        for result in read_jsonl(found[0]):
            if args.model and args.model not in result["model"]:
                continue
            if args.calls and not any(result.get("steps_file", "").startswith(f"runs/{c}.") for c in args.calls):
                continue
            records = _records(folder, result["steps_file"]) if result.get("steps_file") else []
            runs.setdefault((result["method"], result.get("budget_bytes")), []).append((result, records))
    print(f"{'method':<10}{'budget':>10}{'total (s), each repeat':>28}{'steps ' + str(args.from_step) + '+ (s)':>22}"
          f"{'median step':>13}{'recomputed':>12}{'peak/budget':>13}")
    for (method, budget), reps in runs.items():
        totals = [r["total_s"] for r, _ in reps]
        late = [sum(s["step_ms"] for s in recs if s["step"] >= args.from_step) / 1e3 for _, recs in reps]
        median_step = statistics.median(statistics.median(s["step_ms"] for s in recs) for _, recs in reps if recs)
        recomputed = statistics.mean(
            statistics.mean(s["n_checkpointed"] / s["n_blocks"] for s in recs) for _, recs in reps if recs
        )
        peak = max(r["max_peak_allocated_bytes"] for r, _ in reps)
        print(f"{method:<10}{f'{budget / 1e9:.2f} GB' if budget else '—':>10}{statistics.median(totals):>8.2f} ({', '.join(f'{t:.2f}' for t in totals)})".ljust(38)
              + f"{statistics.median(late):>8.2f} ({', '.join(f'{t:.2f}' for t in late)})".ljust(24)
              + f"{median_step:>9.1f} ms{100 * recomputed:>11.1f}%"
              + (f"{peak / budget:>12.0%}" if budget else f"{'—':>12}"))
    for budget in dict.fromkeys(b for _, b in runs):
        if (args.method, budget) not in runs or (args.against, budget) not in runs:
            continue
        others = [recs for _, recs in runs[args.against, budget]]
        diffs: dict[bool, list[float]] = {False: [], True: []}
        for _, recs in runs[args.method, budget]:
            for s in recs:
                if s["step"] < args.from_step:
                    continue
                same = [o[s["step"] - 1]["step_ms"] for o in others if len(o) >= s["step"]]
                if same:
                    diffs[bool(s.get("backstop_armed"))].append(s["step_ms"] - statistics.median(same))
        for armed, d in diffs.items():
            if d:
                low, high = _median_interval(d)
                faster = sum(x < 0 for x in d)
                print(f"{args.method} − {args.against} at {budget / 1e9:.2f} GB, {'armed' if armed else 'unarmed'} steps "
                      f"{args.from_step}+: median {statistics.median(d):+.1f} ms (95% interval {low:+.1f}..{high:+.1f}), "
                      f"mean {statistics.mean(d):+.1f} ms over {len(d)} steps; {args.method} faster in {faster} "
                      f"(sign test p = {_sign_test(faster, sum(x != 0 for x in d)):.2g})")
    return 0


def _median_interval(d: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``d`` (seeded: the same numbers each time)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(d, k=len(d))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def _sign_test(successes: int, n: int) -> float:
    """Two-sided exact binomial p-value of ``successes`` in ``n`` fair coin tosses."""
    if n == 0:
        return 1.0
    k = min(successes, n - successes)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


if __name__ == "__main__":
    raise SystemExit(main())
