"""Advice for a budget: the fastest training setups that fit, ``memfit estimate --advise``.

Enumerates precision × optimizer × (micro-batch, accumulation) splits of the requested batch
× memfit method (none / dynamic / full), keeps the setups whose estimated peak
(:class:`memfit.tools.estimate.anatomy.MemoryEstimate`) fits the budget, and ranks them by a deliberately
simple time model.

# NOTE [Time model]
Time is in units of one fp32 forward + backward of the whole batch without checkpointing
(= 1.0). A setup costs::

    _PRECISION_SPEED[precision] * (1 + _RECOMPUTE * checkpointed / blocks) * (_LORA_SPEED if LoRA else 1)
    * (1 + _RECOMPUTE * head_share if the LM head is chunked else 1)
    + _MICRO_STEP_OVERHEAD * (accumulation - 1)
    + _OPTIMIZER_STEP[optimizer]

``head_share`` is the LM head's share of the matmul weights (``vocab x hidden`` over all of them,
a proxy for its share of the compute): the chunked head recomputes each chunk's logits in backward.
The constants below are rough, stated with where they come from; they only have to rank
setups (is accumulation cheaper than checkpointing here?), not predict seconds. Benchmarks
(``memfit bench``) are the measurement.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memfit.errors import FlagError, UserError
from memfit.engine.budget import Budget, format_bytes
from memfit.engine.parts.optimizer_step import PER_TENSOR
from memfit.tasks.causal_lm import LORA_DROPOUT
from memfit.tools.estimate.anatomy import (
    OPTIMIZERS,
    ActivationProfile,
    MemoryEstimate,
    ModelProfile,
    TrainingSetup,
    activation_profile,
    estimate,
    optimizer_available,
)

__all__ = ["DEFAULT_MARGIN", "NothingFitsError", "Advice", "advise", "format_advice", "only_chunked_head_fits"]

# fp16/bf16 matmuls on tensor cores against fp32 (no TF32, the PyTorch default for matmul):
# the matmuls speed up far more than 2x, elementwise/memory-bound kernels about 2x (half the
# bytes); ~0.5x end to end is what mixed precision typically gives BERT fine-tuning.
_PRECISION_SPEED = {"fp32": 1.0, "bf16": 0.5, "fp16": 0.5}
# A checkpointed block runs its forward twice; backward costs ~2x forward (two matmuls per
# forward matmul), so forward ~ 1/3 of forward + backward. Blocks hold ~all the compute.
_RECOMPUTE = 1 / 3
# Each extra micro-step: kernel launches, Python/Trainer overhead and lower GPU utilisation
# of smaller matmuls; a few percent of a full-batch step on a BERT-base-sized model.
_MICRO_STEP_OVERHEAD = 0.03
# LoRA freezes the weights: backward computes no weight gradients, one of its two matmuls per
# forward matmul, so forward + backward ~ (1 + 1) / (1 + 2) of full fine-tuning's (the adapters'
# own rank-r matmuls are small). bf16 weights compute as bf16 autocast does.
_LORA_SPEED = 2 / 3
# optimizer.step() against one fp32 forward + backward of a BERT-base batch of ~4k tokens:
# memory-bound passes over the parameters. foreach AdamW reads/writes ~4 fp32 tensors per
# parameter; SGD 1-2; bitsandbytes 8-bit AdamW adds (de)quantisation in one fused kernel;
# HF Adafactor loops over tensors in Python with several row/column reductions each.
_OPTIMIZER_STEP = {"adamw": 0.02, "adamw-8bit": 0.025, "adafactor": 0.06, "sgd": 0.005, "sgd-momentum": 0.008}
_METHODS = ("none", "dynamic", "full")
# NOTE [A row's head in its command]
# A row that chunks a causal LM's head is a setup memfit runs only where it plans the head. Under
# --memfit_head auto (the default) it plans it under dynamic and static with a budget, and none and
# full keep it (NOTE [The head by default]). --memfit_head plan (memfit.fit(head=True)) plans it
# whatever the method: none and full, whose plans never name the head, then chunk it on every step
# (NOTE [A plan without a head]); dynamic plans it per batch. So the command names the row's head:
# plan where the row chunks it, keep where the row keeps it (auto would let dynamic chunk a head the
# row's time and peak keep).
_HEAD_FLAG = {"keep": "keep", "chunked": "plan"}
# NOTE [Advice keeps a margin]
# The cap limits what the caching allocator *reserves*, and it reserves more than it
# allocates (about 1% more without checkpointing, up to 7% with `full`, with expandable
# segments), and the estimate itself misses measured peaks by a few percent (docs/devlog.md).
# A setup estimated at 98% of the budget would OOM as often as not, and `none` cannot replan.
# So setups must fit the budget less this share: the 3% memfit's dynamic method keeps on CUDA.
DEFAULT_MARGIN = 0.03


class NothingFitsError(UserError, ValueError):
    """No setup fits the budget; the message gives the bytes the smallest one needs."""


@dataclass(frozen=True)
class Advice:
    """One setup that fits, with its estimate and estimated relative step time."""

    method: str
    """memfit method: ``none``, ``dynamic`` (just enough blocks for the longest input) or ``full``."""
    estimate: MemoryEstimate
    """Memory estimate of the setup (its ``setup.checkpoint`` is the number of blocks)."""
    relative_time: float
    """Step time in units of an fp32 un-checkpointed forward + backward (NOTE [Time model])."""

    def train_flags(self, memory_budget: str) -> list[str]:
        """The ``memfit train`` flags selecting this setup under ``memory_budget``."""
        s = self.estimate.setup
        if s.weights == "bf16":
            flags = ["--torch_dtype", "bfloat16"]
        else:
            flags = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"]}[s.precision]
        if s.lora_r:
            flags += ["--use_peft", "--lora_r", str(s.lora_r), "--lora_target_modules", "all-linear"]
            flags += ["--lora_dropout", f"{s.lora_dropout:g}"] if s.lora_dropout != LORA_DROPOUT else []
        flags += list(OPTIMIZERS[s.optimizer].train_flags)
        flags += ["--per_device_train_batch_size", str(s.micro_batch_size)]
        flags += ["--gradient_accumulation_steps", str(s.accumulation_steps)]
        flags += ["--memfit_method", self.method]
        if self.estimate.lm_head is not None:  # NOTE [A row's head in its command]
            flags += ["--memfit_head", _HEAD_FLAG[s.head]]
        return flags + ["--memory_budget", memory_budget]

    def run_words(self, size: Callable[[int], str] = format_bytes) -> str:
        """What :meth:`train_flags` run, in words: ``"method none, 0 of 24 blocks checkpointed, the LM head chunked
        in 16 on every step (--memfit_head plan), estimated peak 9.76 GiB"``: the row, as the command runs it."""
        e = self.estimate
        blocks = f"{e.checkpointed_blocks} of {e.n_blocks} blocks checkpointed"
        if self.method == "dynamic":
            blocks += " at the longest input (planned per batch)"
        head = ""
        if e.lm_head is not None:
            flag = f"--memfit_head {_HEAD_FLAG[e.setup.head]}"
            if e.setup.head == "keep":
                head = f", the LM head kept ({flag})"
            else:
                when = "at the longest input" if self.method == "dynamic" else "on every step"
                head = f", the LM head chunked in {e.lm_head.n_chunks} {when} ({flag})"
        return f"method {self.method}, {blocks}{head}, estimated peak {size(e.total_bytes)}"


