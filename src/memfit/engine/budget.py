"""Budgets: read "6GiB"/"6GB"/bytes, quote them back as typed, enforce the cap on CUDA, and check the static need.

Units, once: **GiB = 2**30 bytes, GB = 10**9 bytes** (MiB/MB, KiB/kB, TiB/TB likewise). The HF-script
flag ``--memory_threshold 6`` means 6 GB (10**9), as in the original experiment scripts.

On CUDA the budget is a hard cap on the caching allocator through
``torch.cuda.set_per_process_memory_fraction``: an allocation that would take the process
past it raises ``torch.OutOfMemoryError``, exactly as on a smaller GPU. The CUDA context
(about 0.5-1 GB) lives outside the allocator and is not part of the budget.

# NOTE [A budget as typed]
Rule 1. A unit is read only as written in :data:`UNIT_BYTES`, case included: B, kB (or KB), MB,
GB, TB are powers of 10**3; KiB, MiB, GiB, TiB powers of 2**10. "5gb", "5Gb", "5G" or "5gib" is
refused with what it may mean, 5GB and 5GiB (only 5GiB for "5gib"), in bytes: the two readings
differ by 7% (a "b" is a bit elsewhere, a "G" alone is 2**30 to some tools and 10**9 to others),
and a budget read the wrong way is an OOM or a GPU left idle, found late. "5 GB" (a space) reads
as 5GB. A negative budget or one of 0 bytes is refused naming the value as typed.
Rule 2. :class:`Budget` is the one owner of how a budget is said: as typed with its bytes,
"1MB (1000000 bytes)"; and every other size in a message about it in the family of the unit
typed (MB/GB for decimal units, MiB/GiB for binary ones and for a number of bytes), so a user who
typed MB never reads GiB.
Rule 3. A message that says to change the budget names it as the user gave it: ``budget=`` to
``memfit.fit``, ``--memory_budget`` (or ``--memory_threshold``) on the command line and in the
Trainer (:attr:`Budget.name`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from types import MappingProxyType

import torch

from memfit.errors import UserError

__all__ = [
    "Budget",
    "BudgetTooSmallError",
    "parse_bytes",
    "format_bytes",
    "apply_cuda_cap",
    "check_static_need",
    "UNIT_BYTES",
    "OPTIMIZER_TRANSIENT",
]

#: the static part's name for what ``optimizer.step()`` allocates on top of its state
#: (NOTE [Optimizer step transient] in engine/parts/optim_state.py)
OPTIMIZER_TRANSIENT = "optimizer step temporaries"

#: bytes per unit, by the unit as written, case included ("" is a plain number of bytes): the one
#: table of byte units (NOTE [A budget as typed])
UNIT_BYTES = MappingProxyType({
    "": 1,
    "B": 1,
    "kB": 10**3,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
})
_DECIMAL = frozenset({"kB", "KB", "MB", "GB", "TB"})
#: the units sizes are shown in, per family, larger first (:func:`format_bytes`)
_SHOWN = MappingProxyType({"binary": (("GiB", 2**30), ("MiB", 2**20)), "decimal": (("GB", 10**9), ("MB", 10**6))})
_PATTERN = re.compile(r"^\s*(-?)([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")


class BudgetTooSmallError(UserError, ValueError):
    """The budget cannot hold the parts of training that no checkpointing can shrink."""


def _named(argument: str | None, value: object) -> str:
    """How an error names the value it refuses: ``--memory_budget -3GB: `` (a flag, as typed) or
    ``budget='6XB': `` (a Python argument, as its repr); nothing without an argument."""
    if argument is None:
        return ""
    if argument.startswith("-"):
        return f"{argument} {value}: "
    return f"{argument.rstrip('=')}={value!r}: "


def _read(value: int | float | str, argument: str | None) -> tuple[int, str]:
    """``value`` in bytes and the unit it was typed in (NOTE [A budget as typed], rule 1)."""
    named = _named(argument, value)
    if isinstance(value, bool):
        raise ValueError(f"{named}not a memory size: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{named}a memory size cannot be negative: {value!r}")
        return int(value), ""
    match = _PATTERN.match(str(value))
    if not match:
        raise ValueError(f"{named}{_not_a_size(value)}")
    sign, number, unit = match.groups()
    if unit not in UNIT_BYTES:
        raise ValueError(f"{named}{_unread_unit(value, number, unit)}")
    if sign:
        raise ValueError(f"{named}a memory size cannot be negative; write e.g. {number}{unit or 'GB'}")
    return int(float(number) * UNIT_BYTES[unit]), unit


def _unread_unit(value: object, number: str, unit: str) -> str:
    """What to write instead of a unit :data:`UNIT_BYTES` lacks (NOTE [A budget as typed], rule 1)."""
    lower = unit.lower()
    if lower == "b":
        said = f"{number}B or {number} (bytes; a b is a bit)"
    elif lower[:1] in ("k", "m", "g", "t") and lower[1:] in ("", "b", "i", "ib"):
        step = " kmgt".index(lower[0])
        readings = [] if "i" in lower else [(f"{'k' if lower[0] == 'k' else lower[0].upper()}B", 10, 3 * step)]
        readings.append((f"{lower[0].upper()}iB", 2, 10 * step))
        said = " or ".join(f"{number}{name} ({number}*{base}**{power} = {int(float(number) * base**power)} bytes)"
                           for name, base, power in readings)
    else:
        return _not_a_size(value)
    return f"the unit {unit!r} is not one memfit reads (units are read as written, case included): write {said}"


def _not_a_size(value: object) -> str:
    return (f"not a memory size: {value!r}; write e.g. '6GiB' (6*2**30 bytes), '6GB' (6*10**9 bytes), '512MiB' or "
            "a plain number of bytes")


def parse_bytes(value: int | float | str, argument: str | None = None) -> int:
    """Parse a memory size into bytes (NOTE [A budget as typed], rule 1).

    Args:
        value: bytes as an int, or a string with a unit, written as in :data:`UNIT_BYTES`:
            ``"6GiB"`` (6·2**30), ``"6GB"`` (6·10**9), ``"512MiB"``, ``"1.5 GB"``, ``"123456"``.
        argument: what ``value`` was given as, named in an error: a Python argument
            (``"budget"``: ``budget='6XB': ...``) or a flag (``"--memory_budget"``:
            ``--memory_budget 6XB: ...``).

    Returns:
        The size in bytes.

    Raises:
        ValueError: for a negative size, a unit not written as in the table (``"6gb"``: the
            message gives both readings) or text that is not a size.

    Example:
        >>> parse_bytes("6GiB"), parse_bytes("6GB")
        (6442450944, 6000000000)
    """
    return _read(value, argument)[0]


def format_bytes(n: int | float | None, family: str = "binary") -> str:
    """Human-readable size, e.g. ``'5.59 GiB'``; ``family="decimal"`` for GB/MB (``'6.00 GB'``)."""
    if n is None:
        return "-"
    (big, big_bytes), (small, small_bytes) = _SHOWN[family]
    if abs(n) >= big_bytes:
        return f"{n / big_bytes:.2f} {big}"
    if abs(n) >= small_bytes:
        return f"{n / small_bytes:.1f} {small}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Budget:
    """A memory budget, and how the user gave it: the one owner of how a budget is said (NOTE [A budget as typed]).

    Example:
        >>> budget = Budget.parse("1MB", "--memory_budget")
        >>> str(budget), budget.size(17_600_000), budget.name
        ('1MB (1000000 bytes)', '17.6 MB', '--memory_budget')
        >>> str(Budget.parse(6 * 2**30))
        '6442450944 bytes (6.00 GiB)'
    """

    bytes: int
    """The budget in bytes."""
    typed: str | None = None
    """The budget as the user typed it (``"1MB"``, ``"5 GB"``); None when given as a number of bytes."""
    unit: str = ""
    """The unit typed, a key of :data:`UNIT_BYTES` (``"MB"``); ``""`` for a number of bytes."""
    name: str = "budget="
    """What the user gave it as, named by every message that says to change it: ``budget=``
    (``memfit.fit``), ``--memory_budget`` or ``--memory_threshold`` (the command line, the Trainer)."""

    @classmethod
    def parse(cls, value: int | float | str | Budget, name: str = "budget=") -> Budget:
        """Read a budget given as ``name`` (a :class:`Budget` is returned as it is).

        Raises:
            ValueError: a value :func:`parse_bytes` refuses, or 0 bytes; the message starts with
                ``name`` and the value as typed.
        """
        if isinstance(value, Budget):
            return value
        n_bytes, unit = _read(value, name)
        if n_bytes <= 0:
            raise ValueError(f"{_named(name, value)}a budget of 0 bytes holds nothing; give e.g. 6GB")
        return cls(n_bytes, str(value).strip() if unit else None, unit, name)

    @property
    def family(self) -> str:
        """``"decimal"`` (typed in kB/MB/GB/TB) or ``"binary"`` (KiB/MiB/GiB/TiB, or bytes): the units of :meth:`size`."""
        return "decimal" if self.unit in _DECIMAL else "binary"

    def size(self, n_bytes: int | float | None) -> str:
        """A size in a message about this budget, in the family of the unit typed (``'17.6 MB'``)."""
        return format_bytes(n_bytes, self.family)

    @property
    def column_unit(self) -> tuple[str, int]:
        """The unit of a table's column of sizes beside this budget: the unit typed where it is
        one that sizes are shown in (MB, GB, MiB, GiB), else the nearest of its family (GiB for bytes)."""
        big, small = _SHOWN[self.family]
        return small if self.unit and UNIT_BYTES[self.unit] <= small[1] else big

    @property
    def flag_value(self) -> str:
        """The budget as a command line's value: as typed, spaces dropped (``"5GB"`` for ``"5 GB"``), or bytes."""
        return "".join(self.typed.split()) if self.typed is not None else str(self.bytes)

    def __str__(self) -> str:
        if self.typed is not None:
            return f"{self.typed} ({self.bytes} bytes)"
        shown = format_bytes(self.bytes)
        return f"{self.bytes} bytes" if shown.endswith(" B") else f"{self.bytes} bytes ({shown})"


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


