"""What a memfit run's treatments cost against the floor under them, from two caps of one ``loop_bench.py`` call.

At a roomy cap most steps treat nothing: there a step takes what the model, the optimizer and the
head take. For each repeat this prints, over the steady steps, the median of

* ``floor``: the roomy run's step over the fixed policy's (at the tight cap), on the steps where
  the roomy run treated no block: the least a plan can reach;
* ``tight``: the tight run's step over the fixed policy's (what loop_bench's table reports);
* ``treatments``: the tight run's step less the roomy run's, over the fixed policy's: what fitting
  the tight cap cost.

The folder is a ``loop_bench.py`` output (``results.jsonl`` and ``steps/``), or a published one
(``head.jsonl.gz`` and ``steps.tgz``, whose step files are named ``steps/<call>.<run>.steps.jsonl.gz``)
with ``--call``.

    python benchmarks/step_floor.py benchmarks/results/nvidia-h100/llm-head --call s22-2 \\
        --method dynamic+auto --fixed hf-every-1+liger --tight 23.62 --roomy 42.73
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tarfile
from pathlib import Path


def _lines(folder: Path, call: str | None) -> list[dict]:
    from memfit.engine.records import read_jsonl

    for name in ("results.jsonl", "head.jsonl.gz"):
        if (folder / name).is_file():
            return [line for line in read_jsonl(folder / name) if call is None or line.get("call") == call]
    return []


def _steps(folder: Path, call: str | None, line: dict) -> list[dict]:
    """The run's step records: its own file, or its member of the published steps.tgz."""
    from memfit.engine.records import read_jsonl

    own = folder / line["steps_file"]
    if own.is_file():
        return list(read_jsonl(own))
    run = Path(line["steps_file"]).name.removesuffix(".jsonl.gz")
    with tarfile.open(folder / "steps.tgz") as tar:
        member = tar.extractfile(f"steps/{call}.{run}.steps.jsonl.gz")
        return [json.loads(text) for text in gzip.decompress(member.read()).decode().splitlines() if text.strip()]


def floor_rows(folder: Path, method: str, fixed: str, tight_gb: float, roomy_gb: float, call: str | None = None,
               steady_from: int = 8) -> list[dict]:
    """Per repeat: ``floor``, ``tight`` and ``treatments`` (module docstring), and the untreated steps counted."""
    lines = _lines(folder, call)

    def run(name: str, gb: float, repeat: int) -> dict | None:
        return next((line for line in lines if line["method"] == name and line.get("status", "ok") == "ok"
                     and round(line["budget_bytes"] / 1e9, 2) == round(gb, 2) and line["repeat"] == repeat), None)

    rows = []
    for repeat in sorted({line["repeat"] for line in lines if line["method"] == method}):
        tight, roomy, peer = run(method, tight_gb, repeat), run(method, roomy_gb, repeat), run(fixed, tight_gb, repeat)
        if tight is None or roomy is None or peer is None:
            continue
        records = _steps(folder, call, roomy)
        steady = range(steady_from, min(len(tight["step_ms"]), len(roomy["step_ms"]), len(peer["step_ms"]), len(records)))
        untreated = [i for i in steady if not any(k != "head" for k in records[i].get("treatments", {}))]
        if not untreated:
            continue
        rows.append({
            "repeat": repeat, "untreated_steps": len(untreated), "steps": len(steady),
            "floor": statistics.median(roomy["step_ms"][i] / peer["step_ms"][i] for i in untreated),
            "tight": statistics.median(tight["step_ms"][i] / peer["step_ms"][i] for i in steady),
            "treatments": statistics.median((tight["step_ms"][i] - roomy["step_ms"][i]) / peer["step_ms"][i] for i in steady),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--call", help="a published folder's call (its lines' `call`)")
    p.add_argument("--method", default="dynamic+auto")
    p.add_argument("--fixed", required=True, help="the fixed policy compared with, at the tight cap")
    p.add_argument("--tight", type=float, required=True, help="the tight cap in GB, as --budget_gb gave it")
    p.add_argument("--roomy", type=float, required=True, help="the roomy cap in GB")
    p.add_argument("--steady_from", type=int, default=8, help="first step index compared (0-based)")
    args = p.parse_args(argv)
    try:
        rows = floor_rows(args.folder, args.method, args.fixed, args.tight, args.roomy, args.call, args.steady_from)
    except (KeyError, FileNotFoundError) as err:  # a line whose step records are not in the folder
        print(f"step_floor.py: {args.folder}: the roomy run's step records are missing ({err}); give the call's "
              f"output folder, or a published one with --call", file=sys.stderr)
        return 2
    if not rows:
        print(f"step_floor.py: no repeat of {args.method} at {args.tight} and {args.roomy} GB beside {args.fixed} "
              f"with an untreated steady step in {args.folder}", file=sys.stderr)
        return 2
    print("| repeat | untreated steps | floor | tight | treatments |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['repeat']} | {r['untreated_steps']} of {r['steps']} | {r['floor']:.3f} | {r['tight']:.3f} | {r['treatments']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
