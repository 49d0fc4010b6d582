"""Several ranks under FSDP2 through Accelerate: a decoder LLM, one cap per rank (issue #41).

``run`` (under torchrun, one process per GPU) trains one configuration: a Llama-3- or
Qwen2.5-shaped decoder (``--shape``) built from its config (random weights, bf16), full
fine-tuning or LoRA (``--lora``: r 16 on every linear layer, peft), AdamW, sharded by
Accelerate's FSDP2 plugin (``fully_shard`` on every decoder layer and the root), in a plain
loop. Each rank draws its own batches of ``--batch_size`` rows with the SFT lengths of
``memfit train causal-lm`` (seeded by rank: the ranks plan for different lengths). Methods:

* ``none``: memfit measuring only, uncapped: the speed reference; its per-rank peak (the
  largest over the ranks) is written to ``peak.json`` and gives the caps of the other runs
  (``--reference DIR --share 0.5``);
* ``full``, ``static``, ``dynamic``: memfit hooked after Accelerate sharded the model, every
  micro-step through ``ctl.run_step`` (an OOM in a block's forward is replayed by every rank:
  NOTE [Replay under FSDP] in memfit/engine/replay.py);
* peers, memfit only measuring: ``accelerate-ac`` (Accelerate's FSDP2 activation checkpointing,
  ``fsdp_activation_checkpointing``), ``accelerate-ac-offload`` (the same with its CPU offload,
  ``fsdp_offload_params``), ``hf-ckpt`` (Hugging Face's ``gradient_checkpointing_enable``).

The cap is ``torch.cuda.set_per_process_memory_fraction`` on every rank, for memfit and peers
alike. A rank that fails (an OOM a peer cannot survive, or one memfit cannot replay in step)
ends the run; every collective has a timeout (``--collective_timeout_s``), so a run fails
rather than hangs. Each rank writes ``rank{r}.json`` (step times, peaks, OOM replays, blocks
treated per step) and memfit's step records.

``oom-check`` trains ``dynamic`` three times in one process group (clean; an OOM injected on
rank 1 in block 1's forward at a steady step; and, last, one injected in a backward), and
writes ``oom_check.json``: whether the injected forward run's final weights equal the clean
run's bitwise on every rank, the records' OOM replays, and the backward run's error (memfit
raises a clear error there instead of hanging: it cannot be replayed in step).

``summarize`` writes ``results.jsonl`` (the fields ``memfit report`` reads, per configuration,
the slowest rank's time and the largest peak) and ``summary.md`` (time per step of the slowest
rank vs ``none``, every rank's peak vs its cap, OOMs, replays, blocks treated per rank, and
scaling from 2 to 4 GPUs where both ran).

Without CUDA (a check of the script on CPU ranks under gloo) Accelerate does not enable FSDP;
the script then lets its state take the FSDP plugin as on GPUs (as tests/_fsdp_trainer_worker.py
does), and times and peaks mean nothing.

Usage:
    torchrun --nproc_per_node 2 benchmarks/fsdp_bench.py run --output_dir OUT/none --method none --shape llama-3b
    torchrun --nproc_per_node 2 benchmarks/fsdp_bench.py run --output_dir OUT/dynamic-0.5 --method dynamic \\
        --shape llama-3b --reference OUT/none --share 0.5
    torchrun --nproc_per_node 2 benchmarks/fsdp_bench.py oom-check --output_dir OUT/oom-check --shape llama-1b
    python benchmarks/fsdp_bench.py summarize OUT
(``python benchmarks/run_suite.py fsdp [--quick]`` runs the matrix: benchmarks/suites/fsdp.py.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

#: Decoder shapes (random weights): Llama-3.2-1B/3B, Llama-3.1-8B, Qwen2.5-1.5B/3B/7B, and a tiny
#: one for CPU checks; vocabularies cut to 32,000 (the head is not what this suite measures).
SHAPES = {
    "llama-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8)),
    "llama-3b": ("llama", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                               num_key_value_heads=8)),
    "llama-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=8)),
    "qwen-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                                num_key_value_heads=2)),
    "qwen-3b": ("qwen2", dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                              num_key_value_heads=2)),
    "qwen-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                              num_key_value_heads=4)),
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2)),
}
VOCAB = 32000
MEMFIT = ("none", "full", "static", "dynamic")
PEERS = ("accelerate-ac", "accelerate-ac-offload", "hf-ckpt")


def _fsdp_on_cpu() -> None:
    """Accelerate enables FSDP only on accelerators; on CPU ranks let its state take the plugin."""
    import accelerate.state as state
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU):
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin

    state.AcceleratorState.__init__ = patched


def _sft_lengths(n: int, batch: int, seed: int, cap: int) -> list[list[int]]:
    """Per step, ``batch`` lengths drawn from memfit train causal-lm's SFT table."""
    from memfit.cli.tasks._common import QUANTILE_LEVELS
    from memfit.cli.tasks.causal_lm import SFT_TOKENS

    rng = random.Random(seed)
    levels = list(zip(QUANTILE_LEVELS, SFT_TOKENS))

    def draw() -> int:
        u = rng.random()
        for (p0, v0), (p1, v1) in zip(levels, levels[1:]):
            if u <= p1:
                return min(cap, int(v0 + (v1 - v0) * (u - p0) / (p1 - p0)))
        return min(cap, SFT_TOKENS[-1])

    return [[draw() for _ in range(batch)] for _ in range(n)]


