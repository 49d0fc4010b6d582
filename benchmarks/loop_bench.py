"""In-process benchmark of a plain training loop: every method and peer, interleaved, in one process.

The model is built once; each configuration (method or peer × budget) starts from the same
weights (copied back from host memory), a new AdamW and the same batches, under its own cap
(``set_per_process_memory_fraction``), and runs ``--steps`` steps; configurations are
interleaved repeat by repeat, so that every ratio is measured side by side in one process on one
GPU. First (unless ``--no_untimed``) every batch runs once untimed with the plain loop (CUDA, library and kernel set-up for
every shape: each new shape's first run is slow) and once with every layer recomputed (Hugging
Face's checkpointing): a recompute runs its forward on autograd's thread, and what libraries build
per shape in thread-local caches (cuDNN's attention graphs: about 65 ms per new length for
SmolLM-360M on an H100, ``recompute_cold.py``) would otherwise fall on the first memfit
configuration alone and not on ``none`` (docs/devlog.md); and, for a model with an LM head, once
with each fused loss (Liger's, Cut Cross-Entropy's, where installed): Triton compiles their kernels
per length class on first use, seconds each, and caches them on disk for every later run; paid by the
first configuration to use them (memfit's head probes both) and found compiled by the next, they
made whole-run ratios depend on the order (``--no_untimed`` skips these passes; ``--untimed_fused N``
keeps the fused losses' on the first N batches). memfit's own warm-up times the fused kernels at shapes of its own
(the head's probe), which a machine's first run compiles inside its timed warm-up (about 3 s on a fresh H200, the
reach suite's s43-2): ``--untimed_memfit N`` runs ``dynamic+auto`` untimed on the first N batches first,
under the device's memory as its cap, so that those compiles, once a machine, fall on no timed run. Then uncapped ``none`` gives the speed
reference and the peak from which ``--budgets`` (shares of it) are set. ``plain`` and ``none``
run uncapped only (under a cap they do not fit, by design).

Methods (memfit under the cap, every micro-step through ``Controller.run_step``):
``none`` (memfit only measures), ``full``, ``static``, ``dynamic`` (recompute only),
``dynamic+sel`` (recompute and selective), ``dynamic+all`` (recompute, selective, offload), ``dynamic+ew``
(recompute and elementwise), ``dynamic+auto`` (the treatments offered by default), ``static+auto`` (the same treatments, the one plan of the longest batch for every batch), ``dynamic+offload``
(recompute, offload; ``-free``: every offload priced at its fixed cost alone),
``dynamic-backstop`` (recompute only, the backstop armed as a loop without replay would have
it, called without run_step), ``reactive``, ``none+compile`` (uncapped), ``full+compile`` and
``dynamic+compile`` (every block's body compiled by torch.compile inside memfit's wrapper),
``dynamic+sel+compile`` (the same, with compiled ``selective``: the body compiled again under
``activation_memory_budget`` 0.5; ``dynamic+sel-0.25+compile`` and ``dynamic+sel-0.1+compile``
under 0.25 and 0.1), ``dynamic+sel+compile+eager-loss`` (the same with the model's
loss function left eager), any of these with ``@M`` (memfit's margin set to the share M of the
budget, e.g. ``dynamic@0.1``), and ``dynamic-plans``: the plan of each step of this
repeat's ``dynamic`` run at the same budget, step by step, with no model, counting, protection or
replay (what ``dynamic`` costs beyond its plans). ``alt`` runs ``plain`` and ``none`` uncapped
step by step in turn on two copies of the model (lines ``alt-plain``, ``alt-none``; the latter
with the median per-step ratio): memfit's cost when it changes nothing, free of the GPU's drift
between runs. The memfit side runs on the copy in even repeats and on the original in odd ones
(``memfit_on``), so that pooled repeats cancel what differs between the two copies. ``alt-dynamic`` (after ``dynamic``) does the same for ``dynamic`` against its own
plans run bare, under the budget plus the other copy's weights and optimizer state (lines
``alt-dynamic-plans``, ``alt-dynamic``): what counting and protection cost, step by step. Every
line lists its steps' times (``step_ms``); ``--profile`` writes each configuration's costliest
functions over its steady steps under cProfile beside its step records; ``--gpu_busy`` adds to each line
its steady steps' GPU timeline under torch.profiler (``gpu_busy``: per step the span, the GPU's busy time and the
host's time, and the costliest kernels; benchmarks/gpu_busy.py).
Peers (no memfit at all; the bench reads the allocator): ``plain`` (the same loop),
``hf-every-1``, ``hf-every-2``, ``hf-offload`` (Hugging Face's checkpointing, either API name),
``trl-offload`` (TRL's activation offloading around the step), ``compile-F`` (``torch.compile``
of every block under ``activation_memory_budget`` F, memfit.tools.bench.peers.TorchCompile), and
``selective-static`` (every block under memfit's selective policy, for every batch).
Head peers (issue 39): ``hf-every-1+liger``, ``hf-every-1+cce`` and ``hf-every-1+chunked-8``, Hugging Face's
checkpointing of every layer with a chunked loss fixed for the whole run (:data:`HEAD_PEERS`), and
``compile-F+liger``, ``compile-F+chunked-8``, the compile peer with the same fixed loss.
The LM head (issue 39): ``--head on|off|auto`` passes ``memfit.fit(head=True|False|"auto")`` to every
memfit configuration, and a name's head part (``dynamic+head``, ``dynamic+head-off``,
``dynamic+head-auto``, before any ``@M``) sets it for that configuration alone; without either, fit's
default. A last part ``+only-X`` (X one of memfit.engine.parts.head.IMPLEMENTATIONS: ``dynamic+auto+only-liger``)
lets the chunked head run X alone, the others never probed. Every memfit line at a budget is compared with the fastest fixed policy (a peer) that fits the
same cap, step by step (``fastest_fixed``, ``step_ratio_vs_fastest_fixed``: NOTE [Against the fastest
fixed policy]), also tabled in ``<folder>.vs_fixed.md`` (the output folder's name: calls publish side by side). ``--no_cudnn_sdpa`` turns cuDNN attention off (an OOM
inside it can poison later cuDNN calls of the process); without it, each configuration starts with cuDNN's attention on,
and its line's ``cudnn_sdpa`` says whether it was still on at its end (memfit turns it off where it fails); ``--config_time_limit_s`` stops a configuration
that runs long (status ``time_limit``); ``--device cpu`` with ``--config_overrides`` (a tiny model) is a
dry run of a command: memfit's logical accounting, host-clock times.

Data: ``--lengths sft`` (the SFT table of memfit.tasks.causal_lm, long-tailed, up to 2,048
tokens; ``sft:MAX`` the same table stretched to MAX), ``uniform:A:B``, or ``fixed:L1,L2,...`` (long context). Output under ``--output_dir``:
``results.jsonl`` (the suite schema ``memfit report`` reads, plus loop fields: each line's
``cuda_alloc_retries`` (allocations the caching allocator served only after releasing its cache, in the steady steps), ``head`` (the chunked head's implementation, its price, and ``probed``: what warm-up's probe read of each implementation), ``step_ratio_vs_none`` and ``step_ratio_vs_none_compile``, the median of its steady steps'
ratios to the same repeat's uncapped ``none`` / ``none+compile`` on the same batches) and
``steps/<config>.jsonl.gz`` (memfit's step records).

Usage:
    python benchmarks/loop_bench.py --model SmolLM-360M --lengths sft --batch 8 --steps 60 \\
        --budgets 0.5 0.7 --repeats 3 --methods plain none full static dynamic dynamic+sel \\
        --output_dir out/llm
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import inspect
import json
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Sequence

# the allocator settings `memfit train` and run_suite.py use, before torch is imported: every configuration of a
# process alike (memfit under a cap turns them on otherwise, for the configurations after it: NOTE [Expandable
# segments under a cap], engine/run/meter.py)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

GB = 10**9
MEMFIT_METHODS = {
    "none": ("none", {}, ("recompute",)),
    "full": ("full", {}, ("recompute",)),
    "static": ("static", {}, ("recompute",)),
    "dynamic": ("dynamic", {}, ("recompute",)),
    "dynamic+sel": ("dynamic", {}, ("recompute", "selective")),
    "dynamic+all": ("dynamic", {}, ("recompute", "selective", "offload")),
    # and the norms' and gated MLP's elementwise ops recomputed at module level (NOTE [Elementwise recompute])
    "dynamic+ew": ("dynamic", {}, ("recompute", "elementwise")),
    # and the input of a recomputed block held in pinned host memory (NOTE [Checkpoints on the host])
    "dynamic+host": ("dynamic", {}, ("recompute", "host_checkpoint")),
    # the treatments a run that names none is offered (Treatment.by_default): what a user gets
    "dynamic+auto": ("dynamic", {}, None),
    # the one plan of the longest batch for every batch, with the same treatments: the static recipe that makes it fit
    "static+auto": ("static", {}, None),
    # the same with the blocks' weights kept on the device: issue 59's static recipe for long batches (the longest
    # batch's floor for every batch: every block's input on the host and its MLP tiled, the head chunked)
    "static+auto-weights-kept": ("static", {"host_weights": False}, None),
    # offload beside recompute, priced by its exposed copy time (NOTE [Offload price]); and the
    # same with every offload priced at its fixed cost alone, so the planner offloads wherever
    # it saves bytes: what offload costs where the price says it does not pay
    "dynamic+offload": ("dynamic", {}, ("recompute", "offload")),
    "dynamic+offload-free": ("dynamic", {}, ("recompute", "offload")),
    "dynamic-backstop": ("dynamic", {"backstop": True}, ("recompute",)),
    "reactive": ("reactive", {}, ("recompute",)),
    # every block's body compiled by torch.compile inside memfit's wrapper (NOTE [Compiled blocks])
    "none+compile": ("none", {"compile": True}, ("recompute",)),
    "full+compile": ("full", {"compile": True}, ("recompute",)),
    "dynamic+compile": ("dynamic", {"compile": True}, ("recompute",)),
    # and selective: the body compiled again under activation_memory_budget 0.5
    "dynamic+sel+compile": ("dynamic", {"compile": True}, ("recompute", "selective")),
    # the same with the model's loss function left eager (what compiling it is worth)
    "dynamic+sel+compile+eager-loss": ("dynamic", {"compile": {"loss": False}}, ("recompute", "selective")),
    # compiled selective under a lower activation_memory_budget (the compile peer's 0.1, and 0.25)
    "dynamic+sel-0.25+compile": ("dynamic", {"compile": {"activation_memory_budget": 0.25}}, ("recompute", "selective")),
    "dynamic+sel-0.1+compile": ("dynamic", {"compile": {"activation_memory_budget": 0.1}}, ("recompute", "selective")),
    # this repeat's `dynamic` plans at the same budget, step by step, with nothing else (below)
    "dynamic-plans": (None, {}, ("recompute",)),
}
PEERS = ("plain", "hf-every-1", "hf-every-2", "hf-offload", "trl-offload", "selective-static", "hf-every-1+liger",
         "hf-every-1+cce", "hf-every-1+chunked-8", "hf-offload+liger")
#: the fixed losses a peer's name may end in, (implementation, chunks): Liger's or Cut Cross-Entropy's fused linear
#: cross-entropy or the pure chunked loss in 8 chunks (memfit.engine.parts.head's switch set once, never planned). The
#: head peers (issue 39) are Hugging Face's checkpointing of every layer with one; a ``compile-F`` peer may take one too
#: (``compile-0.5+liger``)
FIXED_HEADS = {"+liger": ("liger", 1), "+cce": ("cce", 1), "+chunked-8": ("pure", 8)}
HEAD_PEERS = {f"hf-every-1{part}": head for part, head in FIXED_HEADS.items()}
HEAD_PEERS["hf-offload+liger"] = FIXED_HEADS["+liger"]  # the checkpoints on the host and the fused loss: the static floor


def fixed_head(model, implementation: str, n_chunks: int):
    """A head peer's loss: the model's head switched to ``chunked`` once for the whole run.

    Returns:
        ``(undo, None)``, or ``(None, note)`` saying why the peer is skipped (its package or
        device missing, or no head found).
    """
    from memfit.engine.parts.head import attach_head

    switch = attach_head(model)
    if switch is None:
        return None, "skipped: no LM head memfit recognises"
    try:
        switch.set("chunked", n_chunks, implementation)
    except ValueError as err:
        switch.remove()
        return None, f"skipped: {err}"
    return switch.remove, None


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM-360M", help="a bundled config name (memfit/configs) or bert-base")
    p.add_argument("--lora", action="store_true", help="LoRA r 16 on every linear layer (peft)")
    p.add_argument("--dtype", default="bfloat16", help="weights' dtype (bert-base: float32)")
    p.add_argument("--lengths", default="sft", help="sft | sft:MAX | uniform:A:B | fixed:L1,L2,...")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--budgets", nargs="*", type=float, default=[0.5, 0.7], help="shares of uncapped none's peak")
    p.add_argument("--budget_gb", nargs="*", type=float, default=[], help="absolute budgets in GB, besides")
    p.add_argument("--reference_longest", action="store_true",
                   help="where none is not among --methods, the uncapped none that --budgets' shares are of runs the "
                        "longest batch only, twice (its peak is the run's: no plan, the most tokens): a run of many "
                        "steps compares its methods without paying none's steps")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--first_repeat", type=int, default=0, help="number of the first repeat (a suite that runs one "
                   "repeat per call into one folder numbers them apart)")
    p.add_argument("--methods", nargs="+", default=["plain", "none", "full", "static", "dynamic"])
    p.add_argument("--last", nargs="*", default=[], help="peers run once per budget after every repeat of the others: "
                   "a peer whose OOM leaves GPU memory held in the process (TRL's offloading did) cannot then "
                   "spoil the matrix")
    p.add_argument("--steady_from", type=int, default=15, help="steps before this are left out of the steady time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--time_limit_s", type=float, default=1e9, help="stop starting configurations after this")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run (memfit's logical "
                   "accounting, host-clock times, no allocator readings) that checks the command end to end")
    p.add_argument("--config_overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="model config attributes set after loading --model's (a tiny model for a dry run)")
    p.add_argument("--head", choices=sorted(HEAD_VALUES), default=None, help="memfit.fit(head=...) of every memfit "
                   "configuration without a head part in its name (on: True, off: False, auto: 'auto'); "
                   "default: fit's own default")
    p.add_argument("--no_cudnn_sdpa", action="store_true", help="turn cuDNN's scaled-dot-product attention off for "
                   "the process (an OOM inside it poisons later cuDNN calls in the process)")
    p.add_argument("--config_time_limit_s", type=float, default=1e9, help="a configuration stops starting steps after "
                   "this (its line's status: time_limit)")
    p.add_argument("--profile", action="store_true", help="run the steady steps of each configuration that runs "
                   "alone (not alt, alt-dynamic) under cProfile, mark its line profiled, and write its costliest "
                   "functions beside its step records: steps/<config>.profile.txt")
    p.add_argument("--profile_warmup", action="store_true", help="with --profile: the steps before --steady_from "
                   "under cProfile instead of the steady ones (where a run's warm-up time goes)")
    p.add_argument("--reach_gib", nargs=2, type=float, default=None, metavar=("LO", "HI"),
                   help="instead of the budgets: per method, the smallest cap in [LO, HI] GiB at which it trains every "
                   "step (bisection in --reach_step_gib steps: benchmarks/bisect_caps.py); <folder>.reach.jsonl and "
                   "<folder>.reach.md beside results.jsonl")
    p.add_argument("--reach_step_gib", type=float, default=1.0, help="the bisection's step, GiB")
    p.add_argument("--reach_start_gib", type=float, default=None, help="memfit's first trial where no fixed policy of "
                   "the call gives one (the best peer's smallest cap from another call, when the methods of a workload "
                   "are split over calls): the bisection's cap nearest to it, inside --reach_gib")
    p.add_argument("--no_untimed", action="store_true", help="skip the untimed passes over every batch (plain, then every "
                   "layer recomputed) before the first configuration: it then pays each shape's first run (a cap's reach "
                   "does not depend on it; a time does)")
    p.add_argument("--untimed_fused", type=int, default=0, metavar="N", help="with --no_untimed, still run each fused "
                   "loss untimed on the first N batches: Triton compiles their kernels on first use, seconds each, and "
                   "the first configuration to use them would pay for every later one")
    p.add_argument("--untimed_memfit", type=int, default=0, metavar="N", help="run dynamic+auto untimed on the first N "
                   "batches before the timed configurations (the device's memory its cap): a machine's first memfit "
                   "warm-up compiles the fused kernels at its probe's shapes, seconds a fresh machine, once")
    p.add_argument("--models_every_step", action="store_true",
                   help="also write memfit's memory model after every step (steps/<run>.models.jsonl.gz, one line a step): "
                        "what planned each next step, for benchmarks/model_replay.py --at_step")
    p.add_argument("--gpu_busy", action="store_true", help="profile each configuration's steady steps (torch.profiler, "
                   "CUDA activity) and add gpu_busy to its line: per step the GPU's span, its busy time and the host's "
                   "time, and the costliest kernels (benchmarks/gpu_busy.py; the profiler slows the host, so ratios of "
                   "such lines are for anatomy, not for comparison)")
    p.set_defaults(cprofile=None)  # --profile's cProfile.Profile while a configuration runs (_profiled)
    return p.parse_args(argv)


def _lengths(spec: str, n: int, batch: int, seed: int) -> list[list[int]]:
    """Per step, the lengths of its ``batch`` examples."""
    rng = random.Random(seed)
    if spec == "sft" or spec.startswith("sft:"):
        from memfit.tasks._common import QUANTILE_LEVELS
        from memfit.tasks.causal_lm import SFT_TOKENS

        def draw() -> int:
            u = rng.random()
            for (p0, v0), (p1, v1) in zip(zip(QUANTILE_LEVELS, SFT_TOKENS), zip(QUANTILE_LEVELS[1:], SFT_TOKENS[1:])):
                if u <= p1:
                    return int(v0 + (v1 - v0) * (u - p0) / (p1 - p0))
            return SFT_TOKENS[-1]

        scale = int(spec.partition(":")[2] or SFT_TOKENS[-1]) / SFT_TOKENS[-1]  # sft:MAX stretches the table to MAX
        return [[max(1, int(draw() * scale)) for _ in range(batch)] for _ in range(n)]
    kind, _, rest = spec.partition(":")
    if kind == "uniform":
        a, b = (int(x) for x in rest.split(":"))
        return [[rng.randint(a, b)] * batch for _ in range(n)]
    if kind == "fixed":
        values = [int(x) for x in rest.split(",")]
        return [[values[i % len(values)]] * batch for i in range(n)]
    raise SystemExit(f"--lengths {spec!r}: give sft, sft:MAX, uniform:A:B or fixed:L1,L2")


def _build(args):
    import torch
    import transformers

    if args.model == "bert-base":
        config = transformers.BertConfig()
        for key, value in _overrides(args.config_overrides).items():
            setattr(config, key, value)
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(config).to(args.device)
        return model.train(), "text-classification"
    from memfit.tasks._common import CONFIGS_DIR

    config = transformers.AutoConfig.from_pretrained(str(CONFIGS_DIR / f"{args.model}.json"))
    config.use_cache = False
    for key, value in _overrides(args.config_overrides).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    # built on the device: an 8B model's random initialisation on the host takes minutes, on the GPU seconds
    with torch.device(args.device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
        except ValueError:  # a family without SDPA here (Gemma 2: soft-capped attention): its eager attention, as users run it
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype), attn_implementation="eager")
    model = model.to(args.device)
    if args.lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    return model.train(), "causal-lm"


def _overrides(pairs: list[str]) -> dict:
    """``--config_overrides KEY=VALUE ...`` as config attributes (integers where they parse as one)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--config_overrides {pair!r}: give KEY=VALUE, e.g. num_hidden_layers=2")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def _batches(args, model, lengths):
    import torch

    vocab = model.config.vocab_size
    out = []
    g = torch.Generator().manual_seed(args.seed)
    for step, row in enumerate(lengths):
        width = max(row)
        ids = torch.randint(10, vocab, (len(row), width), generator=g)
        mask = torch.zeros(len(row), width, dtype=torch.long)
        for i, n in enumerate(row):
            mask[i, :n] = 1
        if args.model == "bert-base":
            batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (len(row),), generator=g)}
        else:
            labels = ids.masked_fill(mask == 0, -100)
            batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        out.append(batch)
    return out


