"""Treatments: what a block does with its saved activations in one step.

A plan gives every block one treatment; the block runs it at its next training forward
(NOTE [Switch is read at call time] in blocks.py):

| name        | forward                                   | kept for backward       | backward                |
| ----------- | ----------------------------------------- | ----------------------- | ----------------------- |
| `keep`      | plain                                     | everything it saves     | plain                   |
| `recompute` | under ``torch.utils.checkpoint``          | its inputs              | the block runs again    |

Gradients are those of ``keep`` under every treatment: ``torch.utils.checkpoint`` is
non-reentrant and restores the RNG state, so a recompute draws the same dropout masks.

A :class:`Treatment` instance is made per run (a treatment may hold per-run state) and
shared by every block it treats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from memfit.blocks import Block

__all__ = ["KEEP", "RECOMPUTE", "Treatment", "Keep", "Recompute", "TREATMENTS", "make_treatments"]

KEEP = "keep"
RECOMPUTE = "recompute"


class Treatment:
    """How a block runs one training forward; subclasses set ``name`` and :meth:`run`."""

    name: ClassVar[str] = ""
    #: the block keeps only its inputs, which no saved-tensor hook sees (NOTE [Who sees a
    #: checkpointed block's tensors] in accounting.py): the runtime counts them at block entry
    holds_inputs: ClassVar[bool] = False

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError


class Keep(Treatment):
    """The block runs plainly and keeps what it saves."""

    name = KEEP

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        return block.run_body(*args, **kwargs)


class Recompute(Treatment):
    """Whole-block checkpoint: only the inputs are kept; backward runs the block again."""

    name = RECOMPUTE
    holds_inputs = True

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        return checkpoint(block.run_body, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


#: every treatment, by name
TREATMENTS: dict[str, type[Treatment]] = {t.name: t for t in (Keep, Recompute)}


def make_treatments(names: tuple[str, ...] = (KEEP, RECOMPUTE)) -> dict[str, Treatment]:
    """One instance per treatment name for a run (``keep`` always included).

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    unknown = [n for n in names if n not in TREATMENTS]
    if unknown:
        raise ValueError(f"unknown treatment {unknown[0]!r}; choose from {', '.join(TREATMENTS)}")
    return {name: TREATMENTS[name]() for name in dict.fromkeys((KEEP, *names))}
