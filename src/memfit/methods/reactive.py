"""``reactive``: no plan, no model; evict already-run blocks' saved tensors under pressure (DTR-style)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from memfit.methods.base import Decision, Method
from memfit.planner import Plan
from memfit.protection import Eviction, Protection

if TYPE_CHECKING:
    from memfit.accounting import SavedTensorCounter
    from memfit.planning import Planning
    from memfit.store import ReactiveStore

__all__ = ["Reactive"]


class Reactive(Method):
    """No plan, no model: evict already-run blocks' saved tensors under pressure (DTR-style).

    Every block runs under memfit's saved-tensor store; at each block entry, when the bytes
    in use plus the margin plus the largest block so far would cross the budget, the blocks
    with the least recompute time per byte freed (and the stalest) are evicted, and re-run
    in backward when first needed (store.py, NOTE [Reactive room] in protection.py).
    """

    name = "reactive"
    adapts = True

    def make_protection(
        self, new_store: Callable[[], "ReactiveStore"], planning: "Planning", meter: object, counter: "SavedTensorCounter",
    ) -> Protection:
        return Eviction(new_store(), planning, meter, counter)

    def decide(self, planning: "Planning", key: tuple[int, int], failed: Plan | None = None) -> Decision:
        return Decision(Plan(()))
