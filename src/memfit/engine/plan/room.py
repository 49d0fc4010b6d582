"""The room: what the budget keeps free besides the plan, and the only rules that change it.

# NOTE [Room]
A plan must fit the *room*: the budget less the margin and the allocator's slack. The margin
covers prediction error: it starts at a share of the budget (``DEFAULT_MARGIN_SHARE``, per
accounting: the allocator's readings err more than counted tensors), shrinks while steps keep
to their predictions (NOTE [The margin follows the misses]) and grows after a steady
step above its prediction (to ``MISS_MARGIN_FACTOR`` × the miss) or an OOM the slack does not
explain (by the budget over ``OOM_MARGIN_PARTS``). The slack is memory the caching allocator
reserves but cannot hand out (the free tails of partly used pages), which no release returns;
the CUDA cap limits *reserved* bytes while the model predicts *allocated* ones. On CUDA the
slack starts at ``min(ALLOCATOR_SLACK_BYTES, budget / 16)`` and an OOM raises it to
``SLACK_FACTOR`` × the reserved bytes that were not allocated when it failed, when that is
more. ``reactive`` has no plans but the same slack: each block entry keeps it free. Logical
accounting has no allocator: its slack is 0.

# NOTE [Other streams' pools]
The caching allocator keeps a pool per stream: a block freed on one stream serves only that stream
until a release (an OOM, or an allocator retry: NOTE [The slack is priced]) returns it. A run whose
work allocates on streams beside the step's (FSDP2's all-gather copy-in and reduce-scatter streams,
offload's copies) keeps those pools mapped the whole step, so the step's own stream can use the cap
less them. Under FSDP2 the gap between reserved and allocated bytes stayed 3.5-5 GiB of a 29 GiB
cap (every steady step released the cache twice while the slack grew a step at a time toward its
ceiling: docs/devlog.md). So the CUDA meter reads, from the allocator's snapshot, the bytes those
pools hold free at a step's end (at the run's first step and after any step that retried: a read
walks every block, which costs less than the retry's sync and unmapping it follows) and the room
keeps the most it read free (``pool_bytes``), apart from the slack and its ceiling. It over-counts
what those pools hold in use at the step's peak (a block's gathered weights), which the prediction
counts too: a few hundred MB kept free for no retry.

# NOTE [Room where an OOM is fatal]
The slack is learnt from an OOM, which a run must survive to learn from. Under FSDP with several
ranks an OOM outside the blocks' forwards and the planned LM head (a backward, or a head memfit
does not plan) stops every rank (NOTE [Replay under FSDP], replay.py), so such a run starts with the slack the allocator may need, not the
least it usually needs: ``budget / FATAL_OOM_SLACK_PARTS``. Sharded LoRA runs have stopped at
such an OOM with 1.7-2.2% of their budgets reserved but not allocated, above the 256 MiB that a
replayable run starts with (docs/devlog.md, FSDP on 2 and 4 GPUs). Most of that was other streams'
pools (FSDP2's: NOTE [Other streams' pools]), which the room keeps apart once read, so the pools read
come off this start, down to the slack a replayable run starts with.

# NOTE [The slack is priced]
A steady step during which the allocator served an allocation only after releasing its cache
(CUDA's ``num_alloc_retries``: a device sync, the cache's pages unmapped, and under expandable
segments mapped again chunk by chunk for the rest of the step) left the allocator too little
room for the step's own fragmentation. More slack stops it, but the slack is one for every
shape: a growth by ``RETRY_SLACK_SHARE`` of the budget (up to ``MAX_RETRY_SLACK_SHARE``) makes
every long step's plan treat more for the rest of the run, where a retry costs the steps that
meet it. So both are priced per step, over the last ``RETRY_RATE_STEPS`` steady steps
(:class:`StepTimes`), and the slack grows only when the retries cost more:

* a retry's price is its step's time net of its treatments' predicted time, less the median of
  the same shape bucket's steady steps without a retry, plus the next steady step's own time over
  a clean one (the release's aftermath: the cache's pages, unmapped, are mapped again by the steps
  after it; that step is not kept as a clean one), times the share of those steps that retried (a
  run with fewer steady steps counted as if the rest had not: its first retry is not read as a
  rate); retries in a row (``RETRY_STREAK``) are priced at once;
* the growth's price is the planner's: the mean over those steps' shapes of the plan at the
  smaller room less the plan now (``Search.slack_cost_ms``, search.py).

A retry in a bucket with no clean step yet waits for one: the bucket's next clean step prices it
(growing at once on a run's first retries kept 3-6% of the budget unused on the llm suite:
docs/devlog.md). A bucket that retries again before any clean step (one that releases the cache
on every step, the cost that measured worst) grows the slack at once, and so does a retry with
no step time to price it, and so do ``RETRY_STREAK`` steady steps in a row that retried, whatever
their buckets: where every step retries and no two steps share a bucket (SFT lengths under FSDP2 on
2 GPUs: docs/devlog.md) no clean step ever comes to price one, and every step pays the release. The slack shrinks back by the same step, not below where it started,
after ``SHRINK_AFTER_CLEAN_STEPS`` steady steps in a row without a retry: plans then use the room
again, and a retry that comes back is priced again.

# NOTE [A retry beside no clean step of its bucket]
Buckets are 8 tokens wide: under SFT lengths a bucket recurs after hundreds of steps, so a retry's bucket has no
clean step yet, nearly always, and its retry waited for one that did not come; retries that each cost a fifth to
two-fifths of a step recurred at a third of the steps of an 8B LoRA under FSDP2 on 2 GPUs, with the slack unmoved
(s41: docs/devlog.md). And the release's cost does not end with its step: the cache's pages, unmapped, are mapped
again by the steps after it (a step after a retry ran up to 270 ms over its like there). So a retry whose bucket has
no clean step is priced, where it can be, against the clean steps of buckets at least as large (as many rows or
more, as long or longer): a step's time net of its treatments' predicted time grows with its rows and its length, so
their clean times bound its own from above, and its time over that bound is at least what the retry cost. One step's
time is noisy, and the least of many leans low by the noise (on issue 59's 0.25 share cell, records of s39-4, it
read retries at twice what steps of nearly the same length said), so the bound is the median of the medians of the
``BOUND_BUCKETS`` buckets nearest above in tokens: each at least as large, the middle one of them. The price waits
one steady step, whose own time over a clean one (its bucket's, or such a bound) is added: the release's aftermath,
which is not kept as a clean step; then the retry is priced against the growth as above, as a retry of a bucket
with clean steps is. Nor is the step after any retry kept as a clean step: kept, it would raise its bucket's median
clean time and price the bucket's next retries low. It is a lower bound as far as the treatments' prices hold: a retry priced so
grows the slack only where even the bound cost more than the growth. Under FSDP a step's time is the slowest rank's,
so the bucket timed is the ranks' largest rows and length, agreed with the OOM flag (NOTE [The ranks' agreement on
the host], ranks.py); where ranks' batches have different rows the bound may not hold (the largest rows and length
may come from different ranks), nor under DDP, where no such agreement runs and each rank times its own shape. Where
no larger bucket has a clean step the retry waits as before.

# NOTE [The margin follows the misses]
A margin fixed at its starting share keeps that share of the budget unused for the whole run
however well the model predicts (the longest batches then peak a few percent under the cap with
every step within half a percent of its prediction: docs/devlog.md). So after
``MARGIN_CLEAN_STEPS`` steady steps in a row without a miss that grew it, the margin shrinks, in
one step (every change of the room drops the cached plans), to the larger of
``LEAST_MARGIN_SHARE`` of the budget (the allocator's readings still err) and
``MISS_MARGIN_FACTOR`` × the largest miss of the last ``MARGIN_MISS_STEPS`` steady steps (a shape
that missed once recurs: a margin shrunk below its miss would grow and shrink with it). An OOM
the slack does not explain raises the margin and makes that the floor for the rest of the run (an
OOM costs a replay; shrinking back would pay one again). What makes a step teach stays a quarter of the starting margin (learner.py:
noise must not move the curves). It never shrinks where an OOM is fatal, where the caller set the
margin, for a method with one plan for every shape (``static``), nor under logical accounting
(its counted bytes do not err as the allocator does).

Every rule returns whether the room changed; its owner (``Planning``) then drops the plans
made for the room before.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from memfit.engine.budget import Budget

__all__ = [
    "Room", "StepTimes", "DEFAULT_MARGIN_SHARE", "ALLOCATOR_SLACK_BYTES", "RETRY_SLACK_SHARE", "MAX_RETRY_SLACK_SHARE",
    "OOM_MARGIN_PARTS", "MISS_MARGIN_FACTOR", "SLACK_FACTOR", "SHRINK_AFTER_CLEAN_STEPS", "CLEAN_STEPS_KEPT", "RETRY_RATE_STEPS",
    "RETRY_STREAK", "BUCKETS_KEPT", "BOUND_BUCKETS", "FATAL_OOM_SLACK_PARTS", "LEAST_MARGIN_SHARE", "MARGIN_CLEAN_STEPS", "MARGIN_MISS_STEPS",
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
#: steady steps in a row without a retry after which the slack shrinks a step (NOTE [The slack is priced])
SHRINK_AFTER_CLEAN_STEPS = 32
#: per shape bucket, how many of the latest steps without a retry price a retry
CLEAN_STEPS_KEPT = 8
#: the latest steady steps over which a retry's and a growth's prices are taken per step
RETRY_RATE_STEPS = 64
#: shape buckets whose clean steps and waiting retry :class:`StepTimes` keeps, the latest seen (a run of uneven lengths
#: meets a new bucket most steps: bounded whatever the run's length)
BUCKETS_KEPT = 1024
#: steady steps in a row that retried, in any buckets, after which the slack grows without a price (NOTE [The slack
#: is priced])
RETRY_STREAK = 3
#: the larger buckets nearest above a retry's whose clean steps bound its clean time (NOTE [A retry beside no clean
#: step of its bucket])
BOUND_BUCKETS = 3
#: a run that cannot survive an OOM starts its slack at the budget over this (NOTE [Room where an OOM is fatal])
FATAL_OOM_SLACK_PARTS = 24
#: the least the margin shrinks to, as a share of the budget, per accounting (NOTE [The margin follows the misses])
LEAST_MARGIN_SHARE = {"cuda": 0.01, "logical": 0.001}
#: steady steps without a miss that grew the margin before it shrinks
MARGIN_CLEAN_STEPS = 8
#: the latest steady steps whose misses the shrunk margin covers (a shape that missed recurs)
MARGIN_MISS_STEPS = 64


@dataclass
class StepTimes:
    """Per shape bucket, the latest steady steps' times without an allocator retry, net of their
    treatments' predicted time: what a retry's extra time is measured against; and the latest
    steady steps' shapes and whether each retried: what a retry and a growth cost per step (NOTE
    [The slack is priced])."""

    clean_ms: dict[tuple[int, int], deque] = field(default_factory=dict)
    #: the latest steady steps: (shape, whether the allocator retried)
    recent: deque = field(default_factory=lambda: deque(maxlen=RETRY_RATE_STEPS))
    #: per bucket without clean steps, the net time of a retry step waiting for one to price it
    waiting_ms: dict[tuple[int, int], float] = field(default_factory=dict)
    #: a retry priced against larger buckets' clean steps, waiting for the next steady step's aftermath (NOTE [A retry
    #: beside no clean step of its bucket])
    after_retry_ms: float | None = None
    #: steady steps in a row that retried since the last clean step or the last growth of the slack it made
    streak: int = 0

    def add_clean(self, bucket: tuple[int, int], net_ms: float) -> None:
        kept = self.clean_ms.pop(bucket, None) or deque(maxlen=CLEAN_STEPS_KEPT)  # re-inserted: the latest seen last
        kept.append(float(net_ms))
        self.clean_ms[bucket] = kept
        _keep_latest(self.clean_ms)

    def retry_ms(self, bucket: tuple[int, int], net_ms: float) -> float | None:
        """What a step's retries cost: its net time over the bucket's median clean one (None before one)."""
        clean = self.clean_ms.get(bucket)
        return None if not clean else max(0.0, float(net_ms) - statistics.median(clean))

    def bound_ms(self, bucket: tuple[int, int]) -> float | None:
        """An upper bound of a clean step's time at ``bucket``: the median of the medians of the ``BOUND_BUCKETS``
        kept buckets nearest above it in tokens with at least its rows and its length (None: none kept), NOTE [A retry
        beside no clean step of its bucket]."""
        rows, length = bucket
        larger = sorted((n * t, statistics.median(kept)) for (n, t), kept in self.clean_ms.items()
                        if n >= rows and t >= length and kept)
        return statistics.median(ms for _, ms in larger[:BOUND_BUCKETS]) if larger else None

    def excess_ms(self, bucket: tuple[int, int], net_ms: float) -> float | None:
        """What a step took over a clean one: against its bucket's clean steps (:meth:`retry_ms`), else at least its
        time over :meth:`bound_ms` (None: neither known)."""
        exact = self.retry_ms(bucket, net_ms)
        if exact is not None:
            return exact
        bound = self.bound_ms(bucket)
        return None if bound is None else max(0.0, float(net_ms) - bound)

    def note(self, key: tuple[int, int], retried: bool) -> None:
        """A steady step of shape ``key`` ran, with or without a retry."""
        self.recent.append((tuple(key), bool(retried)))
        self.streak = self.streak + 1 if retried else 0

    @property
    def retry_share(self) -> float:
        """The share of the last ``RETRY_RATE_STEPS`` steady steps that retried (a run's first
        steps counted as if the rest had not: NOTE [The slack is priced])."""
        return sum(retried for _, retried in self.recent) / RETRY_RATE_STEPS

    def wait(self, bucket: tuple[int, int], net_ms: float) -> bool:
        """Keep a retry of ``bucket`` (no clean step yet) until a clean step prices it; returns True,
        keeping nothing, if one was kept already: the bucket retried twice before a clean step."""
        if self.waiting_ms.pop(bucket, None) is not None:
            return True
        self.waiting_ms[bucket] = float(net_ms)
        _keep_latest(self.waiting_ms)
        return False

    def waited_retry_ms(self, bucket: tuple[int, int]) -> float | None:
        """The retry kept for ``bucket``, priced against its clean steps now (None: none kept)."""
        net_ms = self.waiting_ms.pop(bucket, None)
        return None if net_ms is None else self.retry_ms(bucket, net_ms)


def _least_slack(budget_bytes: int) -> int:
    """The slack a run on CUDA starts with, where an OOM is not fatal, and the least it is cut to where one is."""
    return min(ALLOCATOR_SLACK_BYTES, budget_bytes // 16)


def _keep_latest(by_bucket: dict) -> None:
    """At most ``BUCKETS_KEPT`` buckets, the latest seen kept."""
    while len(by_bucket) > BUCKETS_KEPT:
        del by_bucket[next(iter(by_bucket))]


@dataclass
class Room:
    """The margin and the allocator's slack kept free below the budget (NOTE [Room]).

    Attributes:
        budget: the budget as typed (NOTE [A budget as typed]), the run's one copy of it; bytes are read as one; None
            for none.
        margin_bytes: kept free for prediction error.
        slack_bytes: kept free for what the allocator reserves but cannot hand out.
        pool_bytes: kept free for what other streams' pools hold (NOTE [Other streams' pools]).
    """

    budget: "Budget | int | None"
    margin_bytes: int = 0
    slack_bytes: int = 0
    pool_bytes: int = 0
    #: the floor a shrink stops at: the slack the run started with, or what an OOM measured
    #: (None: the slack given)
    start_slack_bytes: int | None = None
    #: steady steps in a row without a retry
    clean_steps: int = 0
    #: an OOM outside the blocks' forwards stops the run (NOTE [Room where an OOM is fatal])
    oom_fatal: bool = False
    times: StepTimes = field(default_factory=StepTimes)
    #: the least the margin shrinks to (None: the margin given, so it never shrinks: NOTE [The margin follows the misses])
    least_margin_bytes: int | None = None
    #: the latest steady steps' misses (0 for a step at or under its prediction), and how many
    #: steady steps in a row have not grown the margin
    misses: deque = field(default_factory=lambda: deque(maxlen=MARGIN_MISS_STEPS))
    steps_without_growth: int = 0
    #: the margin the run started with: what makes a step teach reads it (NOTE [The margin follows the misses])
    start_margin_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and not isinstance(self.budget, Budget):
            self.budget = Budget.parse(self.budget)
        if self.start_slack_bytes is None:
            self.start_slack_bytes = self.slack_bytes
        if self.least_margin_bytes is None:
            self.least_margin_bytes = self.margin_bytes
        if self.start_margin_bytes is None:
            self.start_margin_bytes = self.margin_bytes

    @classmethod
    def for_run(cls, budget: "Budget | int | None", accounting: str, margin_share: float | None = None,
                oom_fatal: bool = False, margin_shrinks: bool = True) -> "Room":
        """The room a run starts with.

        Args:
            budget: the budget (None: no room to keep).
            accounting: the meter's kind (``cuda``: an allocator, with its slack; ``logical``).
            margin_share: the margin's share of the budget (default ``DEFAULT_MARGIN_SHARE``).
            oom_fatal: an OOM outside the blocks' forwards stops the run (NOTE [Room where an OOM is fatal]).
            margin_shrinks: the method may let the margin shrink (not one with one plan for every shape:
                NOTE [The margin follows the misses]).
        """
        budget_bytes = None if budget is None else Budget.parse(budget).bytes
        share = DEFAULT_MARGIN_SHARE.get(accounting, 0.0) if margin_share is None else margin_share
        slack = 0
        if accounting == "cuda":
            least = _least_slack(budget_bytes or 0)
            slack = max(least, (budget_bytes or 0) // FATAL_OOM_SLACK_PARTS) if oom_fatal else least
        margin = int(share * (budget_bytes or 0))
        shrinks = margin_shrinks and margin_share is None and not oom_fatal  # NOTE [The margin follows the misses]
        least_margin = min(margin, int(LEAST_MARGIN_SHARE.get(accounting, share) * (budget_bytes or 0))) if shrinks else margin
        return cls(budget, margin, slack, start_slack_bytes=slack, oom_fatal=oom_fatal, least_margin_bytes=least_margin)

    @property
    def budget_bytes(self) -> int | None:
        """The budget in bytes (None: no budget)."""
        return None if self.budget is None else self.budget.bytes

    @property
    def free_bytes(self) -> int:
        """What a plan's predicted peak must fit: the budget less what the room keeps free."""
        return self.budget_bytes - self.kept_bytes

    @property
    def allocator_bytes(self) -> int:
        """What the allocator holds beyond the counted bytes: the slack and other streams' pools."""
        return self.slack_bytes + self.pool_bytes

    @property
    def kept_bytes(self) -> int:
        """What the room keeps free below the budget: the margin, the slack and other streams' pools."""
        return self.margin_bytes + self.allocator_bytes

    def learn_pools(self, free_bytes: int | None) -> bool:
        """Other streams' pools held ``free_bytes`` free at a step's end (None: not read): keep the most read free
        (NOTE [Other streams' pools]); returns whether the room changed."""
        if free_bytes is None or self.budget_bytes is None or free_bytes <= self.pool_bytes:
            return False
        grown, self.pool_bytes = int(free_bytes) - self.pool_bytes, int(free_bytes)
        if self.oom_fatal:  # the slack such a run starts with held these pools (NOTE [Room where an OOM is fatal])
            cut = max(0, min(grown, self.start_slack_bytes - _least_slack(self.budget_bytes)))
            self.start_slack_bytes, self.slack_bytes = self.start_slack_bytes - cut, self.slack_bytes - cut
        return True

    def after_steady(self, key: tuple[int, int], bucket: tuple[int, int], alloc_retries: int, net_ms: float | None,
                     growth_ms: Callable[[], float]) -> bool:
        """A steady step at ``key`` (its plan bucket ``bucket``) with or without allocator retries, to the slack's
        rules (NOTE [The slack is priced]): a retry is priced against the bucket's clean steps (waiting for the
        first where there is none yet), a growth by ``growth_ms()`` (the planner's price of the smaller room), both
        per step over the latest steady steps. Returns whether the room changed."""
        times = self.times
        times.note(key, bool(alloc_retries))
        pending, times.after_retry_ms = times.after_retry_ms, None
        if not alloc_retries:
            if net_ms is None:
                return self.after_clean_step()
            if pending is not None:  # NOTE [A retry beside no clean step of its bucket]: its aftermath, not a clean step
                changed = self.after_clean_step()
                after = times.excess_ms(bucket, net_ms) or 0.0
                return self.price_retry((pending + after) * times.retry_share, growth_ms()) or changed
            changed = self.after_clean_step()
            if len(times.recent) > 1 and times.recent[-2][1]:
                return changed  # after a retry: its aftermath (NOTE [A retry beside no clean step of its bucket])
            times.add_clean(bucket, net_ms)
            waited = times.waited_retry_ms(bucket)
            if waited is None:
                return changed
            return self.price_retry(waited * times.retry_share, growth_ms()) or changed
        if net_ms is None:
            return self.after_alloc_retries(None)
        excess = times.excess_ms(bucket, net_ms)  # against its bucket's clean steps, else their bound
        if excess is not None and times.streak < RETRY_STREAK:  # priced with the next step's aftermath (NOTE [The slack is priced])
            times.after_retry_ms = excess + (pending or 0.0)  # a retry before it: its aftermath is in this step's time
            return self.after_waiting_retry()
        if times.clean_ms.get(bucket):  # retries in a row, priced now against the bucket's own clean steps
            return self.after_alloc_retries((excess + (pending or 0.0)) * times.retry_share, growth_ms())
        if times.wait(bucket, net_ms):
            return self.after_alloc_retries(None)  # the bucket retried twice before a clean step
        if times.streak >= RETRY_STREAK:
            times.streak = 0  # counted again at the grown slack
            return self.after_alloc_retries(None)
        return self.after_waiting_retry()

    def raise_margin(self, extra_bytes: int) -> bool:
        """Keep ``extra_bytes`` more free from now on."""
        self.margin_bytes += max(0, int(extra_bytes))
        return True

    def after_miss(self, miss_bytes: int | None) -> bool:
        """A steady step peaked ``miss_bytes`` above its prediction (negative: below it; None: no steady step): the
        margin grows to ``MISS_MARGIN_FACTOR`` × the miss, if that is more; else it may shrink (NOTE [The margin
        follows the misses])."""
        if miss_bytes is None:
            return False
        self.misses.append(max(0, int(miss_bytes)))
        if miss_bytes > 0 and MISS_MARGIN_FACTOR * miss_bytes > self.margin_bytes:
            self.steps_without_growth = 0
            return self.raise_margin(int(MISS_MARGIN_FACTOR * miss_bytes) - self.margin_bytes)
        self.steps_without_growth += 1
        floor = max(self.least_margin_bytes, int(MISS_MARGIN_FACTOR * max(self.misses)))
        if self.steps_without_growth < MARGIN_CLEAN_STEPS or self.margin_bytes <= floor:
            return False
        self.margin_bytes = floor
        return True

    @property
    def slack_step_bytes(self) -> int:
        """How much one retry rule grows the slack, or shrinks it (NOTE [The slack is priced])."""
        return int(RETRY_SLACK_SHARE * (self.budget_bytes or 0))

    def after_alloc_retries(self, retry_ms: float | None = None, growth_ms: float = 0.0) -> bool:
        """The allocator released its cache to serve a steady step that cost ``retry_ms`` more
        (None: not measured, taken to cost more): the slack grows by :attr:`slack_step_bytes`, up to
        ``MAX_RETRY_SLACK_SHARE`` of the budget, if the retry cost more than ``growth_ms``, what the
        growth would add to the step's plan (NOTE [The slack is priced])."""
        self.clean_steps = 0
        return self.price_retry(retry_ms, growth_ms)

    def after_waiting_retry(self) -> bool:
        """A retry kept until its bucket's next clean step prices it (NOTE [The slack is priced]):
        the shrink's count starts again; nothing else changes yet."""
        self.clean_steps = 0
        return False

    def price_retry(self, retry_ms: float | None, growth_ms: float) -> bool:
        """The growth rule of :meth:`after_alloc_retries` alone (for a retry priced after the clean
        steps that came since it)."""
        if not self.budget_bytes:
            return False
        ceiling = int(MAX_RETRY_SLACK_SHARE * self.budget_bytes)
        if self.slack_bytes >= ceiling or (retry_ms is not None and retry_ms <= growth_ms):
            return False
        self.slack_bytes = min(ceiling, self.slack_bytes + self.slack_step_bytes)
        return True

    def after_clean_step(self) -> bool:
        """A steady step ran without a retry: after ``SHRINK_AFTER_CLEAN_STEPS`` in a row the slack
        shrinks by :attr:`slack_step_bytes`, not below where it started (returns whether it did)."""
        self.clean_steps += 1
        if self.clean_steps < SHRINK_AFTER_CLEAN_STEPS or self.slack_bytes <= self.start_slack_bytes:
            return False
        self.clean_steps = 0
        self.slack_bytes = max(self.start_slack_bytes, self.slack_bytes - self.slack_step_bytes)
        return True

    def learn_slack(self, unusable_bytes: int) -> bool:
        """Keep ``SLACK_FACTOR`` × ``unusable_bytes`` free for the allocator if that is more than now."""
        wanted = int(SLACK_FACTOR * unusable_bytes)
        if wanted <= self.slack_bytes:
            return False
        self.slack_bytes = self.start_slack_bytes = wanted  # measured: no shrink goes below it
        return True

    def after_oom(self, unusable_bytes: int) -> bool:
        """A step ran out of memory with ``unusable_bytes`` reserved but not allocated: the
        slack grows to explain what other streams' pools do not, else the margin by the budget over
        ``OOM_MARGIN_PARTS``."""
        if self.budget_bytes is None:
            return False
        self.steps_without_growth = 0
        if self.learn_slack(max(0, unusable_bytes - self.pool_bytes)):
            return True
        self.raise_margin(max(self.budget_bytes // OOM_MARGIN_PARTS, 1))
        self.least_margin_bytes = max(self.least_margin_bytes, self.margin_bytes)  # NOTE [The margin follows the misses]
        return True
