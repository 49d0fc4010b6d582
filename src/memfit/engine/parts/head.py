"""The LM head of a causal LM as a part: final norm's output -> ``lm_head`` -> loss.

:func:`find_head` recognises the head of a Hugging Face causal LM (the decoder body, ``lm_head``,
the logit post-processing of its family, its loss); :class:`HeadSwitch` makes the model's
training forward compute that loss with the treatment the caller sets for the step (``keep``:
the model's own path; ``chunked``: :func:`chunked_causal_lm_loss`, a chunk of tokens at a time);
:func:`head_saved_bytes` prices both for the planner and :func:`probe_head` measures them.

# NOTE [How the chunked head hooks into the model]
The model's own forward runs, so everything it does before the head (its kwargs, cache, masks,
position ids, across transformers versions) stays the model's: a forward pre-hook on the causal LM
takes ``labels`` out and asks for no logits (``logits_to_keep`` = an empty index tensor, so
``lm_head`` runs on zero tokens); a forward hook on the decoder body keeps its last hidden state
(the final norm's output); a forward hook on the causal LM computes the loss from it and puts it
in ``outputs.loss``. Rule 1. Only a forward that is training, has grad enabled and passes
``labels`` as a keyword (as the Trainer and TRL do) is taken over; any other forward is untouched,
but an evaluation whose kept head would pass the budget (NOTE [The head in evaluation]).
Rule 2. The treatment is read when the loss is computed, after the body has run, so a plan fixed
at the first block (controller.py) applies to the head of the same step. Under ``keep`` the loss is
the model's own ops (``lm_head``, its post-processing, its ``loss_function``) on the same tensors:
bitwise the model's loss, gradients and logits. Rule 3. A chunked step's ``outputs.logits`` is ``None``: the logits are never materialised
(``logits="detached"`` returns them, computed without grad in the model's dtype, for metrics that
read them; it costs ``tokens x vocab`` in the model's dtype).

# NOTE [The head as its own FSDP unit]
Where FSDP2 shards ``lm_head`` as a unit of its own, or with the final norm (Accelerate's FSDP2
wrapping does), its weight is gathered only for a call of ``lm_head`` (and again before its
backward), each call is a collective every rank must make in the same order, and a grouped
unit counts the calls of its modules. Calling ``lm_head`` once per chunk, or once more after the
model's own call, would make ranks with other plans (each plans its own batches) wait on each
other forever. So there the model's own call is the only one: the pre-hook leaves
``logits_to_keep`` alone and swaps ``lm_head``'s ``forward``, for that forward, for one that
computes the loss of the step's treatment from the rows it is given (all of them) and stashes it:
``keep`` returns the logits (the loss is the model's ops on them, bitwise its own), ``chunked``
returns an empty tensor made from the loss, which the loss then adds times zero, so that FSDP's
hook on the call's output gathers the weight before any chunk is recomputed. One gather in
forward, one before the backward, one reduce-scatter, on every rank whatever its plan; the
chunks read the gathered weight with ``F.linear`` (the ``pure`` implementation only: those that
compute the weight's gradient in forward hand it to a parameter FSDP has freed by then). Only a
plain ``nn.Linear`` head is treated this way (a LoRA layer on ``lm_head`` in its own unit is
kept). The warm-up's price probe makes no collective either: it times this rank's shard of the
weight as a head of that many rows and scales its times by the vocabulary over the rows.

# NOTE [The head in evaluation]
A forward that does not train (``eval()``, or grad off: a Trainer's ``evaluate``) with ``labels``
and every logit asked for runs the model's own head, bitwise, where its bytes fit what the budget
leaves at that moment. Its bytes are the logits in the model's dtype, their float32 upcast and
``log_softmax``'s float32 output (``tokens x vocab x (size + 8)``): at 16k tokens of a 128k
vocabulary 11.7 GiB, which ran an 8B LoRA trained in 8 GiB out of memory at its evaluation.
Where they do not fit, :attr:`HeadSwitch.on_evaluation` (set by the run: ``RunHead.evaluation``
in treatments/chunked_head.py) names a chunk count and whether the logits fit: then the logits are
made whole in the model's dtype and the loss is computed from them a chunk of rows at a time (the
float32 copies exist one chunk at a time; ``outputs.logits`` are the model's, bitwise), or, where
even the logits do not fit, the loss is computed from the hidden rows a chunk at a time
(:func:`chunked_causal_lm_loss`) and ``outputs.logits`` is None, said once. The loss equals the
model's within float32 rounding. An FSDP unit's head (NOTE [The head as its own FSDP unit]) is left
as it is.

# NOTE [Chunk recomputed in backward]
Each chunk runs ``lm_head`` -> post-processing -> float32 -> cross-entropy (sum) under
``torch.utils.checkpoint`` (non-reentrant, RNG kept): forward keeps only the chunk's hidden rows
(views of the body's output), backward recomputes the chunk's logits. This calls the ``lm_head``
*module*, so LoRA on ``lm_head``, tied weights, autocast and bf16 behave as in the model. Computing
each chunk's gradient in forward (Liger's way; ``pure_grad_in_forward``, :class:`_GradInForward`)
saves that recompute but needs the raw weight, which LoRA on ``lm_head`` does not offer, and keeps
the weight's gradient (float32, ``vocab x hidden``) from forward to backward. Both are offered, with
the fused kernels where they apply (:data:`IMPLEMENTATIONS`): which is faster is measured
(:func:`probe_head`), not assumed.

# NOTE [Chunked loss equals the model's loss]
As ``ForCausalLMLoss``: labels padded with ``ignore_index`` and shifted left (or the caller's
``shift_labels``), the sum of float32 cross-entropies divided by ``num_items_in_batch`` when given,
else by the number of tokens not ignored. Ignored tokens are chunked like the others (no
data-dependent gather, so no device sync) and contribute zero. Only the order of float
additions differs: loss and gradients equal the model's within float32 rounding, not bitwise.
"""

