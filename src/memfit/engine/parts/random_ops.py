"""Which ops draw random numbers: what ``selective`` never keeps, and what a compiled block's
budgeted graph is checked for (NOTE [Selective policy], selective.py; NOTE [Compiled blocks], blocks.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["draws_random", "runs_random", "dropout_p"]


@functools.cache
def _dropout_index(op: Any) -> int | None:
    """Position of an op's ``dropout_p`` argument (fused attention), or None."""
    names = [a.name for a in op._schema.arguments]
    return names.index("dropout_p") if "dropout_p" in names else None


def dropout_p(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """A call's ``dropout_p`` (0.0 when left to its default), or None for an op without one."""
    at = _dropout_index(op) if hasattr(op, "_schema") else None
    return None if at is None else kwargs.get("dropout_p", args[at] if at < len(args) else 0.0)


def draws_random(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a call of ``op`` draws random numbers: a seeded op (a dropout, ``rand``), an
    attention only with a ``dropout_p`` that may be nonzero."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    p = dropout_p(op, args, kwargs)
    return p is None or not (isinstance(p, (int, float)) and p == 0)


class _RandomDraws(TorchDispatchMode):
    """Notes whether any op run under it draws random numbers (:func:`draws_random`)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.seen = self.seen or draws_random(func, args, kwargs)
        return func(*args, **kwargs)


def runs_random(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Whether ``fn(*args, **kwargs)`` draws random numbers; it runs once, without autograd
    (the caller forks the RNG if the draws must not move it)."""
    mode = _RandomDraws()
    with torch.no_grad(), mode:
        fn(*args, **kwargs)
    return mode.seen