def _hf_checkpointing(model, every: int, offload: bool):
    """Hugging Face's checkpointing of every ``every``-th layer, by whichever name this version has."""
    kwargs = {"every_n_layers": every, **({"offload": True} if offload else {})}
    base = getattr(model, "get_base_model", lambda: model)()
    for name, kw in (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
                     ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")):
        enable = getattr(base, name, None)
        if enable is not None and set(kwargs) <= set(inspect.signature(enable).parameters):
            enable(**{kw: {"use_reentrant": False}}, **kwargs)
            if hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
            return lambda: getattr(base, name.replace("enable", "disable"))()
    raise RuntimeError(f"this transformers has no checkpointing enable taking {sorted(kwargs)}")


def _hooks(model) -> dict[int, tuple[set, set]]:
    return {id(m): (set(m._forward_pre_hooks), set(m._forward_hooks)) for m in model.modules()}


def _remove_new_hooks(model, before: dict[int, tuple[set, set]]) -> None:
    for m in model.modules():
        pre, post = before.get(id(m), (set(), set()))
        for key in set(m._forward_pre_hooks) - pre:
            del m._forward_pre_hooks[key]
        for key in set(m._forward_hooks) - post:
            del m._forward_hooks[key]


def _versions(args) -> dict:
    import torch
    import transformers

    from memfit.tools.bench.provenance import provenance

    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    out = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__, **provenance()}
    if args.device == "cuda":  # at the configuration's end: memfit turns it off where it failed (replay.py)
        out["cudnn_sdpa"] = torch.backends.cuda.cudnn_sdp_enabled()
    return out


