"""The optimizer state an optimizer will create, known before it exists: the one table of it.

One table (``_RULES``) says, per Hugging Face ``--optim`` name, how an optimizer stores its
state; a torch optimizer class reads the same rows through :data:`TORCH_OPTIMIZERS`
(engine/accounting.py), and ``memfit estimate`` through :func:`state_bytes_of_shapes`
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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = ["expected_state_bytes", "state_bytes_of_shapes", "torch_optimizer_state_bytes", "KNOWN_OPTIMIZERS", "TORCH_OPTIMIZERS"]

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