def _batch(lengths: list[int], seed: int, device):
    import torch

    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.full((len(lengths), width), -100, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(3, VOCAB, (length,), generator=g)
        labels[row, :length] = ids[row, :length]
        mask[row, :length] = 1
    return {k: v.to(device) for k, v in (("input_ids", ids), ("attention_mask", mask), ("labels", labels))}


def _model(shape: str, lora: bool, hf_ckpt: bool, device):
    import torch
    import transformers

    kind, dims = SHAPES[shape]
    config_cls = transformers.LlamaConfig if kind == "llama" else transformers.Qwen2Config
    config = config_cls(vocab_size=VOCAB, max_position_embeddings=4096, use_cache=False, tie_word_embeddings=False,
                        attn_implementation="sdpa", **dims)
    torch.manual_seed(0)  # the same weights on every rank (FSDP shards what each rank holds)
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM
    # built on the device, in bf16: an 8B model's float32 init on the host takes minutes and 32 GB a rank
    with torch.device(device):
        model = cls._from_config(config, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    if hf_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train(), "LlamaDecoderLayer" if kind == "llama" else "Qwen2DecoderLayer"


def _accelerator(layer_cls: str, ac: bool, offload: bool):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=[layer_cls],
        reshard_after_forward=True, activation_checkpointing=ac, cpu_offload=offload,
        state_dict_type="SHARDED_STATE_DICT",
    )
    return Accelerator(fsdp_plugin=plugin)


def _init(timeout_s: float):
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        _fsdp_on_cpu()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"), dist.get_rank()


def _cap(device, budget_bytes: int | None) -> None:
    import torch

    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if budget_bytes is None else min(1.0, budget_bytes / total), device)


