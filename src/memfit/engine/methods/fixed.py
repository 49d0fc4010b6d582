"""Methods with one plan for every step: ``none`` (keep every block) and ``full`` (recompute every block)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memfit.engine.methods.base import Decision, Method
from memfit.engine.plan.planner import Plan

if TYPE_CHECKING:
    from memfit.engine.plan.planning import Planning

__all__ = ["NoCheckpoint", "FullCheckpoint"]


class NoCheckpoint(Method):
    """Never checkpoint: fastest, and OOMs when the step does not fit (memfit only measures)."""

    name = "none"
    measures_only = True

    def decide(self, planning: "Planning", key: tuple[int, int], failed: Plan | None = None) -> Decision:
        return Decision(Plan(()))


class FullCheckpoint(Method):
    """Recompute every block (Hugging Face's ``gradient_checkpointing=True``)."""

    name = "full"

    def decide(self, planning: "Planning", key: tuple[int, int], failed: Plan | None = None) -> Decision:
        return Decision(Plan(planning.all_blocks))