#: cuDNN's attention as each configuration starts (off with --no_cudnn_sdpa): one configuration's
#: switch (memfit turns it off for the process where it fails) does not carry into the next
CUDNN_SDPA = {"on": True}  # set from torch at the start


def _reset_weights(model, initial) -> list:
    """``model``'s trainable parameters back at ``initial`` (pinned host copies); returns them."""
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p, init in zip(trainable, initial):
            p.copy_(init, non_blocking=True)
    return trainable


def _release(fraction: float = 1.0) -> None:
    """Free what the last configuration left, and set the process's cap to ``fraction`` (on CUDA;
    on CPU, memfit's logical accounting keeps the budget). The pinned host buffers it left go too:
    torch's host allocator keeps them pinned, and the next configuration that moves tensors to the
    host would find them free, where the one before paid seconds to pin them."""
    import torch

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()
        torch.cuda.set_per_process_memory_fraction(fraction)
        torch.backends.cuda.enable_cudnn_sdp(CUDNN_SDPA["on"])


class _Clock:
    """A step's time: CUDA events on the GPU (no sync per step), the host clock on CPU (dry runs)."""

    def __init__(self, device: str):
        import torch

        self.cuda = device == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def begin(self) -> None:
        if self.cuda:
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3

    def elapsed_ms(self) -> float:
        """After a device sync."""
        return self.start.elapsed_time(self.end) if self.cuda else self.ms


def _timeline(args):
    """With ``--gpu_busy`` on CUDA, the steady steps' GPU timeline (benchmarks/gpu_busy.py); else one that
    records nothing."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    from gpu_busy import GpuBusy

    return GpuBusy(enabled=args.gpu_busy and args.device == "cuda")


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _label(budget: int | None) -> str:
    return "uncapped" if budget is None else f"{budget / GB:.2f}GB"


def _memfit_fields(args, records) -> dict:
    """What a memfit run's step records say, for its result line."""
    import memfit
    from memfit.engine.parts.head import HEAD_KEY

    if not records:  # a run that recorded no step (it failed first): the fields every line has
        return {"recomputed_fraction": None, "lost_steps": args.steps}
    summary = memfit.engine.records.summarize(records)
    return dict(
        max_peak_allocated_bytes=summary.max_peak_allocated_bytes,
        recomputed_fraction=round(summary.mean_checkpointed_fraction, 4), oom_count=summary.oom_retries,
        over_budget_steps=summary.over_budget_steps, armed_steps=summary.armed_steps,
        evicting_steps=summary.evicting_steps, counted_steps=summary.counted_steps,
        treated_blocks=summary.treated_blocks, head_steps=summary.part_steps.get(HEAD_KEY, {}), warmup_steps=summary.warmup_steps,
        planner_us_per_step=round(summary.mean_planner_us, 2), lost_steps=args.steps - len(records),
        compile_s=round(summary.compile_ms / 1e3, 2), steady_compiled_graphs=summary.steady_compiled_graphs,
        by_length=_by_length(records),
    )


#: tokens per row of one band of ``by_length`` (issue 40's per-bucket check)
LENGTH_BAND = 256