def _train(args, device, rank: int, method: str, budget_bytes: int | None, out: Path, inject: str | None = None):
    """One configuration on this rank; returns its numbers (and the final weights when asked)."""
    import torch
    import memfit

    peer = method in PEERS
    model, layer_cls = _model(args.shape, args.lora, method == "hf-ckpt", device)
    accelerator = _accelerator(layer_cls, ac=method.startswith("accelerate-ac"), offload=method.endswith("offload"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    model, optimizer = accelerator.prepare(model, optimizer)
    _cap(device, budget_bytes)
    # memfit hooks the sharded model (NOTE [Hooked after sharding] in memfit/integrations/hf.py);
    # a peer runs under memfit's method none, measuring only, uncapped by memfit (the cap is set above)
    ctl = memfit.fit(model, None if peer else budget_bytes, "none" if peer else method, optimizer=optimizer.optimizer,
                     log=str(out / f"memfit_steps.rank{rank}.jsonl"), cap=False, announce=False)
    lengths = _sft_lengths(args.steps, args.batch_size, seed=1000 + rank, cap=args.max_length)
    state = {"fired": 0}
    # inside block 1's body (its MLP): FSDP has gathered the block's parameters, and the block's
    # own OOM handling sees it (NOTE [Replay under FSDP])
    target = getattr(ctl.blocks[1].module, "mlp", ctl.blocks[1].module)
    fire_at = args.steps - 2  # a steady step

    def pre(module, inputs):
        if state.get("armed") == "forward" and module.training and torch.is_grad_enabled():
            state["armed"], state["fired"] = None, state["fired"] + 1
            raise torch.OutOfMemoryError("injected in forward: CUDA out of memory")

    def post(module, inputs, output):
        if state.get("armed") == "backward" and module.training and torch.is_grad_enabled():
            state["armed"] = None

            def fail(grad):
                state["fired"] += 1
                raise torch.OutOfMemoryError("injected in backward: CUDA out of memory")

            (output[0] if isinstance(output, tuple) else output).register_hook(fail)

    handles = [target.register_forward_pre_hook(pre), target.register_forward_hook(post)] if inject and rank == 1 else []
    step_ms, peaks = [], []
    for step in range(args.steps):
        if inject and rank == 1 and step == fire_at:
            state["armed"] = inject
        batch = _batch(lengths[step], seed=100_000 * rank + step, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        torch.manual_seed(step)
        ctl.run_step(lambda: accelerator.backward(model(**batch).loss))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
        step_ms.append((time.perf_counter() - t0) * 1e3)
    records = ctl.records
    ctl.remove()
    for h in handles:
        h.remove()
    steady = step_ms[min(args.steady_from, len(step_ms) - 1):]
    result = {
        "method": method, "rank": rank, "world_size": torch.distributed.get_world_size(), "shape": args.shape,
        "lora": args.lora, "budget_bytes": budget_bytes, "steps": len(step_ms), "batch_size": args.batch_size,
        "step_ms": step_ms, "median_steady_step_ms": statistics.median(steady),
        "max_peak_allocated_bytes": max(peaks) if peaks else max((r.peak_allocated_bytes for r in records), default=0),
        "oom_retries": sum(r.oom_retries for r in records), "records": len(records),
        "mean_treated_blocks": statistics.mean(r.n_checkpointed for r in records) if records else 0.0,
        "n_blocks": records[0].n_blocks if records else 0, "fired": state["fired"],
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    return result, model


def _gathered(model) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in model.state_dict().items()}


def run(args) -> None:
    import torch.distributed as dist

    device, rank = _init(args.collective_timeout_s)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    budget = None
    if args.reference:
        peak = json.loads((Path(args.reference) / "peak.json").read_text())["max_peak_allocated_bytes"]
        budget = int(args.share * peak)
    result, _ = _train(args, device, rank, args.method, budget, out)
    result["share"] = args.share if args.reference else None
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    import torch

    peak = torch.tensor([result["max_peak_allocated_bytes"]], dtype=torch.int64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0 and args.method == "none":
        (out / "peak.json").write_text(json.dumps({"max_peak_allocated_bytes": int(peak.item())}))
    dist.barrier()
    dist.destroy_process_group()


def oom_check(args) -> None:
    import torch
    import torch.distributed as dist

    device, rank = _init(args.collective_timeout_s)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"rank": rank, "shape": args.shape}
    clean, clean_model = _train(args, device, rank, "dynamic", None, out / "clean")
    reference = _gathered(clean_model)
    del clean_model
    # NOTE [The determinism floor]: on a GPU two clean runs of the same steps need not be bitwise
    # equal (attention's and reductions' kernels accumulate in varying order), so the replayed
    # run is compared with the clean one against the distance between two clean runs.
    _, again_model = _train(args, device, rank, "dynamic", None, out / "clean-again")
    floor = _max_abs_diff(reference, _gathered(again_model))
    del again_model
    failed, failed_model = _train(args, device, rank, "dynamic", None, out / "forward", inject="forward")
    diff = _max_abs_diff(reference, _gathered(failed_model))
    del failed_model
    report["forward"] = {
        "fired": failed["fired"], "oom_retries": failed["oom_retries"], "records": failed["records"],
        "clean_records": clean["records"], "weights_equal": diff == 0.0, "max_abs_diff": diff,
        "clean_runs_max_abs_diff": floor, "within_clean_runs_spread": diff <= floor,
    }
    (out / f"oom_check.rank{rank}.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    try:  # last: the ranks cannot go on together after it
        _train(args, device, rank, "dynamic", None, out / "backward", inject="backward")
        report["backward"] = {"error": None}
    except Exception as err:  # noqa: BLE001 - the error is the result
        report["backward"] = {"error": f"{type(err).__name__}: {str(err)[-600:]}"}
    (out / f"oom_check.rank{rank}.json.tmp").write_text(json.dumps(report, indent=1))
    os.replace(out / f"oom_check.rank{rank}.json.tmp", out / f"oom_check.rank{rank}.json")
    sys.stdout.flush()
    # The rank whose backward failed exits non-zero, as a training script's uncaught error would:
    # torchrun then stops the ranks still waiting in a collective (no hang until its timeout).
    os._exit(3 if report["backward"]["error"] else 0)


def _max_abs_diff(a: dict, b: dict) -> float:
    import torch

    return max((float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].numel()), default=0.0)


def summarize(folder: str) -> list[dict]:
    root = Path(folder)
    rows = []
    for config in sorted(p for p in root.iterdir() if p.is_dir()):
        ranks = [json.loads(p.read_text()) for p in sorted(config.glob("rank*.json"))]
        if not ranks:
            rows.append({"name": config.name, "status": "failed"})
            continue
        first = ranks[0]
        rows.append({
            "name": config.name, "status": "ok", "method": first["method"], "world_size": first["world_size"],
            "shape": first["shape"], "lora": first["lora"], "budget_bytes": first["budget_bytes"], "share": first.get("share"),
            "steps": first["steps"], "batch_size": first["batch_size"],
            "step_ms": max(r["median_steady_step_ms"] for r in ranks),  # the slowest rank
            "total_s": max(sum(r["step_ms"]) for r in ranks) / 1e3, "transformers": first.get("transformers"),
            "per_rank": {str(r["rank"]): {k: r[k] for k in ("max_peak_allocated_bytes", "oom_retries", "mean_treated_blocks",
                                                             "median_steady_step_ms", "records")} for r in ranks},
            "n_blocks": first["n_blocks"], "device": first["device"], "torch": first["torch"],
        })
    for r in rows:
        ref = next((x for x in rows if x["status"] == "ok" and x["method"] == "none" and x.get("budget_bytes") is None
                    and x["world_size"] == r.get("world_size") and x["shape"] == r.get("shape") and x["lora"] == r.get("lora")), None)
        if r["status"] == "ok" and ref:
            r["vs_none"] = r["step_ms"] / ref["step_ms"]
    with open(root / "results.jsonl", "w", encoding="utf-8") as fh:
        for r in rows:
            ranks = list(r.get("per_rank", {}).values())
            fh.write(json.dumps({
                **r, "task": f"fsdp2, {r.get('world_size')} ranks", "model": f"{r.get('shape')}{' LoRA' if r.get('lora') else ''}",
                "max_peak_allocated_bytes": max((p["max_peak_allocated_bytes"] for p in ranks), default=None),
                "oom_count": sum(p["oom_retries"] for p in ranks),
                "recomputed_fraction": (statistics.mean(p["mean_treated_blocks"] for p in ranks) / r["n_blocks"])
                if ranks and r.get("n_blocks") else None,
                "status": "ok" if r["status"] == "ok" else "error",
            }) + "\n")
    (root / "summary.md").write_text(_table(rows))
    return rows


def _table(rows: list[dict]) -> str:
    gib = 2**30
    lines = ["| config | ranks | method | cap per rank (GiB) | step ms (slowest rank) | vs none | peak per rank (GiB) "
             "| OOM replays per rank | blocks treated per rank |", "| --- | ---: | --- | ---: | ---: | ---: | --- | --- | --- |"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | | failed (see its log: OOM, error or timeout) | | | | | | |")
            continue
        ranks = [r["per_rank"][k] for k in sorted(r["per_rank"], key=int)]
        cap = f"{r['budget_bytes'] / gib:.2f}" if r["budget_bytes"] else "uncapped"
        peaks = " / ".join(f"{p['max_peak_allocated_bytes'] / gib:.2f}" for p in ranks)
        ooms = " / ".join(str(p["oom_retries"]) for p in ranks)
        treated = " / ".join(f"{p['mean_treated_blocks']:.1f}" for p in ranks)
        vs = f"{r['vs_none']:.2f}×" if "vs_none" in r else ""
        lines.append(f"| {r['name']} | {r['world_size']} | {r['method']} | {cap} | {r['step_ms']:.1f} | {vs} | {peaks} "
                     f"| {ooms} | {treated} of {r['n_blocks']} |")
    scaling = []
    for r in rows:
        if r["status"] == "ok" and r["world_size"] == 4:
            two = next((x for x in rows if x["status"] == "ok" and x["world_size"] == 2 and x["method"] == r["method"]
                        and x["shape"] == r["shape"] and x["lora"] == r["lora"] and x.get("share") == r.get("share")), None)
            if two:  # tokens per second of the whole job, 4 ranks over 2
                scaling.append(f"| {r['name']} | {2 * two['step_ms'] / r['step_ms']:.2f}× |")
    if scaling:
        lines += ["", "| config | throughput 4 GPUs / 2 GPUs |", "| --- | ---: |", *scaling]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp_bench.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "oom-check"):
        r = sub.add_parser(name)
        r.add_argument("--output_dir", required=True)
        r.add_argument("--method", default="dynamic", choices=MEMFIT + PEERS)
        r.add_argument("--shape", default="llama-3b", choices=sorted(SHAPES))
        r.add_argument("--lora", action="store_true")
        r.add_argument("--reference", default=None, help="the none run's folder: its peak.json gives the cap")
        r.add_argument("--share", type=float, default=0.5, help="the cap as a share of none's per-rank peak")
        r.add_argument("--steps", type=int, default=30)
        r.add_argument("--steady_from", type=int, default=8)
        r.add_argument("--batch_size", type=int, default=4)
        r.add_argument("--max_length", type=int, default=2048)
        r.add_argument("--collective_timeout_s", type=float, default=300)
    s = sub.add_parser("summarize")
    s.add_argument("output_dir")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        run(args)
    elif args.command == "oom-check":
        oom_check(args)
    else:
        print(_table(summarize(args.output_dir)), end="")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    sys.exit(main(sys.argv[1:]))
