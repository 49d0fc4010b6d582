"""What a block's forward changes besides its output: buffers it updates in place (BatchNorm's running statistics),
which a re-run and a probe must leave as the step's one forward left them.

# NOTE [Running statistics]
A module in training mode may update its buffers as it runs: BatchNorm's running mean, variance and count (every
``_NormBase`` that tracks them), or a buffer a module changes in place. Trained without memfit each is updated once a
forward. A re-run (the recomputation of ``recompute``, the host checkpoints and ``selective``: every
``torch.utils.checkpoint`` memfit makes) and warm-up's probes (the block run several times beside the step) would
update them again: the gradients stay what they were (a BatchNorm in training normalises by the batch), but the
running statistics, and so the model in eval mode, drift from the one trained without memfit (a MobileViT block's
count read 18 after 9 steps of ``full``, 27 of ``static``). So every checkpoint memfit makes restores the block's
stateful buffers when its recomputation ends (``checkpoint``'s ``context_fn``: :func:`restoring_rerun`), and every
probe restores them when it ends (``probe_warmup``). The stateful buffers (``Block.stateful_buffers``) are those of
the running-statistics norms, and any other whose version counter moved since ``fit`` (an in-place update; the norms'
running mean and variance are updated by their kernel without moving theirs, which is why those are found by type).
They are restored in place (``copy_``): the tensors stay the ones the model and its optimizer hold. A block with none
(a decoder layer) copies nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import noop_context_fn

__all__ = ["buffer_versions", "stateful_buffers", "restoring", "restoring_rerun"]


def buffer_versions(module: nn.Module) -> dict[int, int]:
    """Each buffer's version counter now, by the tensor's ``id``."""
    return {id(b): b._version for b in module.buffers()}


def stateful_buffers(module: nn.Module, versions: dict[int, int]) -> list[torch.Tensor]:
    """The buffers of ``module`` a forward may change (NOTE [Running statistics]): a running-statistics norm's, and any
    whose version moved since ``versions`` (:func:`buffer_versions`) were read."""
    found: dict[int, torch.Tensor] = {}
    for m in module.modules():
        tracks = isinstance(m, _NormBase) and m.track_running_stats
        for b in m.buffers(recurse=False):
            if b is not None and (tracks or b._version != versions.get(id(b), b._version)):
                found[id(b)] = b
    return list(found.values())


@contextlib.contextmanager
def restoring(buffers: list[torch.Tensor]) -> Iterator[None]:
    """Run the body, then put ``buffers`` back as they were when it started (NOTE [Running statistics])."""
    if not buffers:
        yield
        return
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)


def restoring_rerun(block: Any, contexts: Callable[[], tuple[Any, Any]] | None = None) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint``: ``contexts`` (a selective policy's) or torch's own where the block
    has no stateful buffer (a decoder layer: the checkpoint is what it was), else ``contexts()``' (or none) with the
    block's stateful buffers restored when the recomputation ends (NOTE [Running statistics])."""
    buffers = block.stateful_buffers()
    if not buffers:
        return contexts if contexts is not None else noop_context_fn

    def context_fn() -> tuple[Any, Any]:
        forward, recompute = contexts() if contexts is not None else (contextlib.nullcontext(), contextlib.nullcontext())

        @contextlib.contextmanager
        def rerun() -> Iterator[None]:
            with restoring(buffers), recompute:
                yield

        return forward, rerun()

    return context_fn