def _by_length(records) -> dict:
    """Per band of ``LENGTH_BAND`` tokens per row, over the steady steps: steps, the largest
    allocated and reserved peaks over the budget, allocator retries, the median of predicted
    minus observed peak over the budget (the prediction's bias), and blocks treated per step."""
    bands: dict[int, list] = {}
    for r in records:
        if r.phase == "steady" and r.shape and len(r.shape) >= 2:
            bands.setdefault(-(-r.shape[1] // LENGTH_BAND) * LENGTH_BAND, []).append(r)
    out = {}
    for band, rows in sorted(bands.items()):
        budget = rows[0].budget_bytes
        errors = [r.predicted_peak_bytes - r.peak_allocated_bytes for r in rows if r.predicted_peak_bytes is not None]
        out[str(band)] = {
            "steps": len(rows),
            "peak_over_cap": round(max(r.peak_allocated_bytes for r in rows) / budget, 4) if budget else None,
            "reserved_over_cap": round(max(r.peak_reserved_bytes for r in rows) / budget, 4) if budget else None,
            "alloc_retries": sum(r.alloc_retries for r in rows),
            "bias_over_cap": round(statistics.median(errors) / budget, 4) if budget and errors else None,
            "treated_per_step": round(statistics.mean(r.n_checkpointed for r in rows), 2),
        }
    return out


def _write_steps(out_dir: str, name: str, budget: int | None, repeat: int, records, step_ms=None) -> str:
    """The run's step records as ``steps/<name>-<budget>-r<repeat>.jsonl.gz``; ``step_ms``, when
    given, replaces each record's own time. Returns the path under ``out_dir``."""
    steps_file = os.path.join("steps", f"{name}-{_label(budget)}-r{repeat}.jsonl.gz")
    with gzip.open(os.path.join(out_dir, steps_file), "wt") as fh:
        for i, r in enumerate(records):
            line = r.to_dict()
            if step_ms is not None and i < len(step_ms):
                line["step_ms"] = round(step_ms[i], 3)
            fh.write(json.dumps(line) + "\n")
    return steps_file


def _no_plans(args, name: str, budget: int | None, repeat: int) -> dict:
    return _failed(args, name, budget, repeat, "skipped", "no dynamic run before it at this budget and repeat")


def _head_probes(part) -> dict:
    """What warm-up's probe read of each implementation of the chunked head (NOTE [Pricing the head],
    chunked_head.py): its price line over keeping the head (ms per 1k tokens, ms per chunk) and the
    tokens and times it was read at; and those that raised when probed."""
    probed = {}
    for name, (per_token, per_chunk, _) in part.lines.items():
        seen = part.probes.get(name, {})
        fewest = seen[min(seen)] if seen else {}
        probed[name] = {"ms_per_1k_tokens": round(1e3 * per_token, 4), "ms_per_chunk": round(per_chunk, 4),
                        "tokens": int(fewest.get("tokens", 0)), "keep_ms": round(fewest.get("keep", 0.0), 3),
                        "chunked_ms": round(fewest.get("chunked", 0.0), 3)}
    return {"probed": probed, "failed": sorted(part.failed)}


def run_config(args, model, batches, initial, name: str, budget: int | None, repeat: int, out_dir: str) -> dict:
    """One configuration; returns its result line."""
    import torch

    import memfit

    trainable = _reset_weights(model, initial)
    total_memory = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else None
    # memfit sets the cap itself, once what it moves off the device at fit has gone (NOTE [Weights on the host])
    capped_by_memfit = name == "dynamic-plans" or _memfit_config(name, args.head) is not None
    _release(1.0 if budget is None or total_memory is None or capped_by_memfit else min(1.0, budget / total_memory))
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    hooks_before = _hooks(model)
    ctl, undo, context = None, None, contextlib.nullcontext
    note_compile: list[str] = []
    status, note, ooms = "ok", None, 0
    if name == "dynamic-plans":
        plans = args.dynamic_plans.get((budget, repeat))
        if plans is None:
            return _no_plans(args, name, budget, repeat)
        head = {} if args.head is None else {"head": HEAD_VALUES[args.head]}  # the head as `dynamic`'s
        ctl = memfit.fit(model, budget=budget, method=_replay(plans), optimizer=optimizer, treatments=MEMFIT_METHODS[name][2],
                         **head)
    elif (config := _memfit_config(name, args.head)) is not None:
        method, kwargs, treatments = config
        if kwargs.get("compile"):
            import torch._dynamo

            torch._dynamo.reset()  # no graph compiled by another configuration (the compile peer's budget)
        if method == "static":
            kwargs = {**kwargs, "max_shape": (args.batch, max(max(b["input_ids"].shape[1] for b in batches), 1))}
        try:
            ctl = memfit.fit(model, budget=budget, method=method, optimizer=optimizer, treatments=treatments, **kwargs)
        except memfit.BudgetTooSmallError as err:
            return _failed(args, name, budget, repeat, "oom", str(err)[:300])
        if name.startswith("dynamic+offload-free"):
            ctl.planning.price_offload(_FreeOffload(ctl.planning.offload_ms))
        if (only := _only_head(name)) is not None and ctl.head.part is not None:  # the others never probed, never run
            from memfit.engine.parts.head import IMPLEMENTATIONS

            ctl.head.part.failed.update(set(IMPLEMENTATIONS) - {only})
    elif name.startswith("hf-"):
        remove_head = None
        if name in HEAD_PEERS:
            remove_head, skipped = fixed_head(model, *HEAD_PEERS[name])
            if remove_head is None:
                return _failed(args, name, budget, repeat, "skipped", skipped)
        undo_hf = _hf_checkpointing(model, 2 if name == "hf-every-2" else 1, offload=name.startswith("hf-offload"))

        def undo(undo_hf=undo_hf, remove_head=remove_head):
            undo_hf()
            if remove_head is not None:
                remove_head()
    elif name.startswith("compile-"):  # torch.compile of every block under activation_memory_budget F
        from types import SimpleNamespace

        from memfit.tools.bench.peers import TorchCompile

        remove_head = None
        if head := _compile_head(name):
            remove_head, skipped = fixed_head(model, *FIXED_HEADS[head])
            if remove_head is None:
                return _failed(args, name, budget, repeat, "skipped", skipped)
        peer = TorchCompile(_compile_budget(name))
        peer.__enter__()
        peer.prepare(SimpleNamespace(model=model), SimpleNamespace(torch_compile=False))

        def undo(remove_head=remove_head, peer=peer):
            for _, block in memfit.engine.parts.blocks.find_blocks(model):
                block.__dict__.pop("forward", None)  # the class's forward again
            peer.__exit__(None, None, None)
            note_compile.append(peer.record()["note"])
            if remove_head is not None:
                remove_head()
    elif name == "trl-offload":
        from trl.models.activation_offloading import get_act_offloading_ctx_manager

        offloading = get_act_offloading_ctx_manager(model, warn_if_no_head=False)
        context = lambda: offloading  # noqa: E731
    elif name == "selective-static":
        from memfit.engine.plan.planner import Plan

        n = len(memfit.engine.parts.blocks.find_blocks(model))

        class _Every(memfit.engine.methods.Method):
            name = "selective-static"

            def decide(self, planning, key, failed=None):
                return memfit.engine.methods.Decision(Plan(tuple(range(n)), kinds=("selective",) * n))

        ctl = memfit.fit(model, budget=budget, method=_Every(), optimizer=optimizer, treatments=("recompute", "selective"))
    step_ms, retries_from = [], None  # the allocator's retry count when the steady steps begin
    models: list[str] = []  # --models_every_step
    rss_mib = []  # the process's resident host memory after each step (NOTE [Host budget]: it must stay flat)
    compiled = []  # steps during which Dynamo made a graph (NOTE [Steps that compiled])
    from memfit.engine.parts.guard_sides import graphs_made
    from memfit.engine.run.collector import Pauses

    collector, gc_ms = Pauses(freeze=False), []  # the collector's ms in each step, the peers' too (NOTE [The collector's pauses])
    _sync(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timeline = _timeline(args)
    t0 = time.perf_counter()
    try:
        for i, batch in enumerate(batches):
            if time.perf_counter() - t0 > args.config_time_limit_s:
                status, note = "time_limit", f"stopped after {i} of {len(batches)} steps (--config_time_limit_s {args.config_time_limit_s:g})"
                break
            if i == 0 and args.cprofile is not None and args.profile_warmup:
                args.cprofile.enable()  # the warm-up steps under cProfile (--profile_warmup)
            if i == args.steady_from:
                retries_from = _alloc_retries(args)
                timeline.__enter__()  # the steady steps profiled (--gpu_busy)
                if args.cprofile is not None:
                    # under cProfile (--profile), or no longer (--profile_warmup)
                    args.cprofile.disable() if args.profile_warmup else args.cprofile.enable()
            batch = {k: v.to(args.device, non_blocking=True) for k, v in batch.items()}
            graphs = graphs_made()
            clock = _Clock(args.device)

            def micro(batch=batch, i=i):
                torch.manual_seed(1000 + i)
                with context():
                    loss = model(**batch).loss
                    loss.backward()

            with timeline.step(i):
                clock.begin()
                if ctl is not None and name not in ("dynamic-backstop", "dynamic-plans"):
                    ctl.run_step(micro)
                else:
                    micro()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                clock.stop()
            step_ms.append(clock)
            rss_mib.append(_rss_mib())
            gc_ms.append(collector.take(steady=False))
            if ctl is not None and args.max_replays is not None and (n := sum(r.oom_retries for r in ctl.records)) > args.max_replays:
                status, note = "replays", f"stopped after step {i}: {n} OOM replays, over --max_replays {args.max_replays}"
                break
            if ctl is not None and args.models_every_step and ctl.method.learns:
                models.append(json.dumps(ctl.state_dict()))
            if graphs_made() > graphs:
                compiled.append(i)
    except torch.OutOfMemoryError as err:
        status, note, ooms = "oom", str(err).splitlines()[0][:200], 1
    except Exception as err:  # a configuration that breaks is recorded, the matrix goes on
        status, note = "error", f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    finally:
        collector.remove()
        if args.cprofile is not None:
            args.cprofile.disable()
        timeline.__exit__(None, None, None)
    _sync(args.device)
    total_s = time.perf_counter() - t0
    # memfit resets the allocator's peak each step: its runs' peak is in its records (on CPU, only there)
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
    times = [clock.elapsed_ms() for clock in step_ms]
    result = {
        **_line(args, name, budget, repeat, times, compiled), "status": status,
        "total_s": round(total_s, 4) if status == "ok" else None, "max_peak_allocated_bytes": peak, "oom_count": ooms,
        "note": note, "compiled_steps": compiled,
        # allocations served only after the caching allocator released its cache (a device sync
        # each): the cost of running close to a hard cap, counted from the steady steps on
        "cuda_alloc_retries": 0 if retries_from is None else _alloc_retries(args) - retries_from,
        **timeline.fields(), "rss_mib": rss_mib, "gc_ms": gc_ms,
        # growth of resident host memory over the steady steps (a host leak, or a pool that grows)
        "rss_growth_mib": round(rss_mib[-1] - rss_mib[min(args.steady_from, len(rss_mib) - 1)], 1) if rss_mib else None,
    }
    if ctl is not None:
        records = ctl.records
        for moving in [n for n, t in ctl.treatments.items() if t.moves_out]:  # offload, host_checkpoint
            result[moving] = _offload_fields(args, ctl.treatments[moving], records, moving)
        part = ctl.head.part
        if part is not None:  # which chunked head the warm-up's probe chose, and its price
            result["head"] = {"implementation": part.switch.implementation, "ms_per_1k_tokens": round(1e3 * part.extra_ms_per_token, 4),
                              "ms_per_chunk": round(part.per_chunk_ms, 4), **_head_probes(part)}
        ctl.remove()
        if args.device == "cuda" and any(p.device.type != "cuda" for p in model.parameters()):
            _release(1.0)  # weights memfit's cap could not take back at remove() (NOTE [Weights on the host]): back now
            model.to("cuda")
        fields = _memfit_fields(args, records)
        result.update(fields, oom_count=fields.get("oom_count", 0) + ooms)
        steps_file = result["steps_file"] = _write_steps(out_dir, name, budget, repeat, records)
        if name == "dynamic" and len(records) == args.steps:
            from memfit.engine.plan.planner import Plan

            args.dynamic_plans[(budget, repeat)] = [Plan.from_treatments(r.block_treatments, [(kind, *option) for kind, option in r.parts.items()]) for r in records]
        if ctl.method.learns:  # the memory model as the run ended: what each treatment saved and cost
            with gzip.open(os.path.join(out_dir, steps_file.replace(".jsonl.gz", ".model.json.gz")), "wt") as fh:
                json.dump(ctl.state_dict(), fh)
            if models:
                with gzip.open(os.path.join(out_dir, steps_file.replace(".jsonl.gz", ".models.jsonl.gz")), "wt") as fh:
                    fh.write("\n".join(models) + "\n")
    else:
        result.update(recomputed_fraction=None)
    if undo is not None:
        undo()
    if note_compile:
        result["note"] = "; ".join(filter(None, [result["note"], *note_compile]))
    _remove_new_hooks(model, hooks_before)  # TRL's offloading hooks the model's last layers
    # A peer that enters saved-tensor hooks in a forward pre-hook and leaves them in a post-hook
    # (TRL's offloading, around the head) leaves them on autograd's stack when an OOM comes in
    # between, with every tensor they hold: later runs would inherit both.
    popped = 0
    while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        popped += 1
    result["stale_hooks_popped"] = popped
    del optimizer
    _release()
    return result


class _FreeOffload:
    """A link price with only its fixed cost, the link's prefetch depth kept (``dynamic+offload-free``)."""

    def __init__(self, link):
        self.link = link

    def __call__(self, moved_bytes: float, forward_ms: float) -> float:
        return self.link.fixed_ms

    def depth(self, moved_bytes: float, forward_ms: float) -> int:
        return self.link.depth(moved_bytes, forward_ms)


def _offload_fields(args, offload, records, name: str = "offload") -> dict:
    """What ``offload`` did in a run (NOTE [Exposed copy time]): steps and blocks offloaded, bytes
    moved, prefetch depths, the compute stream's waits for copies (out in forward, back in
    backward) in all and per step, and per length the blocks the steady steps offloaded.

    ``blocks`` counts the block forwards that ran offloaded, ``planned_blocks`` those the step records
    say their plans offloaded: the two differ only where a step was replayed after an OOM (its
    forward ran twice, recorded once) or a record does not say what ran."""
    stats = offload.exposed()
    per_step = stats.exposed_ms_by_step
    moved = stats.moved_bytes_by_step
    by_tokens: dict[str, list[list[int]]] = {}
    for r in records[args.steady_from:]:
        blocks = r.treatments.get(name, [])
        seen = by_tokens.setdefault(str(r.tokens), [])
        if blocks not in seen:
            seen.append(blocks)
    return {
        "steps": stats.steps, "blocks": stats.blocks,
        "planned_blocks": sum(len(r.treatments.get(name, [])) for r in records),
        "blocks_per_step_max": max(stats.blocks_by_step, default=0),
        "moved_gib": round(stats.moved_bytes / 2**30, 3),
        "moved_gib_per_step_median": round(statistics.median(moved) / 2**30, 3) if moved else None,
        "moved_gib_per_step_max": round(max(moved) / 2**30, 3) if moved else None,
        "depths": sorted(set(stats.depth_by_step)), "exposed_out_ms": round(stats.exposed_out_ms, 2),
        "exposed_back_ms": round(stats.exposed_back_ms, 2),
        "exposed_ms_per_step_median": round(statistics.median(per_step), 2) if per_step else None,
        "exposed_ms_per_step_max": round(max(per_step), 2) if per_step else None,
        "pinned_gib": round(offload.pool.total / 2**30, 3) if offload.pool is not None else 0,
        "offloaded_blocks_by_tokens": by_tokens,
    }


def _mix(by_treatment: dict[str, list[int]]) -> dict[str, int]:
    """Blocks per treatment, from a record's ``block_treatments`` or a plan's ``by_treatment()``."""
    return {kind: len(blocks) for kind, blocks in by_treatment.items() if blocks}


def _replay(plans, count: bool = False):
    """A method that runs ``plans`` step by step (the last one from then on): no model, no
    protection, and no counting unless ``count``."""
    import memfit

    class _Replay(memfit.engine.methods.Method):
        name = "dynamic-plans"
        step = 0

        def decide(self, planning, key, failed=None):
            self.step += 1
            return memfit.engine.methods.Decision(plans[min(self.step, len(plans)) - 1], count=count)

    return _Replay()


def _alternate(args, sides, batches) -> tuple[dict[str, list[float]], float, str | None]:
    """Every batch on every side in turn, ABBA order: a drift of the GPU's speed falls on both alike.

    ``sides``: ``(name, model, optimizer, run, close)``: ``run`` calls a micro-step (bare or
    through ``run_step``); ``close``, when not None, is called after the side's optimizer step.
    Returns the step times per side, the wall time, and the error that stopped it, if any.
    """
    import torch

    events = {name: [] for name, *_ in sides}
    failure = None
    t0 = time.perf_counter()
    try:
        for i, batch in enumerate(batches):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            for name, m, optimizer, run, close in (sides if i % 4 in (0, 3) else sides[::-1]):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()

                def micro(m=m, batch=batch, i=i):
                    torch.manual_seed(1000 + i)
                    m(**batch).loss.backward()

                run(micro)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                end.record()
                events[name].append((start, end))
                if close is not None:
                    close()
    except Exception as err:  # a pair that breaks is recorded, the matrix goes on
        failure = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    torch.cuda.synchronize()
    total_s = time.perf_counter() - t0
    return {k: [s.elapsed_time(e) for s, e in v] for k, v in events.items()}, total_s, failure


def _paired_lines(args, names, budget, repeat, times, total_s, note, failure=None, steady=None) -> list[dict]:
    """Result lines of two alternated sides; the second carries its per-step ratio over the first.

    ``failure``: what stopped the pair (both lines then say so); ``steady``: the step indices
    the ratios use (default: every step from ``--steady_from``).
    """
    first, second = names
    steps = [i for i in (steady if steady is not None else range(len(times[second]))) if i >= args.steady_from
             and i < min(len(times[first]), len(times[second]))]
    ratios = [times[second][i] / times[first][i] for i in steps]
    out = []
    for name in names:
        line = {
            **_line(args, name, budget, repeat, times[name]), "status": "ok", "total_s": round(total_s / 2, 4),
            "max_peak_allocated_bytes": None, "oom_count": 0, "recomputed_fraction": None, "note": note,
        }
        if name == second and ratios:
            line["paired_with"] = first
            line["paired_step_ratio"] = round(statistics.median(ratios), 4)
            line["paired_sum_ratio"] = round(sum(times[second][i] for i in steps) / sum(times[first][i] for i in steps), 4)
            line["paired_steps"] = len(steps)
        if failure is not None:
            line.update(status="oom" if failure.startswith("OutOfMemoryError") else "error", total_s=None,
                        oom_count=int(failure.startswith("OutOfMemoryError")), note=failure)
        out.append(line)
    return out


def _twin(model, initial):
    """A second copy of ``model`` with its own AdamW, both copies at the initial weights."""
    import copy

    import torch

    twin = copy.deepcopy(model)
    return twin, [torch.optim.AdamW(_reset_weights(m, initial), lr=1e-5) for m in (model, twin)]


def run_alternating(args, model, batches, initial, repeat: int) -> list[dict]:
    """``plain`` and memfit's ``none``, uncapped, step by step in turn on two copies of the model
    (lines ``alt-plain`` and ``alt-none``, the latter with the paired ratios)."""
    import memfit

    _release()
    twin, opts = _twin(model, initial)
    (plain_m, opt_plain), (none_m, opt_none) = _oriented([(model, opts[0]), (twin, opts[1])], repeat)
    ctl = memfit.fit(none_m, budget=None, method="none", optimizer=opt_none)
    sides = [("alt-plain", plain_m, opt_plain, lambda f: f(), None), ("alt-none", none_m, opt_none, ctl.run_step, None)]
    try:
        times, total_s, failure = _alternate(args, sides, batches)
    finally:
        ctl.remove()
        del twin, sides, opt_plain, opt_none, plain_m, none_m, opts
        _release()
    lines = _paired_lines(args, ("alt-plain", "alt-none"), None, repeat, times, total_s,
                          "plain and none alternating step by step on two copies of the model (total_s: half the pair's)",
                          failure)
    lines[1]["memfit_on"] = _ORIENTATION[repeat % 2]
    return lines


#: which copy the memfit side of a pair runs on, by repeat: the model every configuration runs,
#: or its deep copy (a copy's tensors lie elsewhere in memory; alternating by repeat lets the
#: pooled ratios cancel any difference between the two)
_ORIENTATION = ("copy", "original")


def _oriented(pair: list, repeat: int) -> list:
    """``[(original, ...), (copy, ...)]`` as ``[bare side, memfit side]`` for ``repeat`` (:data:`_ORIENTATION`)."""
    return pair if _ORIENTATION[repeat % 2] == "copy" else pair[::-1]


def run_alternating_dynamic(args, model, batches, initial, budget: int, repeat: int, out_dir: str) -> list[dict]:
    """``dynamic`` (through ``run_step``, default protection) and the plans of this repeat's
    ``dynamic`` run at ``budget`` run bare, step by step in turn on two copies of the model.

    Both copies live under one cap: ``budget`` plus the other copy's lasting bytes (weights,
    optimizer state; measured after one step of it, its weights then set back), given to both
    controllers with the margin ``dynamic`` keeps alone, so the activations have what they have
    alone. Each side's step is closed (its peaks read, a device sync) right after its optimizer
    step, before the other side runs: otherwise the other copy's step would lie inside its
    readings. The ratios use the steady steps where ``dynamic`` gave as many blocks each
    treatment as in its own run (``plan_mismatches`` counts the others).
    """
    import torch

    import memfit
    from memfit.engine.run.meter import CudaMeter

    plans = args.dynamic_plans.get((budget, repeat))
    names = ("alt-dynamic-plans", "alt-dynamic")
    if plans is None:
        return [_no_plans(args, n, budget, repeat) for n in names]
    _release()
    before = torch.cuda.memory_allocated()
    twin, opts = _twin(model, initial)
    first = {k: v.cuda() for k, v in batches[0].items()}
    twin(**first).loss.backward()
    opts[1].step()
    opts[1].zero_grad(set_to_none=True)
    del first
    gc.collect()
    twin_static = torch.cuda.memory_allocated() - before
    _reset_weights(twin, initial)
    (bare_m, opt_bare), (dyn_m, opt_dyn) = _oriented([(model, opts[0]), (twin, opts[1])], repeat)
    cap = budget + twin_static
    treatments = MEMFIT_METHODS["dynamic"][2]
    margin = CudaMeter.default_margin * budget / cap
    ctl = bare = None
    sides: list = []
    records, times, total_s, failure = [], {n: [] for n in names}, 0.0, None
    try:
        ctl = memfit.fit(dyn_m, budget=cap, method="dynamic", optimizer=opt_dyn, treatments=treatments, margin=margin)
        bare = memfit.fit(bare_m, budget=cap, method=_replay(plans), optimizer=opt_bare, treatments=treatments,
                          margin=margin)
        sides = [(names[0], bare_m, opt_bare, lambda f: f(), lambda: bare.records),
                 (names[1], dyn_m, opt_dyn, ctl.run_step, lambda: ctl.records)]
        times, total_s, failure = _alternate(args, sides, batches)
        records = ctl.records
    except memfit.BudgetTooSmallError as err:
        failure = f"BudgetTooSmallError: {str(err).splitlines()[0][:200]}"
    finally:
        for c in (ctl, bare):
            if c is not None:
                c.remove()
        del twin, opt_dyn, opt_bare, sides, dyn_m, bare_m, opts
        ctl = bare = None
        _release()
    same = [i for i, r in enumerate(records) if i < len(plans) and _mix(r.block_treatments) == _mix(plans[i].by_treatment())]
    lines = _paired_lines(
        args, names, budget, repeat, times, total_s,
        f"dynamic and its own plans bare, alternating step by step on two copies of the model under the budget "
        f"plus the other copy's {twin_static / GB:.2f} GB (total_s: half the pair's)", failure, steady=same)
    if records:
        fields = _memfit_fields(args, records)
        # the copy's peaks include the other copy's lasting bytes: the peak is stated net of them
        fields["max_peak_allocated_bytes"] -= twin_static
        lines[1].update(fields, oom_count=fields["oom_count"] + lines[1]["oom_count"], plan_mismatches=len(records) - len(same),
                        steps_file=_write_steps(out_dir, names[1], budget, repeat, records, times[names[1]]))
    lines[1]["memfit_on"] = _ORIENTATION[repeat % 2]
    return lines


#: what ``--head`` and a configuration name's head part pass as ``memfit.fit(head=...)`` (the LM head
#: planned beside the blocks, issue 39); without either, ``fit``'s default
HEAD_VALUES = {"on": True, "off": False, "auto": "auto"}
HEAD_PARTS = {"+head": "on", "+head-off": "off", "+head-auto": "auto"}
#: a memfit name's last part (before any @M) that lets its chunked head run one implementation alone
#: (``dynamic+auto+only-liger``): the same plans' head timed by each kernel side by side
ONLY_HEAD = "+only-"


def _only_head(name: str) -> str | None:
    """The implementation a memfit name's ``+only-X`` part names (:data:`ONLY_HEAD`), else None."""
    from memfit.engine.parts.head import IMPLEMENTATIONS

    base = name.partition("@")[0]
    only = base.rpartition(ONLY_HEAD)[2] if ONLY_HEAD in base else None
    return only if only in IMPLEMENTATIONS else None


def _memfit_config(name: str, head: str | None = None) -> tuple | None:
    """(method, fit kwargs, treatments) of a memfit configuration name: one of MEMFIT_METHODS,
    optionally with a head part (:data:`HEAD_PARTS`: ``dynamic+head-off``, which overrides ``head``,
    ``--head``'s value) and then ``@M``, the share of the budget memfit keeps as its margin (0 <= M < 0.5)."""
    base, at, margin = name.partition("@")
    if ONLY_HEAD in base:  # +only-X, the head's one implementation (run_config applies it)
        if _only_head(name) is None:
            return None
        base = base.rpartition(ONLY_HEAD)[0]
    for part, value in HEAD_PARTS.items():
        if base.endswith(part) and base[: -len(part)] in MEMFIT_METHODS:
            base, head = base[: -len(part)], value
    if base not in MEMFIT_METHODS or base == "dynamic-plans" and at:
        return None
    method, kwargs, treatments = MEMFIT_METHODS[base]
    if head is not None:
        kwargs = {**kwargs, "head": HEAD_VALUES[head]}
    if at:
        try:
            share = float(margin)
        except ValueError:
            return None
        if not 0 <= share < 0.5:
            return None
        kwargs = {**kwargs, "margin": share}
    return method, kwargs, treatments


def _compile_head(name: str) -> str | None:
    """A ``compile-F`` peer name's head part (:data:`FIXED_HEADS`), else None."""
    return next((part for part in FIXED_HEADS if name.startswith("compile-") and name.endswith(part)), None)


def _compile_budget(name: str) -> float | None:
    """F of a ``compile-F`` peer name (0 < F <= 1, a head part after it), else None."""
    if not name.startswith("compile-"):
        return None
    head = _compile_head(name)
    try:
        value = float(name.split("-", 1)[1][: -len(head) if head else None])
    except ValueError:
        return None
    return value if 0 < value <= 1 else None


def _failed(args, name: str, budget: int | None, repeat: int, status: str, note: str) -> dict:
    return {
        **_line(args, name, budget, repeat, []), "status": status, "total_s": None, "max_peak_allocated_bytes": None,
        "oom_count": int(status == "oom"), "note": note, "recomputed_fraction": None,
    }


def _alloc_retries(args) -> int:
    import torch

    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0)) if args.device == "cuda" else 0


def _rss_mib() -> float:
    """The process's resident host memory, MiB (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return round(int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return 0.0


def _line(args, method: str, budget: int | None, repeat: int, times: list[float], compiled: Sequence[int] = ()) -> dict:
    """The fields every result line has: what ran (the same model label in every line, so one
    report table holds them all) and its step times (``compiled``: the steps that made a graph,
    left out of the steady time: NOTE [Steps that compiled])."""
    return {
        "task": "text-classification" if args.model == "bert-base" else "causal-lm",
        "model": f"{args.model} (config, random weights{', LoRA r16 all-linear' if args.lora else ''}, {args.dtype})",
        "method": method, "budget_bytes": budget, "batch_size": args.batch, "steps": args.steps, "repeat": repeat,
        **_steady(args, times, compiled),
        "lora": args.lora, "lengths": args.lengths, "step_ms": [round(t, 2) for t in times], **_versions(args),
    }


def _steady(args, times: list[float], compiled: Sequence[int] = ()) -> dict:
    """``steady_step_ms``: the median step from ``--steady_from`` on. With ``fixed:`` lengths,
    whose steps alternate between a few sizes, that median would fall between two sizes' times,
    so it is the mean over the lengths of each length's median step instead, and
    ``steady_step_ms_by_length`` gives those medians."""
    skipped = set(compiled)
    steps = [i for i in range(args.steady_from, len(times)) if i not in skipped]
    if not steps:
        return {"steady_step_ms": None}
    kind, _, rest = args.lengths.partition(":")
    values = [int(x) for x in rest.split(",")] if kind == "fixed" else []
    if len(set(values)) < 2:
        return {"steady_step_ms": round(statistics.median(times[i] for i in steps), 3)}
    per_length: dict[int, list[float]] = {}
    for i in steps:
        per_length.setdefault(values[i % len(values)], []).append(times[i])
    by_length = {length: round(statistics.median(t), 3) for length, t in sorted(per_length.items())}
    return {"steady_step_ms": round(statistics.fmean(by_length.values()), 3), "steady_step_ms_by_length": by_length}


#: the uncapped runs a line's steps are paired with, and the field each ratio goes to
_REFERENCES = (("none", "step_ratio_vs_none"), ("none+compile", "step_ratio_vs_none_compile"))


def _paired_with_none(result: dict, refs: dict[int, dict[str, list[float]]], steady_from: int) -> None:
    """Keep an uncapped ``none``'s (or ``none+compile``'s) step times in ``refs``, and give any
    other line of the same repeat the median of its steady steps' ratios to theirs: the runs
    take the same batches in the same order, and a median of per-step ratios is steadier than a
    ratio of medians when the steps' lengths differ."""
    times, repeat = result.get("step_ms") or [], result["repeat"]
    for name, field in _REFERENCES:
        ref = refs.get(repeat, {}).get(name)
        steps = paired_steps(result, ref, steady_from) if ref and len(ref["step_ms"]) == len(times) else []
        if name != result["method"] and steps:
            result[field] = round(statistics.median(times[i] / ref["step_ms"][i] for i in steps), 4)
    if result["method"] in dict(_REFERENCES) and result.get("budget_bytes") is None and result.get("status") == "ok":
        refs.setdefault(repeat, {})[result["method"]] = result


