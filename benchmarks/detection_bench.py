"""Object-detection benchmark: Conditional DETR with Swin-T/S/B-sized backbones under budgets.

For each backbone size (bundled configs ``conditional-detr-swin-{tiny,small,base}``, random
weights, no hub), through ``memfit bench --tasks object-detection`` (each configuration in
its own process, after a GPU warm-up):

1. ``none`` uncapped: the speed reference and the largest peak ``P`` of the run (skipped
   with ``--budget_gb``, budgets given in GB);
2. every other method (``dynamic full static reactive``, in that order) under a hard cap of
   ``--budget_fractions`` × ``P`` (default 0.6): the largest scales cannot run without
   checkpointing, the smallest (480-pixel sides: about a third of the pixels) can.

Same protocol for every configuration: bf16 autocast (``--precision``), AdamW (lr 1e-4, 2e-5 for Swin-B, weight decay 1e-4,
gradient clipping 0.1, as DETR), batch 16 (the original experiments' batch; ``--batch_size``),
``--steps`` optimizer steps on the synthetic set (``--synthetic``: images with drawn shapes,
COCO-like aspect ratios), multi-scale shorter side 480-800 and longer side at most 1333, drawn
per image or once per batch (``--multi_scale_per``), seed 42: the same images, sizes and order
in every run. Data loading runs in 4 workers, so the drawing of the images overlaps the GPU's
work.

Why batch 16: at batch 2 (Swin's detection recipes: 2 images per GPU) an H200 step of Swin-B
takes 150-240 ms whatever the image size (55k to 157k patches): the host's kernel launches
bound it, not the GPU, so the methods differ by the host cost of their recompute and hooks
and the ranking moved with each process (eighth run, 2026-11-22). At 16 images a step has
10-11 times the patches (median batch of the eighth and ninth runs) for the same launches.
Drawn per image, though, 16 images pad to about the largest scale (the ninth run's median
batch: 83% of the largest's patches); drawn per batch, batches span the range (median 73%,
smallest 35%).

A time guard skips the configurations that would end after ``--time_limit_s`` (each is
listed in ``skipped.txt``), so the whole run fits a short GPU session. Afterwards ``memfit
report`` writes ``<output_dir>/report``: per model a methods table (time vs ``none``, peak vs
budget, OOMs, blocks recomputed) and the peak-vs-input-size plot, where input size is
patches per micro-batch (``N · H/4 · W/4``, linear in pixels).

Usage (repository root; GPU):
    PYTHONPATH=src python3 benchmarks/detection_bench.py --output_dir benchmarks/results/<device>/detection
CPU smoke test of the same path (micro config, small images, 4 steps, 1-2 minutes):
    PYTHONPATH=src python3 benchmarks/detection_bench.py --smoke --output_dir /tmp/detection-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

GB = 10**9
TASK = "object-detection"
_SRC = Path(__file__).resolve().parent.parent / "src"
_PRECISION_FLAGS = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--models", nargs="+", default=["tiny", "small", "base"], help="Swin sizes (bundled configs)")
    p.add_argument("--methods", nargs="+", default=["dynamic", "full", "static", "reactive"],
                   help="methods run under the budgets (none always runs uncapped first)")
    p.add_argument("--budget_fractions", nargs="+", type=float, default=[0.6],
                   help="budgets as fractions of the uncapped none run's largest peak")
    p.add_argument("--budget_gb", nargs="+", default=None,
                   help="budgets in GB (10**9 bytes) instead: no budget-setting none run (e.g. a budget "
                        "an earlier run set, as its folder name shows); one model only")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--shortest_edge", default="480-800")
    p.add_argument("--multi_scale_per", choices=["image", "batch"], default="image",
                   help="draw the shorter side per image (DETR) or once per batch (YOLOX, mmdet's BatchSyncRandomResize)")
    p.add_argument("--longest_edge", type=int, default=1333)
    p.add_argument("--learning_rate", nargs="+", default=["1e-4", "base=2e-5"],
                   help="AdamW's rate: one value for every model, then MODEL=RATE overrides. Swin-B from random "
                        "weights in bf16 diverged to NaN boxes at step 8 with 1e-4 (H200, 2026-11-22), which "
                        "DETR's loss refuses: it gets 2e-5 by default")
    p.add_argument("--precision", nargs="+", default=["bf16"],
                   help="bf16 (autocast), fp16 (autocast with loss scaling: steps with inf gradients are "
                        "skipped) or fp32: one value for every model, then MODEL=PRECISION overrides")
    p.add_argument("--repeats", type=int, default=1,
                   help="with more than 1: after the none run that sets the budget, one interleaved matrix "
                   "(none uncapped and every method, repeat after repeat) into swin-<size>/repeats/, whose "
                   "report gives medians over the repeats (step times move by up to 45%% between processes)")
    p.add_argument("--gpu_warmup_s", type=float, default=1.0)
    p.add_argument("--time_limit_s", type=float, default=330.0,
                   help="skip configurations that would end after this many seconds from the start")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the whole path: micro config, 96-192 pixel sides, batch 2, 4 steps, no time limit")
    args = p.parse_args(argv)
    for spec in args.precision:
        if spec.rpartition("=")[2] not in _PRECISION_FLAGS:
            p.error(f"--precision {spec!r}: give {', '.join(_PRECISION_FLAGS)}, or MODEL=one of them")
    if args.smoke:
        args.models, args.steps, args.shortest_edge, args.longest_edge = ["micro"], 4, "96-192", 256
        args.batch_size = min(args.batch_size, 2)
        args.gpu_warmup_s, args.time_limit_s = 0.0, float("inf")
    if args.budget_gb and len(args.models) > 1:
        p.error("--budget_gb: give one model (a budget in GB fits one backbone)")
    return args


def _per_model(spec: list[str], model: str, default: str) -> str:
    """``model``'s value from ``VALUE`` and ``MODEL=VALUE`` entries (``--learning_rate``, ``--precision``)."""
    values = dict(s.split("=", 1) if "=" in s else ("", s) for s in spec)
    return values.get(model, values.get("", default))


