"""Plans and step times of two memfit versions side by side, from ``benchmarks/ab_loop.sh``'s folder.

For every configuration (method, budget) that both versions ran in a repeat, step i of each saw
the same batch: this prints how many steps ran a different plan (each block's treatment, from the
step records' ``treatments``), and the median over steps ``--steady_from``+ of new's step time over
old's. A refactor passes with 0 differing plans and ratios within the repeats' spread.

Usage:
    python benchmarks/ab_plans.py OUT_DIR [--steady_from 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path


def _steps(folder: Path) -> dict[str, list[dict]]:
    """Step records per configuration file name (``<method>-<budget>-r<repeat>``, repeat dropped)."""
    runs = {}
    for path in sorted((folder / "steps").glob("*.jsonl.gz")):
        if path.name.endswith(".model.json.gz"):
            continue
        name = path.name[: -len(".jsonl.gz")].rsplit("-r", 1)[0]
        with gzip.open(path, "rt") as fh:
            runs[name] = [json.loads(line) for line in fh if line.strip()]
    return runs


def _plan(record: dict) -> dict:
    """Each treated block's treatment, and each part's label (a string: the LM head's ``"chunked:8"``)."""
    plan: dict = {}
    for kind, value in (record.get("treatments") or {}).items():
        if isinstance(value, str):
            plan[kind] = value
        else:
            plan.update((i, kind) for i in value)
    return plan


def compare(out: Path, steady_from: int) -> list[dict]:
    rows = []
    repeats = sorted({p.name.split("-", 1)[1] for p in out.iterdir() if p.name.startswith(("new-", "old-"))})
    for rep in repeats:
        new, old = _steps(out / f"new-{rep}"), _steps(out / f"old-{rep}")
        for name in sorted(set(new) & set(old)):
            a, b = new[name], old[name]
            n = min(len(a), len(b))
            differ = [i for i in range(n) if _plan(a[i]) != _plan(b[i])]
            ratios = [a[i]["step_ms"] / b[i]["step_ms"] for i in range(steady_from, n)
                      if a[i].get("step_ms") and b[i].get("step_ms")]
            rows.append({
                "config": name, "repeat": int(rep), "steps": n, "steps_new": len(a), "steps_old": len(b),
                "plans_differ": len(differ), "first_differing_steps": differ[:5],
                "median_step_ratio_new_over_old": round(statistics.median(ratios), 4) if ratios else None,
                "max_peak_new_bytes": max((r.get("peak_allocated_bytes") or 0) for r in a),
                "max_peak_old_bytes": max((r.get("peak_allocated_bytes") or 0) for r in b),
                "oom_new": sum(r.get("oom_retries") or 0 for r in a), "oom_old": sum(r.get("oom_retries") or 0 for r in b),
            })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--steady_from", type=int, default=10)
    p.add_argument("--json", help="also write the rows as JSON lines here")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    if not out.is_dir():
        print(f"ab_plans.py: no folder {out}", file=sys.stderr)
        return 2
    rows = compare(out, args.steady_from)
    if not rows:
        print(f"ab_plans.py: {out} holds no configuration that both versions ran", file=sys.stderr)
        return 2
    print("| config | repeat | steps | plans differ | new/old step (median) | peak new GiB | peak old GiB | OOM new/old |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['config']} | {r['repeat']} | {r['steps']} | {r['plans_differ']} | {r['median_step_ratio_new_over_old']} "
              f"| {r['max_peak_new_bytes'] / 2**30:.2f} | {r['max_peak_old_bytes'] / 2**30:.2f} | {r['oom_new']}/{r['oom_old']} |")
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
