"""``recompute_tiled``: whole-block checkpoint with the block's gated MLP tiled inside (NOTE [Tiled MLP],
tiled_mlp.py): only the inputs are kept, and backward runs the block again with its MLP in chunks of
tokens, so the recompute holds one chunk of the MLP's intermediates, not all of them.

Its price is measured: the block's forward and backward checkpointed and tiled, beyond the plain
block's (the forward again, and the MLP's forward a third time, a chunk at a time, unless the re-run's
MLP runs hollow: NOTE [Hollow re-runs], tiled_mlp.py). It keeps what
``recompute`` keeps for more time, so the planner takes it where the recompute's peak binds: a
re-run brings back what a tiled block keeps (``rerun_keeps``: NOTE [Treated peaks], model.py),
learnt from ``tiled_mlp``'s probe where the run offers it (without it, nothing is assumed saved).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.utils.checkpoint import checkpoint

from memfit.engine.parts.buffers import restoring_rerun
from memfit.engine.parts.treatments.base import RECOMPUTE, RunOptions, Treatment
from memfit.engine.parts.treatments.tiled_mlp import TILED_MLP, Chunking, TiledMlp, TiledReruns, offered, probe_tiled, tiled_body

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import nn

    from memfit.engine.parts.treatments.base import Block, ProbeKit

__all__ = ["RECOMPUTE_TILED", "RecomputeTiled"]

RECOMPUTE_TILED = "recompute_tiled"


class RecomputeTiled(TiledReruns, Treatment):
    """Whole-block checkpoint whose recompute runs the gated MLP in chunks of tokens (NOTE [Tiled MLP])."""

    name = RECOMPUTE_TILED
    help = "the whole block again in backward, its gated MLP in chunks of tokens (one chunk's intermediates at a time)"
    holds_inputs = True
    reruns = True
    rerun_keeps = TILED_MLP
    keeps_as = RECOMPUTE
    order = 5  # with the recomputed blocks: nothing held below it (NOTE [Earliest blocks first], planner.py)
    eager_only = True

    @classmethod
    def for_run(cls, options: RunOptions) -> Treatment:
        return cls()

    @classmethod
    def by_default(cls, modules: "Sequence[nn.Module]", compile_options: "dict[str, Any] | None") -> bool:
        """Offered to eager blocks with a gated MLP to tile (NOTE [Tiled MLP])."""
        return offered(modules, compile_options)

    def __init__(self, chunking: Chunking | None = None):
        self._tiled = TiledMlp(chunking or Chunking.rerun())

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        return checkpoint(self.tiled_run_body(block), *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=restoring_rerun(block), **kwargs)

    @classmethod
    def probe(cls, block: "Block", kit: "ProbeKit") -> tuple[int, float | None] | None:
        """Its inputs (what ``recompute`` keeps) and its price: forward and backward checkpointed and
        tiled beyond the plain block's, the fastest of the timed runs, interleaved; None where the
        block tiles nothing (NOTE [Tiled MLP])."""
        measured = probe_tiled(block, kit)
        if measured is None:
            return None
        (mlps, lean), _ = measured
        verdict: dict[str, set[int]] = {}  # the block's, for every run timed (NOTE [Hollow re-runs], tiled_mlp.py)

        def checkpointed(*args: Any, **kwargs: Any) -> Any:  # a body of its own per checkpoint, as the treatment's
            body = tiled_body(block.body, mlps, Chunking.rerun(), lean, verdict)
            return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

        lean_ms, plain_ms = [], []
        for run in range(kit.timed_runs):  # NOTE [Cold runs of a block] (probe.py)
            lean_ms.append(kit.forward_backward_ms(checkpointed, kit.shield()))
            plain_ms.append(kit.plain_run_ms(run))
        return kit.input_bytes(), max(0.0, min(lean_ms) - min(plain_ms))