def _train_flags(args: argparse.Namespace, model: str) -> list[str]:
    flags = [
        "--config_name", f"conditional-detr-swin-{model}", *_PRECISION_FLAGS[_per_model(args.precision, model, "bf16")],
        "--shortest_edge", args.shortest_edge, "--longest_edge", str(args.longest_edge), "--multi_scale_per", args.multi_scale_per,
        "--learning_rate", _per_model(args.learning_rate, model, "1e-4"), "--weight_decay", "1e-4", "--max_grad_norm", "0.1",
        "--dataloader_num_workers", "2" if args.smoke else "4",
    ]
    return flags + (["--use_cpu"] if args.smoke else [])


def _results(folder: Path) -> list[dict]:
    path = folder / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    # The runs are subprocesses: they must find this memfit and never wait on the hub.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(_SRC), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.path.insert(0, str(_SRC))
    from memfit.tools.bench import matrix as bench
    from memfit.tools.report import build_report

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    last_s = 0.0  # duration of the last configuration: the estimate of the next one
    skipped: list[str] = []

    primed: set[str] = set()  # models whose kernels a run on this machine has met (NOTE [First process], bench.py)

    def run(folder: Path, label: str, bench_flags: list[str], model: str) -> bool:
        nonlocal last_s
        if time.perf_counter() - start + last_s > args.time_limit_s:
            skipped.append(f"{label}: not run, it would end after --time_limit_s {args.time_limit_s:g}")
            print(f"skip {label} (time limit)", flush=True)
            return False
        t0 = time.perf_counter()
        bench.main([
            "--tasks", TASK, *bench_flags, "--steps", str(args.steps), "--batch_size", str(args.batch_size),
            "--gpu_warmup_s", str(args.gpu_warmup_s), "--prime" if model not in primed else "--no-prime",
            "--output_dir", str(folder), "--", *_train_flags(args, model),
        ])
        primed.add(model)
        last_s = time.perf_counter() - t0
        return True

    for model in args.models:
        folder = out / f"swin-{model}"
        if args.budget_gb:
            budgets = args.budget_gb
        else:
            if not run(folder, f"swin-{model} none", ["--methods", "none", "--uncapped_none_only"], model):
                continue
            reference = next((r for r in reversed(_results(folder)) if r["method"] == "none" and r["status"] == "ok"), None)
            if reference is None:
                skipped.append(f"swin-{model}: the uncapped none run failed, so no budget; see {folder}/runs")
                continue
            budgets = [f"{fraction * reference['max_peak_allocated_bytes'] / GB:.2f}" for fraction in args.budget_fractions]
        if args.repeats > 1:
            flags = ["--methods", "none", *args.methods, "--uncapped_none_only", "--budgets", *budgets, "--repeats", str(args.repeats)]
            run(folder / "repeats", f"swin-{model} none and {' '.join(args.methods)} x{args.repeats}", flags, model)
            continue
        for method in args.methods:
            run(folder, f"swin-{model} {method} at {' '.join(budgets)} GB", ["--methods", method, "--budgets", *budgets], model)

    (out / "skipped.txt").write_text("".join(f"{s}\n" for s in skipped))
    report = build_report(out, out / "report")
    print(f"total {time.perf_counter() - start:.0f} s; {len(skipped)} skipped; report: {report}")
    for model in args.models:
        for r in _results(out / f"swin-{model}") + _results(out / f"swin-{model}" / "repeats"):
            budget = f"{r['budget_bytes'] / GB:.2f} GB" if r["budget_bytes"] else "uncapped"
            peak = f"{r['max_peak_allocated_bytes'] / GB:.2f} GB" if r["max_peak_allocated_bytes"] else "-"
            total = f"{r['total_s']:.1f} s" if r["total_s"] else "-"
            print(f"swin-{model:5} {r['method']:8} {budget:>9}  {r['status']:5} {total:>8}  peak {peak}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