def _relative_time(setup: TrainingSetup, checkpointed: int, n_blocks: int, head_share: float = 0.0) -> float:
    compute = _PRECISION_SPEED[setup.precision] * (1 + _RECOMPUTE * checkpointed / max(n_blocks, 1))
    compute *= _LORA_SPEED if setup.lora_r else 1
    compute *= 1 + _RECOMPUTE * head_share if setup.head == "chunked" else 1
    return compute + _MICRO_STEP_OVERHEAD * (setup.accumulation_steps - 1) + _OPTIMIZER_STEP[setup.optimizer]


def advise(
    profile: ModelProfile,
    batch_size: int,
    budget: Budget | int,
    *,
    precisions: Sequence[str] = ("fp32", "bf16"),
    optimizers: Sequence[str] = ("adamw", "adafactor", "adamw-8bit"),
    margin: float = DEFAULT_MARGIN,
    weights: Sequence[str] = ("fp32",),
    lora_r: int = 0,
    heads: Sequence[str] = ("keep",),
    lora_dropout: float = LORA_DROPOUT,
    shards: int = 1,
    **inputs,
) -> list[Advice]:
    """Every setup that fits ``budget`` less ``margin``, fastest first.

    Optimizers whose package is missing (8-bit AdamW without bitsandbytes) are skipped.
    ``dynamic`` is listed with the fewest blocks that fit the longest input, and only when
    that is neither none nor all of them (those are ``none`` and ``full``).

    Args:
        profile: the model.
        batch_size: examples per optimizer step; split into micro-batch × accumulation.
        budget: the budget (CUDA context excluded, as the cap excludes it): as the user gave it (the
            error quotes it so), or bytes.
        precisions: precisions to try.
        optimizers: optimizers to try (keys of :data:`memfit.tools.estimate.OPTIMIZERS`).
        margin: share of the budget left free (NOTE [Advice keeps a margin]).
        weights: weight dtypes to try (``bf16`` only with precision ``bf16``; causal-lm's
            ``--torch_dtype bfloat16``).
        lora_r: LoRA rank on every linear layer of the blocks; 0 for full fine-tuning.
        heads: LM head treatments to try (``keep``, ``chunked``: a causal LM's; NOTE [The head in the
            estimate] in anatomy.py).
        lora_dropout: peft's LoRA dropout with ``lora_r`` (memfit train's ``--lora_dropout``).
        shards: ranks FSDP2 shards over; the setups are then one rank's (NOTE [Sharded ranks in the estimate]).
        **inputs: ``seq_length`` / ``image_size``, ``attention``, ``num_choices`` as for
            :func:`memfit.tools.estimate.estimate`.

    Returns:
        The fitting setups ordered by (relative time, total bytes).

    Raises:
        NothingFitsError: naming the bytes the smallest setup needs, in the budget's unit family.

    Example:
        >>> ranked = advise(profile, 32, Budget.parse("6GiB", "--memory_budget"), seq_length=128)  # doctest: +SKIP
        >>> ranked[0].train_flags("6GiB")  # doctest: +SKIP
    """
    if not 0 <= margin < 1:
        raise FlagError(f"--margin {margin}: give a share of the budget in [0, 1)")
    budget = Budget.parse(budget, "--memory_budget")
    usable = int(budget.bytes * (1 - margin))
    optimizers = [o for o in dict.fromkeys(optimizers) if optimizer_available(o)]
    n_blocks = profile.n_blocks
    activations: dict[tuple[int, str, str], ActivationProfile] = {}

    config = profile.config
    head_share = (config.vocab_size * config.hidden_size / max(profile.matmul_weight_params, 1)
                  if profile.task == "causal-lm" else 0.0)

    def candidate(precision: str, optimizer: str, micro: int, checkpointed: int, weight: str = "fp32",
                  head: str = "keep") -> Advice:
        if (micro, precision, weight) not in activations:  # NOTE [What the meta count runs]: the weights' dtype, LoRA
            activations[micro, precision, weight] = activation_profile(profile, micro, precision=precision, weights=weight,
                                                                       lora_r=lora_r, lora_dropout=lora_dropout, **inputs)
        setup = TrainingSetup(precision, optimizer, micro, batch_size // micro, str(checkpointed), weight, lora_r, head,
                              lora_dropout=lora_dropout, shards=shards)
        est = estimate(profile, setup, activations=activations[micro, precision, weight], **inputs)
        if not est.fits(usable) and OPTIMIZERS[optimizer].per_tensor:  # memfit runs the step per tensor then
            per_tensor = dataclasses.replace(setup, optimizer_step=PER_TENSOR)
            lighter = estimate(profile, per_tensor, activations=activations[micro, precision, weight], **inputs)
            est = lighter if lighter.total_bytes < est.total_bytes else est
        method = {0: "none", n_blocks: "full"}.get(checkpointed, "dynamic")
        return Advice(method, est, _relative_time(setup, checkpointed, n_blocks, head_share))

    fitting: list[Advice] = []
    smallest: MemoryEstimate | None = None
    combos = [(p, w) for p in precisions for w in dict.fromkeys(weights) if w == "fp32" or p == "bf16"]
    for precision, weight in combos:
        for optimizer in optimizers:
            for micro in (m for m in range(batch_size, 0, -1) if batch_size % m == 0):
                for head in dict.fromkeys(heads):
                    for checkpointed in range(n_blocks + 1):
                        advice = candidate(precision, optimizer, micro, checkpointed, weight, head)
                        if smallest is None or advice.estimate.total_bytes <= smallest.total_bytes:
                            smallest = advice.estimate
                        if advice.estimate.fits(usable):
                            fitting.append(advice)
                            if advice.method == "dynamic":
                                full = candidate(precision, optimizer, micro, n_blocks, weight, head)
                                fitting += [full] if full.estimate.fits(usable) else []
                            break
    if not fitting:
        raise NothingFitsError(_nothing_fits_message(smallest, budget, margin))
    order = {p: i for i, p in enumerate(precisions)}
    return sorted(
        fitting,
        key=lambda a: (round(a.relative_time, 9), a.estimate.total_bytes, order[a.estimate.setup.precision],
                       a.estimate.setup.weights, a.estimate.setup.optimizer, _METHODS.index(a.method),
                       a.estimate.setup.head),
    )


