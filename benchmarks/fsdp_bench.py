"""Several ranks under FSDP2 through Accelerate: a decoder LLM, one cap per rank (issue #41).

``matrix`` (a plain process) runs a list of configurations in ONE ``torchrun`` launch (each
start costs 15-20 s): the ranks build, train and free each configuration in turn. A
configuration is ``MODEL[+lora]/METHOD[@SHARE][:STEPS][#BATCH]``:

* MODEL: a bundled config (``llama-3b`` = memfit/configs/Llama-3.2-3B.json, ``llama-8b`` =
  Llama-3.1-8B, ``llama-1b`` = Llama-3.2-1B, ``tiny`` = llama-tiny, for CPU checks), real
  vocabulary, random weights, bf16 on GPUs; ``+lora``: peft r 16 on every linear layer. Built
  on the meta device, sharded by Accelerate's FSDP2 (``fully_shard`` on every decoder layer,
  the embeddings and head, the root), then materialised on the GPU (each rank initialises its
  own shards): an 8B model's init on the host takes minutes.
* METHOD: ``none`` (uncapped, memfit measuring only: the speed reference, and its per-rank peak,
  the largest over the ranks, gives the caps of the same model's other configurations),
  ``full``, ``static``, ``dynamic`` (memfit hooked after sharding, every micro-step through
  ``ctl.run_step``: NOTE [Replay under FSDP] in memfit/engine/run/replay.py), and the peers, memfit
  only measuring: ``accelerate-ac`` (Accelerate's FSDP2 activation checkpointing,
  ``fsdp_activation_checkpointing``), ``accelerate-ac-offload`` (the same with its CPU offload),
  ``hf-ckpt`` (Hugging Face's ``gradient_checkpointing_enable``).
* SHARE: the per-rank cap as a share of the same model's ``none`` peak
  (``torch.cuda.set_per_process_memory_fraction`` on every rank, memfit and peers alike), or a size
  in GiB (``@24GiB``: the same cap whatever ``none`` takes; no ``none`` needed).
* STEPS: this configuration's steps (default ``--steps``); BATCH: its rows per rank and step
  (default ``--batch_size``; named in the folder, ``llama-8b-lora-b4-x4-none``).

Each rank draws its own batches of ``--batch_size`` rows with ``memfit train causal-lm``'s SFT
lengths (seeded by rank, the same in every configuration), AdamW (torch's default: foreach).

# NOTE [One launch, many configurations]
Rule 1. Before training, the ranks agree (one all-reduce) whether the cap holds the static
need (weights, gradients, AdamW state and its step's temporaries: NOTE [Optimizer step
transient] in memfit/engine/parts/optim_state.py); if not, every rank skips the configuration.
Rule 2. After each step the ranks agree whether the configuration's time limit
(``--config_limit_s``) has passed; if so all stop it together and keep the steps done.
Rule 3. Any error on a rank (an OOM a peer cannot survive, one memfit cannot replay in step)
leaves the other ranks inside a collective the failed rank never joins; the failed rank writes
its error and ends its process, torchrun stops the others, and ``matrix`` records the
configuration as failed and launches the rest again. A launch that outlives the current
configuration's limit by ``--grace_s`` (a hang) is killed the same way.
Rule 4. The matrix ends by its deadline (``--deadline_s`` from its start, or ``--end_unix_s``,
whichever comes first): no configuration starts later than ``--config_limit_s`` before it
(the ranks agree), and a launch still running ``--grace_s`` after it is killed; what has not
run is recorded as not run.

``oom-check:MODEL`` (last in a list: it ends the launch) trains ``dynamic`` three times in the
process group (clean, again, and with an OOM injected on rank 1 in block 1's forward at a steady
step), then once with one injected in a backward, and writes ``oom_check.rank{r}.json``:
whether the replayed run's final weights equal the clean run's (on a GPU: within the distance
between the two clean runs: NOTE [The determinism floor]), the OOM replays, and the backward
run's error (it cannot be replayed in step; memfit says so and the ranks stop, no hang).

``--profile`` runs one more step after each configuration's (the batch of step ``--steady_from`` again, untimed)
under ``torch.profiler`` and records each rank's time in collectives (``collective_ms``: NCCL's kernels run from a
collective's launch until its last rank joins, so what a configuration spends beyond ``full``'s, where every rank
runs the same plan, is waiting for the slowest rank).

# NOTE [A launch warms up untimed]
A launch's first configuration of each model ran its steady steps 10-30% slower in the first repeat than in the
second (s41-1, s41-2: the 3B's `none` 703 against 547 ms at one step; the 8B LoRA's 1,030 against 873), every step
alike, while the configurations after it ran as fast in both: each new shape's first run builds its kernels' plans
(cuDNN's attention graphs, cuBLAS's choices) and the process's first calls warm up, and a process pays that once
for every configuration after it. Six untimed steps did not remove it (s41-2): the steady steps' shapes were new.
So every launch first runs each of its models' whole schedule (every shape its configurations will see) untimed under
``none``, uncapped, keeping nothing (``--warmup_steps`` sets another count; 0: none), and a ratio against the first
configuration compares like with like. Then once more under ``full``: a recompute runs its forward on autograd's
thread, and what libraries build per shape in thread-local caches (cuDNN's attention graphs) fell on the first
configuration that recomputes (s41-3: the 3B's `dynamic` ran four of its first repeat's steady steps 90-130 ms slower
than its second, the peers after it did not; loop_bench.py's untimed passes do the same for the same reason).

``--repeats N`` runs the whole list N times in turn (interleaved: a drift of the machine's speed
touches every configuration alike); repeat r > 0 writes ``<name>-r<r>`` and takes its cap from
the first repeat's ``none``.

``summarize DIR...`` writes ``results.jsonl`` (the fields ``memfit report`` reads) and
``summary.md``, one row per configuration over its repeats (step time: the median of the
repeats' slowest-rank medians, each repeat's in ``step_ms_repeats``): slowest rank's median step vs ``none``, every rank's peak vs its cap, OOM
replays, blocks treated per rank, the static check, "dynamic vs the fastest peer that fits" per
model and cap, and the throughput of 4 ranks over 2 (same model) where both ran.

Without CUDA (a check of the script on CPU ranks under gloo) Accelerate does not enable FSDP;
the script then lets its state take the FSDP plugin as on GPUs (as tests/_fsdp_trainer_worker.py
does), and times and peaks mean nothing.

Usage:
    python benchmarks/fsdp_bench.py matrix --output_dir OUT --nproc 2 \\
        llama-3b/none llama-3b/dynamic@0.5 llama-3b/accelerate-ac@0.5 oom-check:llama-1b
    python benchmarks/fsdp_bench.py summarize OUT [OUT4]
    python benchmarks/fsdp_bench.py decisions OUT/llama-3b-x2-dynamic-0.5*/memfit_steps.rank*.jsonl
(``python benchmarks/run_suite.py fsdp --calls x2`` runs the suite's 2-GPU job: benchmarks/suites/fsdp.py.)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import gzip
import json
import os
import random
import re
import resource
import shutil
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# the allocator settings `memfit train` and run_suite.py use, set before torch is imported (the ranks inherit them): every
# configuration alike, peers included, which do not fit 0.5 without them (s40-4); `expandable_segments:False` in the
# environment measures the other setting (NOTE [Expandable segments under a cap], engine/run/meter.py)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

ROOT = Path(__file__).resolve().parent.parent
#: bundled configs (src/memfit/configs/) by the short names the suite uses
MODELS = {"llama-1b": "Llama-3.2-1B", "llama-3b": "Llama-3.2-3B", "llama-8b": "Llama-3.1-8B", "tiny": "llama-tiny"}
MEMFIT = ("none", "full", "static", "dynamic")
PEERS = ("accelerate-ac", "accelerate-ac-offload", "hf-ckpt")
_SPEC = re.compile(r"^(?P<model>[\w.-]+?)(?P<lora>\+lora)?/(?P<method>[\w-]+)(?:@(?P<share>[0-9.]+)(?P<gib>GiB)?)?(?::(?P<steps>\d+))?"
                   r"(?:#(?P<batch>\d+))?$")
_OOM_CHECK = re.compile(r"^oom-check:(?P<model>[\w.-]+)$")
GIB = 2**30


@dataclass(frozen=True)
class Config:
    """One configuration of the matrix (NOTE [One launch, many configurations])."""

    name: str
    """Its folder: ``llama-3b-lora-x2-dynamic-0.5``."""
    model: str
    """A key of :data:`MODELS`."""
    lora: bool
    method: str
    """A memfit method, a peer, or ``oom-check``."""
    share: float | None
    """The cap as a share of ``reference``'s per-rank peak; None: uncapped."""
    reference: str | None
    """The folder of the same model's ``none`` configuration."""
    steps: int
    batch_size: int | None = None
    """Rows per rank and step; None: ``--batch_size``."""
    cap_gib: float | None = None
    """A cap per rank in GiB (``@24GiB``) instead of a share."""


