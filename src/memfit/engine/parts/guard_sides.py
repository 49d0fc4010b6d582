"""The sides of the compiler's size guards, compiled in warm-up rather than in steady steps.

# NOTE [Guard sides in warm-up]
Marking batch and length dynamic (NOTE [Dynamic batch and length], blocks.py) leaves the guards
the compiler itself takes on a size to choose its code: a length aligned to 8 or not (inductor's
attention lowering, its graph caches), batch x length above or below a threshold (its scheduler's
fusion rule on CUDA, its C++ code's row chunking on a CPU). Each side compiles a graph at the
first call that lands on it, seconds on a GPU, and with the long-tailed lengths of chat data
that call comes dozens of steps after warm-up. So in each warm-up step (the first step where a
method has none) a compiled callable (a block's body under each compilation, the model's loss)
is also run on its inputs cut to shorter lengths: for the call's length and each halving of it
down to ``1 / 2**HALVINGS`` of it, the largest multiple of ``ALIGN`` not above it and one less.
Every side whose token count lies between the shortest cut and warm-up's longest step is then
compiled in warm-up; a cut that meets no new side reruns a cached graph (milliseconds).

Rule 1. Once a step per compiled code (alike blocks share it), compilation and input signature
(which inputs ask for grad, grad mode), and again after any call that compiled a graph (a block
whose graphs differ from the others' of its class).
Rule 2. After the real call, shorter lengths only, one at a time, each freed before the next:
at most one block's forward and backward more, as the backward's recompute of a block. A step
longer than warm-up's crosses a threshold above them at its first call.
Rule 3. The cut dimensions are those marking marks for the length (every dimension of the size of
the first tensor's next-to-last), and a cut tensor is laid out as the model lays one of that length
out (the compiler guards on strides and views too): a dense one densely in its order of
dimensions, a broadcast one broadcast, a view as the same view. A cut length equal to another
size of the inputs (a head dimension) would mark that one too: it moves down by ``ALIGN``.
Rule 4. A cut runs under its own saved-tensor hooks (the step's counter sees nothing), with the
RNG forked (the real call's dropout masks unchanged), and returns gradients to its own inputs only
(nothing accumulates in a parameter). A cut that fails (inputs that cannot be cut this way) or
runs out of memory ends the sweeps of that code; memfit says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

logger = logging.getLogger(__name__)

__all__ = ["GuardSides", "cut_lengths", "input_tensors", "graphs_made", "ALIGN", "HALVINGS"]

#: the alignment of a length inductor's kernels ask (NOTE [Guard sides in warm-up])
ALIGN = 8
#: halvings of a warm-up call's token count whose sides are compiled
HALVINGS = 6


def cut_lengths(length: int, taken: set[int] = frozenset()) -> list[int]:
    """The shorter lengths a call of ``length`` is also run at in warm-up, longest first (NOTE
    [Guard sides in warm-up]), none of them in ``taken`` (the inputs' other sizes).

    Example:
        >>> cut_lengths(100)
        [96, 95, 48, 47, 24, 23, 8, 7]
        >>> cut_lengths(64, taken={16})
        [63, 32, 31, 8, 7]
    """
    out: list[int] = []
    m = length
    while m >= max(ALIGN, length >> HALVINGS):
        aligned = m - m % ALIGN
        while aligned != length and aligned in taken and aligned - ALIGN >= ALIGN:
            aligned -= ALIGN
        for cut in (aligned, aligned - 1):
            if 2 <= cut < length and cut not in taken and cut not in out:
                out.append(cut)
        m //= 2
    return out


def _dense_strides(t: torch.Tensor, shape: list[int]) -> list[int]:
    """Strides of a dense tensor of ``shape`` whose dimensions lie in ``t``'s order (outermost
    first), with ``t``'s broadcast (stride 0) dimensions kept broadcast."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    strides, step = [0] * t.dim(), 1
    for d in reversed(order):
        if t.stride(d) != 0:
            strides[d], step = step, step * shape[d]
    return strides


def _free_of_size_one(t: torch.Tensor, strides: list[int]) -> list[int]:
    """``strides`` of ``t``'s dimensions longer than 1 (a size-1 dimension's stride is free)."""
    return [st for size, st in zip(t.shape, strides) if size > 1]


