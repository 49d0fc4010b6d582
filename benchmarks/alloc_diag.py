"""Why the caching allocator releases its cache under a cap with memory still free (issue 40's room).

One process per variant (the allocator's settings are read when CUDA starts): the llm suite's
model and batches (loop_bench's), `dynamic` under a cap; per step the plan, memfit's prediction,
the allocator's peaks and counters (retries, device mallocs/frees, inactive split bytes), and
the step's time.

    python benchmarks/alloc_diag.py --out /tmp/diag [--share 0.5] [--steps 40]

Variants: ``es`` (expandable segments, as `memfit train` sets them), ``es-noslack`` (retries
do not grow the slack), ``es-empty`` (empty_cache between steps), ``noes`` (no expandable
segments), ``none`` (uncapped, gives the cap), ``full`` (every block recomputed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {
    "none": ("expandable_segments:True", "none"),
    "es": ("expandable_segments:True", "dynamic"),
    "es-noslack": ("expandable_segments:True", "dynamic"),
    "es-empty": ("expandable_segments:True", "dynamic"),
    "noes": ("", "dynamic"),
    "full": ("expandable_segments:True", "full"),
}
COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def child(args) -> None:
    import torch

    sys.path.insert(0, HERE)
    import loop_bench

    import memfit
    import memfit.engine.plan.room as room

    if args.variant == "es-noslack":
        room.RETRY_SLACK_SHARE = 0.0
    ns = loop_bench._parse(["--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps),
                            "--lengths", args.lengths, "--output_dir", args.out])
    model, _ = loop_bench._build(ns)
    batches = loop_bench._batches(ns, model, loop_bench._lengths(ns.lengths, ns.steps, ns.batch, ns.seed))
    method = VARIANTS[args.variant][1]
    budget = None if method == "none" else args.budget
    if budget is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / torch.cuda.get_device_properties(0).total_memory))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ctl = memfit.fit(model, budget=budget, method=method, optimizer=opt) if method != "none" else None
    rows = []
    for i, batch in enumerate(batches):
        batch = {k: v.cuda() for k, v in batch.items()}
        before = torch.cuda.memory_stats()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()

        def micro(batch=batch):
            model(**batch).loss.backward()

        ctl.run_step(micro) if ctl else micro()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        after = torch.cuda.memory_stats()
        row = {"step": i, "tokens": int(batch["input_ids"].numel()), "ms": round(ms, 2),
               "alloc_peak": after["allocated_bytes.all.peak"], "reserved_peak": after["reserved_bytes.all.peak"],
               "reserved_end": after["reserved_bytes.all.current"],
               "inactive_split_peak": after["inactive_split_bytes.all.peak"],
               **{c: after.get(c, 0) - before.get(c, 0) for c in COUNTERS}}
        if ctl is not None:
            r = ctl.records[-1]
            row.update(plan=len(r.plan), pred=r.predicted_peak_bytes, slack=ctl.planning.room.slack_bytes,
                       margin=ctl.planning.room.margin_bytes, phase=r.phase, treat={k: len(v) for k, v in r.treatments.items()})
        if args.variant == "es-empty":
            torch.cuda.empty_cache()
        rows.append(row)
    with open(os.path.join(args.out, f"{args.variant}.jsonl"), "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--variant", default=None)
    p.add_argument("--variants", nargs="*", default=["none", "es", "es-noslack", "es-empty", "noes", "full"])
    p.add_argument("--model", default="SmolLM-360M")
    p.add_argument("--lengths", default="sft")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--share", type=float, default=0.5)
    p.add_argument("--budget", type=int, default=None)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.variant:
        return child(args)
    for v in args.variants:
        if v != "none" and args.budget is None:
            with open(os.path.join(args.out, "none.jsonl")) as fh:
                args.budget = int(args.share * max(json.loads(l)["alloc_peak"] for l in fh))
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": VARIANTS[v][0]}
        cmd = [sys.executable, __file__, "--out", args.out, "--variant", v, "--model", args.model, "--lengths",
               args.lengths, "--batch", str(args.batch), "--steps", str(args.steps)]
        cmd += ["--budget", str(args.budget)] if args.budget else []
        t0 = time.time()
        rc = subprocess.run(cmd, env=env).returncode
        print(f"{v}: rc {rc}, {time.time() - t0:.0f} s, budget {args.budget}", flush=True)


if __name__ == "__main__":
    main()