def parse_config(text: str, world: int, steps: int) -> Config:
    """``MODEL[+lora]/METHOD[@SHARE][:STEPS][#BATCH]`` or ``oom-check:MODEL`` -> Config.

    Raises:
        SystemExit: naming the configuration to fix.
    """
    check = _OOM_CHECK.match(text)
    if check:
        if check["model"] not in MODELS:
            raise SystemExit(f"fsdp_bench: {text!r}: the model is one of {', '.join(MODELS)}")
        return Config(f"oom-check-{check['model']}-x{world}", check["model"], False, "oom-check", None, None, steps)
    m = _SPEC.match(text)
    if not m or m["model"] not in MODELS or m["method"] not in MEMFIT + PEERS:
        raise SystemExit(f"fsdp_bench: configuration {text!r}: write MODEL[+lora]/METHOD[@SHARE][:STEPS][#BATCH] with MODEL one "
                         f"of {', '.join(MODELS)} and METHOD one of {', '.join(MEMFIT + PEERS)}, or oom-check:MODEL")
    value = float(m["share"]) if m["share"] else None
    share, cap_gib = (None, value) if m["gib"] else (value, None)
    if (m["method"] == "none") != (value is None):
        raise SystemExit(f"fsdp_bench: configuration {text!r}: none runs uncapped (no @SHARE); every other method needs one")
    batch = f"-b{m['batch']}" if m["batch"] else ""
    stem = f"{m['model']}{'-lora' if m['lora'] else ''}{batch}-x{world}"
    name = f"{stem}-{m['method']}" + (f"-{share:g}" if share else f"-{cap_gib:g}GiB" if cap_gib else "")
    return Config(name, m["model"], bool(m["lora"]), m["method"], share, None if share is None else f"{stem}-none",
                  int(m["steps"] or steps), int(m["batch"]) if m["batch"] else None, cap_gib)


# ------------------------------------------------------------------------------------------ data


def _sft_lengths(n: int, batch: int, seed: int, cap: int) -> list[list[int]]:
    """Per step, ``batch`` lengths drawn from memfit train causal-lm's SFT table."""
    from memfit.tasks._common import QUANTILE_LEVELS
    from memfit.tasks.causal_lm import SFT_TOKENS

    rng = random.Random(seed)
    levels = list(zip(QUANTILE_LEVELS, SFT_TOKENS))

    def draw() -> int:
        u = rng.random()
        for (p0, v0), (p1, v1) in zip(levels, levels[1:]):
            if u <= p1:
                return min(cap, int(v0 + (v1 - v0) * (u - p0) / (p1 - p0)))
        return min(cap, SFT_TOKENS[-1])

    return [[draw() for _ in range(batch)] for _ in range(n)]


def _uniform_lengths(n: int, batch: int, seed: int, low: int, high: int) -> list[list[int]]:
    """Per step, ``batch`` lengths uniform in ``[low, high]`` (long sequences: activations over the static part)."""
    rng = random.Random(seed)
    return [[rng.randint(low, high) for _ in range(batch)] for _ in range(n)]


def _batch(lengths: list[int], seed: int, vocab: int, device):
    import torch

    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.full((len(lengths), width), -100, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(3, vocab, (length,), generator=g)
        labels[row, :length] = ids[row, :length]
        mask[row, :length] = 1
    return {k: v.to(device) for k, v in (("input_ids", ids), ("attention_mask", mask), ("labels", labels))}


# ----------------------------------------------------------------------------------------- model


def _fsdp_plugin_taken() -> None:
    """Accelerate gives its state the FSDP plugin only where its PartialState still says a plain
    multi-device run: not on CPU ranks, and not after ``AcceleratorState._reset_state()`` once an
    earlier configuration of the same launch made it FSDP (the next Accelerator then has no
    ``fsdp_plugin``). Let its state take the plugin whenever one is passed."""
    import accelerate.state as state
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and getattr(self, "fsdp_plugin", None) is not fsdp_plugin:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin

    state.AcceleratorState.__init__ = patched


def _sharded_model(config: Config, device, rank: int):
    """The model, sharded by Accelerate's FSDP2 while on the meta device, then materialised on
    ``device`` (its parameters on the host with CPU offload), each rank drawing its own shards'
    weights; buffers (RoPE's frequencies) keep the values they were built with."""
    import torch
    import transformers
    from accelerate import Accelerator, init_empty_weights
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model

    from memfit.tasks._common import CONFIGS_DIR

    hf_config = transformers.AutoConfig.from_pretrained(CONFIGS_DIR / f"{MODELS[config.model]}.json")
    hf_config.use_cache = False
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with init_empty_weights(include_buffers=False):  # buffers (RoPE's) keep their values
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    layer_cls = type(model.model.layers[0]).__name__
    if config.method == "hf-ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"),
                                    autocast_adapter_dtype=False)
    AcceleratorState._reset_state()  # each configuration its own plugin (the process group stays)
    offload = config.method == "accelerate-ac-offload"
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=[layer_cls],
        reshard_after_forward=True, activation_checkpointing=config.method.startswith("accelerate-ac"),
        cpu_offload=offload, state_dict_type="SHARDED_STATE_DICT",
    ))
    if accelerator.state.fsdp_plugin.activation_checkpointing:
        model = fsdp2_apply_ac(accelerator, model)
    model = fsdp2_prepare_model(accelerator, model)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device="cpu" if offload else device)
    with torch.no_grad():
        for name, b in buffers.items():
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = b.to(device)  # offload moves parameters only
        torch.manual_seed(1234 + rank)  # the same weights in every configuration
        for name, p in model.named_parameters():
            shard = p.to_local() if hasattr(p, "to_local") else p
            if "norm" in name:
                shard.fill_(1.0)
            elif "lora_B" in name:
                shard.zero_()
            else:
                shard.normal_(0.0, 0.02)
    return model.train(), accelerator, hf_config.vocab_size


# ----------------------------------------------------------------------------------- the worker


def _init(timeout_s: float):
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    _fsdp_plugin_taken()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"), dist.get_rank()


