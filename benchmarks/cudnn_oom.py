"""What cuDNN's attention is worth, and whether it survives an OOM (NOTE [cuDNN attention after an
OOM], memfit/engine/run/replay.py). CUDA only.

1. Speed: forward + backward of causal ``scaled_dot_product_attention`` (bf16) under each backend
   (cuDNN, flash, memory-efficient), median of ``--repeats`` timed runs after warm-up, at the
   llm suite's shapes (SmolLM-360M's 15 heads of 64: batch 8 x 2,048 and batch 1 x 16,384).
2. OOM: with the process capped just above what the inputs take, cuDNN's attention is run until
   it raises an OOM (forward or backward); then, uncapped, the same shape and a new one are run
   again under cuDNN, and whether each succeeds (or its error) is recorded.

Writes ``cudnn_oom.json`` under ``--output_dir``.

Usage:
    python benchmarks/cudnn_oom.py --output_dir out/cudnn
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _qkv(batch: int, length: int, heads: int, dim: int) -> list[torch.Tensor]:
    return [torch.randn(batch, heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)]


def _step(backend: SDPBackend, qkv: list[torch.Tensor], stage: list[str] | None = None) -> None:
    grad = torch.ones_like(qkv[0])  # before the kernel: an OOM after it is the attention's own
    with sdpa_kernel([backend]):
        if stage is not None:
            stage[:] = ["forward"]
        out = scaled_dot_product_attention(*qkv, is_causal=True)
        if stage is not None:
            stage[:] = ["backward"]
        out.backward(grad)


def speed(shapes: list[tuple[int, int]], heads: int, dim: int, repeats: int) -> list[dict]:
    rows = []
    for batch, length in shapes:
        qkv = _qkv(batch, length, heads, dim)
        row = {"batch": batch, "length": length, "heads": heads, "head_dim": dim}
        for name, backend in BACKENDS.items():
            try:
                for _ in range(3):
                    _step(backend, qkv)
                times = []
                for _ in range(repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    _step(backend, qkv)
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end))
                row[f"{name}_ms"] = round(statistics.median(times), 3)
            except RuntimeError as err:
                row[f"{name}_error"] = str(err).splitlines()[0][:200]
        rows.append(row)
        del qkv
    return rows


def after_oom(heads: int, dim: int) -> list[dict]:
    """Caps rising from just above the inputs: at each OOM, the stage it came from, then cuDNN's
    attention uncapped on the same shape and on a new one."""
    total = torch.cuda.get_device_properties(0).total_memory
    batch, length = 8, 4096
    qkv = _qkv(batch, length, heads, dim)
    grads = 3 * qkv[0].numel() * 2  # dq, dk, dv
    rows = []
    for tenths in range(1, 16):
        extra = tenths / 10
        for t in qkv:
            t.grad = None
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_allocated() + extra * grads) / total))
        stage: list[str] = []
        try:
            _step(BACKENDS["cudnn"], qkv, stage)
            torch.cuda.synchronize()
            rows.append({"extra_share_of_grads": extra, "oom": None})
            break
        except torch.OutOfMemoryError as err:
            row = {"extra_share_of_grads": extra, "oom": str(err).splitlines()[0][:160], "stage": stage[0] if stage else None}
        torch.cuda.set_per_process_memory_fraction(1.0)
        for t in qkv:
            t.grad = None
        torch.cuda.empty_cache()
        for label, shape in (("same_shape", (batch, length)), ("new_shape", (4, 3000 + tenths * 8))):
            try:
                _step(BACKENDS["cudnn"], qkv if label == "same_shape" else _qkv(*shape, heads, dim))
                torch.cuda.synchronize()
                row[label] = "ok"
            except RuntimeError as err:
                row[label] = str(err).splitlines()[0][:200]
        rows.append(row)
    torch.cuda.set_per_process_memory_fraction(1.0)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output_dir", required=True)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.exit(2, "cudnn_oom.py: no CUDA device here; run it on a GPU machine\n")
    os.makedirs(args.output_dir, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
              "speed": speed([(8, 2048), (1, 16384)], 15, 64, args.repeats), "after_oom": after_oom(15, 64)}
    with open(os.path.join(args.output_dir, "cudnn_oom.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