def _profiled(args, name: str, budget: int | None, repeat: int, run):
    """``run()``, under cProfile with ``--profile``: the 40 costliest functions by own time, and memfit's 40
    costliest by time with callees, to a text file."""
    if not args.profile:
        return run()
    import cProfile
    import io
    import pstats

    profile = args.cprofile = cProfile.Profile()  # run_config enables it over the steady steps
    try:
        result = run()
    finally:
        profile.disable()
        args.cprofile = None
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats("memfit", 40)  # where memfit's own time goes, callees included
    if args.profile_warmup:
        stats.sort_stats("cumulative").print_stats(60)  # and everyone's: kernels compiled, libraries set up
    label = _label(budget)
    result["profiled"] = True  # its times include the profiler's
    with open(os.path.join(args.output_dir, "steps", f"{name}-{label}-r{repeat}.profile.txt"), "w") as fh:
        steps = f"0-{args.steady_from - 1}" if args.profile_warmup else f"{args.steady_from}-{args.steps - 1}"
        fh.write(f"{name} {label} repeat {repeat}: steps {steps} under the profiler "
                 f"({result.get('total_s')} s for the run)\n")
        fh.write(text.getvalue())
    return result


def main(argv: list[str]) -> int:
    args = _parse(argv)
    args.dynamic_plans = {}  # (budget, repeat) -> the plan of each step of that `dynamic` run
    args.max_replays = None  # a trial stops past these OOM replays (the reach suite sets it: _reach)
    pairs = ("alt", "alt-dynamic")
    known = lambda m: m in ("plain", "none") or _memfit_config(m) or m in PEERS or _compile_budget(m)  # noqa: E731
    if args.device != "cuda" and set(pairs) & set(args.methods):
        raise SystemExit(f"--methods {' '.join(sorted(set(pairs) & set(args.methods)))}: pairs run on CUDA only; "
                         "leave them out with --device cpu")
    import torch

    if args.no_cudnn_sdpa:
        # NOTE [cuDNN attention off]: an OOM inside cuDNN's attention can leave later cuDNN calls of
        # the process failing, which a peer (no replay) would meet in a later configuration.
        torch.backends.cuda.enable_cudnn_sdp(False)
    CUDNN_SDPA["on"] = torch.backends.cuda.cudnn_sdp_enabled()
    unknown = [m for m in args.methods if not known(m) and m not in pairs] + [m for m in args.last if not known(m)]
    if unknown:
        raise SystemExit(f"unknown method(s) {', '.join(unknown)}: choose from "
                         f"{', '.join(sorted(MEMFIT_METHODS) + sorted(PEERS))}, compile-F (0 < F <= 1, optionally +liger or +chunked-8), a memfit method with a head part ({', '.join(HEAD_PARTS)}) and/or @M (margin share, 0 <= M < 0.5), and in --methods "
                         f"only {', '.join(pairs)}")
    if args.reach_gib:
        _reach_caps(args)  # a range that cannot be bisected is said before anything is built or written
    if args.reference_longest and ("none" in args.methods or not args.budgets):
        print("loop_bench: --reference_longest changes nothing here: " + ("none is among --methods and runs every batch"
              if "none" in args.methods else "no --budgets share needs a reference"), file=sys.stderr, flush=True)
    os.makedirs(os.path.join(args.output_dir, "steps"), exist_ok=True)
    started = time.perf_counter()
    model, _ = _build(args)
    batches = _batches(args, model, _lengths(args.lengths, args.steps, args.batch, args.seed))
    initial = [p.detach().to("cpu", copy=True) for p in model.parameters() if p.requires_grad]
    if args.device == "cuda":
        initial = [p.pin_memory() for p in initial]
    results_path = os.path.join(args.output_dir, "results.jsonl")

    refs: dict[int, dict[str, list[float]]] = {}  # per repeat, the uncapped none runs' step times

    def emit(result: dict) -> None:
        _paired_with_none(result, refs, args.steady_from)
        with open(results_path, "a") as fh:
            fh.write(json.dumps(result) + "\n")
        shown = f"{result['total_s']:.2f}s steady {result['steady_step_ms']}ms" if result["status"] == "ok" else result["note"]
        peak = result["max_peak_allocated_bytes"]
        extra = f" treated {result.get('treated_blocks')} ooms {result.get('oom_count')}" if result.get("treated_blocks") is not None else ""
        if result.get("offload"):  # what ran offloaded beside what the records planned (_offload_fields)
            off = result["offload"]
            extra += (f" offloaded {off['blocks']} ran/{off['planned_blocks']} planned, {off['moved_gib']} GiB moved, "
                      f"{off['pinned_gib']} GiB pinned, exposed {off['exposed_out_ms']}+{off['exposed_back_ms']} ms")
        budget = _label(result["budget_bytes"])
        print(f"[{time.perf_counter() - started:6.0f}s] {result['method']:>16} {budget:>9} r{result['repeat']}: "
              f"{result['status']} {shown} peak {(peak or 0) / GB:.2f}GB{extra}", flush=True)

    # a wall-clock limit from outside (`timeout` sends SIGTERM) ends the run through the finally below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        _matrix(args, model, batches, initial, emit, started)
    finally:  # a time limit or a failure still leaves every line compared with the fixed policies
        write_vs_fixed(args.output_dir, args.steady_from)
    return 0


