"""Shape keys: what a step's plan depends on.

The *shape key* of a step is ``(N, T)``: batch rows and tokens per row at the first block
(sequence length for text, patches for vision), read from the first floating-point tensor
the first block receives, so it works for any model input (token ids, pixels, kwargs).
Plans are shared by the shapes of a *bucket*: tokens rounded up to a multiple of
``bucket_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["shape_key", "bucket_key", "first_tensor"]


def shape_key(shape: Sequence[int]) -> tuple[int, int]:
    """``(N, T)`` from the shape of the first block's input.

    ``(N, T, C)`` → ``(N, T)``; ``(N, C, H, W)`` → ``(N, H·W)``; ``(N, C)`` → ``(N, 1)``.

    Example:
        >>> shape_key([8, 128, 768]), shape_key([2, 3, 64, 64])
        ((8, 128), (2, 4096))
    """
    if len(shape) == 0:
        return (1, 1)
    if len(shape) <= 2:
        return (int(shape[0]), 1)
    if len(shape) == 3:
        return (int(shape[0]), int(shape[1]))
    return (int(shape[0]), int(math.prod(shape[2:])))


def bucket_key(key: tuple[int, int], bucket_tokens: int = 8) -> tuple[int, int]:
    """Round tokens *up* to a multiple of ``bucket_tokens`` (1: exact keys).

    Shapes of a bucket share its plan, made for the longest of them seen so far (NOTE [Plan
    for the longest shape seen] in planning.py).

    Example:
        >>> bucket_key((4, 41), 8)
        (4, 48)
    """
    n, t = key
    return (n, -(-t // bucket_tokens) * bucket_tokens)


def first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The first floating-point tensor among a block's arguments (its hidden states), or None."""
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t
    return None
