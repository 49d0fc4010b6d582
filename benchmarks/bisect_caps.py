"""The smallest cap at which a method trains a workload: bisection over caps in fixed steps (issue 59's
reach suite), and the table of what it found.

``loop_bench.py --reach_gib LO HI`` runs it per method in one process (the model built once, each
trial a fresh configuration from the same weights and batches): a trial *fits* when every step ran
(status ``ok``, nothing lost) with at most one OOM replay per 100 steps (for a peer, which cannot
replay, no OOM at all). Fitting is taken to be monotone in the cap, so a bisection over
``LO, LO + step, ..., HI`` needs about log2 of their count trials; the largest cap is tried first
(if it does not fit, nothing smaller is tried). Every trial's line goes to ``results.jsonl`` like any
configuration's; ``<folder>.reach.jsonl`` holds one line per method (its smallest fitting cap, or
null, and its trials) and ``<folder>.reach.md`` the table (the output folder's name: calls publish
side by side).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

GIB = 2**30

__all__ = ["caps_gib", "fits", "smallest_fitting", "write_reach"]


def caps_gib(lo: float, hi: float, step: float) -> list[float]:
    """``lo, lo + step, ...`` up to ``hi`` (inclusive within rounding), in GiB."""
    if step <= 0 or hi < lo:
        raise ValueError(f"--reach_gib {lo} {hi} with step {step}: give LO <= HI and a positive step")
    n = int(round((hi - lo) / step)) + 1
    return [round(lo + i * step, 6) for i in range(n)]


def fits(line: dict, steps: int) -> bool:
    """Whether a configuration's line trained every step within the reach suite's rule: status ok,
    no step lost, and at most one OOM replay per 100 steps (a peer's OOM ends its run: not ok)."""
    replays = line.get("oom_count") or 0
    return line.get("status") == "ok" and not line.get("lost_steps") and replays <= steps // 100


def smallest_fitting(caps: Sequence[float], trial: Callable[[float], bool]) -> tuple[float | None, list[tuple[float, bool]]]:
    """The smallest of the ascending ``caps`` at which ``trial`` holds, by bisection (monotone
    assumed), the largest tried first; and every trial in the order run."""
    tried: list[tuple[float, bool]] = []

    def run(i: int) -> bool:
        ok = trial(caps[i])
        tried.append((caps[i], ok))
        return ok

    if not caps or not run(len(caps) - 1):
        return None, tried
    lo, hi = 0, len(caps) - 1  # caps[hi] fits; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if run(mid):
            hi = mid
        else:
            lo = mid + 1
    return caps[hi], tried


def write_reach(out_dir: str, rows: list[dict]) -> None:
    """``<folder>.reach.jsonl`` (one line per method) and ``<folder>.reach.md`` (the table) in ``out_dir``."""
    name = os.path.basename(os.path.normpath(out_dir))
    with open(os.path.join(out_dir, f"{name}.reach.jsonl"), "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    lines = ["| method | smallest cap (GiB) | trials (GiB: fits) |", "| --- | ---: | --- |"]
    for row in rows:
        smallest = "none fits" if row["smallest_gib"] is None else f"{row['smallest_gib']:g}"
        trials = ", ".join(f"{c:g}: {'yes' if ok else 'no'}" for c, ok in row["trials"])
        lines.append(f"| {row['method']} | {smallest} | {trials} |")
    with open(os.path.join(out_dir, f"{name}.reach.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
