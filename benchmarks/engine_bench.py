"""Engine benchmark (issue: the memfit engine): bert-base fp32 under 4/6/8 GB caps on a GPU.

Protocol (../shared/design.md, "Benchmark protocol"):

* bert-base-uncased architecture from its config (random weights), fp32, AdamW, batch 32,
  ``--steps`` steps whose sequence lengths are drawn uniformly from 32..512 with a fixed
  seed: every configuration sees the same lengths and tokens in the same order;
* each configuration runs in its own process (clean allocator), after a GPU warm-up
  (matrix products for ``--gpu_warmup_s`` seconds: the card's clock depends on temperature);
* ``none`` runs uncapped (the speed reference); ``full``, ``static``, ``dynamic`` and the
  oracle run under a hard cap (``set_per_process_memory_fraction``) at each budget;
* the *oracle* is measured, not assumed: per budget, a sweep under the same hard cap finds
  for every length bucket (16 tokens) the fewest first-k checkpointed blocks with which
  steps at the bucket's longest length run without an OOM, leaving ``--oracle_margin`` of
  the budget free; those plans run through the ``precomputed`` method.

Output under ``--output_dir``: ``results.jsonl`` (one line per configuration, the schema
`memfit report` reads), ``steps/<config>.jsonl`` (memfit step records), ``sweep_<budget>.json``,
``oracle_<budget>.json`` plans, and a markdown table printed at the end.

Usage:
    python benchmarks/engine_bench.py --output_dir benchmarks/results/<device>/engine
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from memfit.tools.bench.matrix import warm_gpu
from memfit.engine.methods import Decision, Method, save_plans

GB = 10**9
N_LAYERS = 12


def _lengths(args) -> list[int]:
    """The step lengths: uniform in ``--min_len..--max_len``, or ``--schedule adversarial``
    (the CPU soak's: long tail, never-seen jumps every ``--jump_every`` steps, monotone ramps)."""
    import random

    if args.schedule == "adversarial":
        from cpu_soak import schedule  # this folder is on sys.path when run as a script

        return schedule(args.steps, args.seed, args.max_len, args.jump_every)
    rng = random.Random(args.seed)
    return [rng.randint(args.min_len, args.max_len) for _ in range(args.steps)]


# Methods of the matrix that are a memfit method with other arguments.
VARIANTS = {"dynamic-nobackstop": ("dynamic", {"backstop": False})}


def _build(batch_size: int):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig()  # the defaults are bert-base-uncased's architecture
    model = BertForSequenceClassification(config).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    return model, optimizer, config


def _batch(step: int, batch_size: int, length: int, vocab: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(10_000 + step)
    ids = torch.randint(1000, vocab, (batch_size, length), device="cuda", generator=g)
    labels = torch.randint(0, 2, (batch_size,), device="cuda", generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _versions() -> dict:
    import torch
    import transformers

    from memfit.tools.bench.provenance import provenance

    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        **provenance(),
    }


class FirstK(Method):
    """Checkpoint the first k blocks, whatever the shape (the sweep's fixed plans)."""

    def __init__(self, k: int):
        self.k = k
        self.name = f"first-{k}"

    def decide(self, planning, key, failed=None):
        return Decision(tuple(range(self.k)))


def worker_sweep(args) -> None:
    """Under the cap of ``--budget``: per length bucket, the fewest first-k blocks that run.

    Buckets are visited in increasing length and k starts at the previous bucket's (the
    fewest k never shrinks with length); a k is accepted when two steps at the bucket's
    longest length run without an OOM under the hard cap and their peak leaves
    ``--oracle_margin`` of the budget free (the margin ``dynamic`` keeps by default: plans
    accepted with no margin OOMed in a 200-step run on an H200).
    """
    import gc

    import torch

    import memfit

    model, optimizer, config = _build(args.batch_size)
    warm_gpu(2.0)
    budget = int(args.budget * GB)
    buckets = list(range(args.min_len + (-args.min_len) % 16, args.max_len + 1, 16))
    if buckets[-1] != args.max_len:
        buckets.append(args.max_len)
    rows, k = [], 0
    # One step with every block checkpointed creates the optimizer state first.
    ctl = memfit.fit(model, budget=budget, method="full", optimizer=optimizer)
    model(**_batch(0, args.batch_size, args.min_len, config.vocab_size)).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    ctl.remove()
    for length in buckets:
        while True:
            ctl = memfit.fit(model, budget=budget, method=FirstK(k), optimizer=optimizer)
            failed = False
            try:
                for rep in range(2):
                    model(**_batch(rep, args.batch_size, length, config.vocab_size)).loss.backward()
                    optimizer.zero_grad(set_to_none=True)  # no update: the weights stay as built
            except torch.OutOfMemoryError:
                failed = True
            optimizer.zero_grad(set_to_none=True)
            peak = torch.cuda.max_memory_allocated()
            ctl.remove()
            gc.collect()
            torch.cuda.empty_cache()
            fits = not failed and peak <= budget * (1 - args.oracle_margin)
            if fits or k == N_LAYERS:
                break
            k += 1
        rows.append({"length": length, "k": k, "fits": fits, "peak_allocated_bytes": peak})
        print(f"sweep {args.budget:g}GB L={length} k={k} fits={fits} peak={peak / GB:.2f} GB", flush=True)
    with open(os.path.join(args.output_dir, f"sweep_{args.budget:g}GB.json"), "w") as fh:
        json.dump({"batch_size": args.batch_size, "budget_bytes": budget, "rows": rows, **_versions()}, fh, indent=1)


def oracle_plans(sweep: dict) -> dict:
    """The swept fewest-k per length bucket, as plans for ``precomputed``."""
    return {(sweep["batch_size"], r["length"]): tuple(range(r["k"])) for r in sweep["rows"]}


def worker_run(args) -> None:
    """One configuration: method × budget, timed over the step list."""
    import torch

    import memfit

    model, optimizer, config = _build(args.batch_size)
    warm_gpu(args.gpu_warmup_s)
    budget = int(args.budget * GB) if args.budget else None
    kwargs = {}
    method = args.method
    if method in VARIANTS:
        method, kwargs = VARIANTS[method][0], dict(VARIANTS[method][1])
    if args.method == "precomputed":
        kwargs["path"] = args.plans
    if args.method == "static":
        kwargs["max_shape"] = (args.batch_size, args.max_len)
    steps_file = os.path.join(args.output_dir, "steps", f"{args.config}.jsonl")
    os.makedirs(os.path.dirname(steps_file), exist_ok=True)
    result = {
        "task": "adversarial" if args.schedule == "adversarial" else f"uniform-{args.min_len}-{args.max_len}",
        "model": "bert-base-uncased (config, random weights)",
        "method": args.label or args.method,
        "budget_bytes": budget,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "precision": "fp32",
        "repeat": args.repeat,
        "steps_file": os.path.relpath(steps_file, args.output_dir),
        # measurements, left null when the configuration fails
        "total_s": None,
        "max_peak_allocated_bytes": None,
        "recomputed_fraction": None,
        **_versions(),
    }
    lengths = _lengths(args)
    oom_count = 0
    try:
        ctl = memfit.fit(model, budget=budget, method=method, optimizer=optimizer, log=steps_file, **kwargs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for step, length in enumerate(lengths):
            while True:
                failed = False
                try:
                    torch.manual_seed(step)
                    batch = _batch(step, args.batch_size, length, config.vocab_size)
                    model(**batch).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                except torch.OutOfMemoryError as exc:
                    failed = True
                    message = str(exc)
                if not failed:
                    break
                oom_count += 1
                if oom_count > args.max_ooms:
                    raise memfit.BudgetTooSmallError(f"more than {args.max_ooms} OOM replays")
                batch = None
                optimizer.zero_grad(set_to_none=True)
                if args.method == "none":
                    raise torch.OutOfMemoryError("none does not fit")
                ctl.note_oom(message)
        torch.cuda.synchronize()
        total_s = time.perf_counter() - t0
        records = ctl.records
        ctl.remove()
        steady = [r for r in records if r.phase == "steady"]
        result.update(
            status="ok",
            total_s=total_s,
            oom_count=oom_count,
            max_peak_allocated_bytes=max(r.peak_allocated_bytes for r in records),
            max_peak_reserved_bytes=max(r.peak_reserved_bytes for r in records),
            over_budget_steps=sum(budget is not None and r.peak_allocated_bytes > budget for r in records),
            recomputed_fraction=statistics.mean(r.n_checkpointed / r.n_blocks for r in records),
            warmup_steps=len(records) - len(steady),
            planner_us_per_step=statistics.mean(r.planner_us for r in steady) if steady else None,
            planner_us_median=statistics.median(r.planner_us for r in steady) if steady else None,
        )
    except (torch.OutOfMemoryError, memfit.BudgetTooSmallError) as exc:
        result.update(status="oom", oom_count=oom_count + 1, note=str(exc)[:300])
    except Exception as exc:  # the matrix goes on; the failure is recorded
        result.update(status="error", oom_count=oom_count, note=f"{type(exc).__name__}: {exc}"[:300])
    with open(os.path.join(args.output_dir, "results.jsonl"), "a") as fh:
        fh.write(json.dumps(result) + "\n")
    print(json.dumps(result), flush=True)


def _spawn(args, extra: list[str]) -> None:
    cmd = [sys.executable, __file__, "--output_dir", args.output_dir, "--steps", str(args.steps),
           "--batch_size", str(args.batch_size), "--seed", str(args.seed), "--min_len", str(args.min_len),
           "--max_len", str(args.max_len), "--gpu_warmup_s", str(args.gpu_warmup_s),
           "--oracle_margin", str(args.oracle_margin), "--schedule", args.schedule, "--jump_every", str(args.jump_every), "--max_ooms", str(args.max_ooms),
           "--budgets", *map(str, args.budgets), *extra]
    # Every configuration runs with expandable segments (as `memfit train` sets them):
    # without them a hard cap is partly lost to fragmentation, for every method alike.
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
    subprocess.run(cmd, check=False, env=env)


def table(output_dir: str) -> str:
    rows = [json.loads(line) for line in open(os.path.join(output_dir, "results.jsonl"))]
    ref = [r["total_s"] for r in rows if r["method"] == "none" and r["budget_bytes"] is None and r["status"] == "ok"]
    ref_s = statistics.median(ref) if ref else None
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["budget_bytes"] or 0, r["method"]), []).append(r)
    lines = ["| budget | method | status | time (s, median) | vs none | max peak (GB) | OOMs | recomputed | planner µs/step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (budget, method), rs in sorted(groups.items()):
        ok = [r for r in rs if r["status"] == "ok"]
        t = statistics.median(r["total_s"] for r in ok) if ok else None
        peak = max((r["max_peak_allocated_bytes"] for r in ok), default=None)
        lines.append(
            f"| {budget / GB if budget else 'uncapped'} | {method} | {','.join(sorted({r['status'] for r in rs}))} | "
            f"{t:.2f} | {t / ref_s:.3f}× | {peak / GB:.2f} | {sum(r.get('oom_count', 0) for r in rs)} | "
            f"{statistics.mean(r['recomputed_fraction'] for r in ok):.3f} | "
            f"{(statistics.mean(r['planner_us_per_step'] for r in ok if r.get('planner_us_per_step') is not None) if any(r.get('planner_us_per_step') is not None for r in ok) else float('nan')):.1f} |"
            if ok and ref_s else f"| {budget / GB if budget else 'uncapped'} | {method} | {rs[0]['status']} | - | - | - | {sum(r.get('oom_count', 0) for r in rs)} | - | - |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min_len", type=int, default=32)
    p.add_argument("--max_len", type=int, default=512)
    p.add_argument("--budgets", type=float, nargs="+", default=[4, 6, 8], help="GB (10**9 bytes)")
    p.add_argument("--methods", nargs="+", default=["full", "static", "dynamic", "oracle"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--first_repeat", type=int, default=0, help="number of the first repeat (a matrix run in several calls)")
    p.add_argument("--gpu_warmup_s", type=float, default=5.0)
    p.add_argument("--oracle_margin", type=float, default=0.03, help="share of the budget the oracle's sweep keeps free")
    p.add_argument("--phase", choices=["all", "sweep", "runs", "table"], default="all")
    p.add_argument("--skip_none", action="store_true", help="no uncapped `none` reference run (one already ran)")
    p.add_argument("--prime", action="store_true", help="first an untimed 20-step `none` run into prime/ (a fresh "
                   "machine's first process is slow: NOTE [First process] in memfit/tools/bench/matrix.py)")
    p.add_argument("--max_ooms", type=int, default=8, help="a run stops after this many OOM replays")
    p.add_argument("--schedule", choices=["uniform", "adversarial"], default="uniform")
    p.add_argument("--jump_every", type=int, default=250, help="adversarial schedule: steps between never-seen lengths")
    # worker flags
    p.add_argument("--worker", choices=["sweep", "run"])
    p.add_argument("--method")
    p.add_argument("--budget", type=float)
    p.add_argument("--plans")
    p.add_argument("--config")
    p.add_argument("--label", help="method name in the results (e.g. oracle for precomputed sweep plans)")
    p.add_argument("--repeat", type=int, default=0)
    args = p.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    if args.worker == "sweep":
        return worker_sweep(args)
    if args.worker == "run":
        return worker_run(args)
    if args.phase in ("all", "sweep") and "oracle" in args.methods:
        for budget in args.budgets:
            _spawn(args, ["--worker", "sweep", "--budget", str(budget)])
    if args.phase in ("all", "runs"):
        if args.prime:
            primed = argparse.Namespace(**{**vars(args), "output_dir": os.path.join(args.output_dir, "prime"), "steps": 20})
            _spawn(primed, ["--worker", "run", "--method", "none", "--config", "none-prime", "--repeat", "-1"])
        for repeat in range(args.first_repeat, args.first_repeat + args.repeats):
            if not args.skip_none:
                _spawn(args, ["--worker", "run", "--method", "none", "--config", f"none-uncapped-r{repeat}", "--repeat", str(repeat)])
            for budget in args.budgets:
                for method in args.methods:
                    extra = ["--worker", "run", "--budget", str(budget), "--repeat", str(repeat),
                             "--config", f"{method}-{budget:g}GB-r{repeat}"]
                    if method == "oracle":
                        path = os.path.join(args.output_dir, f"oracle_{budget:g}GB.json")
                        sweep = json.load(open(os.path.join(args.output_dir, f"sweep_{budget:g}GB.json")))
                        save_plans(path, N_LAYERS, oracle_plans(sweep))
                        extra += ["--method", "precomputed", "--plans", path, "--label", "oracle"]
                    else:
                        extra += ["--method", method]
                    _spawn(args, extra)
    print(table(args.output_dir))


if __name__ == "__main__":
    main()
