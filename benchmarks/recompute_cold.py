"""What a recomputed block pays the first time it meets a sequence length. CUDA only.

A checkpointed block's recompute runs its forward again during the backward, on autograd's device
thread, not on the thread that ran the forward. Some libraries keep per-thread caches of what
they build per shape (PyTorch keeps cuDNN's attention graphs in ``thread_local`` caches), so a
length the forward has met can still be new to the backward thread's recompute.

For each ``--backends`` entry (a fresh process each, so no cache is shared), a stack of
``--layers`` attention + MLP layers (SmolLM-360M's widths, bf16, batch ``--batch``) takes, for
each of ``--lengths`` (each new to the process): a plain forward + backward (first, then again),
then the same with every layer checkpointed (``torch.utils.checkpoint``, non-reentrant; first,
then again). Each step is synchronised and timed on the wall clock. ``first - second`` is what
meeting the length costs; for the checkpointed step that is after the plain steps met it on the
forward thread.

With ``--hf`` the stack is SmolLM-360M's own Hugging Face layers on padded batches (rows of
unequal length, so a boolean mask reaches the attention) and Hugging Face's checkpointing; the
``default`` backend is torch's own choice. Each run also records which attention kernels a plain
step launched.

Writes ``recompute_cold.json`` (``recompute_cold_hf.json``) under ``--output_dir``.

Usage:
    python benchmarks/recompute_cold.py --output_dir out/cold
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention
from torch.utils.checkpoint import checkpoint

BACKENDS = {"cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION],
            "efficient": [SDPBackend.EFFICIENT_ATTENTION], "default": None}  # default: torch's own choice


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, inner: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.up, self.down = nn.Linear(hidden, inner, bias=False), nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.out(a)
        return x + self.down(torch.nn.functional.silu(self.up(x)))


def _step(layers, x, recompute: bool) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    if isinstance(layers, nn.ModuleList):
        y = x
        for layer in layers:
            y = checkpoint(layer, y, use_reentrant=False) if recompute else layer(y)
        y.float().pow(2).mean().backward()
    else:  # a Hugging Face model on a padded batch: its own checkpointing
        if recompute:
            layers.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            layers.gradient_checkpointing_disable()
        layers(**x).loss.backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def _hf_model(n_layers: int):
    import transformers

    config = transformers.AutoConfig.from_pretrained(os.path.join(os.path.dirname(__file__), "..", "src", "memfit",
                                                                  "configs", "SmolLM-360M.json"))
    config.num_hidden_layers, config.use_cache = n_layers, False
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.cuda().train()


def _hf_batch(batch: int, length: int) -> dict:
    ids = torch.randint(10, 49152, (batch, length), device="cuda")
    mask = torch.zeros_like(ids)
    for i in range(batch):
        mask[i, : length - 37 * i] = 1  # padded rows, as a collator pads to the longest
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _kernels(layers, x) -> list[str]:
    """The attention kernels one plain step launched (their names' telling part)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _step(layers, x, False)
    names = {e.key for e in prof.key_averages()}
    return sorted({n[:60] for n in names if any(k in n.lower() for k in ("cudnn", "flash", "fmha", "attention"))})


def one_backend(name: str, lengths: list[int], batch: int, n_layers: int, hf: bool) -> dict:
    torch.manual_seed(0)
    if hf:
        layers, make = _hf_model(n_layers), _hf_batch
    else:
        layers = nn.ModuleList(Layer(960, 15, 2560) for _ in range(n_layers)).cuda().to(torch.bfloat16)
        make = lambda b, n: torch.randn(b, n, 960, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rows = []
    with contextlib.nullcontext() if BACKENDS[name] is None else sdpa_kernel(BACKENDS[name]):
        x0 = make(batch, 64 + 37 * batch)
        for _ in range(3):  # the process's own start-up, at a length outside the list
            _step(layers, x0, False), _step(layers, x0, True)
        kernels = _kernels(layers, x0)
        for length in lengths:
            x = make(batch, length)
            row = {"length": length}
            row["plain_first_ms"], row["plain_second_ms"] = _step(layers, x, False), _step(layers, x, False)
            row["recompute_first_ms"], row["recompute_second_ms"] = _step(layers, x, True), _step(layers, x, True)
            rows.append(row)
    cost = lambda kind: statistics.median(r[f"{kind}_first_ms"] - r[f"{kind}_second_ms"] for r in rows)
    return {"backend": name, "hf": hf, "layers": n_layers, "batch": batch, "rows": rows, "kernels": kernels,
            "plain_new_length_ms": cost("plain"), "recompute_new_length_ms": cost("recompute"),
            "recompute_second_median_ms": statistics.median(r["recompute_second_ms"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output_dir", required=True)
    p.add_argument("--backends", nargs="+", default=["cudnn", "flash"], choices=sorted(BACKENDS))
    p.add_argument("--lengths", type=int, nargs="+", default=[1001, 1203, 1405, 1607, 1809, 2011, 907, 1313])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hf", action="store_true", help="SmolLM-360M's Hugging Face layers on padded batches (a "
                   "boolean mask), checkpointed by Hugging Face, instead of the bare layers")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.exit(2, "recompute_cold.py: no CUDA device here; run it on a GPU machine\n")
    if args.child:
        print(json.dumps(one_backend(args.child, args.lengths, args.batch, args.layers, args.hf)))
        return
    results = []
    for name in args.backends:  # a process each: no cache carries from one backend's run to the next
        cmd = [sys.executable, __file__, "--output_dir", args.output_dir, "--child", name, "--batch", str(args.batch),
               "--layers", str(args.layers), "--lengths", *map(str, args.lengths), *(["--hf"] if args.hf else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            print(f"{name:>9}: failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
            continue
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(result)
        print(f"{name:>9}{' hf' if args.hf else ''}: kernels {result['kernels']}")
        print(f"{name:>9}: a new length costs plain {result['plain_new_length_ms']:.1f} ms, recomputed "
              f"{result['recompute_new_length_ms']:.1f} ms (recomputed step warm {result['recompute_second_median_ms']:.1f} ms)")
    os.makedirs(args.output_dir, exist_ok=True)
    if results:  # the backends that ran; one that failed is named above and fails the call
        with open(os.path.join(args.output_dir, f"recompute_cold{'_hf' if args.hf else ''}.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)
    if len(results) < len(args.backends):
        sys.exit(1)


if __name__ == "__main__":
    main()
