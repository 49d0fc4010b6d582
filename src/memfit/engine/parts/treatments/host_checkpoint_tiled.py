"""``host_checkpoint_tiled``: ``host_checkpoint`` (NOTE [Checkpoints on the host]) whose re-run runs the
block's gated MLP in chunks of tokens (NOTE [Tiled MLP], tiled_mlp.py): the floor treatment.

Between its forward and its recompute a block keeps on the device only the inputs every block shares
(its own input waits in pinned host memory), and its recompute holds one chunk of the MLP's
intermediates: no treatment keeps less for a block at any moment of the step, so a run that offers it
replays with it when every block recomputed still ran out of memory (``floor_treatment``, NOTE [A
replay treats more], methods/dynamic.py). What it keeps is ``host_checkpoint``'s; its price is
the link's unhidden copies and its re-run's, which is ``recompute_tiled``'s (``reruns_as``: the same tiled body,
hollow where it may be, NOTE [Hollow re-runs], tiled_mlp.py) where the run offers it, else ``host_checkpoint``'s
forward again plus what tiling adds (``tiled_mlp``'s measured price); its recompute brings back what a tiled block
keeps (``rerun_keeps``: NOTE [Treated peaks], model.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit.engine.parts.treatments.host_checkpoint import HOST_CHECKPOINT, HostCheckpoint
from memfit.engine.parts.treatments.recompute_tiled import RECOMPUTE_TILED
from memfit.engine.parts.treatments.tiled_mlp import TILED_MLP, Chunking, TiledMlp, TiledReruns, offered, probe_tiled

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import nn

    from memfit.engine.parts.treatments.base import Block, ProbeKit

__all__ = ["HOST_CHECKPOINT_TILED", "HostCheckpointTiled"]

HOST_CHECKPOINT_TILED = "host_checkpoint_tiled"


class HostCheckpointTiled(TiledReruns, HostCheckpoint):
    """``host_checkpoint`` with the gated MLP tiled in the block's runs (NOTE [Tiled MLP])."""

    name = HOST_CHECKPOINT_TILED
    help = "as host_checkpoint, the gated MLP in chunks of tokens in the block's runs (the floor)"
    rerun_keeps = TILED_MLP
    reruns_as = RECOMPUTE_TILED
    keeps_as = HOST_CHECKPOINT
    order = 12  # with the host checkpoints, above the recomputed blocks
    eager_only = True

    def __init__(self, *args: Any, chunking: Chunking | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._tiled = TiledMlp(chunking or Chunking.rerun())

    @classmethod
    def by_default(cls, modules: "Sequence[nn.Module]", compile_options: "dict[str, Any] | None") -> bool:
        """Offered where ``host_checkpoint`` is (blocks on a GPU) to eager blocks with a gated MLP to tile."""
        return HostCheckpoint.by_default(modules, compile_options) and offered(modules, compile_options)

    @classmethod
    def probe(cls, block: "Block", kit: "ProbeKit") -> tuple[int, float | None] | None:
        """``host_checkpoint``'s (the inputs that stay; priced by the link), where the block tiles something."""
        if probe_tiled(block, kit) is None:
            return None
        return super().probe(block, kit)

    def _body(self, block: "Block") -> Any:
        return self.tiled_run_body(block)
