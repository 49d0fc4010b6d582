"""What recomputing a block costs in a real backward, against what the probe measures.

The planner chooses *which* blocks to checkpoint by their recompute cost, which the probe
takes as a forward of the block timed between two synchronisations (the faster of two: NOTE
[Probe] and NOTE [Cold runs of a block] in runtime.py). This script checks that price on a
fixed batch: for each plan (a set of blocks checkpointed), the median time of forward +
backward, interleaved over rounds; a plan's recompute cost is its time less ``none``'s.
Beside it, per group (on its first block's inputs from a plain forward): the probe's time
(a forward with autograd on, synchronised before and after; the first of ``--probes`` runs
and the median of the rest), and forward + backward (gradients of the inputs only) plain
and checkpointed, whose difference is the block's price of checkpointing measured apart.

The default is the detection benchmark's Swin-B Conditional DETR (``--config_name``), batch
16, one padded size, bf16 autocast, a loss on the logits and boxes (no Hungarian matching:
its host time is the same for every plan). Plans are named ``NAME=FIRST-LAST[,FIRST-LAST]``
over block indices (``find_blocks``'s order).

Usage (repository root; GPU):
    PYTHONPATH=src python3 benchmarks/recompute_bench.py --json out.json
CPU smoke test (micro config, small images):
    PYTHONPATH=src python3 benchmarks/recompute_bench.py --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

_SRC = Path(__file__).resolve().parent.parent / "src"
SWIN_B_PLANS = [
    "none=", "stage1=0-1", "stage2=2-3", "stage3x4=4-7", "stage3x8=4-11", "stage4=22-23",
    "encoder=24-29", "decoder=30-35", "static=0-12", "stage3x17=4-20", "full=0-35",
]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_name", default="conditional-detr-swin-base")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--height", type=int, default=896)
    p.add_argument("--width", type=int, default=1344)
    p.add_argument("--plans", nargs="+", default=SWIN_B_PLANS)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iters", type=int, default=3, help="timed steps per plan per round")
    p.add_argument("--probes", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.config_name, args.batch_size, args.height, args.width = "conditional-detr-swin-micro", 2, 128, 192
        args.plans, args.rounds, args.iters, args.probes = ["none=", "first=0-0", "all=0-3"], 1, 1, 2
    return args


def _plan(spec: str, n_blocks: int) -> tuple[str, set[int]]:
    name, _, ranges = spec.partition("=")
    blocks: set[int] = set()
    for part in filter(None, ranges.split(",")):
        lo, _, hi = part.partition("-")
        blocks.update(range(int(lo), int(hi or lo) + 1))
    if any(b >= n_blocks for b in blocks):
        raise SystemExit(f"plan {spec!r}: the model has {n_blocks} blocks")
    return name, blocks


def _after_first(times: list[float]) -> float:
    """Median of the runs after the first (the first may load kernels: NOTE [Cold runs of a block])."""
    return statistics.median(times[1:] or times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd(block, args: tuple, kwargs: dict, checkpointed: bool, autocast, device: torch.device) -> float:
    """Forward and backward of one block (gradients of its inputs only), synchronised: ms."""
    inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
    _sync(device)
    t0 = time.perf_counter()
    with torch.enable_grad(), autocast:
        if checkpointed:
            out = checkpoint(block.body, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        else:
            out = block.body(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        loss = sum(o.float().mean() for o in outs)
    torch.autograd.grad(loss, inputs, allow_unused=True)
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, str(_SRC))
    from transformers import AutoModelForObjectDetection

    from memfit.engine.parts.blocks import find_blocks, wrap_blocks
    from memfit.engine.run.controller import _group_ids
    from memfit.tasks._common import CONFIGS_DIR, load_config
    from memfit.tasks.object_detection import _init_swin_patch_bias

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = load_config(str(CONFIGS_DIR / f"{args.config_name}.json"), num_labels=8)
    model = AutoModelForObjectDetection.from_config(config)
    _init_swin_patch_bias(model)
    model.to(device).train()
    blocks = wrap_blocks(find_blocks(model))
    groups = _group_ids(blocks)
    plans = [_plan(s, len(blocks)) for s in args.plans]
    pixels = torch.randn(args.batch_size, 3, args.height, args.width, device=device)
    mask = torch.ones(args.batch_size, args.height, args.width, dtype=torch.long, device=device)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    )

    def step() -> float:
        _sync(device)
        t0 = time.perf_counter()
        with autocast:
            out = model(pixel_values=pixels, pixel_mask=mask)
            loss = out.logits.float().mean() + out.pred_boxes.float().mean()
        loss.backward()
        _sync(device)
        model.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) * 1e3

    times: dict[str, list[float]] = {name: [] for name, _ in plans}
    recomputes: dict[str, int] = {}
    for name, enabled in plans:  # warm-up: every plan once (kernels, allocator)
        for b in blocks:
            b.enabled = b.index in enabled
        before = sum(b.recomputes for b in blocks)
        step()
        recomputes[name] = sum(b.recomputes for b in blocks) - before
    for _ in range(args.rounds):
        for name, enabled in plans:
            for b in blocks:
                b.enabled = b.index in enabled
            times[name].extend(step() for _ in range(args.iters))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0

    # probe-style times: each group's first block, on its inputs from a plain forward
    inputs: dict[int, tuple] = {}
    firsts = {g: groups.index(g) for g in sorted(set(groups))}
    hooks = [
        blocks[i].module.register_forward_pre_hook(
            lambda m, a, k, i=i: inputs.setdefault(i, (a, k)), with_kwargs=True
        )
        for i in firsts.values()
    ]
    for b in blocks:
        b.enabled = False
    with autocast:  # with autograd, so that the inputs say which of them need gradients
        model(pixel_values=pixels, pixel_mask=mask)
    for h in hooks:
        h.remove()
    detach = lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t  # noqa: E731
    # detached now, so that the forward's graph (every block's activations) is freed
    inputs = {i: (tuple(map(detach, a)), {name: detach(v) for name, v in k.items()}) for i, (a, k) in inputs.items()}
    probes: dict[int, list[float]] = {}
    pairs: dict[int, dict[str, list[float]]] = {}
    for g, i in firsts.items():
        a, k = inputs[i]
        probes[g] = []
        for _ in range(args.probes):
            with torch.enable_grad(), autocast:
                _sync(device)
                t0 = time.perf_counter()
                out = blocks[i].body(*a, **k)
                _sync(device)
            probes[g].append((time.perf_counter() - t0) * 1e3)
            del out
        for mode in ("plain", "checkpointed"):
            pairs.setdefault(g, {})[mode] = [_fwd_bwd(blocks[i], a, k, mode == "checkpointed", autocast, device)
                                             for _ in range(args.probes)]
    del inputs

    base = statistics.median(times[plans[0][0]])
    rows = []
    for name, enabled in plans:
        med = statistics.median(times[name])
        probe_sum = sum(_after_first(probes[groups[b]]) for b in enabled)
        rows.append({
            "plan": name, "blocks": sorted(enabled), "n": len(enabled), "median_ms": med,
            "over_first_ms": med - base, "probe_sum_ms": probe_sum, "recomputes": recomputes[name],
            "times_ms": times[name],
        })
    group_rows = [
        {"group": g, "first_block": i, "blocks": groups.count(g), "probe_first_ms": probes[g][0],
         "probe_median_ms": _after_first(probes[g]), "pair_plain_ms": _after_first(pairs[g]["plain"]),
         "pair_checkpointed_ms": _after_first(pairs[g]["checkpointed"])}
        for g, i in firsts.items()
    ]
    print(f"{args.config_name}, batch {args.batch_size}, {args.height}x{args.width}, {device}; "
          f"peak {peak / 1e9:.1f} GB; over the first plan ({plans[0][0]}: {base:.1f} ms)")
    print(f"{'plan':<12}{'n':>4}{'median ms':>11}{'over':>9}{'probe sum':>11}{'ratio':>7}")
    for r in rows:
        ratio = r["over_first_ms"] / r["probe_sum_ms"] if r["probe_sum_ms"] else float("nan")
        print(f"{r['plan']:<12}{r['n']:>4}{r['median_ms']:>11.1f}{r['over_first_ms']:>9.1f}{r['probe_sum_ms']:>11.1f}{ratio:>7.2f}")
    print("group  blocks  probe first  probe median  fwd+bwd plain  checkpointed  difference (ms)")
    for r in group_rows:
        print(f"{r['group']:>5}{r['blocks']:>8}{r['probe_first_ms']:>13.2f}{r['probe_median_ms']:>14.2f}"
              f"{r['pair_plain_ms']:>15.2f}{r['pair_checkpointed_ms']:>14.2f}"
              f"{r['pair_checkpointed_ms'] - r['pair_plain_ms']:>17.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "device": str(device),
                                               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                                               "plans": rows, "groups": group_rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