def _matrix(args, model, batches, initial, emit, started: float) -> None:
    """Every configuration, repeat by repeat (uncapped first, then each budget), then ``--last``."""
    if not args.no_untimed:
        run_config(args, model, batches, initial, "plain", None, -1, args.output_dir)  # untimed: every shape once
        run_config(args, model, batches, initial, "hf-every-1", None, -1, args.output_dir)  # and recomputed (the docstring)
    if not args.no_untimed or args.untimed_fused:  # and the fused losses' kernels compiled (the docstring)
        from memfit.engine.parts.head import FUSED

        warm = batches if not args.no_untimed else batches[: args.untimed_fused]
        for part, (implementation, _) in FIXED_HEADS.items():
            if implementation in FUSED:
                run_config(args, model, warm, initial, f"hf-every-1{part}", None, -1, args.output_dir)
    if args.untimed_memfit:  # memfit's warm-up's compiles, once a machine (the docstring)
        import torch

        cap = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else 10**12
        run_config(args, model, batches[: args.untimed_memfit], initial, "dynamic+auto", cap, -1, args.output_dir)
    if args.reach_gib:
        _reach(args, model, batches, initial, emit, started)
        return
    # uncapped none is the reference budgets in shares are set from; with budgets in GB only it runs if asked
    uncapped = [m for m in ("plain", "none", "none+compile") if m in args.methods or m == "none" and args.budgets]
    reference = None
    budgets = sorted({int(g * GB) for g in args.budget_gb})
    for repeat in range(args.first_repeat, args.first_repeat + args.repeats):
        for name in uncapped:
            ran = batches
            if name == "none" and args.reference_longest and "none" not in args.methods:
                ran = [max(batches, key=lambda b: b["input_ids"].numel())] * 2  # the reference only: its peak
            result = _profiled(args, name, None, repeat, lambda ran=ran: run_config(
                args, model, ran, initial, name, None, repeat, args.output_dir))
            if ran is not batches:
                result["note"] = "the reference of --budgets: the longest batch only, twice (--reference_longest)"
            emit(result)
            if name == "none" and reference is None and args.budgets:
                if not result["max_peak_allocated_bytes"]:
                    raise SystemExit(f"uncapped none did not finish ({result['note']}): --budgets (shares of its peak) "
                                     "cannot be set; give --budget_gb instead")
                if result.get("status") != "ok":  # said: a share of an unfinished run's peak is a share of a lower bound
                    print(f"loop_bench: uncapped none did not finish ({result.get('status')}); --budgets are shares of the "
                          "peak it recorded before it stopped, a lower bound of what it needs", flush=True)
                reference = result
                budgets = sorted(set(budgets) | {int(share * reference["max_peak_allocated_bytes"]) for share in args.budgets})
        if "alt" in args.methods:
            for line in run_alternating(args, model, batches, initial, repeat):
                emit(line)
        for budget in budgets:
            for name in [m for m in args.methods if m not in ("plain", "none", "none+compile", "alt")]:
                if time.perf_counter() - started > args.time_limit_s:
                    print("time limit: stopping", flush=True)
                    return
                if name == "alt-dynamic":
                    for line in run_alternating_dynamic(args, model, batches, initial, budget, repeat, args.output_dir):
                        emit(line)
                else:
                    emit(_profiled(args, name, budget, repeat, lambda: run_config(
                        args, model, batches, initial, name, budget, repeat, args.output_dir)))
    for budget in budgets:
        for name in args.last:
            if time.perf_counter() - started > args.time_limit_s:
                print("time limit: stopping", flush=True)
                return
            emit(run_config(args, model, batches, initial, name, budget, args.first_repeat, args.output_dir))


