"""The LM head's bytes on a GPU, kept and chunked per implementation, against the formula the planner prices.

For a bundled config's head (random weights), at each ``batch x length`` and chunk count, each
implementation of the chunked head (``pure``, ``pure_grad_in_forward``, a fused kernel where
installed) and ``keep`` run forward and backward on random hidden rows once untimed, then once
measured:

* ``held_bytes``: allocated after the forward less before it (what lives into backward);
* ``peak_bytes``: the peak from the forward's start to the end of backward, less the bytes before
  it and less the gradients ``torch.autograd.grad`` returns (a training step adds the weight's into
  ``.grad`` instead);
* ``formula_saved`` / ``formula_peak``: :func:`memfit.engine.parts.head.head_saved_bytes`'s ``saved`` and
  ``saved + transient`` (logits not held by the caller, as loop_bench's steps);
* ``ms``: forward and backward, synchronised.

    python benchmarks/head_peaks.py --model SmolLM-360M --batch 8 --lengths 1024 2048 --chunks 4 8 16 --out head-peaks.json

It exits 2 with one line where there is no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _measure(run, grads_bytes: int) -> dict[str, float]:
    run()  # untimed, as the warm probe (NOTE [A warm probe], engine/parts/head.py)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    held = run(report_held=True)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    peak = torch.cuda.max_memory_allocated() - before - grads_bytes
    return {"held_bytes": float(held - before), "peak_bytes": float(peak), "ms": ms}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM-360M", help="a bundled config name (memfit/configs)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--out", default="head-peaks.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("head_peaks.py: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    import transformers

    from memfit.tasks._common import CONFIGS_DIR
    from memfit.engine.parts.head import available_implementations, find_head, fused_chunks, head_loss, head_saved_bytes

    config = transformers.AutoConfig.from_pretrained(str(CONFIGS_DIR / f"{args.model}.json"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().train()
    spec = find_head(model)
    weight = spec.lm_head.weight
    vocab, width = spec.vocab_size, weight.shape[-1]
    implementations = available_implementations(spec, "cuda")
    rows = []
    for length in args.lengths:
        tokens = args.batch * length
        hidden0 = torch.randn(args.batch, length, width, device="cuda", dtype=weight.dtype)
        labels = torch.randint(0, vocab, (args.batch, length), device="cuda")
        grads_bytes = hidden0.nbytes + weight.nbytes  # what autograd.grad hands back

        def runner(treatment: str, implementation: str, n_chunks: int):
            def run(report_held: bool = False) -> int:
                h = hidden0.detach().requires_grad_(True)
                loss = head_loss(spec, h, labels, treatment, n_chunks, implementation)
                held = torch.cuda.memory_allocated() if report_held else 0
                grads = torch.autograd.grad(loss, [h, weight])
                del grads, loss
                return held
            return run

        cases = [("keep", "keep", 1)]
        for implementation in implementations:
            counts = [fused_chunks(tokens, vocab, width)] if implementation not in ("pure", "pure_grad_in_forward") else args.chunks
            cases += [("chunked", implementation, n) for n in counts]
        for treatment, implementation, n_chunks in cases:
            try:
                measured = _measure(runner(treatment, implementation, n_chunks), grads_bytes)
            except Exception as exc:  # a kernel that fails here is reported, not fatal
                measured = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            formula = head_saved_bytes(tokens, vocab, width, weight.dtype, treatment, n_chunks,
                                       implementation=implementation if treatment == "chunked" else "pure", logits_held=False)
            rows.append({"tokens": tokens, "batch": args.batch, "length": length, "treatment": treatment,
                         "implementation": implementation, "n_chunks": n_chunks, **measured,
                         "formula_saved": formula.saved_bytes, "formula_peak": formula.saved_bytes + formula.transient_bytes})
            print(json.dumps(rows[-1]), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model, "vocab": vocab, "hidden": width}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
