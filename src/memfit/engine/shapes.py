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

__all__ = ["shape_key", "bucket_key", "first_tensor", "input_key", "KeyCheck"]


def shape_key(shape: Sequence[int], channels_first: bool = False) -> tuple[int, int]:
    """``(N, T)`` from the shape of the first block's input.

    ``(N, T, C)`` → ``(N, T)``; ``(N, C, H, W)`` → ``(N, H·W)``; ``(N, C)`` → ``(N, 1)``; with ``channels_first``
    (a block whose first layer is a convolution: NOTE [What the key cannot see]) ``(N, C, L)`` → ``(N, L)``.

    Example:
        >>> shape_key([8, 128, 768]), shape_key([2, 3, 64, 64]), shape_key([4, 1, 16000], channels_first=True)
        ((8, 128), (2, 4096), (4, 16000))
    """
    if len(shape) == 0:
        return (1, 1)
    if len(shape) <= 2:
        return (int(shape[0]), 1)
    if len(shape) == 3 and not channels_first:
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


def input_key(args: tuple, kwargs: dict, channels_first: bool = False) -> tuple[int, int] | None:
    """A block's own ``(N, T)``: :func:`shape_key` of its first floating-point input (None without one)."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point() else first_tensor(args, kwargs)
    return shape_key(x.shape, channels_first) if x is not None else None


class KeyCheck:
    """Whether the step's key carries every block's shape (NOTE [What the key cannot see]).

    # NOTE [What the key cannot see]
    A step's plan follows its key, the first block's ``(N, T)``, and the memory model predicts every block from
    it. That holds where each block's own shape follows the first block's (a decoder's layers, a vision stack
    whose stages shrink the patches by fixed factors). It does not where a block's length varies apart from it:
    an encoder-decoder's decoder layers under a fixed source length (T5, Whisper's 3,000 frames). There the
    predictions miss: over the budget, or replays on a GPU. So each step's blocks' own keys are kept per step key
    (the first ``MAX_KEYS`` keys' worth: bounded), and the first block seen with two shapes under one step key is
    said once, with what to change. An audio model whose first block is a convolution over raw samples,
    ``(N, 1, samples)``, read ``(N, 1)`` as a sequence's rows and length would hide every length: a block whose
    first layer with parameters is a convolution reads its input channels first (``Block.channels_first``), as
    an image's ``(N, C, H, W)`` is read, and its key is ``(N, samples)``, which its encoder's frames follow.
    """

    #: step keys whose blocks' shapes are kept
    MAX_KEYS = 256

    def __init__(self) -> None:
        self._seen: dict[tuple[tuple[int, int], int], tuple[int, int]] = {}
        self._keys: set[tuple[int, int]] = set()
        self.said = False

    def note(self, key: tuple[int, int], block_keys: dict[int, tuple[int, int]]) -> str | None:
        """The step ``key``'s blocks' own keys: the words to say, the first time a block's differ under one key."""
        if self.said or not block_keys:
            return None
        if key not in self._keys:
            if len(self._keys) >= self.MAX_KEYS:
                return None
            self._keys.add(key)
        for index, own in block_keys.items():
            first = self._seen.setdefault((key, index), own)
            if first != own:
                self.said = True
                return (f"memfit: the plans follow the first block's input, rows and length {key}, but block {index} "
                        f"(of the blocks memfit found, from 0) ran with {first} and with {own} under it: its memory varies with a "
                        "length the first block does not carry (an encoder-decoder's decoder length under a fixed source "
                        "length), and the predictions will miss (over the budget, or replays on a GPU). Pad that input to "
                        "one length, pass blocks= a pattern whose first block carries every length, or use method='full' "
                        "(--memfit_method full)")
        return None