class _TimeUp(Exception):
    """--time_limit_s spent in the middle of a bisection."""


def _reach(args, model, batches, initial, emit, started: float) -> None:
    """Per method, the smallest cap that fits (benchmarks/bisect_caps.py), every trial emitted as a line:
    the fixed policies first, each guessing its answer from its peak; then memfit's methods, each tried
    first at the best peer's smallest cap, where its per-step ratio to that peer is the row's
    ``vs_best_peer`` (NOTE [Fewer trials, the same certificate])."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    from bisect_caps import GIB, fits, smallest_fitting, write_reach

    caps = _reach_caps(args)
    args.max_replays = args.steps // 100  # the rule's replays: a trial past them cannot fit (bisect_caps.fits)
    names = [m for m in args.methods if m not in ("plain", "none", "none+compile", "alt", "alt-dynamic")]
    rows, lines, best = [], {}, None  # best: the fixed policies' smallest cap, (GiB, method)
    for name in sorted(names, key=lambda m: not _is_fixed(m)):
        def trial(cap_gib: float, name=name) -> bool | tuple[bool, float | None]:
            if time.perf_counter() - started > args.time_limit_s:
                raise _TimeUp
            line = run_config(args, model, batches, initial, name, int(cap_gib * GIB), args.first_repeat, args.output_dir)
            line["reach_trial_gib"] = cap_gib
            emit(line)
            lines[(name, cap_gib)] = line
            ok = fits(line, args.steps)
            peak = line.get("max_peak_allocated_bytes")
            return (ok, peak / GIB if peak else None) if _is_fixed(name) else ok

        start = best[0] if best is not None else args.reach_start_gib
        first = None if _is_fixed(name) or start is None else min(range(len(caps)), key=lambda i: abs(caps[i] - start))
        try:
            smallest, tried = smallest_fitting(caps, trial, first)
            row = {"method": name, "smallest_gib": smallest, "trials": tried, "steps": args.steps,
                   "lo_gib": caps[0], "hi_gib": caps[-1], "step_gib": args.reach_step_gib, "complete": True}
            if _is_fixed(name) and smallest is not None and (best is None or smallest < best[0]):
                best = (smallest, name)
            elif not _is_fixed(name) and best is not None:
                row["vs_best_peer"] = _vs_peer(lines.get((name, best[0])), lines[(best[1], best[0])], best, args.steady_from)
            rows.append(row)
        except _TimeUp:
            print("time limit: stopping the bisection", flush=True)
            rows.append({"method": name, "smallest_gib": None, "trials": [], "steps": args.steps, "complete": False})
            break
        finally:
            write_reach(args.output_dir, rows)
        print(f"reach: {name} smallest cap {smallest if smallest is not None else 'none'} GiB "
              f"({len(tried)} trials){' ' + str(row.get('vs_best_peer')) if row.get('vs_best_peer') else ''}", flush=True)


def _reach_caps(args) -> list[float]:
    """--reach_gib's caps, with one clear error for a range, step or start that cannot be bisected (checked before
    the model is built, again where the bisection starts)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    from bisect_caps import caps_gib

    try:
        caps = caps_gib(*args.reach_gib, args.reach_step_gib)
    except ValueError as e:
        raise SystemExit(f"loop_bench: {e}") from None
    if args.reach_start_gib is not None and not caps[0] <= args.reach_start_gib <= caps[-1]:
        raise SystemExit(f"loop_bench: --reach_start_gib {args.reach_start_gib:g} is outside --reach_gib "
                         f"{caps[0]:g} {caps[-1]:g}: give a cap inside the range")
    return caps


