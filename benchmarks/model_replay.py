"""A run's last memory model replayed on its own steady steps: what it predicts for each step's plan
against the peak the step read, and the outside curve's samples per token.

loop_bench.py writes each memfit run's step records (``steps/<run>.jsonl.gz``) and last memory model
(``steps/<run>.model.json.gz``); published step files keep ``static_bytes`` since 2026-11-29 (older ones need the
run's raw files). The model's curves hold the head kept (NOTE [Head in the peaks],
model.py); a step that chunked the head is predicted less the head's saving, priced here by the
formula of ``--implementation`` at the step's chunk count (the implementation the run's summary
names; a step whose optimizer step ran per tensor less that step's saving, for full fine-tuning in bf16; ``pure_grad_in_forward`` replays a run made before the fused kernels had formulas of their
own) with the model's vocabulary and width from its bundled config. An error that moves smoothly with the tokens is a
curve's fit, not noise (docs/devlog.md, seventeenth session: the outside curve's samples disagreed).

    python benchmarks/model_replay.py STEPS.jsonl.gz MODEL.model.json.gz --model Qwen2.5-1.5B --implementation cce
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("steps", type=Path, help="a run's step records (.jsonl.gz)")
    p.add_argument("model", type=Path, help="the same run's last memory model (.model.json.gz)")
    p.add_argument("--model_config", "--model", dest="config", required=True, help="the bundled config the run trained")
    p.add_argument("--implementation", default="pure", help="the chunked head's implementation the run used")
    p.add_argument("--bucket_tokens", type=int, default=8)
    p.add_argument("--models", type=Path, default=None,
                   help="the run's models after every step (loop_bench --models_every_step): each step is replayed on "
                        "the model that planned it (the one after the step before), not the last")
    args = p.parse_args(argv)
    from memfit.tasks._common import CONFIGS_DIR
    from memfit.engine.plan.model import MemoryModel
    from memfit.engine.plan.planner import Plan
    from memfit.engine.records import StepRecord
    from memfit.engine.parts.head import HEAD_KEY, head_saved_bytes

    config_file = CONFIGS_DIR / f"{args.config}.json"
    if not config_file.is_file():
        print(f"model_replay.py: no bundled config {args.config!r} in {CONFIGS_DIR}", file=sys.stderr)
        return 2
    config = json.loads(config_file.read_text())
    vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])

    def saving(tokens: int, head: tuple[str, int]) -> int:  # the kept head's peak less the step's chunked one
        if head[0] == "keep":
            return 0
        kept = head_saved_bytes(tokens, vocab, hidden, torch.bfloat16, "keep", logits_held=False)
        chunked = head_saved_bytes(tokens, vocab, hidden, torch.bfloat16, "chunked", head[1], implementation=args.implementation)
        return kept.saved_bytes + kept.transient_bytes - chunked.saved_bytes - chunked.transient_bytes

    def bound(state: dict) -> MemoryModel:
        m = MemoryModel.from_dict(state["model"])
        m.part_saving, m.bucket_tokens = {"head": saving}, args.bucket_tokens
        return m

    model = bound(json.load(gzip.open(args.model)))
    planned_by = [json.loads(line) for line in gzip.open(args.models, "rt")] if args.models else None
    step_saved = _per_tensor_saving(config_file)  # what a step run per tensor takes off the optimizer step's moment
    outside = model.outside
    print("outside curve, bytes a token: " + ", ".join(
        f"{n * t} tokens {y / (n * t) / 1e3:.0f} KB" for (n, t), y in zip(outside.xs, outside.ys)))
    print("| step | tokens a row | treated | backward start GB | recompute GB | predicted now GB | read GB | error GB "
          "| transient curve GB | head saving GB |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for line in gzip.open(args.steps, "rt"):
        r = json.loads(line)
        if r.get("phase", "steady") != "steady":  # published step files leave defaults out
            continue
        attempt = (r.get("oom_attempts") or [None])[0]  # an OOM's first try: its plan and what it read
        record = StepRecord.from_dict(r)
        head = record.parts.get(HEAD_KEY) or ("keep", 1)
        if attempt:  # its blocks, and their treatments where not all recomputed (the head is the replayed step's)
            plan = Plan(tuple(attempt["plan"] or ()), kinds=tuple(attempt.get("treatments") or ()), parts=[(HEAD_KEY, *head)])
        else:
            plan = Plan.from_treatments(record.block_treatments, [(HEAD_KEY, *head)])
        key = (r["shape"][0], r["shape"][1])
        if planned_by is not None:
            if r["step"] < 2 or r["step"] - 2 >= len(planned_by):
                continue
            model = bound(planned_by[r["step"] - 2])
        model.step_saved = step_saved if str(r.get("treatments", {}).get("optimizer_step", "")).startswith("per_tensor") else 0.0
        start = r["static_bytes"] + model.backward_start_bytes(key, plan)
        recompute = r["static_bytes"] + model.recompute_bytes(key, plan)
        predicted = r["static_bytes"] + model.step_bytes(key, plan)
        read = attempt["peak_allocated_bytes"] if attempt else r["peak_allocated_bytes"]
        mix = ", ".join(f"{len(blocks)} {kind}" for kind, blocks in sorted(plan.by_treatment().items()))
        rerun = f"{recompute / 1e9:.2f}" if math.isfinite(recompute) else "-"  # no block re-runs its body
        transient = model.transient(key, every_block=len(plan.blocks) == len(model.groups) and not plan.kinds)
        print(f"| {r['step']} | {key[1]} | {mix or 0} | {start / 1e9:.2f} | {rerun} | "
              f"{predicted / 1e9:.2f} | {read / 1e9:.2f} | {(predicted - read) / 1e9:+.2f} | {transient / 1e9:.2f} | "
              f"{model.parts_saved_bytes(key, plan) / 1e9:.2f} |")
    return 0


def _per_tensor_saving(config_file: Path) -> float:
    """foreach AdamW's step temporaries less the per-tensor step's (parts/optimizer_step.py), for full fine-tuning of
    the bundled config in bf16: what a record whose optimizer step ran ``per_tensor`` saved at that moment (a LoRA
    run's step is small and keeps foreach)."""
    from transformers import AutoConfig

    from memfit.engine.parts.optim_state import expected_step_transient_bytes
    from memfit.tools.estimate import ModelProfile

    profile = ModelProfile.from_config(AutoConfig.from_pretrained(config_file), "causal-lm")
    params = [torch.empty(s, dtype=torch.bfloat16, device="meta", requires_grad=True) for s in profile.param_shapes]
    made = expected_step_transient_bytes("adamw_torch", params, foreach=True) or 0
    return float(made - min(made, expected_step_transient_bytes("adamw_torch", params, foreach=False) or 0))


if __name__ == "__main__":
    sys.exit(main())
