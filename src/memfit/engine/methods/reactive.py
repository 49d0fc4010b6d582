"""``reactive``: no plan, no model; evict already-run blocks' saved tensors under pressure (DTR-style).

# NOTE [A reactive replay differs]
An OOM under ``reactive`` comes from what eviction between blocks could not anticipate (an
allocation inside a block larger than the room kept: NOTE [Room inside a block] in
protection.py learns it from the failure). The replay must not be the same attempt again: each
OOM at a shape raises its bucket's *escalation*, and a step at that bucket, or a longer one of
the same rows, recomputes the first ``ceil(level × blocks / 4)`` blocks whole (their inputs
alone kept) besides evicting the others: four failures make it ``full``, after which the budget
is too small. The escalation stays for the run: the shape that failed once does not fail again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from memfit.engine.plan import learner
from memfit.engine.methods.base import Decision, Method
from memfit.engine.plan.planner import Plan
from memfit.engine.run.protection import Eviction, Protection
from memfit.engine.shapes import bucket_key

if TYPE_CHECKING:
    from memfit.engine.parts.accounting import SavedTensorCounter
    from memfit.engine.plan.learner import StepOutcome
    from memfit.engine.plan.planning import Planning
    from memfit.engine.parts.store import ReactiveStore

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

    def __init__(self) -> None:
        #: per plan bucket, how many OOMs a step of it had (NOTE [A reactive replay differs])
        self._escalation: dict[tuple[int, int], int] = {}

    def make_protection(
        self, new_store: Callable[[], "ReactiveStore"], planning: "Planning", meter: object, counter: "SavedTensorCounter",
    ) -> Protection:
        return Eviction(new_store(), planning, meter, counter)

    def decide(self, planning: "Planning", key: tuple[int, int], failed: Plan | None = None) -> Decision:
        bucket = bucket_key(key, planning.bucket_tokens)
        if failed is not None:
            self._escalation[bucket] = self._escalation.get(bucket, 0) + 1
        level = max((lv for (n, t), lv in self._escalation.items() if n == key[0] and t <= bucket[1]), default=0)
        first = min(planning.n_blocks, math.ceil(level * planning.n_blocks / 4))
        return Decision(Plan(tuple(range(first))), count=level > 0)

    def learn(self, planning: "Planning", outcome: "StepOutcome") -> int | None:
        """No model to learn; a step the allocator served only by releasing its cache grows the
        slack that every block entry keeps free (NOTE [Room], room.py)."""
        planning.apply(learner.grow_slack(planning, outcome))
        return None
