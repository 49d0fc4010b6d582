"""``recompute``: whole-block checkpoint; only the inputs are kept and backward runs the block
again (``torch.utils.checkpoint``, non-reentrant, RNG state restored: the same dropout masks)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.utils.checkpoint import checkpoint

from memfit.engine.parts.buffers import restoring_rerun
from memfit.engine.parts.treatments.base import RECOMPUTE, Treatment

if TYPE_CHECKING:
    from memfit.engine.parts.treatments.base import Block, ProbeKit

__all__ = ["Recompute"]


class Recompute(Treatment):
    """Whole-block checkpoint: only the inputs are kept; backward runs the block again."""

    name = RECOMPUTE
    help = "the whole block again in backward"
    holds_inputs = True
    reruns = True
    order = 0  # nothing held below a recompute (NOTE [Earliest blocks first], planner.py)

    @classmethod
    def probe(cls, block: "Block", kit: "ProbeKit") -> tuple[int, float | None]:
        """What a checkpoint keeps of the block's own, its hidden-state input, priced by the plain probe's forward (None
        here). The step's count teaches it too where the block runs recomputed; a warm-up on the floor runs none, and
        without it the memory model would never be ready (NOTE [Warm-up on the floor], methods/dynamic.py)."""
        return kit.input_bytes(), None

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        return checkpoint(block.run_body, *args, use_reentrant=False, preserve_rng_state=True, context_fn=restoring_rerun(block),
                          **kwargs)