def _agree(flag: float, device, op: str = "max") -> float:
    """The ranks' largest (or smallest) ``flag``: one all-reduce."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(flag)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return float(t.item())


def _cap(device, budget_bytes: int | None) -> None:
    import torch

    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if budget_bytes is None else min(1.0, budget_bytes / total), device)


def _static_need(model, optimizer, budget_bytes: int | None = None, treated: bool = False) -> dict[str, int]:
    """This rank's weights, gradients, AdamW state and step temporaries (memfit's static check): foreach's, or where
    ``treated`` (memfit's methods) those its optimizer step part runs in what ``budget_bytes`` leaves (the per-tensor
    step where foreach's do not fit: NOTE [The optimizer step's treatments])."""
    from memfit.engine.parts.accounting import expected_optimizer_bytes, local
    from memfit.engine.run.controller import check_static_need_of
    from memfit.engine.parts.optim_state import torch_step_transient_bytes
    from memfit.engine.parts.optimizer_step import choose_step

    state = expected_optimizer_bytes(optimizer)
    if treated and budget_bytes is not None:
        rest = sum(check_static_need_of(model, None, state).values())
        return check_static_need_of(model, None, state, transient_bytes=choose_step(optimizer, budget_bytes - rest, local))
    return check_static_need_of(model, None, state, transient_bytes=torch_step_transient_bytes(optimizer, local))


def _train(args, config: Config, device, rank: int, budget_bytes: int | None, out: Path, inject: str | None = None):
    """One configuration on this rank: its numbers (None when the ranks skip it) and the model."""
    import torch
    import torch.distributed as dist

    import memfit

    method = "dynamic" if config.method == "oom-check" else config.method
    peer = method in PEERS
    out.mkdir(parents=True, exist_ok=True)
    model, accelerator, vocab = _sharded_model(config, device, rank)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    need = _static_need(model, optimizer, budget_bytes, treated=not peer)
    static_bytes = int(_agree(sum(need.values()), device))
    base = {
        "name": config.name, "method": method, "rank": rank, "world_size": dist.get_world_size(), "model": config.model,
        "lora": config.lora, "budget_bytes": budget_bytes, "share": config.share,
        "batch_size": config.batch_size or args.batch_size,
        "static_need_bytes": static_bytes, "static_parts": need,
    }
    # NOTE [One launch, many configurations], rule 1 (offload keeps the shards on the host: not checked)
    fits = budget_bytes is None or method == "accelerate-ac-offload" or static_bytes < budget_bytes
    if rank == 0:
        print(f"fsdp_bench: {config.name}: cap {'uncapped' if budget_bytes is None else f'{budget_bytes / GIB:.2f} GiB'}"
              f" per rank vs static need {static_bytes / GIB:.2f} GiB (largest rank: "
              + ", ".join(f"{k} {v / GIB:.2f}" for k, v in need.items()) + f"): {'fits' if fits else 'does not fit'}",
              flush=True)
    if not fits:
        return {**base, "status": "cap below the static need"}, model
    _cap(device, budget_bytes)
    # memfit hooks the sharded model (NOTE [Hooked after sharding] in memfit/integrations/hf.py);
    # a peer runs under memfit's method none, measuring only, uncapped by memfit (the cap is set above)
    ctl = memfit.fit(model, None if peer else budget_bytes, "none" if peer else method, optimizer=optimizer,
                     log=str(out / f"memfit_steps.rank{rank}.jsonl"), cap=False, announce=False,
                     treatments=args.treatments.split(",") if getattr(args, "treatments", None) and not peer else None)
    decisions = _DecisionProfile(ctl, args.steady_from) if getattr(args, "profile_decisions", False) else None
    batch_size = config.batch_size or args.batch_size
    lengths = _sft_lengths(config.steps, batch_size, seed=1000 + rank, cap=args.max_length) if not args.min_length \
        else _uniform_lengths(config.steps, batch_size, 1000 + rank, args.min_length, args.max_length)
    state = {"fired": 0}
    # inside block 1's body (its MLP): FSDP has gathered the block's parameters, and the block's
    # own OOM handling sees it (NOTE [Replay under FSDP])
    target = getattr(ctl.blocks[1].module, "mlp", ctl.blocks[1].module)
    fire_at = config.steps - 2  # a steady step

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
    step_ms, peaks, models = [], [], []
    started = time.monotonic()
    stopped = None
    for step in range(config.steps):
        if inject and rank == 1 and step == fire_at:
            state["armed"] = inject
        batch = _batch(lengths[step], seed=100_000 * rank + step, vocab=vocab, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        torch.manual_seed(step)
        ctl.run_step(lambda: accelerator.backward(model(**batch).loss))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if getattr(args, "models_every_step", False) and ctl.method.learns:
            models.append(json.dumps(ctl.state_dict()))
        if device.type == "cuda":
            torch.cuda.synchronize()
            # memfit's meter resets the allocator's peak inside run_step: the forward's and backward's
            # peak is in the step's record, the optimizer step's after it
            peaks.append(max(torch.cuda.max_memory_allocated(), ctl.records[-1].peak_allocated_bytes if ctl.records else 0))
        step_ms.append((time.perf_counter() - t0) * 1e3)
        # rule 2: every rank stops at the same step
        if _agree(time.monotonic() - started > args.config_limit_s, device) and step + 1 < config.steps:
            stopped = f"time limit {args.config_limit_s:g} s after {step + 1} of {config.steps} steps"
            break
    records = list(ctl.records)  # the timed steps' (not the profiled one's)
    if models:  # the model after each step: step s was planned by line s - 2 (decide_replay.py)
        with gzip.open(out / f"memfit_models.rank{rank}.jsonl.gz", "wt") as fh:
            fh.write("\n".join(models) + "\n")
    collective_ms = _profiled_step(ctl, model, accelerator, optimizer, lengths[min(args.steady_from, len(lengths) - 1)],
                                   rank, vocab, device, out, trace=getattr(args, "profile_trace", False)) if getattr(args, "profile", False) and config.method != "oom-check" else None
    # the run's one host pool (NOTE [Host budget]): its pinned bytes at the end
    host_pool = max((getattr(getattr(t, "pool", None), "total", 0) for t in ctl.treatments.values()), default=0)
    ctl.remove()
    for h in handles:
        h.remove()
    steady = step_ms[min(args.steady_from, len(step_ms) - 1):]
    return {
        **base, "status": stopped or "ok", "steps": len(step_ms), "step_ms": [round(x, 2) for x in step_ms],
        "median_steady_step_ms": statistics.median(steady), "steady_from": min(args.steady_from, len(step_ms) - 1),
        "max_peak_allocated_bytes": max(peaks) if peaks else max((r.peak_allocated_bytes for r in records), default=0),
        "oom_retries": sum(r.oom_retries for r in records), "records": len(records),
        "mean_treated_blocks": statistics.mean(r.n_checkpointed for r in records) if records else 0.0,
        "armed_steps": sum(r.backstop_armed for r in records), "alloc_retries": sum(r.alloc_retries or 0 for r in records),
        # the garbage collector's passes over the steady steps, and the longest (NOTE [The collector's pauses])
        "gc_ms": round(sum(r.gc_ms for r in records[args.steady_from:]), 1),
        "max_gc_ms": max((r.gc_ms for r in records[args.steady_from:]), default=0.0),
        "n_blocks": records[0].n_blocks if records else 0, "fired": state["fired"],
        # what the blocks ran as, over every step of every rank (a long-context run's host checkpoints and tiles)
        "block_treatments": dict(sum((collections.Counter({k: len(v) for k, v in r.block_treatments.items()}) for r in records),
                                     collections.Counter())),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host_pool_bytes": host_pool,
        "collective_ms": collective_ms, "stream_pools": _stream_pools(device),
        **({"decisions": decisions.report()} if decisions is not None else {}),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }, model


class _DecisionProfile:
    """cProfile around the controller's decisions from the ``steady_from``-th on, and the garbage collector's passes
    (a diagnosis of decision times that the CPU does not show: NOTE in docs/devlog.md, session 31)."""

    def __init__(self, ctl, steady_from: int):
        import cProfile
        import gc

        self.profile, self.calls, self.ms, self.gc = cProfile.Profile(), 0, [], {}
        decide, self._start = ctl._decide, None

        def timed(step, *rest):
            self.calls += 1
            if self.calls <= steady_from:
                return decide(step, *rest)
            t0 = time.perf_counter()
            self.profile.enable()
            try:
                return decide(step, *rest)
            finally:
                self.profile.disable()
                self.ms.append(round((time.perf_counter() - t0) * 1e3, 2))

        def collected(phase, info):
            if phase == "start":
                self._start = time.perf_counter()
            elif self._start is not None:
                passes, ms = self.gc.get(info["generation"], (0, 0.0))
                self.gc[info["generation"]] = (passes + 1, ms + (time.perf_counter() - self._start) * 1e3)

        ctl._decide = timed
        gc.callbacks.append(collected)
        self._callback = collected

    def report(self) -> dict:
        import gc
        import io
        import pstats

        gc.callbacks.remove(self._callback)
        text = io.StringIO()
        pstats.Stats(self.profile, stream=text).sort_stats("cumulative").print_stats(30)
        return {"decision_ms": self.ms, "gc": {str(g): [n, round(ms, 1)] for g, (n, ms) in self.gc.items()},
                "top": text.getvalue().splitlines()[:80]}


def _stream_pools(device) -> dict[str, list[int]] | None:
    """At the run's end, per stream of this rank's device, the caching allocator's reserved and allocated bytes (the
    current stream's is "current"): what other streams' pools hold (NOTE [Other streams' pools], room.py)."""
    from memfit.engine.run.meter import stream_pools

    return None if device.type != "cuda" else {name: list(pool) for name, pool in stream_pools(device).items()}


def _profiled_step(ctl, model, accelerator, optimizer, lengths: list[int], rank: int, vocab: int, device, out: Path,
                   trace: bool = False) -> float:
    """The time this rank's collectives took in one more step (the batch of step ``--steady_from`` again, under
    ``torch.profiler``, untimed): on GPUs the NCCL kernels' device time, which runs from a collective's launch until
    the last rank joins it, so beyond ``full``'s (every rank the same plan) it is the wait for the slowest rank; on CPU
    (gloo, synchronous) the ``c10d::`` operators' host time. Writes ``profile.rank<r>.json`` (:func:`_device_streams`)
    and ``profile.rank<r>.txt`` (the operators by their device time, then by their host time); ``trace``: also the
    step's chrome trace (``trace.rank<r>.json.gz``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    batch = _batch(lengths, seed=100_000 * rank + 999, vocab=vocab, device=device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        ctl.run_step(lambda: accelerator.backward(model(**batch).loss))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    by = "self_device_time_total" if cuda else "self_cpu_time_total"
    (out / f"profile.rank{rank}.txt").write_text(events.table(sort_by=by, row_limit=60) + "\n"
                                                 + events.table(sort_by="cpu_time_total", row_limit=40))
    _write(out / f"profile.rank{rank}.json", _device_streams(prof) if cuda else {})
    if trace:
        trace = out / f"trace.rank{rank}.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
    if cuda:
        us = sum(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) for e in events if "nccl" in e.key.lower())
    else:
        us = sum(e.cpu_time_total for e in events if e.key.startswith("c10d::"))
    return round(us / 1e3, 3)


def _device_streams(prof) -> dict:
    """Per CUDA stream of a profiled step: its kernels' and copies' time, the union of their intervals (busy) and the
    span from its first start to its last end, in ms; and the step's span over every stream. A compute stream busy for
    less than the step's span idled (waiting on the host, or on another stream)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for e in prof.profiler.kineto_results.events():
        if e.device_type().name != "CUDA" or e.duration_ns() <= 0:
            continue
        spans.setdefault(str(e.device_resource_id()), []).append((e.start_ns(), e.start_ns() + e.duration_ns()))
    streams = {}
    for stream, intervals in spans.items():
        intervals.sort()
        busy, (lo, hi) = 0, intervals[0]
        for a, b in intervals[1:]:
            if a > hi:
                busy, lo = busy + hi - lo, a
            hi = max(hi, b)
        busy += hi - lo
        streams[stream] = {"events": len(intervals), "total_ms": sum(b - a for a, b in intervals) / 1e6, "busy_ms": busy / 1e6,
                           "span_ms": (max(b for _, b in intervals) - intervals[0][0]) / 1e6}
    every = [x for v in spans.values() for x in v]
    return {"span_ms": (max(b for _, b in every) - min(a for a, _ in every)) / 1e6 if every else 0.0, "streams": streams}


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        _cap(device, None)


def _write(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def worker(args) -> None:
    """Under torchrun: every configuration of ``--plan`` not done yet, in order."""
    import torch.distributed as dist

    plan = json.loads(Path(args.plan).read_text())
    args = argparse.Namespace(**{**vars(args), **plan["settings"]})
    out = Path(args.output_dir)
    device, rank = _init(args.collective_timeout_s)
    _warm_up(args, [Config(**entry) for entry in plan["configs"]], device, rank, out)
    for entry in plan["configs"]:
        config = Config(**entry)
        folder = out / config.name
        if (folder / "status.json").exists():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        if _agree(time.time() > args.last_start_unix_s, device):  # rule 4
            break
        if rank == 0:
            _write(out / "current.json", {"name": config.name, "started_unix_s": time.time()})
        dist.barrier()
        try:
            if config.method == "oom-check":
                oom_check(args, config, device, rank, folder)  # ends the process
            budget = None if config.cap_gib is None else int(config.cap_gib * GIB)
            if config.reference:
                reference = out / config.reference / "peak.json"
                if not reference.exists():
                    if rank == 0:
                        _write(folder / "status.json", {"status": f"no reference: {config.reference} did not run"})
                    continue
                budget = int(config.share * json.loads(reference.read_text())["max_peak_allocated_bytes"])
            result, model = _train(args, config, device, rank, budget, folder)
            del model
            _free(device)
        except BaseException as err:  # noqa: BLE001 - rule 3: record, then end this process
            (folder / f"rank{rank}.error.txt").write_text(f"{type(err).__name__}: {str(err)[-1500:]}\n")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)
        _write(folder / f"rank{rank}.json", result)
        peak = _agree(result.get("max_peak_allocated_bytes", 0), device)
        dist.barrier()
        if rank == 0:
            if config.method == "none" and result["status"] == "ok":
                _write(folder / "peak.json", {"max_peak_allocated_bytes": int(peak)})
            _write(folder / "status.json", {"status": result["status"]})
        dist.barrier()
    dist.destroy_process_group()


def _warm_up(args, configs: list[Config], device, rank: int, out: Path) -> None:
    """NOTE [A launch warms up untimed]: each model still to run, its longest schedule (or ``--warmup_steps``) untimed
    under ``none`` and then ``full``, uncapped, before any timed configuration; nothing is kept."""
    steps = getattr(args, "warmup_steps", None)
    if steps == 0:
        return
    todo = [c for c in configs if not (out / c.name / "status.json").exists() and c.method != "oom-check"]
    for model, lora in dict.fromkeys((c.model, c.lora) for c in todo):
        n = steps or max(c.steps for c in todo if (c.model, c.lora) == (model, lora))
        first = next(c for c in todo if (c.model, c.lora) == (model, lora))
        for method in ("none", "full"):
            warm = replace(first, name=f"warmup-{model}{'+lora' if lora else ''}-{method}", method=method, share=None,
                           reference=None, cap_gib=None, steps=n)
            if rank == 0:
                print(f"fsdp_bench: warming up: {n} untimed steps of {model}{'+lora' if lora else ''} under {method}", flush=True)
            _, trained = _train(argparse.Namespace(**{**vars(args), "profile": False, "models_every_step": False}), warm,
                                device, rank, None, out / warm.name)
            del trained
            _free(device)


def _gathered(model) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in model.state_dict().items()}


def _max_abs_diff(a: dict, b: dict) -> float:
    return max((float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].numel()), default=0.0)


