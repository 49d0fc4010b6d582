"""The optimizer state an optimizer will create, known before it exists: the one table of it.

One table (``_RULES``) says, per Hugging Face ``--optim`` name, how an optimizer stores its
state; a torch optimizer class reads the same rows through :data:`TORCH_OPTIMIZERS`
(engine/parts/accounting.py), and ``memfit estimate`` through :func:`state_bytes_of_shapes`
(tools/estimate/anatomy.py).

The memfit Trainer checks weights + gradients + this state against the budget before training
starts, so that a budget too small fails once with the whole need stated, not a second time
when the optimizer is made (NOTE [Expected optimizer state]).

# NOTE [Expected optimizer state]
Each ``--optim`` name maps to how many state tensors it keeps per trainable parameter and how
they are stored; the bytes follow from the parameters alone:

* ``param``: full tensors in the parameter's dtype (torch's AdamW, SGD momentum, Adagrad,
  RMSprop: ``zeros_like(param)``).
* ``fp32``: full tensors in float32 whatever the parameter's dtype (bitsandbytes' 32-bit
  optimizers, AnyPrecisionAdamW with its default float32 moments).
* ``int8`` / ``int4``: block-wise quantised (bitsandbytes, torchao): one byte (half a byte) per
  element plus a float32 scale per block of 256 (128) elements; tensors under 4096 elements
  stay float32, as both libraries do.
* ``factored``: Adafactor's second moment: a row and a column vector for a matrix (the
  leading dimensions reduced apart), a full tensor for a vector, in float32 (HF's Adafactor
  upcasts half-precision gradients before making its state); no first moment (HF's
  ``adafactor`` runs with ``beta1=None``).

Optimizers whose state depends on more than the parameters (GaLore and APOLLO project
gradients to a rank chosen per module) are not predicted: the runtime measures their state
after the first step, as for any optimizer it does not know.

# NOTE [Optimizer step transient]
``optimizer.step()`` allocates temporaries on top of the state, while parameters, gradients
and state are alive and the activations are gone; when activations are small (a large model at
a small batch) that moment is the step's peak, and a cap that holds weights + gradients + state
but not these temporaries fails in the first ``step()``, outside any step memfit can replay.
What torch's Adam, AdamW and SGD allocate (torch/optim/adam.py, sgd.py), by implementation:

* fused (``fused=True``, ``--optim adamw_torch_fused``): nothing (one kernel updates in place).
* foreach (torch's default when every parameter is on an accelerator, FSDP2's DTensor shards
  included): per device/dtype group of a parameter group, Adam makes ``_foreach_sqrt`` of the
  second moments (and, with Adam's coupled weight decay or ``maximize``, a gradient copy freed
  before it), SGD a gradient copy with weight decay or ``maximize``: one copy of the group's
  parameters. A group's list is only dropped when the next group's is made, so the transient is
  the two largest consecutive groups (one group: its size; SGD with momentum but not Nesterov
  drops its copy within the group). Parameter groups run one at a time.
* for-loop (``foreach=False``; the default on CPU): per parameter, Adam's ``sqrt`` and its
  quotient beside the previous parameter's quotient, and SGD's gradient copies: bounded here by
  three (SGD: two) copies of the largest parameter, one more with a gradient copy.

Which implementation runs is torch's own choice (``_default_to_fused_or_foreach``), asked with
the optimizer's parameters. Other classes: not predicted (None), counted as 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = [
    "expected_state_bytes", "state_bytes_of_shapes", "torch_optimizer_state_bytes", "torch_step_transient_bytes",
    "expected_step_transient_bytes", "KNOWN_OPTIMIZERS", "TORCH_OPTIMIZERS",
]

_QUANTISED_MIN_NUMEL = 4096


@dataclass(frozen=True)
class _Rule:
    """How one ``--optim`` stores its state (NOTE [Expected optimizer state])."""

    states: int
    """State tensors per parameter."""
    storage: str
    """``param``, ``fp32``, ``int8``, ``int4`` or ``factored``."""


_ADAM = _Rule(2, "param")
_RULES: dict[str, _Rule] = {
    "adamw_torch": _ADAM,
    "adamw_torch_fused": _ADAM,
    "adamw_torch_xla": _ADAM,
    "adamw_torch_npu_fused": _ADAM,
    "stable_adamw": _ADAM,
    "schedule_free_adamw": _ADAM,  # z and the second moment
    "schedule_free_radam": _ADAM,
    "schedule_free_sgd": _Rule(1, "param"),  # z
    "grokadamw": _Rule(3, "param"),  # both moments and the gradient EMA
    "adamw_anyprecision": _Rule(2, "fp32"),
    "sgd": _Rule(0, "param"),  # + momentum, from --optim_args
    "adagrad": _Rule(1, "param"),
    "rmsprop": _Rule(1, "param"),  # + momentum and centered, from --optim_args
    "adafactor": _Rule(1, "factored"),
    "adalomo": _Rule(1, "factored"),
    "lomo": _Rule(0, "param"),
    "paged_adamw_32bit": _Rule(2, "fp32"),
    "lion_32bit": _Rule(1, "fp32"),
    "paged_lion_32bit": _Rule(1, "fp32"),
    "ademamix": _Rule(3, "fp32"),
    "paged_ademamix_32bit": _Rule(3, "fp32"),
    "rmsprop_bnb": _Rule(1, "fp32"),
    "rmsprop_bnb_32bit": _Rule(1, "fp32"),
    "adamw_bnb_8bit": _Rule(2, "int8"),
    "adamw_8bit": _Rule(2, "int8"),
    "paged_adamw_8bit": _Rule(2, "int8"),
    "adamw_torch_8bit": _Rule(2, "int8"),
    "lion_8bit": _Rule(1, "int8"),
    "paged_lion_8bit": _Rule(1, "int8"),
    "ademamix_8bit": _Rule(3, "int8"),
    "paged_ademamix_8bit": _Rule(3, "int8"),
    "rmsprop_bnb_8bit": _Rule(1, "int8"),
    "adamw_torch_4bit": _Rule(2, "int4"),
}
#: ``--optim`` names whose state :func:`expected_state_bytes` predicts.
KNOWN_OPTIMIZERS = frozenset(_RULES)
#: torch optimizer classes, by name, and the row of ``_RULES`` they store their state as
TORCH_OPTIMIZERS = MappingProxyType({
    "Adam": "adamw_torch", "AdamW": "adamw_torch", "NAdam": "adamw_torch", "RAdam": "adamw_torch",
    "Adamax": "adamw_torch", "SGD": "sgd", "RMSprop": "rmsprop", "Adagrad": "adagrad",
})
#: rows whose optimizer takes ``amsgrad`` (a third state, the largest second moment)
_AMSGRAD = frozenset({"adamw_torch", "adamw_torch_fused"})


def _optim_args(text: str | None) -> dict[str, str]:
    """``"momentum=0.9,centered=True"`` → dict, as the Trainer parses ``--optim_args``."""
    pairs = (item.split("=", 1) for item in (text or "").replace(" ", "").split(",") if "=" in item)
    return {key: value for key, value in pairs}


def _extra_states(optim: str, args: dict[str, str]) -> int:
    def on(name: str) -> bool:
        value = args.get(name, "0").lower()
        return value in ("true", "1") or (value.replace(".", "", 1).isdigit() and float(value) > 0)

    if optim == "sgd":
        return int(on("momentum"))
    if optim == "rmsprop":
        return int(on("momentum")) + int(on("centered"))
    if optim in _AMSGRAD:
        return int(on("amsgrad"))
    return 0


def _tensor_state_bytes(shape: Sequence[int], itemsize: int, rule: _Rule, states: int) -> int:
    n = math.prod(shape)
    if rule.storage == "param":
        return states * n * itemsize
    if rule.storage == "fp32" or (rule.storage in ("int8", "int4") and n < _QUANTISED_MIN_NUMEL):
        return states * n * 4
    if rule.storage == "int8":
        return states * (n + 4 * math.ceil(n / 256))
    if rule.storage == "int4":
        return states * (math.ceil(n / 2) + 4 * math.ceil(n / 128))
    # factored: float32 row and column second moments of the last two dimensions
    if len(shape) >= 2:
        rows, cols = n // shape[-1], n // shape[-2]
        return states * (rows + cols) * 4
    return states * n * 4


def expected_state_bytes(optim: str, params: Iterable[torch.Tensor], optim_args: str | None = None) -> int | None:
    """Bytes of optimizer state that ``--optim optim`` will keep for ``params``.

    Args:
        optim: a ``TrainingArguments.optim`` name (``"adamw_torch"``, ``"adafactor"``, ...).
        params: the trainable parameters (this rank's shards when they are sharded).
        optim_args: ``TrainingArguments.optim_args`` (``"momentum=0.9"`` adds SGD's momentum buffer).

    Returns:
        The bytes, or ``None`` for an optimizer whose state cannot be known before it exists
        (NOTE [Expected optimizer state]).

    Example:
        >>> expected_state_bytes("adamw_torch", [torch.zeros(1000)])
        8000
    """
    return _state_bytes(optim, ((tuple(p.shape), p.element_size()) for p in params), _optim_args(optim_args))


def state_bytes_of_shapes(
    optim: str, shapes: Iterable[Sequence[int]], itemsize: int = 4, optim_args: str | None = None,
) -> int | None:
    """:func:`expected_state_bytes` for parameters known by their shapes, of ``itemsize`` bytes
    per element (what ``memfit estimate`` has before any model exists).

    Example:
        >>> state_bytes_of_shapes("adamw_torch", [(10, 100)])
        8000
    """
    return _state_bytes(optim, ((tuple(s), itemsize) for s in shapes), _optim_args(optim_args))


def torch_optimizer_state_bytes(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> int | None:
    """The state a torch ``optimizer`` will hold for ``params`` after its first step, from its
    class and its parameter groups' options (``momentum``, ``centered``, ``amsgrad``); None
    for a class not in :data:`TORCH_OPTIMIZERS`."""
    name = TORCH_OPTIMIZERS.get(type(optimizer).__name__)
    if name is None:
        return None
    options = {
        key: str(any(bool(g.get(key)) for g in optimizer.param_groups)) for key in ("momentum", "centered", "amsgrad")
    }
    return _state_bytes(name, ((tuple(p.shape), p.element_size()) for p in params), options)


def _state_bytes(optim: str, shapes: Iterable[tuple[tuple[int, ...], int]], args: dict[str, str]) -> int | None:
    name = str(getattr(optim, "value", optim))
    rule = _RULES.get(name)
    if rule is None:
        return None
    states = rule.states + _extra_states(name, args)
    return sum(_tensor_state_bytes(shape, itemsize, rule, states) for shape, itemsize in shapes)


#: torch optimizer classes whose step temporaries are predicted (NOTE [Optimizer step transient])
_TRANSIENT_CLASSES = frozenset({"Adam", "AdamW", "SGD"})
#: ``--optim`` names the Trainer makes as torch's AdamW, and whether it is the fused one
_HF_ADAMW = MappingProxyType({"adamw_torch": False, "adamw_torch_fused": True})


def _implementation(params: Sequence[torch.Tensor], group: dict) -> str:
    """``fused``, ``foreach`` or ``for-loop``: what torch's step runs for one parameter group."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    if group.get("fused"):
        return "fused"
    if group.get("foreach") is None and not group.get("differentiable"):
        _, foreach = _default_to_fused_or_foreach(list(params), False, use_fused=False)
        return "foreach" if foreach else "for-loop"
    return "foreach" if group.get("foreach") else "for-loop"


def _group_transient_bytes(kind: str, params: Sequence[torch.Tensor], local: Callable, group: dict) -> int:
    """The step temporaries of one parameter group (NOTE [Optimizer step transient])."""
    shards = [local(p) for p in params]
    if kind == "fused" or not shards:
        return 0
    copies_grad = bool(group.get("maximize")) or (bool(group.get("weight_decay")) and not group.get("decoupled_weight_decay"))
    if kind == "SGD" and not copies_grad:
        return 0
    if group["_impl"] == "foreach":
        sizes: dict[tuple, int] = {}  # torch's grouping, in first-seen order
        for t in shards:
            key = (t.device, t.dtype)
            sizes[key] = sizes.get(key, 0) + t.numel() * t.element_size()
        ordered = list(sizes.values())
        if kind == "SGD" and group.get("momentum") and not group.get("nesterov"):
            return max(ordered)  # the copy is dropped for the momentum buffers within its group
        return max([ordered[0], *(a + b for a, b in zip(ordered, ordered[1:]))])
    largest = max(t.numel() * t.element_size() for t in shards)
    return ((2 if kind == "SGD" else 3) + int(copies_grad)) * largest


def torch_step_transient_bytes(
    optimizer: torch.optim.Optimizer | None, local: Callable[[torch.Tensor], torch.Tensor] | None = None,
    per_tensor: bool = False,
) -> int | None:
    """Bytes ``optimizer.step()`` allocates on top of its state (NOTE [Optimizer step transient]).

    Args:
        optimizer: a torch optimizer (its trainable parameters: those that require grad).
        local: the tensor a rank holds of a parameter (a DTensor's local shard under FSDP2).
        per_tensor: as if the groups that are not fused ran torch's for-loop step (parts/optimizer_step.py).

    Returns:
        The largest parameter group's temporaries; 0 for no optimizer; None for a class whose
        temporaries are not predicted.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(1000))
        >>> torch_step_transient_bytes(torch.optim.AdamW([w], foreach=True)), torch_step_transient_bytes(torch.optim.AdamW([w], fused=True))
        (4000, 0)
    """
    if optimizer is None:
        return 0
    local = local or _local
    kind = type(optimizer).__name__
    if kind not in _TRANSIENT_CLASSES:
        return None
    kind = "SGD" if kind == "SGD" else "Adam"
    decoupled = type(optimizer).__name__ == "AdamW"
    out = 0
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.requires_grad]
        if not params:
            continue
        impl = _implementation(params, group)
        options = {"decoupled_weight_decay": decoupled, **group, "_impl": "for-loop" if per_tensor and impl != "fused" else impl}
        out = max(out, _group_transient_bytes("fused" if options["_impl"] == "fused" else kind, params, local, options))
    return out


def expected_step_transient_bytes(
    optim: str, params: Iterable[torch.Tensor], weight_decay: float = 0.0, foreach: bool | None = None,
) -> int | None:
    """:func:`torch_step_transient_bytes` of the optimizer ``--optim optim`` will make, before it
    exists: torch's AdamW for ``adamw_torch`` (foreach or for-loop as torch chooses) and
    ``adamw_torch_fused``; None for other names (not predicted). ``foreach``: the group's option
    (None: torch's choice; False: the per-tensor step, parts/optimizer_step.py).

    Example:
        >>> expected_step_transient_bytes("adamw_torch_fused", [torch.zeros(10, requires_grad=True)])
        0
    """
    fused = _HF_ADAMW.get(str(getattr(optim, "value", optim)))
    if fused is None:
        return None
    params = [p for p in params if p.requires_grad]
    group = {"fused": fused, "foreach": foreach, "weight_decay": weight_decay, "decoupled_weight_decay": True}
    group["_impl"] = _implementation(params, group)
    return _group_transient_bytes("fused" if group["_impl"] == "fused" else "Adam", params, _local, group)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, else ``t`` (engine/parts/accounting.py's ``local``, which imports this module)."""
    return t.to_local() if hasattr(t, "to_local") else t
