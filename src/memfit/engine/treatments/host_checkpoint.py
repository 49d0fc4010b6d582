"""``host_checkpoint``: ``recompute`` with the block's input held in pinned host memory.

# NOTE [Checkpoints on the host]
Past "recompute every block", what stays on the device for backward is each block's input (its
hidden states: layers x tokens x hidden bytes). ``host_checkpoint`` runs the block under
``torch.utils.checkpoint`` (non-reentrant, RNG state restored: the gradients of ``recompute``,
bit for bit) inside a saved-tensor hook pair of its own, the outer one: checkpoint saves its
positional inputs through the hooks in force before its own (innermost) pair takes the body's
saved tensors, so those inputs, and only they, meet this pair. It is ``offload``'s pair (NOTE
[Offload], offload.py): each input of at least ``min_bytes`` is copied to the run's pinned host
pool on the side stream while the block computes, and the device storage goes once the copy is
done; in backward the stash comes back ``depth`` blocks ahead (NOTE [Prefetch depth]), so the
block's recompute finds its input on the device. Keyword inputs (a decoder's position
embeddings and mask, shared by every block) are held by checkpoint's closure and stay.

What it keeps on the device is what warm-up measures (the keyword inputs and the small ones);
what it moves is ``recompute``'s bytes less those (``moves_from``); its price is the block's
forward again plus the copies' unhidden part from the link's measured bandwidth (NOTE
[Treatment prices], model.py). It frees more than ``recompute`` for more time, so the planner
gives it where its price per byte freed wins: past what recomputing saves at the tight end, and
before it only where the copies hide behind the compute; a batch that fits untreated is untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from memfit.engine.treatments.base import RECOMPUTE
from memfit.engine.treatments.offload import MIN_BYTES, Offload

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import nn

    from memfit.engine.blocks import Block
    from memfit.engine.probe import ProbeKit

__all__ = ["HOST_CHECKPOINT", "HostCheckpoint"]

HOST_CHECKPOINT = "host_checkpoint"


class HostCheckpoint(Offload):
    """Whole-block checkpoint whose inputs wait in pinned host memory (NOTE [Checkpoints on the host])."""

    name = HOST_CHECKPOINT
    help = "the whole block again in backward, its input held in pinned host memory meanwhile"
    reruns = True
    moves_from = RECOMPUTE
    order = 10  # above the recomputed blocks, below the offloaded ones: backward reaches it sooner

    @classmethod
    def probe(cls, block: "Block", kit: "ProbeKit") -> tuple[int, float | None] | None:
        """The inputs that stay on the device (keyword inputs, and positional ones under ``MIN_BYTES``);
        priced by the link. None for a block whose positional inputs would all stay: nothing to move."""
        args, kwargs = kit.detached
        moved = [t for t in tree_leaves(args) if _is_tensor(t) and t.untyped_storage().nbytes() >= MIN_BYTES]
        if not moved:
            return None
        staying = [t for t in tree_leaves((args, kwargs)) if _is_tensor(t) and not any(t is m for m in moved)]
        return kit.distinct_bytes(staying), None

    def _forward(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        if self.counter is not None and self.counter.active:
            for t in tree_leaves(kwargs):  # held by checkpoint's closure, never packed
                if _is_tensor(t):
                    self.counter.count_tensor(block.index, t)
        return checkpoint(block.run_body, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    @classmethod
    def by_default(cls, modules: "Sequence[nn.Module]", compile_options: "dict[str, Any] | None") -> bool:
        """Offered wherever the blocks are on a CUDA device (on a CPU the host is the device: nothing is freed)."""
        return any(p.is_cuda for m in modules for p in m.parameters())


def _is_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor)
