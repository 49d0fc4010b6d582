"""The room: what the budget keeps free besides the plan, and the only rules that change it.

# NOTE [Room]
A plan must fit the *room*: the budget less the margin and the allocator's slack. The margin
covers prediction error: it starts at a share of the budget (``DEFAULT_MARGIN_SHARE``, per
accounting: the allocator's readings err more than counted tensors) and grows after a steady
step above its prediction (to ``MISS_MARGIN_FACTOR`` × the miss) or an OOM the slack does not
explain (by the budget over ``OOM_MARGIN_PARTS``). The slack is memory the caching allocator
reserves but cannot hand out (the free tails of partly used pages), which no release returns;
the CUDA cap limits *reserved* bytes while the model predicts *allocated* ones. On CUDA the
slack starts at ``min(ALLOCATOR_SLACK_BYTES, budget / 16)`` and an OOM raises it to
``SLACK_FACTOR`` × the reserved bytes that were not allocated when it failed, when that is
more. A steady step during which the allocator served an allocation only after releasing its
cache (a device sync, and the cache's memory unmapped and mapped again: CUDA's
``num_alloc_retries``) grows the slack by ``RETRY_SLACK_SHARE`` of the budget, up to
``MAX_RETRY_SLACK_SHARE`` of it: plans that fill the cap to its last bytes leave the allocator
no room for the step's own fragmentation, and a release every step costs more than the
recompute that leaves it room. ``reactive`` has no plans but the same rule: each block entry
keeps the slack free. Logical accounting has no allocator: its slack is 0.

Every rule returns whether the room shrank; its owner (``Planning``) then drops the plans
made for the larger room.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Room", "DEFAULT_MARGIN_SHARE", "ALLOCATOR_SLACK_BYTES", "RETRY_SLACK_SHARE", "MAX_RETRY_SLACK_SHARE",
    "OOM_MARGIN_PARTS", "MISS_MARGIN_FACTOR", "SLACK_FACTOR",
]

#: the margin's share of the budget before any step erred, per accounting (the meter's kind)
DEFAULT_MARGIN_SHARE = {"cuda": 0.03, "logical": 0.001}
#: The allocator's slack kept free on CUDA before any OOM has measured it.
ALLOCATOR_SLACK_BYTES = 256 * 2**20
#: A steady step the allocator served only by releasing its cache grows the slack by this
#: share of the budget ...
RETRY_SLACK_SHARE = 1 / 32
#: ... up to this share of it in all.
MAX_RETRY_SLACK_SHARE = 1 / 8
#: an OOM the slack does not explain grows the margin by the budget over this
OOM_MARGIN_PARTS = 20
#: a steady step above its prediction grows the margin to this many times the miss
MISS_MARGIN_FACTOR = 1.25
#: an OOM grows the slack to this many times the reserved bytes that were not allocated
SLACK_FACTOR = 1.25


@dataclass
class Room:
    """The margin and the allocator's slack kept free below the budget (NOTE [Room]).

    Attributes:
        budget_bytes: the budget, or None for none.
        margin_bytes: kept free for prediction error.
        slack_bytes: kept free for what the allocator reserves but cannot hand out.
    """

    budget_bytes: int | None
    margin_bytes: int = 0
    slack_bytes: int = 0

    @classmethod
    def for_run(cls, budget_bytes: int | None, accounting: str, margin_share: float | None = None) -> "Room":
        """The room a run starts with.

        Args:
            budget_bytes: the budget (None: no room to keep).
            accounting: the meter's kind (``cuda``: an allocator, with its slack; ``logical``).
            margin_share: the margin's share of the budget (default ``DEFAULT_MARGIN_SHARE``).
        """
        share = DEFAULT_MARGIN_SHARE.get(accounting, 0.0) if margin_share is None else margin_share
        slack = min(ALLOCATOR_SLACK_BYTES, (budget_bytes or 0) // 16) if accounting == "cuda" else 0
        return cls(budget_bytes, int(share * (budget_bytes or 0)), slack)

    @property
    def free_bytes(self) -> int:
        """What a plan's predicted peak must fit: the budget less the margin and the slack."""
        return self.budget_bytes - self.margin_bytes - self.slack_bytes

    def raise_margin(self, extra_bytes: int) -> bool:
        """Keep ``extra_bytes`` more free from now on."""
        self.margin_bytes += max(0, int(extra_bytes))
        return True

    def after_miss(self, miss_bytes: int) -> bool:
        """A steady step peaked ``miss_bytes`` above its prediction: the margin grows to
        ``MISS_MARGIN_FACTOR`` × the miss, if that is more."""
        if miss_bytes > 0 and MISS_MARGIN_FACTOR * miss_bytes > self.margin_bytes:
            return self.raise_margin(int(MISS_MARGIN_FACTOR * miss_bytes) - self.margin_bytes)
        return False

    def after_alloc_retries(self) -> bool:
        """The allocator released its cache to serve a steady step: the slack grows by
        ``RETRY_SLACK_SHARE`` of the budget, up to ``MAX_RETRY_SLACK_SHARE`` in all."""
        if not self.budget_bytes:
            return False
        ceiling = int(MAX_RETRY_SLACK_SHARE * self.budget_bytes)
        if self.slack_bytes >= ceiling:
            return False
        self.slack_bytes = min(ceiling, self.slack_bytes + int(RETRY_SLACK_SHARE * self.budget_bytes))
        return True

    def learn_slack(self, unusable_bytes: int) -> bool:
        """Keep ``SLACK_FACTOR`` × ``unusable_bytes`` free for the allocator if that is more than now."""
        wanted = int(SLACK_FACTOR * unusable_bytes)
        if wanted <= self.slack_bytes:
            return False
        self.slack_bytes = wanted
        return True

    def after_oom(self, unusable_bytes: int) -> bool:
        """A step ran out of memory with ``unusable_bytes`` reserved but not allocated: the
        slack grows to explain it, else the margin by the budget over ``OOM_MARGIN_PARTS``."""
        if self.budget_bytes is None:
            return False
        return self.learn_slack(unusable_bytes) or self.raise_margin(max(self.budget_bytes // OOM_MARGIN_PARTS, 1))
