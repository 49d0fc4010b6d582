"""``recompute``: whole-block checkpoint; only the inputs are kept and backward runs the block
again (``torch.utils.checkpoint``, non-reentrant, RNG state restored: the same dropout masks)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.utils.checkpoint import checkpoint

from memfit.engine.parts.treatments.base import RECOMPUTE, Treatment

if TYPE_CHECKING:
    from memfit.engine.parts.treatments.base import Block

__all__ = ["Recompute"]


class Recompute(Treatment):
    """Whole-block checkpoint: only the inputs are kept; backward runs the block again."""

    name = RECOMPUTE
    help = "the whole block again in backward"
    holds_inputs = True
    reruns = True
    order = 0  # nothing held below a recompute (NOTE [Earliest blocks first], planner.py)

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        return checkpoint(block.run_body, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
