"""What one decoder layer of a bundled config saves for backward, by autograd node: which tensors a
treatment could still free (a copy, an elementwise output) and which only a recompute can.

Walks the autograd graph of one layer's output (random weights, random input), lists each node's
saved tensors that are not parameters, and counts each storage once (``shared``: already listed).
Runs on a CPU (the CPU's attention kernel) or a GPU (``--device cuda``: the GPU's).

    python benchmarks/saved_inventory.py --model Qwen2.5-1.5B --batch 8 --length 64
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen2.5-1.5B", help="a bundled config (memfit/configs)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    import torch
    import transformers

    from memfit.tasks._common import CONFIGS_DIR

    config_file = CONFIGS_DIR / f"{args.model}.json"
    if not config_file.is_file():
        print(f"saved_inventory.py: no bundled config {args.model!r} in {CONFIGS_DIR}", file=sys.stderr)
        return 2
    config = transformers.AutoConfig.from_pretrained(str(config_file))
    config.num_hidden_layers, config.use_cache = 1, False
    dtype = getattr(torch, args.dtype)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model = model.to(args.device).train()
    n, t = args.batch, args.length
    x = torch.randn(n, t, config.hidden_size, device=args.device, dtype=dtype, requires_grad=True)
    positions = torch.arange(t, device=args.device).unsqueeze(0).expand(n, -1)
    out = model.model.layers[0](x, attention_mask=None, position_ids=positions,
                                position_embeddings=model.model.rotary_emb(x, positions))
    out = out[0] if isinstance(out, tuple) else out
    parameters = {q.untyped_storage().data_ptr() for q in model.parameters()}
    seen: set[int] = set()
    rows, stack, visited = [], [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except RuntimeError:  # a saved tensor already freed, or not a tensor
                continue
            for tensor in value if isinstance(value, (tuple, list)) else [value]:
                if not isinstance(tensor, torch.Tensor) or tensor.untyped_storage().data_ptr() in parameters:
                    continue
                ptr = tensor.untyped_storage().data_ptr()
                rows.append({"node": node.name(), "saved": attr[len("_saved_"):], "shape": list(tensor.shape),
                             "dtype": str(tensor.dtype).removeprefix("torch."), "bytes": tensor.untyped_storage().nbytes(),
                             "shared": ptr in seen, "layer_input": ptr == x.untyped_storage().data_ptr()})
                seen.add(ptr)
        stack.extend(f for f, _ in node.next_functions)
    total = sum(r["bytes"] for r in rows if not r["shared"])
    print(json.dumps({"model": args.model, "tokens": n * t, "bytes": total, "bytes_per_token": total / (n * t),
                      "saved": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