def oom_check(args, config: Config, device, rank: int, out: Path) -> None:
    """The injected-OOM check (module docstring); ends the process."""
    import torch.distributed as dist

    report: dict = {"rank": rank, "model": config.model, "world_size": dist.get_world_size()}
    clean, clean_model = _train(args, config, device, rank, None, out / "clean")
    reference = _gathered(clean_model)
    del clean_model
    _free(device)
    # NOTE [The determinism floor]: on a GPU two clean runs of the same steps need not be bitwise
    # equal (attention's and reductions' kernels accumulate in varying order), so the replayed
    # run is compared with the clean one against the distance between two clean runs.
    _, again_model = _train(args, config, device, rank, None, out / "clean-again")
    floor = _max_abs_diff(reference, _gathered(again_model))
    del again_model
    _free(device)
    failed, failed_model = _train(args, config, device, rank, None, out / "forward", inject="forward")
    diff = _max_abs_diff(reference, _gathered(failed_model))
    del failed_model
    _free(device)
    report["forward"] = {
        "fired": failed["fired"], "oom_retries": failed["oom_retries"], "records": failed["records"],
        "clean_records": clean["records"], "weights_equal": diff == 0.0, "max_abs_diff": diff,
        "clean_runs_max_abs_diff": floor, "within_clean_runs_spread": diff <= floor,
    }
    _write(out / f"oom_check.rank{rank}.json", report)
    dist.barrier()
    try:  # last: the ranks cannot go on together after it
        _train(args, config, device, rank, None, out / "backward", inject="backward")
        report["backward"] = {"error": None}
    except Exception as err:  # noqa: BLE001 - the error is the result
        report["backward"] = {"error": f"{type(err).__name__}: {str(err)[-600:]}"}
    _write(out / f"oom_check.rank{rank}.json", report)
    if rank == 0 or report["backward"]["error"]:
        _write(out / "status.json", {"status": "ok"})
    sys.stdout.flush()
    # The rank whose backward failed exits non-zero, as a training script's uncaught error would:
    # torchrun then stops the ranks still waiting in a collective (no hang until its timeout).
    os._exit(3 if report["backward"]["error"] else 0)


