"""Planner time per plan on the CPU, on a GPU run's own memory model: each steady step's shape planned anew (cache
cleared), with the run's treatments and a Llama-shaped LM head part (on the meta device) beside the blocks.

The planner is Python on the host (NOTE [Plan is fixed before forward], engine/run/controller.py), so its time on a
run's model can be measured here; ``planner_bench.py`` does so on made-up models. Prints the median and largest ms a
plan over ``--repeats`` passes of the run's shapes, and the last plan.

    python benchmarks/plan_replay.py STEPS.jsonl.gz MODEL.model.json.gz --budget_gb 12.35 --blocks 16 \\
        --hidden 2048 --vocab 128256 --static_gb 9.95 --treatments recompute elementwise host_checkpoint tiled_mlp \\
        host_checkpoint_tiled
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("steps", help="a run's step records (.jsonl.gz)")
    p.add_argument("model", help="the same run's last memory model (.model.json.gz)")
    p.add_argument("--budget_gb", type=float, required=True)
    p.add_argument("--static_gb", type=float, required=True, help="the run's static bytes (its records' static_bytes)")
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--treatments", nargs="+", default=["recompute"])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    import torch
    import transformers as tf

    from memfit.engine.parts.head import attach_head
    from memfit.engine.parts.treatments.chunked_head import HeadPart
    from memfit.engine.plan.planning import Planning

    saved = json.load(gzip.open(args.model))
    config = tf.LlamaConfig(hidden_size=args.hidden, num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8,
                            intermediate_size=64, vocab_size=args.vocab, use_cache=False, tie_word_embeddings=True)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config).to(torch.bfloat16)
    planning = Planning(args.blocks, [0] * args.blocks, int(args.budget_gb * 1e9), margin_bytes=saved["margin_bytes"],
                        bucket_tokens=8, slack_bytes=saved["slack_bytes"], treatments=tuple(args.treatments))
    planning.add_part(HeadPart(attach_head(model)))
    planning.load_state_dict(saved)
    planning.static_bytes = int(args.static_gb * 1e9)
    keys = [tuple(json.loads(line)["shape"][:2]) for line in gzip.open(args.steps, "rt")]
    times, plan = [], None
    for _ in range(args.repeats):
        for key in keys:
            planning.cache.clear()
            t0 = time.perf_counter()
            plan = planning.plan_for(key)
            times.append((time.perf_counter() - t0) * 1e3)
    print(f"{len(times)} plans: median {statistics.median(times):.3f} ms, largest {max(times):.3f} ms; the last "
          f"{plan.by_treatment()} {plan.parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