def _cut(value: Any, length: int, new: int) -> Any:
    """``value`` with every dimension of size ``length`` cut to ``new``, laid out as the caller's
    code would lay out a tensor of that length (Rule 3): a dense tensor densely, in its order of
    dimensions (the compiler guards on strides too); a view of a larger buffer as the same view."""
    if not isinstance(value, torch.Tensor):
        return value
    t = value.detach()
    cut = t
    for dim, size in enumerate(t.shape):
        if size == length:
            cut = cut.narrow(dim, 0, new)
    if cut is t:
        return t.requires_grad_(value.requires_grad)  # cut from the step's graph all the same
    dense_now = _dense_strides(t, list(t.shape))
    if _free_of_size_one(t, dense_now) == _free_of_size_one(t, list(t.stride())):
        # a size-1 dimension keeps a stride that is not the dense one (the compiler guards on it too)
        strides = [new_st if now == st else st
                   for new_st, now, st in zip(_dense_strides(t, list(cut.shape)), dense_now, t.stride())]
        dense = torch.empty_strided([1 if st == 0 else s for s, st in zip(cut.shape, strides)], strides,
                                    dtype=t.dtype, device=t.device)
        dense.copy_(cut[tuple(slice(0, 1) if st == 0 else slice(None) for st in strides)])
        cut = dense.expand(cut.shape) if 0 in strides else dense  # a view only where the input is one
    return cut.requires_grad_(value.requires_grad)


def input_tensors(args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """A compiled callable's input tensors in call order, those in a tuple or list argument
    included (a rotary table's ``(cos, sin)``): what marking and cutting read."""
    out: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _signature(args: tuple, kwargs: dict[str, Any]) -> tuple:
    return (torch.is_grad_enabled(), *(t.requires_grad for t in input_tensors(args, kwargs)))


def graphs_made() -> int:
    """Graphs Dynamo has made in this process (only grows; blocks.compile_clock reports it too)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class GuardSides:
    """The run's sweep of guard sides (NOTE [Guard sides in warm-up]): open during a warm-up
    step's forward (:meth:`open`, :meth:`close`); each compiled callable is called through
    :meth:`call`."""

    def __init__(self) -> None:
        self.active = False
        self._swept: set[tuple] = set()
        self._failed: set[Any] = set()
        #: cut calls run (a proxy of the sweep's cost)
        self.cut_calls = 0

    def open(self) -> None:
        self.active = True
        self._swept.clear()

    def close(self) -> None:
        self.active = False

    def call(self, compiled: Callable[..., Any], code: Any, mark: Callable[[tuple, dict], None], args: tuple,
             kwargs: dict[str, Any]) -> Any:
        """``compiled(*args, **kwargs)``, its inputs marked by ``mark``; in a warm-up step, then run
        at the cut lengths if no call of ``code`` (what is compiled, and how) with this input
        signature has been cut in the step, or if this call compiled a graph (a block whose
        graphs differ from the others' of its class)."""
        mark(args, kwargs)
        if not self.active or code in self._failed:
            return compiled(*args, **kwargs)
        graphs = graphs_made()
        out = compiled(*args, **kwargs)
        key = (code, _signature(args, kwargs))
        if key not in self._swept or graphs_made() > graphs:
            self._swept.add(key)
            self._sweep(compiled, code, mark, args, kwargs)
        return out

    def _sweep(self, compiled: Callable[..., Any], code: Any, mark: Callable[[tuple, dict], None], args: tuple,
               kwargs: dict[str, Any]) -> None:
        tensors = input_tensors(args, kwargs)
        if not tensors or tensors[0].dim() != 3:
            return
        batch, length, _ = tensors[0].shape
        if batch == length:  # which dimensions are the length's is not known
            return
        taken = {s for t in tensors for s in t.shape if s != length} | {batch}
        devices = [d for d in {t.device for t in tensors} if d.type == "cuda"]
        for new in cut_lengths(length, taken):
            try:
                with torch.random.fork_rng(devices=devices):
                    self._run(compiled, mark, *tree_map(lambda v: _cut(v, length, new), (args, kwargs)))
            except Exception as err:  # the sweep only saves compile time later: never a reason to stop
                self._failed.add(code)
                logger.debug("memfit: compiled blocks: could not run a compiled call at %d of its %d tokens a row in "
                             "warm-up (%s: %s); a step on another side of its size guards may compile later",
                             new, length, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
                return

    def _run(self, compiled: Callable[..., Any], mark: Callable[[tuple, dict], None], args: tuple, kwargs: dict[str, Any]) -> None:
        self.cut_calls += 1
        mark(args, kwargs)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
            out = compiled(*args, **kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        wrt = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)