# ----------------------------------------------------------------------------------- the matrix


def _launch(args, plan_path: Path, log) -> subprocess.Popen:
    """One torchrun of ``--nproc`` ranks; with ``--nodes N``, N torchrun agents of ``nproc / N`` ranks each meeting at a
    c10d rendezvous on localhost (N node ranks of this host, each on GPUs of its own), under one shell whose exit is
    the first failure's."""
    worker = [str(Path(__file__).resolve()), "worker", "--plan", str(plan_path), "--output_dir", str(args.output_dir)]
    if args.nodes <= 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_port",
                   str(args.port), *worker]
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    per = args.nproc // args.nodes
    agents = []
    for node in range(args.nodes):
        gpus = ",".join(str(g) for g in range(node * per, (node + 1) * per))
        agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nodes), "--nproc_per_node", str(per),
                 "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{args.port}", "--rdzv_id",
                 f"fsdp-bench-{args.port}", *worker]
        agents.append(f"CUDA_VISIBLE_DEVICES={gpus} {shlex.join(agent)} & p{node}=$!")
    waits = "; ".join(f"wait $p{node} || x=$?" for node in range(args.nodes))
    return subprocess.Popen(["bash", "-c", f"{'; '.join(agents)}; x=0; {waits}; exit $x"], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """End the torchrun this matrix started (its own process group) and its ranks."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def matrix(args) -> int:
    """Run the configurations in as few torchrun launches as failures allow (NOTE [One launch, many configurations])."""
    if args.nodes < 1 or args.nproc % args.nodes:
        raise SystemExit(f"fsdp_bench: --nodes {args.nodes} must divide --nproc {args.nproc} (each node rank gets as many ranks)")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    once = [parse_config(text, args.nproc, args.steps) for text in args.configs]
    configs = [c if r == 0 else replace(c, name=f"{c.name}-r{r}") for r in range(max(1, args.repeats)) for c in once]
    settings = {k: getattr(args, k, 0) for k in ("steady_from", "batch_size", "max_length", "min_length", "collective_timeout_s",
                                              "config_limit_s", "treatments", "profile", "profile_decisions",
                                              "models_every_step", "warmup_steps", "profile_trace")}
    started = time.monotonic()
    deadline = min(time.time() + args.deadline_s, args.end_unix_s or float("inf"))  # rule 4
    settings["last_start_unix_s"] = deadline - args.config_limit_s
    launches = 0
    with open(out / "launches.log", "a", encoding="utf-8") as log:
        while True:
            todo = [c for c in configs if not (out / c.name / "status.json").exists()]
            left_s = deadline - time.time()
            if not todo or left_s < args.config_limit_s:
                break
            plan = out / "plan.json"
            _write(plan, {"settings": settings, "configs": [asdict(c) for c in todo]})
            (out / "current.json").unlink(missing_ok=True)
            log.write(f"--- launch {launches + 1}: {len(todo)} configurations, {left_s:.0f} s left\n")
            log.flush()
            launches += 1
            proc = _launch(args, plan, log)
            reason = None
            while proc.poll() is None:
                time.sleep(1.0)
                current = _read(out / "current.json")
                if time.time() > deadline + args.grace_s:
                    reason = f"killed {args.grace_s:g} s after the matrix deadline"
                elif current and time.time() - current["started_unix_s"] > args.config_limit_s * (  # the slow ones
                        4 if current["name"].startswith("oom-check") or "offload" in current["name"] else 1) + args.grace_s:
                    reason = f"killed: over its time limit by {args.grace_s:g} s (a hang)"
                if reason:
                    _stop(proc)
                    break
            if proc.returncode == 0 and reason is None:
                continue  # every configuration has its status; the loop ends
            current = _read(out / "current.json")
            name = current["name"] if current else todo[0].name
            folder = out / name
            folder.mkdir(parents=True, exist_ok=True)
            if not (folder / "status.json").exists():
                errors = {p.name: p.read_text().strip() for p in sorted(folder.glob("rank*.error.txt"))}
                _write(folder / "status.json", {"status": "failed", "why": reason or f"torchrun exit {proc.returncode}",
                                                 "errors": errors})
            print(f"fsdp_bench: {name}: {_read(folder / 'status.json')['status']} "
                  f"({reason or f'torchrun exit {proc.returncode}'})", flush=True)
    for c in configs:
        if not (out / c.name / "status.json").exists():
            (out / c.name).mkdir(parents=True, exist_ok=True)
            _write(out / c.name / "status.json", {"status": "not run: the matrix deadline"})
    print(f"fsdp_bench: {len(configs)} configurations in {launches} launches, {time.monotonic() - started:.0f} s", flush=True)
    print(_table(summarize([str(out)])), end="")
    return 0


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------- the summary


def _published_rows(path: Path) -> list[dict]:
    """The rows a published ``results.jsonl`` holds (written by :func:`summarize`)."""
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [{**line, "model": line["shape"], "status": line["row_status"]} for line in lines if "row_status" in line]


def summarize(folders: list[str], summary: str | None = None) -> list[dict]:
    """``results.jsonl`` and ``summary.md`` in the first folder, from the configurations of all;
    with ``summary``, only the table, to that file: the 4-over-2 table of two jobs, whose folders
    may be matrix folders or published ones (their ``results.jsonl``). A missing folder is skipped."""
    rows = []
    for root in map(Path, folders):
        if not root.is_dir():
            continue
        if (root / "results.jsonl").exists() and not any((p / "status.json").exists() for p in root.iterdir()):
            rows += _published_rows(root / "results.jsonl")
            continue
        for config in sorted(p for p in root.iterdir() if p.is_dir() and (p / "status.json").exists()):
            if config.name.startswith("oom-check"):
                continue
            status = _read(config / "status.json") or {"status": "unreadable"}
            ranks = [json.loads(p.read_text()) for p in sorted(config.glob("rank*.json"))]
            ran = [r for r in ranks if "median_steady_step_ms" in r]
            row = {"name": config.name, "status": status["status"], **({"errors": status["errors"]} if status.get("errors") else {})}
            if ranks:
                first = ranks[0]
                row.update({k: first.get(k) for k in ("method", "world_size", "model", "lora", "budget_bytes", "share",
                                                      "batch_size", "static_need_bytes")})
            if ran and len(ran) == len(ranks):
                first = ran[0]
                row.update({
                    "steps": first["steps"], "steady_from": first["steady_from"],
                    "step_ms": max(r["median_steady_step_ms"] for r in ran),  # the slowest rank
                    # each steady step's slowest rank, for ratios per step against configurations of the same batches
                    "steady_ms": [max(r["step_ms"][i] for r in ran) for i in range(first["steady_from"], min(len(r["step_ms"]) for r in ran))],
                    "total_s": max(sum(r["step_ms"]) for r in ran) / 1e3, "n_blocks": first["n_blocks"],
                    "device": first["device"], "torch": first["torch"], "transformers": first["transformers"],
                    # armed_steps and alloc_retries: absent from a rank file written before they were recorded
                    "per_rank": {str(r["rank"]): {k: r.get(k) for k in ("max_peak_allocated_bytes", "oom_retries",
                                                                       "mean_treated_blocks", "median_steady_step_ms",
                                                                       "armed_steps", "alloc_retries", "block_treatments",
                                                                       "max_rss_bytes", "host_pool_bytes", "collective_ms",
                                                                       "stream_pools", "gc_ms", "max_gc_ms")}
                                 for r in ran},
                })
            rows.append(row)
    rows = _over_repeats(rows)
    for r in rows:
        ref = _none_of(rows, r)
        if "step_ms" in r and ref:
            r["vs_none"] = r["step_ms"] / ref["step_ms"]
        if "per_rank" in r:
            r["max_peak_allocated_bytes"] = max(p["max_peak_allocated_bytes"] for p in r["per_rank"].values())
            r["under_cap"] = r["budget_bytes"] is None or r["max_peak_allocated_bytes"] <= r["budget_bytes"]
    if summary:
        Path(summary).write_text(_table(rows))
        return rows
    root = Path(folders[0])
    with open(root / "results.jsonl", "w", encoding="utf-8") as fh:
        for r in rows:
            ranks = list(r.get("per_rank", {}).values())
            if "per_rank" not in r:  # a configuration that ran no step: what its name says, the rest its none's
                r = {**_from_name(r["name"]), **r}
                ref = next((x for x in rows if "step_ms" in x and x.get("model") == r.get("model") and x.get("lora") == r.get("lora")
                            and x.get("world_size") == r.get("world_size")
                            and r.get("batch_size", x.get("batch_size")) == x.get("batch_size")), {})
                r = {**{k: ref[k] for k in ("batch_size", "steps", "device", "torch", "transformers") if k in ref}, **r}
            fh.write(json.dumps({
                **{k: None for k in ("budget_bytes", "batch_size", "steps", "total_s", "max_peak_allocated_bytes", "device",
                                     "torch", "transformers")},
                **r, "task": f"fsdp2, {r.get('world_size')} ranks", "model": f"{r.get('model')}{' LoRA' if r.get('lora') else ''}",
                "shape": r.get("model"), "row_status": r["status"],
                "oom_count": sum(p["oom_retries"] for p in ranks) if ranks else None,
                "recomputed_fraction": (statistics.mean(p["mean_treated_blocks"] for p in ranks) / r["n_blocks"])
                if ranks and r.get("n_blocks") else None,
                "status": "ok" if r["status"] == "ok" and ranks else "error",
                "note": None if r["status"] == "ok" else r["status"],
            }) + "\n")
    (root / "summary.md").write_text(_table(rows))
    return rows


_REPEAT = re.compile(r"-r(\d+)$")
_NAME = re.compile(r"^(?P<model>[\w.-]+?)(?P<lora>-lora)?(?:-b(?P<batch>\d+))?-x(?P<world>\d+)-(?P<method>"
                   + "|".join(sorted(MEMFIT + PEERS, key=len, reverse=True)) + r")(?:-(?P<share>[0-9.]+)(?P<gib>GiB)?)?$")


def _from_name(name: str) -> dict:
    """What a configuration's folder name says of it (model, LoRA, ranks, method, share, batch), for
    the results line of one that wrote no rank file; {} for another name."""
    m = _NAME.match(name)
    if not m:
        return {}
    value = float(m["share"]) if m["share"] else None
    return {"model": m["model"], "lora": bool(m["lora"]), "world_size": int(m["world"]), "method": m["method"],
            "share": None if m["gib"] else value, **({"budget_bytes": int(value * GIB)} if m["gib"] else {}),
            **({"batch_size": int(m["batch"])} if m["batch"] else {})}


def _over_repeats(rows: list[dict]) -> list[dict]:
    """One row per configuration: its repeats (``<name>-r<r>``) folded into the first's row. Step
    time: the median of the repeats' (``step_ms_repeats``); peaks, OOM replays and allocator
    retries per rank: the largest and the sums over repeats; blocks treated: the mean; status: the
    first that is not ok, with the count of repeats that ran."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(_REPEAT.sub("", row["name"]), []).append(row)
    out = []
    for name, group in groups.items():
        by_repeat = {m[1] if (m := _REPEAT.search(g["name"])) else "0": g["steady_ms"] for g in group if "steady_ms" in g}
        if len(group) == 1:
            out.append({**group[0], "name": name, "steady_ms_repeats": by_repeat})
            continue
        ran = [g for g in group if "per_rank" in g]
        first = dict(ran[0] if ran else group[0])
        first["name"], first["repeats"], first["steady_ms_repeats"] = name, len(group), by_repeat
        failed = [g["status"] for g in group if g["status"] != "ok"]
        if failed:
            first["status"] = f"{failed[0]} ({len(group) - len(failed)} of {len(group)} repeats ran)"
        if ran:
            first["step_ms_repeats"] = [g["step_ms"] for g in ran]
            first["step_ms"] = statistics.median(first["step_ms_repeats"])
            first["per_rank"] = {
                rank: {
                    "max_peak_allocated_bytes": max(g["per_rank"][rank]["max_peak_allocated_bytes"] for g in ran),
                    "oom_retries": sum(g["per_rank"][rank]["oom_retries"] for g in ran),
                    "mean_treated_blocks": statistics.mean(g["per_rank"][rank]["mean_treated_blocks"] for g in ran),
                    "median_steady_step_ms": statistics.median(g["per_rank"][rank]["median_steady_step_ms"] for g in ran),
                    "armed_steps": sum(g["per_rank"][rank].get("armed_steps") or 0 for g in ran),
                    "alloc_retries": sum(g["per_rank"][rank].get("alloc_retries") or 0 for g in ran),
                    "gc_ms": sum(g["per_rank"][rank].get("gc_ms") or 0.0 for g in ran),
                    "max_gc_ms": max(g["per_rank"][rank].get("max_gc_ms") or 0.0 for g in ran),
                    "collective_ms": statistics.median(c) if (c := [g["per_rank"][rank]["collective_ms"] for g in ran
                                                                   if g["per_rank"][rank].get("collective_ms") is not None])
                    else None,
                }
                for rank in first["per_rank"] if all(rank in g["per_rank"] for g in ran)
            }
        out.append(first)
    return out


def _paired_steps(a: dict, b: dict) -> list[tuple[float, float]]:
    """``a``'s and ``b``'s steady steps side by side, within each repeat both ran (the same batches: NOTE [One launch,
    many configurations])."""
    ra, rb = a.get("steady_ms_repeats") or {}, b.get("steady_ms_repeats") or {}
    return [(x, y) for k in sorted(set(ra) & set(rb)) for x, y in zip(ra[k], rb[k]) if y > 0]


def _summed_ratio(a: dict, b: dict) -> float | None:
    """``a``'s paired steady steps summed over ``b``'s (whole runs, where :func:`_per_step_ratios` reads single steps)."""
    pairs = _paired_steps(a, b)
    return sum(x for x, _ in pairs) / sum(y for _, y in pairs) if pairs else None


def _per_step_ratios(a: dict, b: dict) -> list[float]:
    """``a``'s steady steps over ``b``'s, step by step (:func:`_paired_steps`)."""
    return [x / y for x, y in _paired_steps(a, b)]


def _none_of(rows: list[dict], r: dict) -> dict | None:
    return next((x for x in rows if "step_ms" in x and x["method"] == "none" and x.get("world_size") == r.get("world_size")
                 and x.get("model") == r.get("model") and x.get("lora") == r.get("lora")
                 and x.get("batch_size") == r.get("batch_size")), None)


def _fits(r: dict) -> bool:
    """Ran every step under its cap with no failure."""
    return r["status"] == "ok" and "step_ms" in r and r.get("under_cap", False)


def _table(rows: list[dict]) -> str:
    lines = ["| config | ranks | method | cap per rank (GiB) | static need (GiB) | step ms (slowest rank) | vs none "
             "| peak per rank (GiB) | under cap | OOM replays per rank | allocator retries per rank | blocks treated per rank "
             "| collectives ms per rank (profiled step) | status |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cap = f"{r['budget_bytes'] / GIB:.2f}" if r.get("budget_bytes") else "uncapped" if "budget_bytes" in r else ""
        need = f"{r['static_need_bytes'] / GIB:.2f}" if r.get("static_need_bytes") else ""
        if "per_rank" not in r:
            lines.append(f"| {r['name']} | {r.get('world_size', '')} | {r.get('method', '')} | {cap} | {need} | | | | | | | | | "
                         f"{r['status']} |")
            continue
        ranks = [r["per_rank"][k] for k in sorted(r["per_rank"], key=int)]
        peaks = " / ".join(f"{p['max_peak_allocated_bytes'] / GIB:.2f}" for p in ranks)
        ooms = " / ".join(str(p["oom_retries"]) for p in ranks)
        retries = " / ".join(str(p.get("alloc_retries", "")) for p in ranks)
        treated = " / ".join(f"{p['mean_treated_blocks']:.1f}" for p in ranks)
        vs = f"{r['vs_none']:.2f}×" if "vs_none" in r else ""
        step = f"{r['step_ms']:.1f}" + (f" (median of {len(r['step_ms_repeats'])})" if r.get("step_ms_repeats") else "")
        waits = " / ".join(f"{p['collective_ms']:.1f}" for p in ranks) if all(p.get("collective_ms") is not None for p in ranks) \
            else ""
        lines.append(f"| {r['name']} | {r['world_size']} | {r['method']} | {cap} | {need} | {step} | {vs} | {peaks} "
                     f"| {'yes' if r['under_cap'] else 'NO'} | {ooms} | {retries} | {treated} of {r['n_blocks']} | {waits} | {r['status']} |")
    versus = []
    for r in rows:
        if r.get("method") != "dynamic" or not r.get("share"):
            continue
        peers = [x for x in rows if x.get("method") in PEERS and _fits(x) and x.get("share") == r["share"]
                 and x.get("model") == r["model"] and x.get("lora") == r["lora"] and x.get("world_size") == r["world_size"]
                 and x.get("batch_size") == r.get("batch_size")]
        best = min(peers, key=lambda x: x["step_ms"], default=None)
        mine = f"{r['step_ms']:.1f}" if _fits(r) else r["status"] if r["status"] != "ok" else "over its cap"
        if best is None:
            versus.append(f"| {r['name']} | {mine} | none fits | | |")
        else:
            ratio = f"{r['step_ms'] / best['step_ms']:.2f}×" if _fits(r) else ""
            versus.append(f"| {r['name']} | {mine} | {best['method']} | {best['step_ms']:.1f} | {ratio} |")
    if versus:
        lines += ["", "| dynamic config | dynamic step ms | fastest peer that fits | its step ms | dynamic vs it |",
                  "| --- | ---: | --- | ---: | ---: |", *versus]
    per_step = []
    for r in rows:  # dynamic over each configuration of the same batches that fits: none, and the others at its cap
        if r.get("method") != "dynamic" or not r.get("budget_bytes") or not _fits(r):
            continue
        for x in rows:
            if (x is not r and _fits(x) and x.get("budget_bytes") in (r["budget_bytes"], None) and x.get("model") == r["model"]
                    and x.get("lora") == r["lora"] and x.get("world_size") == r["world_size"]
                    and x.get("batch_size") == r.get("batch_size")):
                ratios = _per_step_ratios(r, x)
                if ratios:
                    per_step.append(f"| {r['name']} | {x['name']} | {statistics.median(ratios):.3f}× "
                                    f"| {_summed_ratio(r, x):.3f}× | {len(ratios)} |")
    if per_step:
        lines += ["", "| dynamic config | against | dynamic over it, per step (median of ratios) | summed over the steps "
                  "| steps |", "| --- | --- | ---: | ---: | ---: |", *per_step]
    scaling = []
    for r in rows:
        if "step_ms" in r and r["world_size"] == 4:
            two = next((x for x in rows if "step_ms" in x and x["world_size"] == 2 and x["method"] == r["method"]
                        and x["model"] == r["model"] and x["lora"] == r["lora"] and x.get("share") == r.get("share")
                        and x.get("batch_size") == r.get("batch_size")), None)
            if two:  # tokens per second of the whole job (the same batch per rank), 4 ranks over 2
                scaling.append(f"| {r['name']} | {two['step_ms']:.1f} | {r['step_ms']:.1f} | {2 * two['step_ms'] / r['step_ms']:.2f}× |")
    if scaling:
        lines += ["", "| config (4 ranks) | step ms, 2 ranks | step ms, 4 ranks | throughput 4 GPUs / 2 GPUs |",
                  "| --- | ---: | ---: | ---: |", *scaling]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp_bench.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("matrix", help="run configurations in one torchrun launch (more only after a failure)")
    m.add_argument("configs", nargs="+", help="MODEL[+lora]/METHOD[@SHARE][:STEPS][#BATCH] or oom-check:MODEL, in order; "
                                              "a model's none before its capped configurations")
    m.add_argument("--output_dir", required=True)
    m.add_argument("--nproc", type=int, default=2, help="ranks (GPUs) of the launch")
    m.add_argument("--port", type=int, default=29711)
    m.add_argument("--nodes", type=int, default=1, help="node ranks of this host (torchrun agents at a c10d rendezvous on "
                   "localhost), --nproc split evenly among them")
    m.add_argument("--steps", type=int, default=16)
    m.add_argument("--steady_from", type=int, default=8, help="median step time from this step on")
    m.add_argument("--batch_size", type=int, default=4, help="rows per rank and step")
    m.add_argument("--max_length", type=int, default=2048, help="longest SFT length drawn")
    m.add_argument("--min_length", type=int, default=0, help="if given, lengths uniform in [min_length, max_length] "
                   "instead of SFT's")
    m.add_argument("--config_limit_s", type=float, default=60, help="a configuration's steps stop after this long")
    m.add_argument("--grace_s", type=float, default=30, help="a launch this long over its configuration's limit, or "
                                                              "over the deadline, is killed")
    m.add_argument("--deadline_s", type=float, default=500, help="the matrix ends by this long after its start (rule 4)")
    m.add_argument("--end_unix_s", type=float, default=None, help="... or by this time (seconds since the epoch), "
                                                                   "if earlier: a job's end shared by its calls")
    m.add_argument("--collective_timeout_s", type=float, default=120)
    m.add_argument("--profile", action="store_true", help="after each configuration's steps, one more under torch.profiler: "
                   "each rank's time in collectives (collective_ms)")
    m.add_argument("--models_every_step", action="store_true", help="also write each rank's memory model after every "
                   "step (memfit_models.rank<r>.jsonl.gz in the configuration's folder): decide_replay.py and "
                   "model_replay.py replay a rank's decisions and predictions from them on a CPU")
    m.add_argument("--profile_decisions", action="store_true", help="profile memfit's decisions of the steady steps and "
                   "count the garbage collector's passes (decisions: their top functions; gc: per generation, passes and ms); "
                   "a diagnosis: its step times are not comparable")
    m.add_argument("--treatments", default=None, help="memfit's treatments, comma-separated (default: memfit's own)")
    m.add_argument("--warmup_steps", type=int, default=None, help="untimed steps of each model under none before a "
                   "launch's first timed configuration (default: its longest schedule: NOTE [A launch warms up untimed]); 0: none")
    m.add_argument("--profile_trace", action="store_true", help="with --profile, also write each rank's chrome trace of "
                   "the profiled step (trace.rank<r>.json.gz; megabytes each)")
    m.add_argument("--repeats", type=int, default=1, help="run the list this many times in turn (interleaved repeats)")
    w = sub.add_parser("worker", help="(under torchrun, started by matrix)")
    w.add_argument("--plan", required=True)
    w.add_argument("--output_dir", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("output_dir", nargs="+", help="matrix folders; the summary goes to the first")
    s.add_argument("--summary", help="write only the table, to this file (no results.jsonl)")
    d = sub.add_parser("decisions", help="memfit's decision times of the steady steps in step-record files")
    d.add_argument("steps", nargs="+", help="step records (.jsonl or .jsonl.gz), e.g. a configuration's ranks and repeats")
    k = sub.add_parser("kernels", help="two profiled steps' device time per kind of kernel on their busiest stream")
    k.add_argument("traces", nargs=2, help="chrome traces (--profile_trace: trace.rank<r>.json.gz), the base first")
    r = sub.add_parser("slack", help="replay the ranks' steady steps through memfit's slack rules: where the slack grows")
    r.add_argument("steps", nargs="+", help="one configuration's step records, one file per rank, rank 0 first")
    r.add_argument("--growth_ms", type=float, required=True, help="the growth's price per step, taken as constant")
    return parser


def slack(paths: list[str], growth_ms: float) -> str:
    """Each rank's steady steps of one configuration through the room's slack rules (NOTE [The slack is priced],
    room.py) as this tree has them, the step's time net of its treatments' estimate, timed in the bucket of the ranks'
    largest shape as the ranks agree it, the growth priced at ``growth_ms`` a step: the steps after which the slack
    grew (their plans the next step's). The room is the one a run on CUDA starts with (``Room.for_run``; several
    ranks: one where an OOM is fatal), the plans' buckets 8 tokens wide (``fit``'s default)."""
    from memfit.engine.plan.room import BOUND_BUCKETS, Room
    from memfit.engine.shapes import bucket_key

    if missing := [path for path in paths if not Path(path).is_file()]:
        raise SystemExit("fsdp_bench slack: no file " + ", ".join(missing))
    ranks = []
    for path in paths:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as fh:
            ranks.append([json.loads(line) for line in fh if line.strip()])
    lines = []
    for rank, records in enumerate(ranks):
        room = Room.for_run(records[0]["budget_bytes"], "cuda", oom_fatal=len(ranks) > 1)
        grew = []
        for i, r in enumerate(records):
            if r.get("phase") == "warmup":  # a compact record leaves a steady step's phase out
                continue
            shapes = [rs[i]["shape"] for rs in ranks if i < len(rs)]
            timed = (max(x[0] for x in shapes), max(x[1] for x in shapes))
            before = room.slack_bytes
            room.after_steady((r["shape"][0], r["shape"][1]), bucket_key(timed, 8), r.get("alloc_retries") or 0,
                              r["step_ms"] - (r.get("recompute_ms_est") or 0.0), lambda: growth_ms)
            if room.slack_bytes != before:
                grew.append(r["step"])
        steady = [r for r in records if r.get("phase") != "warmup"]
        retried = [r["step"] for r in steady if r.get("alloc_retries")]
        lines.append(f"rank {rank}: steady steps that retried {retried}; the slack grew after steps {grew}")
        # each step's net time over the rule's bound: the median of the BOUND_BUCKETS clean steps nearest above it in
        # tokens with at least its rows and length (of the whole run here), where there is one
        net = {r["step"]: r["step_ms"] - (r.get("recompute_ms_est") or 0.0) for r in steady}
        shape = {r["step"]: (r["shape"][0], r["shape"][1]) for r in steady}
        clean = [s for s in net if s not in retried and s - 1 not in retried]

        def over(step: int) -> float | None:
            larger = sorted((shape[c][0] * shape[c][1], net[c]) for c in clean
                            if c != step and shape[c][0] >= shape[step][0] and shape[c][1] >= shape[step][1])
            return net[step] - statistics.median(ms for _, ms in larger[:BOUND_BUCKETS]) if larger else None

        bounded = [x for x in map(over, retried) if x is not None]
        after = [x for x in (over(s + 1) for s in retried if s + 1 in net and s + 1 not in retried) if x is not None]
        if bounded:
            lines.append(f"rank {rank}: over the clean steps nearest above, median: retry steps "
                         f"{statistics.median(bounded):.1f} ms ({len(bounded)} bounded), the steps after them "
                         f"{statistics.median(after) if after else float('nan'):.1f} ms ({len(after)}); {len(retried)} of "
                         f"{len(net)} steady steps retried, mean step {statistics.mean(r['step_ms'] for r in steady):.1f} ms")
    return "\n".join(lines) + "\n"


#: a kernel's kind by the first of these its name holds (case-insensitive), else "other"
KERNEL_KINDS = (("matmul", ("nvjet", "gemm", "cutlass")), ("attention", ("sdpa", "flash", "fmha")),
                ("softmax", ("softmax",)), ("collective", ("nccl",)), ("optimizer (foreach)", ("multi_tensor_apply",)),
                ("copy to/from host", ("memcpy htod", "memcpy dtoh")), ("copy on the device", ("memcpy dtod",)),
                ("reduction", ("reduce_kernel",)),
                ("elementwise and copies", ("elementwise", "catarray", "chunk_cat", "split_with_sizes", "memset")))


def _kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in low for m in marks)), "other")


