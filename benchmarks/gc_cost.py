"""What a full garbage collection costs in a training process, before and after ``gc.freeze()`` (NOTE [The collector's
pauses], engine/run/collector.py): torch, transformers and peft loaded, a Llama-shaped model in bfloat16 on the GPU
(the CPU without one) with LoRA r16 on every linear layer; three full collections unfrozen, three frozen, two
unfrozen again, each timed alone.

    python benchmarks/gc_cost.py [--layers 16] [--hidden 2048]

Results: ``benchmarks/results/nvidia-h200-x2/fsdp/s42/s42-6.gc.txt`` (Llama-3.2-1B's shape).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    args = p.parse_args(argv)
    import peft
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model("llama", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                            num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                            num_key_value_heads=max(1, args.hidden // 256), vocab_size=128256)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules="all-linear"))

    def full() -> float:
        t = time.perf_counter()
        gc.collect()
        return round((time.perf_counter() - t) * 1e3, 1)

    print(sys.version.split()[0], "tracked", len(gc.get_objects()))
    print("full collections, unfrozen (ms):", [full() for _ in range(3)])
    gc.freeze()
    print("full collections, frozen (ms):", [full() for _ in range(3)])
    gc.unfreeze()
    print("unfrozen again (ms):", [full() for _ in range(2)])


if __name__ == "__main__":
    main()
