"""``lean``: the block runs once, as it is, but its norms and its peft LoRA layers save their bfloat16 input instead of
float32 copies, and a LoRA layer sums its float32 output in chunks (NOTE [Lean inputs in a tiled block], tiled_mlp.py).

A LoRA block over bfloat16 weights whose adapters are float32 (peft's default) saves a float32 copy of each adapted
projection's input (q, k and v each their own of the same input) and each RMSNorm's float32 input: about a third of
what the block keeps. Lean, each of these parts saves its bfloat16 input (q, k and v's one input once) and computes
again in backward what it would have kept: a norm's elementwise ops, an adapter's cast and rank-wide projection. The
gradients are ``keep``'s bit for bit; the probe runs the block both ways on the same inputs and RNG state and offers
the treatment only where its outputs and gradients are equal bit for bit and it keeps less. It is what the tiled
treatments run outside the MLP, without the MLP tiled: the planner's lever for kept LoRA blocks, between ``keep`` and
``elementwise`` or a recompute. Eager blocks only (a compiled block's graph never calls the patched forwards).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memfit.engine.parts.treatments.base import Treatment
from memfit.engine.parts.treatments.elementwise import runs_as_plain
from memfit.engine.parts.treatments.tiled_mlp import Chunking, lean_parts, tiled

if TYPE_CHECKING:
    from memfit.engine.parts.treatments.base import Block, ProbeKit

__all__ = ["LEAN", "Lean"]

logger = logging.getLogger("memfit")

LEAN = "lean"


def _lean(parts: Sequence[nn.Module]) -> Any:
    """The context that runs ``parts`` lean (no MLP tiled)."""
    return tiled((), Chunking(), parts)


class Lean(Treatment):
    """The block as it is, its norms and LoRA layers saving their bfloat16 input (NOTE [Lean inputs in a tiled block])."""

    name = LEAN
    help = "the block as it is, its norms and LoRA adapters saving their bf16 input, not float32 copies (re-run in backward)"
    # what it computes again runs inside the block's backward, as ``elementwise``'s: the partial transient learns it
    order = 20
    eager_only = True

    def __init__(self) -> None:
        #: per block, its parts to run lean, found once
        self._parts: dict[int, list[nn.Module]] = {}

    @classmethod
    def by_default(cls, modules: Sequence[nn.Module], compile_options: dict[str, Any] | None) -> bool:
        """Offered to eager blocks in half precision (bf16 or fp16 weights: a norm casts such an input, peft's float32
        adapters cast it) with a LoRA layer or a norm to run lean; the probe keeps it where it saves."""
        half = any(p.dtype in (torch.bfloat16, torch.float16) for m in modules for p in m.parameters())
        return compile_options is None and half and any(lean_parts(m) for m in modules)

    def parts_of(self, block: "Block") -> list[nn.Module]:
        found = self._parts.get(block.index)
        if found is None:
            found = self._parts[block.index] = lean_parts(block.module)
        return found

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        with _lean(self.parts_of(block)):
            return block.run_body(*args, **kwargs)

    @classmethod
    def probe(cls, block: "Block", kit: "ProbeKit") -> tuple[int, float | None] | None:
        """What the block keeps lean and its price (forward and backward beyond the plain block's, the fastest of the
        timed runs, interleaved); None for a compiled block, one with nothing to run lean, one that keeps no less lean,
        or one whose outputs or gradients lean are not the plain block's bit for bit."""
        parts = lean_parts(block.module)
        if block.compiled or not parts:
            return None
        plain_counter, lean_counter = kit.counter_of_run(), kit.counter_of_run()
        try:
            equal = runs_as_plain(block, kit, lambda: _lean(parts), lean_counter.hooks(), plain_counter.hooks())
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # a part whose forward does not run again as it ran: never offered
            logger.debug("memfit: block %s does not run lean (%s); 'lean' is not offered for it", block.index,
                         str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
            return None
        if not equal or lean_counter.bytes >= plain_counter.bytes:
            logger.debug("memfit: block %s keeps no less lean, or its outputs lean differ; 'lean' is not offered for it",
                         block.index)
            return None
        lean_ms, plain_ms = [], []
        for run in range(kit.runs_after_check()):  # its check ran it cold: NOTE [Cold runs of a block] (probe.py)
            lean_ms.append(kit.forward_backward_ms(block.body, kit.shield(), _lean(parts)))
            plain_ms.append(kit.plain_run_ms(run))
        return lean_counter.bytes, max(0.0, min(lean_ms) - min(plain_ms))

