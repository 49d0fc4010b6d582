"""The method interface: what the runtime asks a method at each step, and what it is told."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from memfit.errors import UserError
from memfit.engine.plan.planner import Plan
from memfit.engine.run.protection import Protection, Unprotected

if TYPE_CHECKING:
    from memfit.engine.parts.accounting import SavedTensorCounter
    from memfit.engine.plan.learner import StepOutcome
    from memfit.engine.plan.planning import Planning
    from memfit.engine.parts.store import ReactiveStore

__all__ = ["Decision", "Method", "UnknownMethodError"]


class UnknownMethodError(UserError, ValueError):
    """The method name is not one memfit knows."""


@dataclass(frozen=True)
class Decision:
    """What a method decided for one step.

    Attributes:
        plan: the treatment of every part (one type everywhere: planner, records, plan files).
        warmup: probe blocks this step to fit the memory model.
        count: count the tensors the step saves per block (NOTE [Counting what teaches],
            engine/run/controller.py); a warm-up step always counts.
    """

    plan: Plan
    warmup: bool = False
    count: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.plan, Plan):
            raise TypeError(f"Decision(plan=...) takes a Plan, not {type(self.plan).__name__}: give Plan(blocks) for recomputed blocks")


class Method:
    """Base class: subclasses set ``name`` and implement :meth:`decide`.

    The runtime calls, per run, :meth:`bind` once and :meth:`make_protection` once; per
    step, :meth:`decide` before the first block runs (NOTE [Plan is fixed before forward] in
    engine/run/controller.py) and :meth:`learn` once the step's peaks are known.
    """

    name: ClassVar[str] = ""
    #: an OOM inside a step can be survived by replaying it with a safer plan
    adapts: ClassVar[bool] = False
    #: memfit only measures: the method never changes how a block runs (its blocks may then
    #: use Hugging Face's own checkpointing, as a benchmark's peers do)
    measures_only: ClassVar[bool] = False
    #: its plans come from the memory model (worth saving for ``precomputed``)
    learns: ClassVar[bool] = False

    def bind(self, n_blocks: int, fingerprint: str) -> None:
        """The run's blocks are known: ``n_blocks`` and a fingerprint of the model's blocks.

        Raises:
            ValueError: when the method cannot run this model (naming both).
        """

    def make_protection(
        self, new_store: Callable[[], "ReactiveStore"], planning: "Planning", meter: object, counter: "SavedTensorCounter",
    ) -> Protection:
        """What protects this method's steps mid-step (protection.py); made once per run."""
        return Unprotected()

    def decide(self, planning: "Planning", key: tuple[int, int], failed: Plan | None = None) -> Decision:
        """The plan of a step of shape ``key``.

        Args:
            planning: the run's model, planner and cache.
            key: the step's shape key.
            failed: the plan of the attempt of this very step that ran out of memory, when
                the step is being replayed; None otherwise.
        """
        raise NotImplementedError

    def planning_key(self, planning: "Planning", key: tuple[int, int]) -> tuple[int, int]:
        """The shape whose plan a step of shape ``key`` runs (``static``: the largest one)."""
        return key

    def learn(self, planning: "Planning", outcome: "StepOutcome") -> int | None:
        """Learn from a finished step; return the peak that was predicted for it (None: no model)."""
        return None

    def resume(self) -> None:
        """The memory model was loaded from a checkpoint: no new warm-up is needed."""
