"""``host_checkpoint``: ``recompute`` with the block's input held in pinned host memory.

# NOTE [Checkpoints on the host]
Past "recompute every block", what stays on the device for backward is each block's input (its
hidden states: layers x tokens x hidden bytes). ``host_checkpoint`` runs the block under
``torch.utils.checkpoint`` (non-reentrant, RNG state restored: the gradients of ``recompute``,
bit for bit) inside a saved-tensor hook pair of its own, the outer one: checkpoint saves its
positional inputs through the hooks in force before its own (innermost) pair takes the body's
saved tensors, so those inputs, and only they, meet this pair. It is ``offload``'s pair (NOTE
[Offload], offload.py), which moves only the block's own input (its hidden states, passed
positionally: checkpoint's closure would hold a keyword argument): copied to the run's pinned host
pool on the side stream while the block computes, the device storage gone once the copy is done;
in backward the stash comes back ``depth`` blocks ahead (NOTE [Prefetch depth]), so the block's
recompute finds its input on the device. The other inputs (a decoder's position embeddings and
mask) are every block's: they stay.

What stays on the device, every input but the hidden states (a decoder's mask and rotary tables),
is every block's, which the step counts outside the blocks (NOTE [Storages saved by several
blocks], accounting.py), so its probe counts none of it as the block's: counted so, a padded
batch's mask went into every host-checkpointed block's bytes (on a cut probe the mask is cut in
both its sequence dimensions and scaled back in one), and the host checkpoints' in-flight bytes
(``recompute``'s less these) came out short (docs/devlog.md). A block input of its own beside its
hidden states (none in the model families memfit knows) is counted by the step's own count of the
block, which the byte curves keep where it is larger (NOTE [Upper envelope], model.py).
What it moves is ``recompute``'s bytes less those (``moves_from``); its price is the block's
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

from memfit.engine.parts.buffers import restoring_rerun
from memfit.engine.shapes import first_tensor
from memfit.engine.parts.treatments.base import RECOMPUTE
from memfit.engine.parts.treatments.offload import MIN_BYTES, Offload

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import nn
    from memfit.engine.parts.treatments.base import Block, ProbeKit

__all__ = ["HOST_CHECKPOINT", "HostCheckpoint"]

HOST_CHECKPOINT = "host_checkpoint"


class HostCheckpoint(Offload):
    """Whole-block checkpoint whose input waits in pinned host memory (NOTE [Checkpoints on the host])."""

    name = HOST_CHECKPOINT
    help = "the whole block again in backward, its input held in pinned host memory meanwhile"
    reruns = True
    moves_from = RECOMPUTE
    order = 10  # above the recomputed blocks, below the offloaded ones: backward reaches it sooner

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._input: torch.Tensor | None = None  # the input the running block moves (its hidden states)

    @classmethod
    def by_default(cls, modules: "Sequence[nn.Module]", compile_options: "dict[str, Any] | None") -> bool:
        """Offered wherever the blocks are on a CUDA device (on a CPU the host is the device: nothing is freed)."""
        return any(p.is_cuda for m in modules for p in m.parameters())

    @classmethod
    def probe(cls, block: "Block", kit: "ProbeKit") -> tuple[int, float | None] | None:
        """Nothing of the block's own stays on the device (the other inputs are every block's: NOTE [Checkpoints on the
        host]); priced by the link. None where the hidden states are under ``MIN_BYTES``: nothing worth a copy."""
        args, kwargs = kit.detached
        moved = first_tensor(args, kwargs)
        if moved is None or moved.untyped_storage().nbytes() < MIN_BYTES:
            return None
        return 0, None

    def _moves(self, t: torch.Tensor) -> bool:
        """Only the block's own input moves: the other inputs (a mask, position embeddings) are every block's."""
        return self._input is not None and t.untyped_storage().data_ptr() == self._input.untyped_storage().data_ptr()

    def _forward(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        self._input = first_tensor(args, kwargs)
        try:
            return self._checkpoint(block, args, kwargs)
        finally:
            self._input = None  # held past the block's forward, it would keep the input on the device

    def _checkpoint(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        if self.counter is not None and self.counter.active:
            for t in tree_leaves((args, kwargs)):  # what stays (the input is counted by the pack hook if it stays)
                if isinstance(t, torch.Tensor) and t is not self._input:
                    self.counter.count_tensor(block.index, t)
        # checkpoint's closure holds its keyword arguments: an input passed by keyword goes positionally
        key = next((k for k, v in kwargs.items() if v is self._input), None) if self._input is not None else None
        run = self._body(block)
        if key is None:
            return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, context_fn=restoring_rerun(block), **kwargs)
        rest = {k: v for k, v in kwargs.items() if k != key}
        n = len(args)

        def body(*inputs: Any, **others: Any) -> Any:
            return run(*inputs[:n], **{key: inputs[n]}, **others)

        return checkpoint(body, *args, self._input, use_reentrant=False, preserve_rng_state=True,
                          context_fn=restoring_rerun(block), **rest)

    def _body(self, block: "Block") -> Any:
        """What the checkpoint runs, in forward and again in backward: the block's body."""
        return block.run_body
