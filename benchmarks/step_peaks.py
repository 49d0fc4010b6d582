"""Where a step peaks: the allocator's peak between each two moments of one memfit step, by module and phase.

Hooks on every block (forward, and backward through ``register_full_backward_pre_hook`` / ``_hook``), the final
norm and ``lm_head`` read ``torch.cuda.max_memory_allocated()`` and reset it at each moment, so each line is the
highest allocation since the moment before: the step's peak is in the line with the largest value, and its label
says between which two moments it happened. No memory history is recorded (its recorder under the autograd
engine's thread ended a run in a ``SystemError``). Diagnostic, not a suite: it prints, and writes
``--output`` (JSON lines) when given.

Example (one H200; Llama-3.1-8B's shape, LoRA r16, 64k tokens, a 28 GiB cap):

    python benchmarks/step_peaks.py --model Llama-3.1-8B --lora --tokens 65536 --budget 28GiB --steps 3

A padded batch (Llama-3.2-1B's shape, full fine-tuning, the longest batch of the reach suite's (a)):

    python benchmarks/step_peaks.py --model Llama-3.2-1B --rows 572,338,536,1680,2130,1704,210,4084 --budget 13GiB
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Llama-3.1-8B", help="a config shipped in memfit/configs")
    p.add_argument("--lora", action="store_true", help="peft LoRA r16 on every linear layer (dropout 0)")
    p.add_argument("--tokens", type=int, default=None, help="tokens of each sequence a step trains on (default 65536)")
    p.add_argument("--batch", type=int, default=None, help="sequences a step trains on (default 1)")
    p.add_argument("--rows", default=None, metavar="L1,L2,...",
                   help="instead of --batch and --tokens: each sequence's length, padded to the longest with an "
                        "attention mask and labels -100 on the padding (as loop_bench's batches; a padded batch's "
                        "attention takes a mask)")
    p.add_argument("--plans", default=None,
                   help="a plans file (NOTE [Plans files]): run memfit's precomputed method on it, the head planned, "
                        "every treatment it names offered (a plan forced, to read where it peaks)")
    p.add_argument("--budget", default="28GiB", help="memfit.fit's budget")
    p.add_argument("--steps", type=int, default=3, help="steps; the last one is read")
    p.add_argument("--top", type=int, default=15, help="lines printed, the highest first")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run (no allocator readings)")
    p.add_argument("--config_overrides", nargs="*", default=[], metavar="KEY=VALUE", help="config attributes (a tiny model)")
    p.add_argument("--output", default=None, help="write every line here (JSON lines)")
    p.add_argument("--inner", type=int, default=None, metavar="BLOCK",
                   help="also mark every submodule of this block: its forward (and re-runs) and when its output's gradient arrives")
    p.add_argument("--rerun_chunk_mib", type=int, default=None, metavar="MIB",
                   help="the re-runs' MLP chunks, MiB (recompute_tiled, host_checkpoint_tiled; default the engine's "
                        "RERUN_CHUNK_BYTES): where a floor step peaks at another chunk size")
    p.add_argument("--profile", action="store_true",
                   help="run the last step under torch.profiler too and print the ops that allocated most, by input shape")
    args = p.parse_args(argv)
    if args.rows and (args.tokens is not None or args.batch is not None):
        p.error("--rows gives each sequence's length: leave out --tokens and --batch")
    args.tokens, args.batch = args.tokens or 65536, args.batch or 1
    return args


class Moments:
    """The allocator's peak since the previous moment, at every moment of a step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.lines: list[tuple[str, int, int]] = []
        self.on = False
        self.last = "start"

    def mark(self, label: str) -> None:
        if not self.on:
            return
        if self.cuda:
            self.lines.append((f"{self.last} -> {label}", torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()))
            torch.cuda.reset_peak_memory_stats()
        else:
            self.lines.append((f"{self.last} -> {label}", 0, 0))
        self.last = label

    def watch(self, name: str, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(lambda m, a: self.mark(f"{name} forward starts"))
        module.register_forward_hook(lambda m, a, o: self.mark(f"{name} forward ends"))
        module.register_full_backward_pre_hook(lambda m, g: self.mark(f"{name} backward starts"))
        module.register_full_backward_hook(lambda m, gi, go: self.mark(f"{name} backward ends"))

    def watch_inside(self, name: str, module: torch.nn.Module) -> None:
        """Forward hooks only (they fire in re-runs too), and a hook on each output that needs a gradient."""
        module.register_forward_pre_hook(lambda m, a: self.mark(f"{name} forward starts"))

        def ends(m, a, out):
            self.mark(f"{name} forward ends" + ("" if torch.is_grad_enabled() else " (no grad)"))
            tensors = [out] if isinstance(out, torch.Tensor) else [t for t in (out if isinstance(out, tuple) else ()) if isinstance(t, torch.Tensor)]
            for t in tensors:
                if t.requires_grad:
                    t.register_hook(lambda g: self.mark(f"{name} output's gradient"))

        module.register_forward_hook(ends)


def _profiler():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True, record_shapes=True)