def check_static_need(budget: Budget, static_bytes: int, parts: dict[str, int]) -> None:
    """Raise one clear error when weights + gradients + optimizer state (and the optimizer
    step's temporaries, part :data:`OPTIMIZER_TRANSIENT`) exceed the budget.

    Args:
        budget: the budget, as the user gave it (its sizes and name in the message).
        static_bytes: bytes no checkpointing can save (sum of ``parts``).
        parts: name -> bytes, shown in the message.

    Raises:
        BudgetTooSmallError: stating the bytes needed and what to change; when only the
            optimizer step's temporaries do not fit, naming them and how to drop them.
    """
    if static_bytes < budget.bytes:
        return
    size = budget.size
    detail = ", ".join(f"{k} {size(v)}" for k, v in parts.items())
    transient = parts.get(OPTIMIZER_TRANSIENT, 0)
    if transient and static_bytes - transient < budget.bytes:
        raise BudgetTooSmallError(
            f"memory budget {budget} is below the optimizer step's peak: {size(static_bytes)} ({static_bytes} bytes: "
            f"{detail}); its temporaries ({size(transient)}, torch's foreach or for-loop step, the smaller memfit "
            f"could run) do not fit. Make the optimizer with fused=True (--optim adamw_torch_fused: no temporaries), "
            f"or raise {budget.name} above {size(static_bytes)}."
        )
    raise BudgetTooSmallError(
        f"memory budget {budget} is below what training needs before any activation: {size(static_bytes)} "
        f"({static_bytes} bytes: {detail}). Raise {budget.name} above that, or shrink the static part: bf16/fp16 "
        "weights, Adafactor or an 8-bit optimizer (see `memfit estimate`)."
    )