def _vs_peer(mine: dict | None, theirs: dict, best: tuple[float, str], steady_from: int) -> dict:
    """memfit's line at the best peer's smallest cap against that peer's: the median of per-step ratios
    and of the summed steady steps, on the steps both ran (paired_steps)."""
    out = {"peer": best[1], "cap_gib": best[0]}
    steps = paired_steps(mine, theirs, steady_from) if mine and mine.get("status") == "ok" else []
    if steps:
        a, b = mine["step_ms"], theirs["step_ms"]
        out.update(step_ratio=round(statistics.median(a[i] / b[i] for i in steps), 4),
                   sum_ratio=round(sum(a[i] for i in steps) / sum(b[i] for i in steps), 4), steps=len(steps))
    return out


def _is_fixed(method: str) -> bool:
    """A peer that runs one policy for the whole run (no plan per batch): what memfit is compared to."""
    return (method in PEERS and method != "plain") or _compile_budget(method) is not None


def paired_steps(mine: dict, theirs: dict, steady_from: int) -> list[int]:
    """The steps two lines of the same batches are compared on: from ``steady_from`` on, run by
    both, and neither made a graph in it.

    # NOTE [Steps that compiled]
    A step during which Dynamo made a graph (a recompile at a new side of a size guard) takes
    seconds of compiling, not a step's time. Each run records those steps (``compiled_steps``), and
    they are left out of its steady time and of every per-step ratio it is part of, on both sides:
    kept in, a peer's recompiles paired with memfit's cached steps read as ratios of 0.01-0.4 and
    pull the median towards memfit.

    Example:
        >>> paired_steps({"step_ms": [9, 1, 1, 5]}, {"step_ms": [9, 1, 7, 1], "compiled_steps": [2]}, 1)
        [1, 3]
    """
    n = min(len(mine.get("step_ms") or []), len(theirs.get("step_ms") or []))
    compiled = set(mine.get("compiled_steps") or ()) | set(theirs.get("compiled_steps") or ())
    return [i for i in range(steady_from, n) if i not in compiled]


def add_vs_fixed(lines: list[dict], steady_from: int) -> list[dict]:
    """Each memfit line's comparison with the fastest fixed policy that fits the same cap.

    # NOTE [Against the fastest fixed policy]
    Per budget and repeat, the fixed policies (:func:`_is_fixed`) that finished every step under the
    cap (status ok, no OOM) are ranked by their steady step time; the fastest is ``fastest_fixed``, and
    each memfit line of that budget and repeat gets ``step_ratio_vs_fastest_fixed``, the median of its
    steady steps' ratios to that policy's on the same batches (below 0.8: at least 20% less time), and
    ``sum_ratio_vs_fastest_fixed``, the ratio of their summed steady steps. ``fixed_fitting`` counts
    the fixed policies that fit; where none does, memfit's line has only that (0).
    """
    groups: dict[tuple, list[dict]] = {}
    for line in lines:
        if line.get("budget_bytes") is not None:
            groups.setdefault((line["budget_bytes"], line.get("repeat")), []).append(line)
    for group in groups.values():
        fits = [x for x in group if _is_fixed(x["method"]) and x.get("status") == "ok" and not x.get("oom_count")
                and x.get("steady_step_ms") is not None]
        best = min(fits, key=lambda x: x["steady_step_ms"]) if fits else None
        for line in group:
            if _memfit_config(line["method"]) is None:
                continue
            line["fixed_fitting"] = len(fits)
            if best is None:
                continue
            mine, theirs = line.get("step_ms") or [], best["step_ms"]
            steps = paired_steps(line, best, steady_from)
            if not steps:
                continue
            line["fastest_fixed"] = best["method"]
            line["step_ratio_vs_fastest_fixed"] = round(statistics.median(mine[i] / theirs[i] for i in steps), 4)
            line["sum_ratio_vs_fastest_fixed"] = round(sum(mine[i] for i in steps) / sum(theirs[i] for i in steps), 4)
    return lines


def add_vs_head_off(lines: list[dict], steady_from: int) -> list[dict]:
    """Each line of a memfit configuration with a head part other than ``+head-off`` (``dynamic+head-auto``)
    gets ``step_ratio_vs_head_off``: the median of its steady steps' ratios to the same configuration with
    ``+head-off`` at the same budget and repeat, on the same batches (what planning the head costs where
    it fits unchunked)."""
    off = {(x["method"], x.get("budget_bytes"), x.get("repeat")): x for x in lines
           if "+head-off" in x["method"] and x.get("status") == "ok"}
    for line in lines:
        for part in HEAD_PARTS:
            base, at, margin = line["method"].partition("@")
            if part == "+head-off" or not base.endswith(part):
                continue
            twin = off.get((base[: -len(part)] + "+head-off" + at + margin, line.get("budget_bytes"), line.get("repeat")))
            mine, theirs = line.get("step_ms") or [], (twin or {}).get("step_ms") or []
            steps = paired_steps(line, twin or {}, steady_from)
            if steps:
                line["step_ratio_vs_head_off"] = round(statistics.median(mine[i] / theirs[i] for i in steps), 4)
    return lines


def vs_fixed_name(out_dir: str) -> str:
    """``<folder>.vs_fixed.md``: named after the output folder, so two calls' tables publish side by side."""
    return f"{os.path.basename(os.path.normpath(out_dir))}.vs_fixed.md"


def write_vs_fixed(out_dir: str, steady_from: int) -> None:
    """Rewrite ``results.jsonl`` with :func:`add_vs_fixed`'s and :func:`add_vs_head_off`'s fields, and
    ``<folder>.vs_fixed.md`` (:func:`vs_fixed_name`): per memfit configuration and budget, the median over repeats of its ratio to the
    fastest fixed policy, and of its ratio to itself with the head off where that ran."""
    path = os.path.join(out_dir, "results.jsonl")
    if not os.path.exists(path):
        return
    with open(path) as fh:
        lines = add_vs_head_off(add_vs_fixed([json.loads(x) for x in fh if x.strip()], steady_from), steady_from)
    with open(path + ".tmp", "w") as fh:
        fh.writelines(json.dumps(x) + "\n" for x in lines)
    os.replace(path + ".tmp", path)
    rows: dict[tuple, list[dict]] = {}
    for x in lines:
        if "fixed_fitting" in x:
            rows.setdefault((x["budget_bytes"], x["method"]), []).append(x)
    table = ["| budget | method | repeats | fixed policies fitting | fastest fixed | median step ratio | summed ratio "
             "| vs head off | status |", "| ---: | --- | ---: | --- | --- | ---: | ---: | ---: | --- |"]
    for (budget, method), xs in sorted(rows.items()):
        ratios = [x["step_ratio_vs_fastest_fixed"] for x in xs if "step_ratio_vs_fastest_fixed" in x]
        sums = [x["sum_ratio_vs_fastest_fixed"] for x in xs if "sum_ratio_vs_fastest_fixed" in x]
        fastest = sorted({x["fastest_fixed"] for x in xs if "fastest_fixed" in x})
        head_off = [x["step_ratio_vs_head_off"] for x in xs if "step_ratio_vs_head_off" in x]
        table.append(f"| {budget / GB:.2f} GB | {method} | {len(xs)} | {'/'.join(str(x['fixed_fitting']) for x in xs)} | "
                     f"{', '.join(fastest) or '-'} | {statistics.median(ratios) if ratios else '-'} | "
                     f"{statistics.median(sums) if sums else '-'} | {statistics.median(head_off) if head_off else '-'} | "
                     f"{', '.join(sorted({x['status'] for x in xs}))} |")
    with open(os.path.join(out_dir, vs_fixed_name(out_dir)), "w") as fh:
        fh.write("memfit against the fastest fixed policy that fits the same cap, per repeat (NOTE [Against the fastest "
                 "fixed policy] in benchmarks/loop_bench.py); ratios are medians over repeats\n\n" + "\n".join(table) + "\n")
    print("\n".join(table), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