def _allocating_ops(prof) -> str:
    """The profiled step's op calls by the device memory they allocated net, the largest first (per shape)."""
    averages = prof.key_averages(group_by_input_shape=True)
    key = "self_device_memory_usage" if hasattr(averages[0], "self_device_memory_usage") else "self_cuda_memory_usage"
    return averages.table(sort_by=key, row_limit=40, max_name_column_width=40, max_shapes_column_width=80)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    import transformers

    import memfit
    from memfit.engine.parts.treatments import tiled_mlp

    if args.rerun_chunk_mib is not None:  # read by Chunking.rerun() at each treatment's making
        tiled_mlp.RERUN_CHUNK_BYTES = args.rerun_chunk_mib * 2**20
    from memfit.engine.parts.blocks import find_blocks
    from memfit.tasks._common import CONFIGS_DIR

    device = torch.device(args.device)
    path = CONFIGS_DIR / f"{args.model}.json"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.json")))
        print(f"--model {args.model}: no such config in memfit/configs; give one of {known}", file=sys.stderr)
        return 2
    config = transformers.AutoConfig.from_pretrained(str(path))
    config.use_cache = False
    for pair in args.config_overrides:
        key, _, value = pair.partition("=")
        setattr(config, key, int(value) if value.lstrip("-").isdigit() else value)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(0)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if args.lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    model.train()
    moments = Moments(device)
    for name, block in find_blocks(model):
        moments.watch(name.split(".")[-1] if name.split(".")[-1].isdigit() else name, block)
    if args.inner is not None:
        block = find_blocks(model)[args.inner][1]
        for sub_name, sub in block.named_modules():
            if sub_name and "lora_" not in sub_name.split(".")[-1] and not sub_name.split(".")[-1].isdigit():
                moments.watch_inside(f"{args.inner}.{sub_name}", sub)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name, module in (("final norm", base.model.norm), ("lm_head", base.lm_head)):
        moments.watch(name, module)
    if args.plans:
        names = sorted({t for row in json.load(open(args.plans))["plans"] for t in row.get("treatments", [])} | {"recompute"})
        ctl = memfit.fit(model, budget=args.budget, method="precomputed", path=args.plans, treatments=names, head=True)
    else:
        ctl = memfit.fit(model, budget=args.budget)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    rows = [int(n) for n in args.rows.split(",")] if args.rows else [args.tokens] * args.batch
    ids = torch.randint(0, config.vocab_size, (len(rows), max(rows)), device=device)
    mask = (torch.arange(max(rows), device=device)[None, :] < torch.tensor(rows, device=device)[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    inputs = {"input_ids": ids, "labels": labels, **({"attention_mask": mask} if args.rows else {})}
    for step in range(args.steps):
        last = step == args.steps - 1
        moments.on, moments.last = last, "step starts"
        if last and moments.cuda:
            torch.cuda.reset_peak_memory_stats()
        profiler = _profiler() if last and args.profile else contextlib.nullcontext()
        with profiler as prof:
            ctl.run_step(lambda: model(**inputs).loss.backward())
        moments.mark("backward ends")
        opt.step()
        opt.zero_grad(set_to_none=True)
        moments.mark("optimizer step ends")
        moments.on = False
        record = ctl.records[-1]
        print(f"step {step}: {record.treatments} peak {record.peak_allocated_bytes / 2**30:.2f} GiB, static "
              f"{record.static_bytes / 2**30:.2f} GiB, {record.step_ms / 1000:.1f} s", flush=True)
    ctl.remove()
    print("the last step, between two moments: the allocator's peak (GiB) and what was allocated at the later one")
    for label, peak, now in sorted(moments.lines, key=lambda line: -line[1])[:args.top]:
        print(f"{peak / 2**30:8.2f} {now / 2**30:8.2f}  {label}")
    if args.profile:
        print(_allocating_ops(prof))
    if args.output:
        with open(args.output, "w") as fh:
            for label, peak, now in moments.lines:
                fh.write(json.dumps({"between": label, "peak_bytes": peak, "allocated_bytes": now}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