def kernels(paths: list[str]) -> str:
    """Per kind of kernel (:data:`KERNEL_KINDS`), the device time on each trace's busiest stream (the compute stream),
    the second trace's over the first's, and each stream's span and idle time: where a treated step's extra time
    goes on the device."""
    if missing := [path for path in paths if not Path(path).is_file()]:
        raise SystemExit("fsdp_bench kernels: no file " + ", ".join(missing))
    sums, spans = [], []
    for path in paths:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as fh:
            events = [e for e in json.load(fh)["traceEvents"]
                      if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        if not events:
            raise SystemExit(f"fsdp_bench kernels: {path} holds no device event (a CPU run's trace?)")
        by_stream = collections.Counter()
        for e in events:
            by_stream[e["tid"]] += e["dur"]
        stream = by_stream.most_common(1)[0][0]
        mine = [e for e in events if e["tid"] == stream]
        kinds = collections.Counter()
        for e in mine:
            kinds[_kernel_kind(e["name"])] += e["dur"] / 1e3
        span = (max(e["ts"] + e["dur"] for e in mine) - min(e["ts"] for e in mine)) / 1e3
        sums.append(kinds)
        spans.append((span, sum(kinds.values())))
    rows = ["| kind | first (ms) | second (ms) | second - first (ms) |", "| --- | ---: | ---: | ---: |"]
    for kind in sorted(set(sums[0]) | set(sums[1]), key=lambda k: sums[0][k] - sums[1][k]):
        rows.append(f"| {kind} | {sums[0][kind]:.1f} | {sums[1][kind]:.1f} | {sums[1][kind] - sums[0][kind]:+.1f} |")
    rows.append(f"| all (busy) | {spans[0][1]:.1f} | {spans[1][1]:.1f} | {spans[1][1] - spans[0][1]:+.1f} |")
    rows.append(f"| span (first kernel to last) | {spans[0][0]:.1f} | {spans[1][0]:.1f} | {spans[1][0] - spans[0][0]:+.1f} |")
    return "\n".join(rows) + "\n"


def decisions(paths: list[str]) -> str:
    """The steady steps' decision times (the records' ``planner_us``) over every file given: how many, median, 90th
    percentile and most, in ms."""
    import gzip

    if missing := [path for path in paths if not Path(path).is_file()]:
        raise SystemExit("fsdp_bench decisions: no file " + ", ".join(missing))
    ms = []
    for path in paths:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as fh:
            ms += [r["planner_us"] / 1e3 for r in map(json.loads, fh) if r.get("phase") == "steady"]
    ms.sort()
    if not ms:
        raise SystemExit("fsdp_bench decisions: no steady step in " + ", ".join(paths))
    return (f"{len(ms)} steady decisions: median {statistics.median(ms):.1f} ms, 90th percentile "
            f"{ms[min(len(ms) - 1, int(0.9 * len(ms)))]:.1f} ms, most {ms[-1]:.1f} ms\n")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.command == "matrix":
        return matrix(args)
    if args.command == "worker":
        worker(args)
        return 0
    if args.command == "decisions":
        print(decisions(args.steps), end="")
        return 0
    if args.command == "slack":
        print(slack(args.steps, args.growth_ms), end="")
        return 0
    if args.command == "kernels":
        print(kernels(args.traces), end="")
        return 0
    print(_table(summarize(args.output_dir, args.summary)), end="")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main(sys.argv[1:]))