def _nothing_fits_message(smallest: MemoryEstimate, budget: Budget, margin: float) -> str:
    s = smallest.setup
    need = math.ceil(smallest.total_bytes / (1 - margin))
    return (
        f"nothing fits the budget of {budget} with {100 * margin:g}% of it kept free. The smallest setup "
        f"({s.precision}, {s.weights} weights{f', LoRA r {s.lora_r}' if s.lora_r else ''}, {s.optimizer}, micro-batch {s.micro_batch_size}, {smallest.checkpointed_blocks} of "
        f"{smallest.n_blocks} blocks checkpointed{_head_words(smallest)}) needs {budget.size(smallest.total_bytes)} "
        f"({smallest.total_bytes:,} bytes), of which {smallest.static_bytes:,} bytes are static (weights "
        f"{smallest.weights_bytes:,} + gradients {smallest.gradients_bytes:,} + optimizer state "
        f"{smallest.optimizer_state_bytes:,}) and no checkpointing can shrink them. Raise {budget.name} to at "
        f"least {budget.size(need)}"
    )


def _head_words(est: MemoryEstimate) -> str:
    """``", LM head chunked in 38"``: the head's treatment of a causal LM's estimate, else nothing."""
    head = est.lm_head
    if head is None:
        return ""
    return f", LM head chunked in {head.n_chunks}" if est.setup.head == "chunked" else ", LM head kept"