#: where the user's settings of torch's allocators are read (the first is the one memfit adds to)
ALLOC_CONF_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def add_allocator_settings(extra: str, unless: tuple[str, ...]) -> bool:
    """Add ``extra`` to torch's allocator settings at run time, unless they name any of ``unless``; whether it did.

    NOTE [The allocator's settings at run time]
    torch parses a settings string anew each time one is set, and the options it does not name go back to their
    defaults (the split size, the power-of-two rounding, the collection threshold): setting ``extra`` alone would
    undo the user's. And torch 2.11 has no reader of the settings as they stand. So memfit gives the settings the
    environment holds with ``extra`` after them, and writes ``extra`` into ``PYTORCH_CUDA_ALLOC_CONF``, which is what
    the next addition reads (and what the processes the run starts inherit). Its two additions:
    expandable segments under a cap (NOTE [Expandable segments under a cap], run/meter.py) and pinning on threads (NOTE [Pinning on
    threads], treatments/offload.py).
    """
    settings = ",".join(filter(None, (os.environ.get(name, "").strip(" ,") for name in ALLOC_CONF_NAMES)))
    if any(key in settings for key in unless):  # the user's choice, or an allocator without the option
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before the accelerator-wide settings
        setter = getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None)
    if setter is None:
        return False
    try:
        setter(",".join(filter(None, (settings, extra))))
    except RuntimeError:  # a platform without the option
        return False
    os.environ[ALLOC_CONF_NAMES[0]] = ",".join(filter(None, (os.environ.get(ALLOC_CONF_NAMES[0], "").strip(" ,"), extra)))
    return True
