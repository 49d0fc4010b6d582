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

# NOTE [Fewer trials, the same certificate]
A trial at a cap that fits costs every step; most of a bisection's device time is its fitting trials.
Two things cut their number without weakening what the answer means:
- A fixed policy's peak allocated bytes at a cap that fits is its need at any cap (the same batches
  run the same allocations), so the first cap at or above that peak is the likely answer. It is a
  guess, not a proof (a library may pick a smaller workspace when memory is short): the guessed cap
  is tried, then the cap one step below it. A reported smallest cap is always a fitting trial whose
  next step down failed (or the range's lowest), as in a plain bisection.
- memfit's first trial is the best peer's smallest cap (the question the suite asks: does memfit
  fit where the peer needs the least?), so the bisection below it starts from a fit; where it fails
  there, the range above is searched.
A trial that has already spent the replays the rule allows stops there (loop_bench ``--max_replays``):
it cannot fit whatever its later steps do.
"""

from __future__ import annotations

import json
import os
from bisect import bisect_left
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


def smallest_fitting(caps: Sequence[float], trial: Callable[[float], bool | tuple[bool, float | None]],
                     first: int | None = None) -> tuple[float | None, list[tuple[float, bool]]]:
    """The smallest of the ascending ``caps`` at which ``trial`` holds, by bisection (monotone
    assumed), and every trial in the order run.

    ``trial`` returns whether the cap fits, or that and a guess of the smallest fitting cap (GiB, or
    None) taken from a trial that fit: the next trial is then the first cap at or above the guess, or
    the cap below it where that one is already known to fit (NOTE [Fewer trials, the same
    certificate]). The first trial is ``caps[first]`` (default the largest); where it does not fit
    the largest is tried next (if that does not fit either, nothing fits)."""
    tried: list[tuple[float, bool]] = []
    guess: list[float | None] = [None]

    def run(i: int) -> bool:
        out = trial(caps[i])
        ok, guessed = out if isinstance(out, tuple) else (out, None)
        guess[0] = guessed if ok else None  # a trial that failed: plain bisection from here
        tried.append((caps[i], ok))
        return ok

    if not caps:
        return None, tried
    last = len(caps) - 1
    first = last if first is None else min(max(first, 0), last)
    lo, hi = 0, last  # once caps[hi] fits, the answer is in [lo, hi]
    if not run(first):
        if first == last or not run(last):
            return None, tried
        lo = first + 1
    else:
        hi = first
    while lo < hi:
        mid = (lo + hi) // 2
        if guess[0] is not None:
            at = min(max(bisect_left(caps, guess[0] - 1e-9), lo), hi)
            mid = hi - 1 if at == hi else at  # a guess already known to fit: prove the step below it
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
    lines = ["| method | smallest cap (GiB) | trials (GiB: fits) | at the best peer's smallest cap |",
             "| --- | ---: | --- | --- |"]
    for row in rows:
        smallest = "none fits" if row["smallest_gib"] is None else f"{row['smallest_gib']:g}"
        trials = ", ".join(f"{c:g}: {'yes' if ok else 'no'}" for c, ok in row["trials"])
        vs = row.get("vs_best_peer") or {}
        at = (f"{vs['step_ratio']}x {vs['peer']} a step (median of {vs['steps']}), summed {vs['sum_ratio']}x"
              if "step_ratio" in vs else f"did not fit {vs['cap_gib']:g} GiB" if vs else "")
        lines.append(f"| {row['method']} | {smallest} | {trials} | {at} |")
    with open(os.path.join(out_dir, f"{name}.reach.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