from __future__ import annotations

import inspect
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.engine.ranks import is_fsdp

__all__ = [
    "HEAD_KEY", "HEAD_TREATMENTS", "IMPLEMENTATIONS", "HeadSpec", "HeadNotFound", "HeadSwitch", "HeadBytes", "find_head", "attach_head",
    "chunked_causal_lm_loss", "head_saved_bytes", "chunks_for_bytes", "probe_head", "head_loss", "available_implementations", "FUSED",
    "fused_chunks",
]

#: The LM head's part kind: its key in a step record's ``treatments`` and ``implementations`` and in a plan's parts
#: (NOTE [The head in a record], records.py)
HEAD_KEY = "head"

logger = logging.getLogger("memfit")

HEAD_TREATMENTS = ("keep", "chunked")
#: chunked-loss implementations: the pure path runs everywhere; the fused ones need CUDA and their package
IMPLEMENTATIONS = ("pure", "pure_grad_in_forward", "liger", "cce")
#: the implementations whose kernel chunks the tokens itself (NOTE [Head bytes]: priced at :func:`fused_chunks`)
FUSED = ("liger", "cce")

# Families whose ``*ForCausalLM.forward`` is: body -> lm_head -> post-processing -> loss_function,
# and the post-processing each applies to the logits (read from the model, below).
_PLAIN = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "olmo2", "smollm3")
_SOFTCAP = ("gemma2", "gemma3_text")  # tanh(logits / cap) * cap, cap = config.final_logit_softcapping
_SCALE = ("cohere", "cohere2")  # logits * model.logit_scale
_DIVIDE = ("granite",)  # logits / config.logits_scaling
# mixtures add a router loss to the model's loss when output_router_logits is on
_MOE = ("qwen2_moe", "qwen3_moe", "mixtral")


class HeadNotFound(Exception):
    """The model's head cannot be treated; the message says why (one line)."""


@dataclass(frozen=True)
class HeadSpec:
    """What memfit found of a causal LM's head.

    Attributes:
        causal_lm: the ``*ForCausalLM`` module whose forward computes the loss (under peft, the base model).
        body: its decoder body (``causal_lm.model``); its output's first item is the final norm's output.
        lm_head: the output projection module (a peft LoRA layer when LoRA adapts it).
        vocab_size: the logits' width.
        softcap: final-logit soft-capping (Gemma 2/3), or None.
        scale: a factor the logits are multiplied by (Cohere), or None.
        divisor: a number the logits are divided by (Granite), or None.
    """

    causal_lm: nn.Module
    body: nn.Module
    lm_head: nn.Module
    vocab_size: int
    softcap: float | None = None
    scale: float | None = None
    divisor: float | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits for ``hidden`` (final norm's output), in the model's dtype, with
        the family's post-processing in the model's order of operations."""
        return self.post(self.lm_head(hidden))

    def post(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's post-processing of ``lm_head``'s output (soft-capping, scaling), in the model's order."""
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.scale is not None:
            logits = logits * self.scale
        if self.divisor is not None:
            logits = logits / self.divisor
        return logits

    @property
    def weight(self) -> torch.Tensor:
        """The projection's weight (``vocab x hidden``), for the fused implementations."""
        return self.lm_head.weight


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or ``model``)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def find_head(model: nn.Module) -> HeadSpec:
    """Find the head of a Hugging Face causal LM (or a peft model over one).

    Raises:
        HeadNotFound: the architecture is not one memfit knows, or its loss is custom (the
            message says which, in one line).
    """
    lm = _unwrap(model)
    config = getattr(lm, "config", None)
    family = getattr(config, "model_type", None)
    known = _PLAIN + _SOFTCAP + _SCALE + _DIVIDE + _MOE
    if family not in known:
        raise HeadNotFound(f"memfit does not know the head of model type {family!r} ({type(lm).__name__}); it keeps it untreated")
    body, lm_head = getattr(lm, "model", None), getattr(lm, "lm_head", None)
    if not isinstance(body, nn.Module) or not isinstance(lm_head, nn.Module):
        raise HeadNotFound(f"{type(lm).__name__} has no decoder body `model` and `lm_head`; memfit keeps its head untreated")
    if "logits_to_keep" not in inspect.signature(lm.forward).parameters:
        raise HeadNotFound(f"{type(lm).__name__}.forward takes no `logits_to_keep`; memfit keeps its head untreated")
    if not _is_causal_lm_loss(lm):
        raise HeadNotFound(f"{type(lm).__name__} has a custom loss function; memfit keeps its head untreated")
    if family in _MOE and getattr(config, "output_router_logits", False):
        raise HeadNotFound(f"{type(lm).__name__} adds a router loss (output_router_logits=True); memfit keeps its head untreated")
    if lm is not model and not _peft_calls_module(model):
        raise HeadNotFound("this peft version calls the base model's forward directly (hooks do not run); memfit keeps the head untreated")
    return HeadSpec(
        causal_lm=lm, body=body, lm_head=lm_head, vocab_size=int(config.vocab_size),
        softcap=getattr(config, "final_logit_softcapping", None) if family in _SOFTCAP else None,
        scale=float(lm.logit_scale) if family in _SCALE else None,
        divisor=float(config.logits_scaling) if family in _DIVIDE else None,
    )


