"""Paired per-step comparison of two configurations of a ``loop_bench.py`` results folder.

The runs of one ``loop_bench.py`` call take the same batches in the same order, so step i of one
method and step i of another saw the same batch. For each budget and repeat where both ``--a``
and ``--b`` ran, this prints the median over steps ``--steady_from``+ of a's step minus b's (ms)
and of a's step over b's: steadier than a ratio of median steps when the steps' lengths differ,
since two runs' median steps can fall on different lengths. Runs pair within one model;
uncapped references (``none``,
``none+compile``, ``plain``) pair with every budget. A folder that merges several calls (a
published suite folder) keeps, per configuration (method, budget, repeat, steps, LoRA or not),
its latest line: the call appended last.

Usage:
    python benchmarks/paired_steps.py benchmarks/results/nvidia-h100/llm --lora \\
        --a dynamic+sel+compile --b compile-0.5 --steady_from 9
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path


def latest_lines(path: Path, lora: bool) -> dict[tuple, dict]:
    """The latest ok line per (model, method, budget, repeat, steps), of LoRA runs or of the others."""
    lines = {}
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        texts = fh.read().splitlines()
    for text in texts:
        line = json.loads(text) if text.strip() else {}
        if line.get("step_ms") and line.get("status", "ok") == "ok" and bool(line.get("lora")) == lora:
            lines[line.get("model"), line["method"], line.get("budget_bytes"), line["repeat"], line["steps"]] = line
    return lines


def paired(a: list[float], b: list[float], start: int) -> tuple[float, float]:
    """Median of a's steps minus b's (ms) and of a's over b's, from step index ``start``."""
    pairs = list(zip(a[start:], b[start:]))
    return statistics.median(x - y for x, y in pairs), statistics.median(x / y for x, y in pairs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="a folder with loop_bench.py's results.jsonl")
    p.add_argument("--a", required=True, help="method whose steps are compared")
    p.add_argument("--b", required=True, help="method compared against")
    p.add_argument("--lora", action="store_true", help="the LoRA runs (default: the others)")
    p.add_argument("--steady_from", type=int, default=8, help="first step index compared (0-based)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    found = [args.folder / name for name in ("results.jsonl", "results.jsonl.gz") if (args.folder / name).is_file()]
    if not found:
        p.error(f"{args.folder}: no results.jsonl(.gz); give a loop_bench.py output folder or a published llm folder")
    lines = latest_lines(found[0], args.lora)
    rows = 0
    for (model, method, budget, repeat, steps), a in sorted(lines.items(), key=lambda kv: (kv[0][0] or "", kv[0][2] or 0, kv[0][3], kv[0][4])):
        if method != args.a:
            continue
        b = lines.get((model, args.b, budget, repeat, steps)) or lines.get((model, args.b, None, repeat, steps))
        if b is None or len(b["step_ms"]) != len(a["step_ms"]) or len(a["step_ms"]) <= args.steady_from:
            continue
        diff, ratio = paired(a["step_ms"], b["step_ms"], args.steady_from)
        cap = f"{budget / 1e9:.2f} GB" if budget else "uncapped"
        print(f"{model or 'model?'}: {args.a} vs {args.b}, {cap}, repeat {repeat}, {steps} steps: median difference {diff:+.1f} ms, "
              f"median ratio {ratio:.3f}")
        rows += 1
    if not rows:
        print(f"no run of {args.a} pairs with one of {args.b} (same budget or uncapped, repeat and steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