def _head_label(est: MemoryEstimate) -> str:
    head = est.lm_head
    return _DASH if head is None else ("keep" if est.setup.head == "keep" else f"chunked:{head.n_chunks}")


_DASH = "—"


def only_chunked_head_fits(ranked: Sequence[Advice], budget: Budget | None = None) -> str | None:
    """A sentence when every setup that fits chunks the LM head (NOTE [The head in the estimate]), else None;
    its sizes in the family of ``budget``'s unit (binary without one)."""
    heads = [a.estimate for a in ranked if a.estimate.lm_head is not None]
    if not heads or len(heads) != len(ranked) or any(e.setup.head == "keep" for e in heads):
        return None
    head = heads[0].lm_head
    size = budget.size if budget is not None else format_bytes
    return (f"only memfit's chunked LM head fits: kept, the head takes {size(head.bytes('keep'))} at this length "
            f"({head.tokens:,} tokens per micro-batch: cross-entropy's float32 log_softmax, the logits and their float32 "
            f"copy), chunked in {head.n_chunks} {size(head.bytes('chunked'))}; the commands chunk it with "
            "--memfit_head plan (memfit.fit(head=True))")


def format_advice(
    ranked: Sequence[Advice],
    budget: Budget,
    *,
    top: int = 10,
    title: str = "",
    margin: float = DEFAULT_MARGIN,
    command: Sequence[str] = (),
) -> str:
    """A markdown table of the ``top`` setups and the ``memfit train`` command of the best.

    Args:
        ranked: output of :func:`advise`.
        budget: the budget as the user gave it (stated in the text and repeated in the flags); the peak
            column is in its :attr:`~memfit.engine.budget.Budget.column_unit`.
        top: rows shown.
        title: first line.
        margin: the share of the budget :func:`advise` kept free (stated in the text).
        command: the words after ``memfit`` that name the task, model and input length
            (``memfit.tools.estimate.cli.train_command``); empty when ``memfit train`` has no such task.

    Returns:
        Multi-line text; its ``best:`` line is the whole ``memfit train`` command but the data.
    """
    lines = [title] if title else []
    with_head = any(a.estimate.lm_head is not None for a in ranked[:top])
    unit, unit_bytes = budget.column_unit
    lines += [
        f"setups that fit {budget} less {100 * margin:g}% (CUDA context excluded, as the cap excludes it), "
        "fastest first; time in units of an fp32 un-checkpointed step:",
        "",
        "| rank | precision | weights | optimizer | micro-batch x accumulation | method | blocks checkpointed"
        + (" | LM head" if with_head else "") + f" | peak {unit} | time |",
        "| ---: | --- | --- | --- | --- | --- | ---:" + (" | ---" if with_head else "") + " | ---: | ---: |",
    ]
    for rank, a in enumerate(ranked[:top], 1):
        s, e = a.estimate.setup, a.estimate
        weights = s.weights + (f" + LoRA r {s.lora_r}" if s.lora_r else "")
        lines.append(
            f"| {rank} | {s.precision} | {weights} | {s.optimizer}{' (step per tensor)' if e.step_per_tensor else ''} "
            f"| {s.micro_batch_size} x {s.accumulation_steps} | {a.method} "
            f"| {e.checkpointed_blocks}/{e.n_blocks}" + (f" | {_head_label(e)}" if with_head else "")
            + f" | {e.total_bytes / unit_bytes:.2f} | {a.relative_time:.2f} |"
        )
    only = only_chunked_head_fits(ranked, budget)
    if only:
        lines += ["", only]
    flags, run = ranked[0].train_flags(budget.flag_value), "  runs rank 1: " + ranked[0].run_words(budget.size)
    if command:
        lines += [
            "",
            "best: memfit " + " ".join([*command, *flags, "--synthetic", "64", "--do_train", "--output_dir", f"out/{command[1]}"]),
            run,
            "  it runs as printed on 64 generated examples; for your data, replace --synthetic 64 by --train_file FILE "
            "(or --dataset_name NAME)",
        ]
    else:
        lines += ["", "best (memfit train has no task for this model's head; its flags): " + " ".join(flags), run]
    return "\n".join(lines)
