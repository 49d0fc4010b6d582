"""CPU soak: many steps of a tiny BERT under a logical budget, on an adversarial length schedule.

The schedule (fixed seed) mixes what breaks a memory model that learns from what it has
seen: long-tail lengths (log-normal), sudden jumps to lengths never seen before (every
``--jump_every`` steps a new maximum), and stretches of monotone growth. Logical accounting
(parameters + gradients + optimizer state + saved activations, counted) makes the check
exact: no step's counted bytes may exceed the budget. ``none`` runs uncapped, the reference.

Output under ``--output_dir``: ``results.jsonl`` (one line per method, the schema ``memfit
report`` reads) and ``steps/<method>.jsonl`` (step records).

Usage (``benchmarks/run_suite.py soak`` runs it on a machine without CUDA):
    python benchmarks/cpu_soak.py --steps 10000 --methods none dynamic reactive --output_dir OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch

import memfit


def schedule(steps: int, seed: int, max_len: int, jump_every: int) -> list[int]:
    """Lengths: log-normal tail, never-seen jumps, monotone ramps (see the module docstring)."""
    rng = random.Random(seed)
    lengths, ceiling = [], 32
    for step in range(steps):
        if step % jump_every == 0 and step:
            ceiling = min(max_len, int(ceiling * 1.6))
            lengths.append(ceiling)  # a length never seen before
            continue
        phase = (step // 250) % 3
        if phase == 0:  # long tail
            length = int(math.exp(rng.gauss(math.log(24), 0.8)))
        elif phase == 1:  # monotone growth over the stretch
            length = 8 + (step % 250) * ceiling // 250
        else:  # uniform under the ceiling
            length = rng.randint(4, ceiling)
        lengths.append(max(2, min(ceiling, length)))
    return lengths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--methods", nargs="+", default=["none", "dynamic", "reactive"])
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--max_len", type=int, default=512)
    p.add_argument("--jump_every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", required=True)
    args = p.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    torch.set_num_threads(1)
    import transformers
    from transformers import BertConfig, BertForSequenceClassification

    lengths = schedule(args.steps, args.seed, args.max_len, args.jump_every)
    for method in args.methods:
        torch.manual_seed(0)
        config = BertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=37,
                            vocab_size=1000, attn_implementation="eager")
        model = BertForSequenceClassification(config).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # Budget between the counted peaks of `none` and `full` at the longest length.
        peaks = {}
        for probe in ("none", "full"):
            ctl = memfit.fit(model, budget=None, method=probe, optimizer=opt)
            ids = torch.randint(0, 1000, (args.batch_size, args.max_len))
            model(input_ids=ids, labels=torch.zeros(args.batch_size, dtype=torch.long)).loss.backward()
            model.zero_grad(set_to_none=True)
            peaks[probe] = ctl.records[-1].peak_allocated_bytes + 2 * sum(p.numel() * 4 for p in model.parameters())
            ctl.remove()
        budget = None if method == "none" else (peaks["none"] + peaks["full"]) // 2
        margin = {"reactive": 0.05}.get(method)
        log = os.path.join(args.output_dir, "steps", f"{method}.jsonl")
        ctl = memfit.fit(model, budget=budget, method=method, optimizer=opt, log=log, margin=margin)
        t0 = time.perf_counter()
        for step, length in enumerate(lengths):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 1000, (args.batch_size, length), generator=g)
            model(input_ids=ids, labels=torch.randint(0, 2, (args.batch_size,), generator=g)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        total_s = time.perf_counter() - t0
        records = ctl.records
        ctl.remove()
        over = [r.step for r in records if budget is not None and r.peak_allocated_bytes > budget]
        result = {
            "task": "adversarial", "model": "tiny BERT (4 layers, hidden 32; config, random weights)",
            "method": method, "budget_bytes": budget, "batch_size": args.batch_size, "steps": len(records),
            "repeat": 0, "steps_file": os.path.relpath(log, args.output_dir), "total_s": total_s,
            "max_peak_allocated_bytes": max(r.peak_allocated_bytes for r in records), "oom_count": 0,
            "recomputed_fraction": sum((r.n_checkpointed + len(r.evicted_blocks)) / r.n_blocks for r in records) / len(records),
            "status": "ok", "over_budget_steps": len(over), "first_over_budget": over[:5],
            "warmup_steps": sum(r.phase == "warmup" for r in records),
            "planner_us_per_step": sum(r.planner_us for r in records) / len(records),
            "schedule": {"seed": args.seed, "max_len": args.max_len, "jump_every": args.jump_every},
            "device": "cpu", "accounting": "logical",
            "torch": torch.__version__, "transformers": transformers.__version__,
        }
        with open(os.path.join(args.output_dir, "results.jsonl"), "a", encoding="utf-8") as fh:
            fh.write(json.dumps(result) + "\n")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