def _is_causal_lm_loss(lm: nn.Module) -> bool:
    """Whether the model's loss is transformers' ``ForCausalLMLoss`` (or that compiled, as
    ``memfit.fit(compile=...)`` sets it): the semantics :func:`chunked_causal_lm_loss` reproduces."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    loss = getattr(lm, "loss_function", None)
    return loss is ForCausalLMLoss or getattr(loss, "_torchdynamo_orig_callable", None) is ForCausalLMLoss


def _peft_calls_module(model: nn.Module) -> bool:
    """Whether the peft tuner calls its model as a module (so the model's hooks run)."""
    tuner = getattr(model, "base_model", None)
    try:
        source = inspect.getsource(type(tuner).forward)
    except (OSError, TypeError):
        return False
    return "self.model.forward(" not in source


def chunked_causal_lm_loss(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    n_chunks: int,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ForCausalLMLoss(logits_fn(hidden), labels, ...)`` without the whole logits tensor.

    NOTE [Chunked loss equals the model's loss] and NOTE [Chunk recomputed in backward] (module
    docstring) state what is computed and what is kept.

    Args:
        logits_fn: hidden rows ``(n, hidden)`` -> logits ``(n, vocab)`` (e.g. :meth:`HeadSpec.logits`).
        hidden: the final norm's output, ``(batch, length, hidden)``.
        labels: ``(batch, length)`` token ids, shifted here; ignored when ``shift_labels`` is given.
        n_chunks: how many chunks of tokens (at least 1; at most one per token is used).
        num_items_in_batch: the Trainer's count of tokens over a gradient-accumulation window.
        ignore_index: the label that contributes nothing.
        shift_labels: already-shifted labels, as the model's loss accepts them.

    Returns:
        The float32 scalar loss.

    Example:
        >>> head = torch.nn.Linear(8, 50, bias=False)
        >>> h, y = torch.randn(2, 5, 8), torch.randint(0, 50, (2, 5))
        >>> loss = chunked_causal_lm_loss(head, h, y, n_chunks=3)
    """
    if n_chunks < 1:
        raise ValueError(f"n_chunks must be at least 1, got {n_chunks}")
    targets = _shifted(labels, shift_labels, ignore_index).reshape(-1).to(hidden.device)
    rows = hidden.reshape(-1, hidden.shape[-1])
    pieces = zip(torch.tensor_split(rows, min(n_chunks, max(1, rows.shape[0]))), torch.tensor_split(targets, min(n_chunks, max(1, rows.shape[0]))))
    total = sum(checkpoint(_chunk_loss_sum, logits_fn, h, t, ignore_index, use_reentrant=False) for h, t in pieces)
    return _normalise(total, targets, num_items_in_batch, ignore_index)


def _shifted(labels: torch.Tensor | None, shift_labels: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _normalise(total: torch.Tensor, targets: torch.Tensor, num_items_in_batch, ignore_index: int) -> torch.Tensor:
    return total / _denominator(targets, num_items_in_batch, ignore_index)


def _denominator(targets: torch.Tensor, num_items_in_batch, ignore_index: int) -> torch.Tensor | int:
    """What the model's loss divides the summed cross-entropy by: ``num_items_in_batch``, else the tokens not ignored."""
    if num_items_in_batch is None:
        return (targets != ignore_index).sum()
    return num_items_in_batch.to(targets.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """Rows of logits made already, as :func:`chunked_causal_lm_loss`'s ``logits_fn`` (NOTE [The head in evaluation])."""
    return logits


def _chunk_loss_sum(logits_fn, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(logits_fn(hidden).float(), targets, ignore_index=ignore_index, reduction="sum")


class _GradInForward(torch.autograd.Function):
    """Sum of the chunks' float32 cross-entropies of ``post(rows @ weight.T + bias)``, divided by
    ``denominator``; each chunk's gradients are taken in forward by autograd on that chunk alone (the
    same ops as the model's, under the caller's autocast, divided before they meet the model's dtype
    as in the model's loss), the weight's summed in float32; backward only scales them."""

    @staticmethod
    def forward(ctx, rows, weight, bias, targets, n_chunks: int, ignore_index: int, post, denominator):
        grad_rows = torch.empty_like(rows) if rows.requires_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight.requires_grad else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and bias.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        start = 0
        for h, t in zip(torch.tensor_split(rows, n_chunks), torch.tensor_split(targets, n_chunks)):
            # the chunk's own graph lives only here: hooks that count saved tensors (memfit's) must not see it
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
                leaves = [x.detach().requires_grad_(g is not None) for x, g in ((h, grad_rows), (weight, grad_weight), (bias, grad_bias)) if x is not None]
                loss = F.cross_entropy(post(F.linear(*leaves)).float(), t, ignore_index=ignore_index, reduction="sum") / denominator
                wanted = [x for x in leaves if x.requires_grad]
                grads = iter(torch.autograd.grad(loss, wanted) if wanted else [])
            if grad_rows is not None:
                grad_rows[start:start + h.shape[0]] = next(grads)
            for acc in (grad_weight, grad_bias):
                if acc is not None:
                    acc += next(grads)
            total += loss.detach()
            start += h.shape[0]
            del grads  # this chunk's weight gradient, before the next chunk's peak (NOTE [Head bytes])
        ctx.save_for_backward(*(g for g in (grad_rows, grad_weight, grad_bias) if g is not None))
        ctx.has = (grad_rows is not None, grad_weight is not None, grad_bias is not None)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        saved = iter(ctx.saved_tensors)
        rows, weight, bias = (next(saved) if has else None for has in ctx.has)
        return (
            None if rows is None else rows * grad_total.to(rows.dtype),
            None if weight is None else (weight * grad_total).to(ctx.dtypes[0]),
            None if bias is None else (bias * grad_total).to(ctx.dtypes[1]),
            None, None, None, None, None,
        )


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _grad_in_forward_loss(spec: HeadSpec, hidden, labels, n_chunks: int, *, num_items_in_batch=None, ignore_index=-100, shift_labels=None):
    """:func:`chunked_causal_lm_loss` with each chunk's gradient computed in forward (plain ``nn.Linear`` heads)."""
    targets = _shifted(labels, shift_labels, ignore_index).reshape(-1).to(hidden.device)
    rows = hidden.reshape(-1, hidden.shape[-1])
    n = min(n_chunks, max(1, rows.shape[0]))
    denominator = _denominator(targets, num_items_in_batch, ignore_index)
    return _GradInForward.apply(rows, spec.lm_head.weight, spec.lm_head.bias, targets, n, ignore_index, spec.post, denominator)


def _fused_loss(spec: HeadSpec, implementation: str, hidden, labels, *, num_items_in_batch=None, ignore_index=-100, shift_labels=None):
    """The loss through a fused kernel (``liger`` or ``cce``): same semantics as the pure path."""
    targets = _shifted(labels, shift_labels, ignore_index).reshape(-1).to(hidden.device)
    rows = hidden.reshape(-1, hidden.shape[-1])
    bias = getattr(spec.lm_head, "bias", None)
    if implementation == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        out = liger_fused_linear_cross_entropy(rows, spec.weight, targets, bias=bias, ignore_index=ignore_index, reduction="sum", softcap=spec.softcap)
        total = out[0] if isinstance(out, tuple) else getattr(out, "loss", out)
    elif implementation == "cce":
        from cut_cross_entropy import linear_cross_entropy

        # filter_eps=None: every gradient block computed (its default skips those it deems small,
        # which would leave the loss's gradient short of the model's); bias only where there is one
        # (versions before it took none)
        total = linear_cross_entropy(rows, spec.weight, targets, **({"bias": bias} if bias is not None else {}),
                                     ignore_index=ignore_index, softcap=spec.softcap, reduction="sum", filter_eps=None)
    else:
        raise ValueError(f"unknown head implementation {implementation!r}; choose one of {IMPLEMENTATIONS}")
    return _normalise(total.float(), targets, num_items_in_batch, ignore_index)


def _plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` itself (not LoRA's layer nor a quantised subclass), or one
    that FSDP2 made a unit of its own (its class then derives from ``FSDPModule`` and ``nn.Linear``)."""
    return type(module) is nn.Linear or (is_fsdp(module) and nn.Linear in type(module).__bases__)


def available_implementations(spec: HeadSpec, device: torch.device | str) -> list[str]:
    """Implementations of the chunked head usable for ``spec`` on ``device``, ``pure`` first.

    ``pure_grad_in_forward`` needs a plain ``nn.Linear`` head (not LoRA on ``lm_head``).
    The fused ones need CUDA, their package importable, and a plain ``nn.Linear`` head with no
    logit scaling (they take the raw weight; LoRA on ``lm_head`` is not one). Which is fastest is
    for the caller to measure (:func:`probe_head`).
    """
    found = ["pure"]
    if is_fsdp(spec.lm_head):  # the chunks read the weight FSDP gathers for them (NOTE [The head as its own FSDP unit])
        return found
    plain = _plain_linear(spec.lm_head)
    if plain:
        found.append("pure_grad_in_forward")
    if torch.device(device).type != "cuda" or not plain or spec.scale is not None or spec.divisor is not None:
        return found
    for name, module in (("liger", "liger_kernel.transformers.functional"), ("cce", "cut_cross_entropy")):
        try:
            __import__(module)
        except ImportError:
            continue
        found.append(name)
    return found


class HeadSwitch:
    """Makes a causal LM's training forward compute its loss with the treatment set per step.

    NOTE [How the chunked head hooks into the model] (module docstring) says how and when.

    Args:
        spec: the head (:func:`find_head`).
        logits: what a chunked step returns as ``outputs.logits``: ``"drop"`` (None) or
            ``"detached"`` (computed without grad, in the model's dtype).

    Example:
        >>> switch = HeadSwitch(find_head(model))        # doctest: +SKIP
        >>> switch.set("chunked", n_chunks=8)              # doctest: +SKIP
        >>> model(**batch).loss.backward()                 # doctest: +SKIP
    """

    def __init__(self, spec: HeadSpec, logits: str = "drop"):
        if logits not in ("drop", "detached"):
            raise ValueError(f"logits must be 'drop' or 'detached', got {logits!r}")
        self.spec, self.logits_mode = spec, logits
        self.treatment, self.n_chunks, self.implementation = "keep", 1, "pure"
        #: chunked forwards run so far (what a test or a record can read)
        self.chunked_forwards = 0
        #: whether the caller held the last training forward's outputs when its backward began (None:
        #: not seen yet; NOTE [Outputs held through the backward])
        self.outputs_held: bool | None = None
        #: called once with the body's output and the labels before the next loss is computed (warm-up's
        #: price probe, treatments/chunked_head.py), then cleared
        self.probe: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        #: called at a training forward whose loss the switch does not compute (no ``labels``, or some
        #: logits asked for), before the body runs (NOTE [The head by default], treatments/chunked_head.py)
        self.on_left_to_caller: Callable[[], None] | None = None
        #: whether ``lm_head`` is an FSDP unit of its own (NOTE [The head as its own FSDP unit])
        self.unit = is_fsdp(spec.lm_head)
        #: the loss (and logits) the unit's call computed, and whether chunked, until :meth:`_after` reads them
        self._stash: tuple[torch.Tensor, torch.Tensor | None, bool] | None = None
        if self.unit and not _plain_linear(spec.lm_head):
            raise HeadNotFound(f"lm_head ({type(spec.lm_head).__name__}) is an FSDP unit of its own and no plain nn.Linear, "
                               "so its chunks cannot read its gathered weight")
        #: called with an OOM's message and the tokens when the loss ran out of memory; returns the
        #: chunk count to compute it again with (NOTE [Replay under FSDP], replay.py); None: raised
        self.on_oom: Callable[[str, int], int] | None = None
        #: called at a forward that does not train, with labels and every logit asked for, with its tokens; returns
        #: the chunk count to compute its loss in (0: the model's own head) and whether its logits are made
        #: (NOTE [The head in evaluation]); None: such forwards are the model's own
        self.on_evaluation: Callable[[int], tuple[int, bool]] | None = None
        self._usable: list[str] | None = None
        self._pending: dict[str, Any] | None = None
        self._hidden: torch.Tensor | None = None
        lm = spec.causal_lm
        self._handles = [
            lm.register_forward_pre_hook(self._before, with_kwargs=True, prepend=True),
            spec.body.register_forward_hook(self._body_done),
            # first among the model's forward hooks: memfit's accounting hook (controller.py), which
            # stops counting saved tensors, sees the forward end after the chunked loss exists
            lm.register_forward_hook(self._after, with_kwargs=True, prepend=True, always_call=True),
        ]

    def set(self, treatment: str, n_chunks: int = 1, implementation: str = "pure") -> None:
        """The head's treatment for the next loss computed (``keep`` or ``chunked`` with ``n_chunks``);
        it may be set during the forward, before the body ends (NOTE [How the chunked head hooks into the model])."""
        if treatment not in HEAD_TREATMENTS:
            raise ValueError(f"head treatment must be one of {HEAD_TREATMENTS}, got {treatment!r}")
        if n_chunks < 1:
            raise ValueError(f"n_chunks must be at least 1, got {n_chunks}")
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"head implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        if self._usable is None:  # the packages and the device do not change during a run
            self._usable = available_implementations(self.spec, self.spec.weight.device)
        usable = self._usable
        if implementation not in usable:
            raise ValueError(f"head implementation {implementation!r} is not usable here (it needs CUDA, its package and a plain "
                             f"nn.Linear lm_head without logit scaling); choose one of {usable}")
        self.treatment, self.n_chunks, self.implementation = treatment, n_chunks, implementation

    def remove(self) -> None:
        """Take the hooks off; the model computes its head as before."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self._pending, self._hidden = None, None
        labels = kwargs.get("labels")
        if not module.training or not torch.is_grad_enabled():
            return self._evaluating(labels, kwargs, args)
        keep = kwargs.get("logits_to_keep", 0)
        if labels is None or not isinstance(keep, int) or keep != 0:  # no loss here, or some logits asked for
            if self.on_left_to_caller is not None:
                self.on_left_to_caller()
            return None
        self._pending = {"labels": labels, **{k: kwargs[k] for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in kwargs}}
        if self.unit:  # the model's one call of lm_head computes the loss (NOTE [The head as its own FSDP unit])
            self.spec.lm_head.forward = self._unit_forward
            return args, {**kwargs, "labels": None}
        kwargs = {**kwargs, "labels": None, "logits_to_keep": torch.empty(0, dtype=torch.long, device=labels.device)}
        return args, kwargs

    def _evaluating(self, labels: torch.Tensor | None, kwargs: dict, args: tuple) -> tuple[tuple, dict] | None:
        """A forward that does not train: taken over only where its kept head would pass the budget (NOTE [The head in
        evaluation]); its chunk count and whether its logits are made wait in ``_pending`` for :meth:`_after`."""
        keep = kwargs.get("logits_to_keep", 0)
        if labels is None or self.on_evaluation is None or self.unit or not isinstance(keep, int) or keep != 0:
            return None
        n_chunks, logits = self.on_evaluation(labels.numel())
        if n_chunks < 1:
            return None
        extra = {k: kwargs[k] for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in kwargs}
        self._pending = {"labels": labels, **extra, "evaluation": (n_chunks, logits)}
        return args, {**kwargs, "labels": None, "logits_to_keep": torch.empty(0, dtype=torch.long, device=labels.device)}

    def _evaluation_loss(self, output: Any, hidden: torch.Tensor, labels: torch.Tensor, pending: dict[str, Any]) -> Any:
        """The loss of a forward that does not train, in chunks, with the model's logits where they fit (NOTE [The head
        in evaluation])."""
        n_chunks, with_logits = pending.pop("evaluation")
        if not with_logits:
            return self._output(output, chunked_causal_lm_loss(self.spec.logits, hidden, labels, n_chunks, **pending), None)
        logits = self.spec.logits(hidden)  # the model's own logits; the loss reads them a chunk of rows at a time
        return self._output(output, chunked_causal_lm_loss(_rows, logits, labels, n_chunks, **pending), logits)

    def _body_done(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._pending is not None:
            self._hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        pending, hidden = self._pending, self._hidden
        self._pending, self._hidden = None, None
        if self.unit:
            self.spec.lm_head.__dict__.pop("forward", None)
            stash, self._stash = self._stash, None
            if pending is None or output is None:
                return None
            if stash is None:
                raise RuntimeError("memfit's head switch saw no call of lm_head; call HeadSwitch.remove() to keep the model's own head")
            if self.probe is not None and hidden is not None:
                probe, self.probe = self.probe, None
                probe(hidden, pending["labels"] if "shift_labels" not in pending else None)
            loss, logits, chunked = stash
            if not chunked:
                return self._output(output, loss, output.logits if not isinstance(output, tuple) else output[0])
            # the empty logits lm_head returned join the loss's graph, so FSDP's hook on them gathers
            # lm_head's weight before any chunk is recomputed (NOTE [The head as its own FSDP unit])
            empty = output[0] if isinstance(output, tuple) else output.logits
            return self._output(output, loss + empty.sum() * 0, logits)
        if pending is None or output is None:  # not taken over, or the forward raised
            return None
        if hidden is None:
            raise RuntimeError("memfit's head switch saw no output of the decoder body; call HeadSwitch.remove() to keep the model's own head")
        labels = pending.pop("labels")
        if "evaluation" in pending:
            return self._evaluation_loss(output, hidden, labels, pending)
        if self.probe is not None:
            probe, self.probe = self.probe, None
            probe(hidden, labels if "shift_labels" not in pending else None)
        return self._watch(self._recovering(lambda: self._loss(output, hidden, labels, pending), hidden))

    @property
    def logits_held(self) -> bool:
        """Whether a kept head's logits are priced as held through its backward: unless a step has
        said the caller drops the outputs first (NOTE [Outputs held through the backward])."""
        return self.outputs_held is not False

    def _watch(self, result: Any) -> Any:
        """Note, when the backward of ``result``'s loss begins, whether the caller still holds ``result``.

        NOTE [Outputs held through the backward]
        A kept head's returned logits (``tokens x vocab`` in the model's dtype) are freed before its
        backward where the caller drops the outputs first (``model(**batch).loss.backward()``, the
        Trainer's ``compute_loss``) and held through it where it keeps them (``out = model(...);
        out.loss.backward()``): 2 bytes per logit in bf16 that the kept head's peak holds or not
        (NOTE [Head bytes]). So every training forward whose loss the switch computes puts a weak
        reference on its outputs and a hook on its loss, which reads at the backward's start whether
        the outputs are alive; the head's bytes are priced held until a step has said otherwise.
        ``return_dict=False`` outputs (a tuple: no weak reference) are priced held.
        """
        loss = None if isinstance(result, tuple) else result.get("loss")
        if loss is None or not loss.requires_grad:
            return result
        held = weakref.ref(result)

        def at_backward(grad: torch.Tensor) -> None:
            self.outputs_held = held() is not None

        loss.register_hook(at_backward)
        return result

    def _recovering(self, compute: Callable[[], Any], hidden: torch.Tensor) -> Any:
        """``compute()``; where an OOM in it is survived (``on_oom`` set: NOTE [Replay under FSDP],
        replay.py), once more with the head in the chunk count ``on_oom`` returns."""
        if self.on_oom is None:
            return compute()
        message = None
        try:
            return compute()
        except torch.OutOfMemoryError as err:
            message = str(err)  # handled outside the except block, so the failed attempt's frames are freed
        n_chunks = self.on_oom(message, hidden.shape[:-1].numel())
        self.treatment, self.n_chunks, self.implementation = "chunked", n_chunks, "pure"
        return compute()

    def _loss(self, output: Any, hidden: torch.Tensor, labels: torch.Tensor, pending: dict[str, Any]) -> Any:
        if self.treatment == "keep":
            logits = self.spec.logits(hidden)
            loss = self.spec.causal_lm.loss_function(logits=logits, labels=labels, vocab_size=self.spec.vocab_size, **pending)
            return self._output(output, loss, logits)
        if self.implementation == "pure":
            loss = chunked_causal_lm_loss(self.spec.logits, hidden, labels, self.n_chunks, **pending)
        elif self.implementation == "pure_grad_in_forward":
            loss = _grad_in_forward_loss(self.spec, hidden, labels, self.n_chunks, **pending)
        else:
            loss = _fused_loss(self.spec, self.implementation, hidden, labels, **pending)
        self.chunked_forwards += 1
        logits = None
        if self.logits_mode == "detached":
            with torch.no_grad():
                logits = self.spec.logits(hidden)
        return self._output(output, loss, logits)

    def _unit_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of ``hidden`` from ``lm_head``'s weight where FSDP gathered it, without a call of
        ``lm_head`` (NOTE [The head as its own FSDP unit])."""
        lm_head = self.spec.lm_head
        return self.spec.post(F.linear(hidden, lm_head.weight, lm_head.bias))

    def _unit_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head``'s forward during a taken-over training forward where it is an FSDP unit of its
        own: the loss of the treatment set, stashed for :meth:`_after`; returns the logits (``keep``)
        or an empty tensor made from the loss (``chunked``) (NOTE [The head as its own FSDP unit])."""
        pending = dict(self._pending)
        labels = pending.pop("labels")
        return self._recovering(lambda: self._unit_loss(hidden, labels, pending), hidden)

    def _unit_loss(self, hidden: torch.Tensor, labels: torch.Tensor, pending: dict[str, Any]) -> torch.Tensor:
        spec = self.spec
        if self.treatment == "keep":
            raw = nn.Linear.forward(spec.lm_head, hidden)
            loss = spec.causal_lm.loss_function(logits=spec.post(raw), labels=labels, vocab_size=spec.vocab_size, **pending)
            self._stash = (loss, None, False)
            return raw
        loss = chunked_causal_lm_loss(self._unit_logits, hidden, labels, self.n_chunks, **pending)
        logits = None
        if self.logits_mode == "detached":
            with torch.no_grad():
                logits = self._unit_logits(hidden)
        self.chunked_forwards += 1
        self._stash = (loss, logits, True)
        return loss.reshape(1, 1, 1).expand(hidden.shape[0], 0, spec.vocab_size)

    @staticmethod
    def _output(output: Any, loss: torch.Tensor, logits: torch.Tensor | None) -> Any:
        if isinstance(output, tuple):  # return_dict=False: (logits, *rest) without labels; None fields are left out
            return (loss, *([] if logits is None else [logits]), *output[1:])
        # a new output, so its keys keep transformers' order (loss first) and a dropped logits is no key
        fields = {k: v for k, v in output.items() if k not in ("loss", "logits")}
        return type(output)(loss=loss, logits=logits, **fields)


def attach_head(model: nn.Module, logits: str = "drop") -> HeadSwitch | None:
    """A :class:`HeadSwitch` on ``model``'s head, or None (and one logged line saying why) when
    memfit cannot treat it. The switch starts at ``keep``."""
    try:
        return HeadSwitch(find_head(model), logits=logits)
    except HeadNotFound as reason:
        logger.warning("memfit: %s", reason)
        return None


@dataclass(frozen=True)
class HeadBytes:
    """The head's memory for one shape and treatment.

    Attributes:
        saved_bytes: what autograd keeps for backward from the head's forward until its backward.
        transient_bytes: what lives only while the head runs (forward or backward), above ``saved_bytes``.
    """

    saved_bytes: int
    transient_bytes: int


def head_saved_bytes(
    tokens: int, vocab: int, hidden: int, dtype: torch.dtype, treatment: str, n_chunks: int = 1, softcap: bool = False,
    implementation: str = "pure", weight_trains: bool = True, logits_held: bool = True,
) -> HeadBytes:
    """The head's bytes for ``tokens`` tokens (``batch x length``), by formula.

    NOTE [Head bytes]
    ``keep``: cross-entropy's ``log_softmax`` keeps its float32 output (``tokens x vocab x 4``);
    soft-capping keeps its ``tanh`` output in the model's dtype; ``lm_head`` keeps its input
    (``tokens x hidden``), cross-entropy its int64 targets. The transient is the head's backward,
    the step's first moment after its forward's end, every activation still held: ``nll_loss``'s
    gradient and ``log_softmax``'s (float32 each), ``tokens x vocab x 8``, more than the forward's
    logits and float32 upcast; and the returned logits (model dtype) where the caller still holds
    the outputs then (``logits_held``: NOTE [Outputs held through the backward]).
    ``chunked``: only the hidden rows are kept (``tokens x hidden``, shared with the body's output);
    one chunk at a time runs its forward again in backward and holds, at its peak, ``log_softmax``'s
    float32 output with the two float32 gradients (its logits and their upcast are freed by then:
    12 bytes per logit, whatever the dtype): the transient. ``pure_grad_in_forward`` keeps the
    hidden rows' gradient instead of the rows and targets and, when ``lm_head``'s weight trains
    (``weight_trains``), its float32 gradient (``vocab x hidden x 4``); its chunk's transient is the
    same 12 bytes per logit (the chunk's logits in the model's dtype are freed once upcast; measured
    by ``benchmarks/head_peaks.py`` and in tests/test_head.py), or, for chunks of few rows, the
    chunk's weight gradient in the model's dtype beside its logits' float32 gradient and its cast
    (6 bytes a logit). The fused kernels (:data:`FUSED`) chunk the tokens themselves, whatever
    ``n_chunks`` says, and each holds what its own code keeps (``benchmarks/head_peaks.py`` measures
    them against this): Liger's fused linear cross-entropy takes the gradients in forward, the rows'
    and, when the weight trains, the weight's in the weight's dtype (not float32), and its transient
    is one chunk's logits in the model's dtype, of ``tokens / ceil(vocab / hidden)`` rows rounded up
    to a power of two; Cut Cross-Entropy keeps the rows, a float32 log-sum-exp and the int64 targets
    and valid-row indices per token and never materialises logits; its backward holds the rows'
    gradient (its weight's becomes ``.grad``, as the kept head's does). A kernel priced by another's
    formula makes warm-up steps run by different implementations teach the curves samples that
    disagree (docs/devlog.md). Measured by :func:`probe_head`, checked against
    this in tests/test_head.py and by the probe (NOTE [The probe checks the formula], chunked_head.py).
    """
    size = dtype.itemsize
    hidden_bytes = tokens * hidden * size + tokens * 8  # the rows and their int64 targets
    if treatment == "keep":
        saved = tokens * vocab * 4 + (tokens * vocab * size if softcap else 0) + hidden_bytes
        return HeadBytes(saved, tokens * vocab * ((size if logits_held else 0) + 8))
    if treatment == "chunked":
        if implementation == "liger":
            rows = min(tokens, 1 << max(0, -(-tokens // fused_chunks(tokens, vocab, hidden)) - 1).bit_length())
            weight_grad = vocab * hidden * size if weight_trains else 0
            return HeadBytes(tokens * hidden * size + weight_grad, rows * vocab * size + tokens * 8)
        if implementation == "cce":
            return HeadBytes(hidden_bytes + tokens * (4 + 8), tokens * hidden * size)
        rows = -(-tokens // max(1, n_chunks))
        if implementation == "pure_grad_in_forward":
            # the chunk's weight gradient meets its logits' gradient (6 bytes a logit), not their peak
            weight_grad = vocab * hidden * size if weight_trains else 0
            return HeadBytes(tokens * hidden * size + (vocab * hidden * 4 if weight_trains else 0),
                             max(rows * vocab * 12, rows * vocab * 6 + weight_grad) + tokens * 8)  # and the int64 targets
        return HeadBytes(hidden_bytes, rows * vocab * 12)
    raise ValueError(f"head treatment must be one of {HEAD_TREATMENTS}, got {treatment!r}")


def fused_chunks(tokens: int, vocab: int, hidden: int) -> int:
    """How many chunks of tokens a fused kernel (:data:`FUSED`) runs: ``ceil(vocab / hidden)``, as
    Liger's fused linear cross-entropy does (each chunk's logits about as large as the hidden rows),
    at most one per token."""
    return max(1, min(tokens, -(-vocab // max(1, hidden))))


def chunks_for_bytes(tokens: int, vocab: int, dtype: torch.dtype, transient_bytes: int) -> int:
    """The fewest chunks whose one-chunk transient (:func:`head_saved_bytes`) fits ``transient_bytes``
    (at most one token per chunk: ``tokens``), so the planner can turn the bytes it has left into a
    chunk count per batch.

    Example:
        >>> chunks_for_bytes(16384, 151936, torch.bfloat16, 2**30)
        28
    """
    per_token = head_saved_bytes(1, vocab, 0, dtype, "chunked").transient_bytes
    rows = max(1, transient_bytes // per_token)
    return max(1, min(tokens, -(-tokens // rows)))


def probe_head(spec: HeadSpec, hidden: torch.Tensor, labels: torch.Tensor, n_chunks: int, implementation: str = "pure",
               treatments: tuple[str, ...] = HEAD_TREATMENTS) -> dict[str, dict[str, float]]:
    """Measure the head under ``treatments`` (``keep`` and ``chunked``) on the body's output ``hidden``.

    For each treatment: ``saved_bytes`` (distinct storages autograd keeps, counted with
    ``saved_tensors_hooks``, parameters excluded) and ``ms`` (forward + backward, wall time; on CUDA
    synchronised, which is why this is for warm-up only). Gradients are taken with respect to a
    detached copy of ``hidden`` and of ``lm_head``'s trainable weights by ``torch.autograd.grad``,
    so no ``.grad`` changes.

    NOTE [A warm probe]
    Each treatment runs once untimed before the timed run, at the same shape: a process's first
    call of a kernel at a shape pays its set-up (cuBLAS heuristics, a fused kernel's compile and
    autotuning), and memfit's warm-up is when a process is coldest. Timed cold, a chunk's price
    comes out several times its warm one, and the planner chooses fewer, larger chunks and treats
    more blocks to make room for them (docs/devlog.md).
    """
    from memfit.engine.parts.accounting import local

    params = {local(p).untyped_storage().data_ptr() for p in spec.causal_lm.parameters()}
    weights = [p for p in spec.lm_head.parameters() if p.requires_grad]
    results = {}
    for treatment in treatments:
        h = hidden.detach().requires_grad_(True)
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = s.nbytes()
            return t

        def run() -> None:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = head_loss(spec, h, labels, treatment, n_chunks, implementation)
            torch.autograd.grad(loss, [h, *weights])

        run()  # untimed: NOTE [A warm probe]
        storages.clear()
        _sync(hidden)
        start = time.perf_counter()
        run()
        _sync(hidden)
        ms = (time.perf_counter() - start) * 1e3
        results[treatment] = {"saved_bytes": float(sum(storages.values())), "ms": ms}
    return results


def head_loss(spec: HeadSpec, hidden: torch.Tensor, labels: torch.Tensor, treatment: str, n_chunks: int = 1,
              implementation: str = "pure") -> torch.Tensor:
    """The causal-LM loss of ``hidden`` (the body's output) under ``treatment`` (``keep``, the model's
    own loss; ``chunked`` by ``implementation`` at ``n_chunks``): what :func:`probe_head` times."""
    if treatment == "keep":
        return _keep_loss(spec, hidden, labels)
    if implementation == "pure":
        return chunked_causal_lm_loss(spec.logits, hidden, labels, n_chunks)
    if implementation == "pure_grad_in_forward":
        return _grad_in_forward_loss(spec, hidden, labels, n_chunks)
    return _fused_loss(spec, implementation, hidden, labels)


def _keep_loss(spec: HeadSpec, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(spec.logits(hidden), labels, spec.vocab_size)


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
