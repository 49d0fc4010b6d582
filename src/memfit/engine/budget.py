"""Budgets: parse "6GiB"/"6GB"/bytes, enforce the cap on CUDA, and check the static need.

Units, once: **GiB = 2**30 bytes, GB = 10**9 bytes** (MiB/MB, KiB/KB likewise). The HF-script
flag ``--memory_threshold 6`` means 6 GB (10**9), as in the original experiment scripts.

On CUDA the budget is a hard cap on the caching allocator through
``torch.cuda.set_per_process_memory_fraction``: an allocation that would take the process
past it raises ``torch.OutOfMemoryError``, exactly as on a smaller GPU. The CUDA context
(about 0.5-1 GB) lives outside the allocator and is not part of the budget.
"""

from __future__ import annotations

import re
from types import MappingProxyType

import torch

from memfit.errors import UserError

__all__ = [
    "BudgetTooSmallError",
    "parse_bytes",
    "format_bytes",
    "apply_cuda_cap",
    "check_static_need",
    "UNIT_BYTES",
    "OPTIMIZER_TRANSIENT",
]

#: the static part's name for what ``optimizer.step()`` allocates on top of its state
#: (NOTE [Optimizer step transient] in engine/optim_state.py)
OPTIMIZER_TRANSIENT = "optimizer step temporaries"

#: bytes per unit, by the unit's lowercase name (the one table of byte units)
UNIT_BYTES = MappingProxyType({
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
})
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")


class BudgetTooSmallError(UserError, ValueError):
    """The budget cannot hold the parts of training that no checkpointing can shrink."""


def parse_bytes(value: int | float | str, argument: str | None = None) -> int:
    """Parse a memory size into bytes.

    Args:
        value: bytes as an int, or a string with a unit: ``"6GiB"`` (6·2**30), ``"6GB"``
            (6·10**9), ``"512MiB"``, ``"1.5 GB"``, ``"123456"``.
        argument: the Python argument ``value`` was given as (``"budget"``): an error then
            names it (``budget='6XB': ...``); the CLI names its flag itself.

    Returns:
        The size in bytes.

    Raises:
        ValueError: for a negative size, an unknown unit or text that is not a size.

    Example:
        >>> parse_bytes("6GiB"), parse_bytes("6GB")
        (6442450944, 6000000000)
    """
    named = "" if argument is None else f"{argument}={value!r}: "
    if isinstance(value, bool):
        raise ValueError(f"{named}not a memory size: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{named}a memory size cannot be negative: {value!r}")
        return int(value)
    match = _PATTERN.match(str(value))
    if not match or match.group(2).lower() not in UNIT_BYTES:
        raise ValueError(
            f"{named}not a memory size: {value!r}; write e.g. '6GiB' (6*2**30 bytes), '6GB' "
            "(6*10**9 bytes), '512MiB' or a plain number of bytes"
        )
    return int(float(match.group(1)) * UNIT_BYTES[match.group(2).lower()])


def format_bytes(n: int | float | None) -> str:
    """Human-readable size in GiB/MiB (binary units), e.g. ``'5.59 GiB'``."""
    if n is None:
        return "-"
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{int(n)} B"


def apply_cuda_cap(budget_bytes: int, device: torch.device) -> float:
    """Cap the caching allocator of ``device`` at ``budget_bytes``.

    A budget larger than the device caps nothing (fraction 1.0); that is not an error.

    Returns:
        The fraction of the device's total memory that was set.

    Raises:
        BudgetTooSmallError: for a budget of 0.
    """
    total = torch.cuda.get_device_properties(device).total_memory
    if budget_bytes <= 0:
        raise BudgetTooSmallError("the memory budget must be positive")
    fraction = min(1.0, budget_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def check_static_need(budget_bytes: int, static_bytes: int, parts: dict[str, int]) -> None:
    """Raise one clear error when weights + gradients + optimizer state (and the optimizer
    step's temporaries, part :data:`OPTIMIZER_TRANSIENT`) exceed the budget.

    Args:
        budget_bytes: the budget.
        static_bytes: bytes no checkpointing can save (sum of ``parts``).
        parts: name -> bytes, shown in the message.

    Raises:
        BudgetTooSmallError: stating the bytes needed and what to change; when only the
            optimizer step's temporaries do not fit, naming them and how to drop them.
    """
    if static_bytes < budget_bytes:
        return
    detail = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items())
    transient = parts.get(OPTIMIZER_TRANSIENT, 0)
    if transient and static_bytes - transient < budget_bytes:
        raise BudgetTooSmallError(
            f"memory budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the optimizer step's peak: "
            f"{format_bytes(static_bytes)} ({static_bytes} bytes: {detail}); its temporaries "
            f"({format_bytes(transient)}, torch's foreach or for-loop step) do not fit. Make the optimizer with "
            "fused=True (--optim adamw_torch_fused) or foreach=False, or raise --memory_budget above "
            f"{format_bytes(static_bytes)}."
        )
    raise BudgetTooSmallError(
        f"memory budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below what "
        f"training needs before any activation: {format_bytes(static_bytes)} "
        f"({static_bytes} bytes: {detail}). Raise --memory_budget above that, or shrink the "
        "static part: bf16/fp16 weights, Adafactor or an 8-bit optimizer (see `memfit estimate`)."
    )
