"""The room (engine/plan/room.py): the margin and the allocator's slack, and the only rules that grow them."""

from __future__ import annotations

import pytest
from test_model import _model

from memfit.engine.plan import learner
from memfit.engine.plan.learner import StepOutcome
from memfit.engine.plan.planner import Plan
from memfit.engine.plan.planning import BucketBias, ModelUpdate, Planning
from memfit.engine.plan.room import (
    ALLOCATOR_SLACK_BYTES,
    CLEAN_STEPS_KEPT,
    MAX_RETRY_SLACK_SHARE,
    RETRY_SLACK_SHARE,
    SHRINK_AFTER_CLEAN_STEPS,
    Room,
    StepTimes,
)
from memfit.engine.shapes import bucket_key


def _fitted_planning() -> Planning:
    """Four alike blocks under a 1 MB budget whose largest shapes need some of them recomputed."""
    planning = Planning(4, [0, 0, 0, 0], 1_000_000, margin_bytes=0, bucket_tokens=1)
    planning.model = _model([16, 32, 64])
    planning.static_bytes = 200_000
    return planning


@pytest.mark.parametrize(
    "budget, accounting, share, margin, slack",
    [
        (2**30, "cuda", None, int(0.03 * 2**30), 2**30 // 16),  # a small budget: a sixteenth as slack
        (2**40, "cuda", None, int(0.03 * 2**40), ALLOCATOR_SLACK_BYTES),
        (2**30, "logical", None, int(0.001 * 2**30), 0),  # no allocator, no slack
        (2**30, "cuda", 0.0, 0, 2**30 // 16),  # the caller's margin share
        (None, "cuda", None, 0, 0),  # no budget
    ],
)
def test_a_run_starts_with_its_accountings_room(budget, accounting, share, margin, slack):
    room = Room.for_run(budget, accounting, share)
    assert (room.margin_bytes, room.slack_bytes) == (margin, slack)


def test_a_run_that_cannot_survive_an_oom_starts_with_the_slack_it_may_need():
    """NOTE [Room where an OOM is fatal]: 1/24 of the budget, on CUDA only, never below the usual start."""
    from memfit.engine.plan.room import FATAL_OOM_SLACK_PARTS

    big = 40 * 2**30
    assert Room.for_run(big, "cuda").slack_bytes == ALLOCATOR_SLACK_BYTES
    fatal = Room.for_run(big, "cuda", oom_fatal=True)
    assert fatal.slack_bytes == big // FATAL_OOM_SLACK_PARTS > ALLOCATOR_SLACK_BYTES
    assert fatal.start_slack_bytes == fatal.slack_bytes  # shrinking never goes below it
    assert Room.for_run(2**20, "cuda", oom_fatal=True).slack_bytes == 2**20 // 16  # tiny budgets: the usual start
    assert Room.for_run(big, "logical", oom_fatal=True).slack_bytes == 0
    # other streams' pools, once read, come off that start (they were in it), down to the usual start
    start = fatal.slack_bytes
    assert fatal.learn_pools(2**28) and (fatal.slack_bytes, fatal.start_slack_bytes) == (start - 2**28, start - 2**28)
    assert fatal.learn_pools(4 * 2**30) and fatal.slack_bytes == fatal.start_slack_bytes == ALLOCATOR_SLACK_BYTES
    assert fatal.pool_bytes == 4 * 2**30
    usual = Room.for_run(big, "cuda")
    assert usual.learn_pools(2**30) and usual.slack_bytes == ALLOCATOR_SLACK_BYTES  # a replayable run's slack stays


def test_each_rule_says_whether_the_room_shrank():
    room = Room(1_000_000, margin_bytes=1000, slack_bytes=0)
    assert room.free_bytes == 999_000
    assert not room.after_miss(500)  # 1.25 x 500 < the margin
    assert room.after_miss(2000) and room.margin_bytes == 2500
    assert not room.after_miss(-10_000)  # over-predicted: the margin stays
    assert room.learn_slack(800) and room.slack_bytes == 1000
    assert not room.learn_slack(800)
    assert room.after_oom(10) and room.margin_bytes == 2500 + 1_000_000 // 20  # the slack explains nothing
    assert room.after_oom(8000) and room.slack_bytes == 10_000
    grown = [room.after_alloc_retries() for _ in range(6)]
    assert room.slack_bytes == int(MAX_RETRY_SLACK_SHARE * 1_000_000) and grown[-1] is False
    assert int(RETRY_SLACK_SHARE * 1_000_000) > 0
    assert not Room(None).after_alloc_retries() and not Room(None).after_oom(10)


def test_a_retry_grows_the_slack_only_when_it_cost_more_than_the_growth():
    """NOTE [The slack is priced]: unmeasured, a retry grows the slack; measured, only when its time
    is over what the growth would add to the plan."""
    room = Room(1_000_000, slack_bytes=1000)
    step = room.slack_step_bytes
    assert room.after_alloc_retries(None, 0.0) and room.slack_bytes == 1000 + step  # not measured yet
    assert not room.after_alloc_retries(retry_ms=4.0, growth_ms=10.0) and room.slack_bytes == 1000 + step
    assert room.after_alloc_retries(retry_ms=12.0, growth_ms=10.0) and room.slack_bytes == 1000 + 2 * step
    assert not room.after_alloc_retries(retry_ms=1.0, growth_ms=float("inf"))  # the growth could not fit


def test_the_slack_shrinks_back_after_clean_steps_but_never_below_its_start_or_an_oom():
    room = Room(1_000_000, slack_bytes=1000)
    room.after_alloc_retries()
    room.after_alloc_retries()
    assert room.slack_bytes == 1000 + 2 * room.slack_step_bytes
    shrank = [room.after_clean_step() for _ in range(SHRINK_AFTER_CLEAN_STEPS)]
    assert shrank == [False] * (SHRINK_AFTER_CLEAN_STEPS - 1) + [True] and room.slack_bytes == 1000 + room.slack_step_bytes
    for _ in range(SHRINK_AFTER_CLEAN_STEPS - 1):
        room.after_clean_step()
    room.after_alloc_retries(retry_ms=0.0, growth_ms=1.0)  # a retry (not worth growing for) restarts the count
    assert not any(room.after_clean_step() for _ in range(SHRINK_AFTER_CLEAN_STEPS - 1))
    assert room.after_clean_step() and room.slack_bytes == 1000
    assert not any(room.after_clean_step() for _ in range(3 * SHRINK_AFTER_CLEAN_STEPS))  # not below the start
    assert room.learn_slack(40_000) and room.slack_bytes == 50_000
    assert not any(room.after_clean_step() for _ in range(3 * SHRINK_AFTER_CLEAN_STEPS))  # an OOM measured it


def test_the_margin_shrinks_while_steps_keep_to_their_predictions():
    """NOTE [The margin follows the misses]: after MARGIN_CLEAN_STEPS steady steps without a growing
    miss, the margin shrinks in one step to the larger of the least share and 1.25 x the misses of
    the last MARGIN_MISS_STEPS; a miss grows it and restarts the count; an OOM's margin is a floor from then on."""
    from memfit.engine.plan.room import (
        LEAST_MARGIN_SHARE,
        MARGIN_CLEAN_STEPS,
        MARGIN_MISS_STEPS,
    )

    budget = 2**30
    room = Room.for_run(budget, "cuda")
    least = int(LEAST_MARGIN_SHARE["cuda"] * budget)
    assert room.start_margin_bytes == room.margin_bytes > least
    small = least // 2  # a miss inside the margin: no growth, but the floor reads it
    shrank = [room.after_miss(m) for m in [-2**20] * (MARGIN_CLEAN_STEPS - 1) + [small]]
    assert shrank == [False] * (MARGIN_CLEAN_STEPS - 1) + [True] and room.margin_bytes == least
    assert not any(room.after_miss(0) for _ in range(3 * MARGIN_CLEAN_STEPS)) and room.margin_bytes == least
    assert room.after_miss(2 * least) and room.margin_bytes == int(1.25 * 2 * least)  # grows, the count restarts
    assert not any(room.after_miss(0) for _ in range(MARGIN_MISS_STEPS - 1))  # the miss is among the last steps
    assert room.after_miss(0) and room.margin_bytes == least  # the grown miss has left them
    assert room.after_oom(0) and room.margin_bytes == least + budget // 20
    assert not any(room.after_miss(0) for _ in range(3 * MARGIN_CLEAN_STEPS))  # an OOM's margin is the floor
    assert room.start_margin_bytes == int(0.03 * budget)


@pytest.mark.parametrize("share, accounting, fatal, method_shrinks", [
    (0.1, "cuda", False, True), (None, "logical", False, True), (None, "cuda", True, True), (None, "cuda", False, False),
])
def test_the_margin_never_shrinks_when_set_by_the_caller_counted_where_an_oom_is_fatal_or_for_static(
    share, accounting, fatal, method_shrinks,
):
    room = Room.for_run(2**30, accounting, share, oom_fatal=fatal, margin_shrinks=method_shrinks)
    margin = room.margin_bytes
    assert not any(room.after_miss(-2**20) for _ in range(40)) and room.margin_bytes == margin


def test_step_times_price_a_retry_against_the_buckets_clean_steps():
    times = StepTimes()
    assert times.retry_ms((8, 64), 130.0) is None  # nothing to compare with yet
    for ms in (100.0, 104.0, 98.0, 300.0):  # a slow outlier moves a median little
        times.add_clean((8, 64), ms)
    assert times.retry_ms((8, 64), 130.0) == pytest.approx(28.0)
    assert times.retry_ms((8, 64), 90.0) == 0.0
    assert times.retry_ms((8, 128), 130.0) is None  # another bucket
    for _ in range(CLEAN_STEPS_KEPT):
        times.add_clean((8, 64), 120.0)
    assert times.retry_ms((8, 64), 130.0) == pytest.approx(10.0)  # the latest steps only


def test_planning_prices_the_growth_with_the_plan_of_the_smaller_room(monkeypatch):
    """Planning hands a steady step to the slack rules: clean steps are timed, a retry step priced
    against them and against ``slack_cost_ms``; the plans are dropped when the slack changes."""
    planning = Planning(4, [0, 0, 0, 0], 1_000_000, 0, 8, room=Room(1_000_000, slack_bytes=1000))
    for _ in range(3):
        assert not planning.apply(ModelUpdate(steady_key=(8, 64), net_ms=100.0))
    monkeypatch.setattr(planning.search, "slack_cost_ms", lambda key, extra: 0.5)
    # per step: 30 ms x 1 retry in (at least) RETRY_RATE_STEPS steps < 0.5 ms; then 80 ms x 2 of them > 0.5 ms, each
    # priced at the step after it (its aftermath: none here)
    assert not planning.apply(ModelUpdate(alloc_retries=True, steady_key=(8, 64), net_ms=130.0))
    assert not planning.apply(ModelUpdate(steady_key=(8, 64), net_ms=100.0))
    assert planning.slack_bytes == 1000
    planning.cache.put(((8, 64), 0), Plan((0,)))
    assert not planning.apply(ModelUpdate(alloc_retries=True, steady_key=(8, 64), net_ms=180.0))
    assert planning.apply(ModelUpdate(steady_key=(8, 64), net_ms=100.0))
    assert planning.slack_bytes == 1000 + planning.room.slack_step_bytes and not list(planning.cache.items())
    assert not planning.apply(ModelUpdate(alloc_retries=True, net_ms=500.0))  # no steady step: no rule


def test_a_retry_without_clean_steps_waits_for_its_buckets_next_clean_step(monkeypatch):
    """NOTE [The slack is priced]: a retry in a bucket with no clean step yet grows nothing; the
    bucket's next clean step prices it, and the slack grows then only if the retries cost more per
    step than the growth (a retry that cost more than one step's growth, but is rare, does not); a
    bucket that retries twice before any clean step grows the slack at once, and a retry with no
    step time grows it too (nothing to price it with)."""
    planning = Planning(4, [0, 0, 0, 0], 1_000_000, 0, 8, room=Room(1_000_000, slack_bytes=1000))
    monkeypatch.setattr(planning.search, "slack_cost_ms", lambda key, extra: 0.5)
    step = planning.room.slack_step_bytes
    # 20 ms once in RETRY_RATE_STEPS steps: 0.31 ms per step < 0.5; it waits, and its bucket's clean step keeps the slack
    assert not planning.apply(ModelUpdate(alloc_retries=True, steady_key=(8, 64), net_ms=120.0))
    assert not planning.apply(ModelUpdate(steady_key=(8, 64), net_ms=100.0)) and planning.slack_bytes == 1000
    # 80 ms, a second retry: 2.5 ms per step > 0.5; it waits, then grows the slack at its bucket's clean step
    assert not planning.apply(ModelUpdate(alloc_retries=True, steady_key=(8, 512), net_ms=280.0))
    assert not planning.apply(ModelUpdate(steady_key=(8, 64), net_ms=100.0))  # another bucket's clean step
    assert planning.slack_bytes == 1000
    planning.cache.put(((8, 512), 0), Plan((0,)))
    assert planning.apply(ModelUpdate(steady_key=(8, 512), net_ms=200.0))
    assert planning.slack_bytes == 1000 + step and not list(planning.cache.items())
    # twice before a clean step: at once
    assert not planning.apply(ModelUpdate(alloc_retries=True, steady_key=(8, 1024), net_ms=300.0))
    assert planning.apply(ModelUpdate(alloc_retries=True, steady_key=(8, 1024), net_ms=310.0))
    assert planning.slack_bytes == 1000 + 2 * step
    assert planning.apply(ModelUpdate(alloc_retries=True, steady_key=(8, 2048), net_ms=None))  # no time: at once
    assert planning.slack_bytes == 1000 + 3 * step


def test_a_growth_is_priced_per_step_over_the_latest_shapes(monkeypatch):
    """NOTE [The slack is priced]: the growth's price is the mean over the latest steady steps'
    shapes of what the smaller room adds to each one's plan (each shape priced once)."""
    planning = _fitted_planning()
    assert planning.search.growth_ms_per_step() == 0.0  # no steady step yet
    priced = []

    def cost(key, extra):
        priced.append(key)
        return {16: 0.0, 64: 3.0, 32: 1.0}[key[1]]

    monkeypatch.setattr(planning.search, "slack_cost_ms", cost)
    for key in [(4, 16), (4, 64), (4, 64), (4, 32)]:
        planning.room.times.note(key, False)
    assert planning.search.growth_ms_per_step() == pytest.approx((0 + 3 + 3 + 1) / 4)
    assert sorted(priced) == [(4, 16), (4, 32), (4, 64)]


def test_step_times_bound_a_clean_step_by_the_larger_buckets_nearest_above():
    """NOTE [A retry beside no clean step of its bucket]: the median of the medians of the BOUND_BUCKETS buckets
    nearest above in tokens, with at least the rows and the length, bounds a clean step from above; smaller or
    narrower buckets do not, nor larger ones further up."""
    times = StepTimes()
    assert times.bound_ms((8, 64)) is None and times.excess_ms((8, 64), 100.0) is None
    times.add_clean((8, 32), 50.0)  # shorter
    times.add_clean((4, 512), 60.0)  # fewer rows
    assert times.bound_ms((8, 64)) is None
    times.add_clean((8, 512), 300.0)
    assert times.bound_ms((8, 64)) == pytest.approx(300.0)
    times.add_clean((16, 128), 200.0)
    times.add_clean((16, 128), 220.0)
    assert times.bound_ms((8, 64)) == pytest.approx(255.0)  # the median of 210 (2,048 tokens) and 300 (4,096)
    times.add_clean((8, 128), 150.0)  # 1,024 tokens, the nearest: 150, 210, 300
    times.add_clean((8, 4096), 10.0)  # a fast step far above, beyond the three nearest: not read
    assert times.bound_ms((8, 64)) == pytest.approx(210.0)
    assert times.excess_ms((8, 64), 500.0) == pytest.approx(290.0) and times.excess_ms((8, 64), 100.0) == 0.0
    times.add_clean((8, 64), 120.0)
    assert times.excess_ms((8, 64), 500.0) == pytest.approx(380.0)  # its own bucket's clean steps first


def test_a_retry_in_a_new_bucket_is_priced_with_the_next_step_against_larger_buckets(monkeypatch):
    """NOTE [A retry beside no clean step of its bucket]: under SFT lengths a retry's bucket has no clean step; it is
    priced against larger buckets' clean steps one steady step later, that step's time over a clean one (the release's
    aftermath) added and not kept as a clean step; the slack grows where that costs more per step than the growth,
    not where less. Under the rule before, such retries waited for clean steps of their buckets that never came."""
    planning = Planning(4, [0, 0, 0, 0], 1_000_000, 0, 8, room=Room(1_000_000, slack_bytes=1000))
    monkeypatch.setattr(planning.search, "slack_cost_ms", lambda key, extra: 4.0)
    step = planning.room.slack_step_bytes
    for length in (3000, 2980):
        assert not planning.apply(ModelUpdate(steady_key=(3, length), net_ms=900.0))
    # a retry at 2700 that cost little in its own step; the step after it ran 350 ms over the bound
    assert not planning.apply(ModelUpdate(alloc_retries=True, steady_key=(3, 2700), net_ms=880.0))
    assert planning.room.times.after_retry_ms == 0.0 and planning.slack_bytes == 1000
    # 350 ms once in RETRY_RATE_STEPS steps: 5.5 ms per step > 4: the slack grows at the step after
    assert planning.apply(ModelUpdate(steady_key=(3, 2900), net_ms=1250.0))
    assert planning.slack_bytes == 1000 + step and bucket_key((3, 2900), 8) not in planning.room.times.clean_ms
    # a retry whose step and the next cost 100 ms: 2 retries x 100 / 64 = 3.1 ms per step < 4: no growth
    assert not planning.apply(ModelUpdate(alloc_retries=True, steady_key=(3, 1200), net_ms=950.0))
    assert not planning.apply(ModelUpdate(steady_key=(3, 1100), net_ms=950.0)) and planning.slack_bytes == 1000 + step


def test_the_step_after_a_retry_is_not_kept_as_a_clean_step():
    """NOTE [A retry beside no clean step of its bucket]: the step after a retry ran the release's aftermath; kept as a
    clean step it would raise its bucket's median and price the next retries low (here 50 ms instead of 200)."""
    planning = Planning(4, [0, 0, 0, 0], 1_000_000, 0, 8, room=Room(1_000_000, slack_bytes=1000))
    for _ in range(2):
        planning.apply(ModelUpdate(steady_key=(8, 64), net_ms=100.0))
    for _ in range(2):
        planning.apply(ModelUpdate(alloc_retries=True, steady_key=(8, 64), net_ms=130.0))  # 30 ms, and its aftermath
        planning.apply(ModelUpdate(steady_key=(8, 64), net_ms=400.0))  # its aftermath
    assert list(planning.room.times.clean_ms[(8, 64)]) == [100.0, 100.0]
    assert planning.room.times.retry_ms((8, 64), 300.0) == pytest.approx(200.0)


def test_a_retry_in_a_bucket_with_clean_steps_is_priced_with_its_aftermath(monkeypatch):
    """NOTE [The slack is priced]: under packed or fixed-length batches a retry's bucket has clean steps; its price
    waits one step and adds that step's time over a clean one (the release's aftermath). Priced at once, a retry that
    cost 10 ms in its own step and 300 in the next read 0.16 ms a step and the slack never grew."""
    planning = Planning(4, [0, 0, 0, 0], 1_000_000, 0, 8, room=Room(1_000_000, slack_bytes=1000))
    monkeypatch.setattr(planning.search, "slack_cost_ms", lambda key, extra: 1.0)
    for _ in range(2):
        planning.apply(ModelUpdate(steady_key=(8, 64), net_ms=100.0))
    assert not planning.apply(ModelUpdate(alloc_retries=True, steady_key=(8, 64), net_ms=110.0))
    assert planning.slack_bytes == 1000
    # (10 + 300) ms once in RETRY_RATE_STEPS steps: 4.8 ms per step > 1
    assert planning.apply(ModelUpdate(steady_key=(8, 64), net_ms=400.0))
    assert planning.slack_bytes == 1000 + planning.room.slack_step_bytes
    assert list(planning.room.times.clean_ms[(8, 64)]) == [100.0, 100.0]  # the aftermath is no clean step


def test_the_ranks_largest_shape_is_the_bucket_a_step_is_timed_in():
    """NOTE [A retry beside no clean step of its bucket]: under FSDP a step's time is the slowest rank's, so its clean
    time is kept in the bucket of the ranks' largest shape (``timed_key``), its plan's shape kept for the rest."""
    planning = Planning(4, [0, 0, 0, 0], 1_000_000, 0, 8, room=Room(1_000_000, slack_bytes=1000))
    planning.apply(ModelUpdate(steady_key=(3, 1000), timed_key=(3, 3000), net_ms=900.0))
    assert list(planning.room.times.clean_ms) == [(3, 3000)]
    assert list(planning.room.times.recent) == [((3, 1000), False)]  # the growth is priced at the rank's own shape


def test_step_times_keep_one_waiting_retry_per_bucket():
    times = StepTimes()
    assert times.waited_retry_ms((8, 64)) is None  # none kept
    assert not times.wait((8, 64), 130.0)
    times.add_clean((8, 64), 100.0)
    assert times.waited_retry_ms((8, 64)) == pytest.approx(30.0) and times.waited_retry_ms((8, 64)) is None
    assert not times.wait((8, 128), 130.0) and times.wait((8, 128), 140.0)  # the second before a clean step
    assert times.waited_retry_ms((8, 128)) is None  # handed back by the second: nothing kept


def test_slack_cost_is_the_recompute_a_smaller_room_adds():
    planning = _fitted_planning()
    key = (4, 60)
    assert planning.search.slack_cost_ms(key, 0) == 0.0
    k = planning.planned_shape(key)
    one_block, cost = planning.model.savings(k)[0], planning.model.costs(k)[0]
    assert planning.search.slack_cost_ms(key, one_block) == pytest.approx(cost)  # one more block to recompute
    assert planning.search.slack_cost_ms(key, 10**15) == float("inf")
    assert Planning(4, [0] * 4, 1_000_000, 0, 1).search.slack_cost_ms(key, one_block) == 0.0  # no model yet


def _steady(planning, key, observed):
    """A steady step at ``key`` that ran its plan and peaked at ``observed`` (a synthetic meter)."""
    plan = planning.plan_for(key)
    predicted = planning.predict_peak(key, plan)
    outcome = StepOutcome(key=key, plan=plan, warmup=False, outside=0, by_block=[0] * 4, static=planning.static_bytes,
                          peak=observed, plain_peak=observed, transient=None)
    return predicted, planning.apply(learner.note_bias(planning, outcome, predicted))


def test_a_bias_seen_twice_in_a_bucket_is_corrected_by_its_median():
    """NOTE [Bias per bucket]: two steady steps of a bucket over-predicted by more than 1% of the
    budget correct its predictions; the plans are redone and treat less; other buckets keep theirs."""
    planning = _fitted_planning()
    key, other = (4, 60), (4, 20)
    before, other_plan = planning.plan_for(key), planning.plan_for(other)
    other_before = planning.predict_peak(other, other_plan)
    predicted, changed = _steady(planning, key, planning.predict_peak(key, before) - 200_000)
    assert not changed and planning.predict_peak(key, before) == predicted  # once is not a bias
    predicted, changed = _steady(planning, key, predicted - 300_000)
    assert changed and [k for (k, _), _ in planning.cache.items()] == [other]  # only its bucket's plans dropped
    assert planning.predict_peak(key, before) == predicted - 250_000  # the median of 200 kB and 300 kB
    assert len(planning.plan_for(key).blocks) < len(before.blocks)
    assert planning.predict_peak(other, planning.plan_for(other)) == other_before
    # the corrected bucket's next errors are measured against the corrected prediction
    predicted, changed = _steady(planning, key, planning.predict_peak(key, planning.plan_for(key)) - 5_000)
    assert not changed  # within 1% of the budget


def test_small_or_alternating_errors_correct_nothing_and_new_curves_drop_corrections():
    planning = _fitted_planning()
    key = (4, 60)
    for error in (5_000, -8_000, 9_000, -5_000, 20_000, -20_000, 20_000):  # small, or the sign changes
        predicted = planning.predict_peak(key, planning.plan_for(key))
        assert not _steady(planning, key, predicted - error)[1]
    predicted = planning.predict_peak(key, planning.plan_for(key))
    assert not _steady(planning, key, predicted + 30_000)[1]
    assert _steady(planning, key, predicted + 30_000)[1]  # -30 kB twice: under-predicted, raised
    assert planning.predict_peak(key, planning.plan_for(key)) == predicted + 30_000
    planning.apply(ModelUpdate(samples=[(("outside",), key, 1.0)]))
    assert not planning.bias.correction
    assert learner.note_bias(planning, StepOutcome(key=key, plan=Plan(()), warmup=True, outside=0, by_block=[],
                                                   static=0, peak=0, plain_peak=0, transient=None), 10) == ModelUpdate()


def test_a_bias_that_depends_on_the_plan_is_corrected_by_the_least_one():
    """Two plans of one bucket over-predicted by 300 kB and 150 kB: the bucket is corrected by
    150 kB, so neither is then predicted under what it peaked at (NOTE [Bias per bucket])."""
    bias = BucketBias()
    bucket, a, b, tolerance = (4, 64), Plan((0, 1, 2)), Plan((0, 1)), 10_000
    assert not bias.observe(bucket, a, 300_000, tolerance)
    assert bias.observe(bucket, a, 300_000, tolerance) and bias.correction[bucket] == 300_000
    # b, measured against the corrected prediction, is under it: once is enough to lower the correction
    assert bias.observe(bucket, b, 150_000 - 300_000, tolerance) and bias.correction[bucket] == 150_000
    assert not bias.observe(bucket, b, 0, tolerance)
    assert not bias.observe(bucket, a, 300_000 - 150_000, tolerance)  # a's own bias is still 300 kB: no change


def test_a_bias_near_the_tolerance_does_not_toggle_its_buckets_correction():
    """NOTE [Bias per bucket]: a correction changes only where the least bias moved by more than the
    tolerance from it; a bias that wanders around the tolerance on noise keeps the correction it
    has (zeroed below the tolerance, it toggled and replanned its bucket every few steps)."""
    bias = BucketBias()
    bucket, a, tolerance = (4, 40), Plan((0, 1)), 10_000
    assert not bias.observe(bucket, a, 10_500, tolerance)
    assert bias.observe(bucket, a, 10_500, tolerance) and bias.correction[bucket] == 10_500
    for raw in (9_500, 9_000, 11_000, 9_800, 10_200):  # measured against the corrected prediction
        assert not bias.observe(bucket, a, raw - bias.correction[bucket], tolerance)
    assert bias.correction[bucket] == 10_500
    # the plan now peaks 5 kB above its uncorrected prediction: once is noise, twice moves the correction
    assert not bias.observe(bucket, a, -5_000 - bias.correction[bucket], tolerance)
    assert bias.observe(bucket, a, -5_000 - bias.correction[bucket], tolerance) and bias.correction[bucket] == -5_000


def test_over_predictions_in_every_bucket_lower_every_buckets_prediction_by_the_least():
    """NOTE [Over-prediction across buckets]: four steady steps in a row, in three buckets, each
    over-predicted by more than 1% of the budget, lower the prediction of every bucket without a
    correction of its own by the least of them, one never seen too; the plans are redone and
    treat less. One under-prediction, or new curves, drops it."""
    planning = _fitted_planning()
    fresh = (4, 50)
    fresh_before = planning.predict_peak(fresh, planning.plan_for(fresh))
    long_plan = planning.plan_for((4, 64))
    for key, over in (((4, 60), 40_000), ((4, 20), 60_000), ((4, 40), 30_000)):
        predicted = planning.predict_peak(key, planning.plan_for(key))
        assert not _steady(planning, key, predicted - over)[1]  # fewer than RUN_BIAS_STEPS
    predicted = planning.predict_peak((4, 60), planning.plan_for((4, 60)))
    assert _steady(planning, (4, 60), predicted - 50_000)[1]
    assert planning.run_bias.offset == 30_000 and not list(planning.cache.items())
    assert planning.predict_peak(fresh, planning.plan_for(fresh)) == fresh_before - 30_000
    assert len(planning.plan_for((4, 64)).blocks) <= len(long_plan.blocks)
    # a step predicted (before any correction) under its peak drops the offset
    predicted = planning.predict_peak((4, 20), planning.plan_for((4, 20)))
    assert _steady(planning, (4, 20), predicted + 35_000)[1]  # 30 kB lowered, 35 kB under: raw -5 kB
    assert planning.run_bias.offset == 0.0
    assert planning.predict_peak(fresh, planning.plan_for(fresh)) == fresh_before
    # refilled, then new curves drop it
    for key in ((4, 60), (4, 20), (4, 40), (4, 60)):
        _steady(planning, key, planning.predict_peak(key, planning.plan_for(key)) - 40_000)
    assert planning.run_bias.offset == 40_000
    planning.apply(ModelUpdate(samples=[(("outside",), (4, 60), 1.0)]))
    assert planning.run_bias.offset == 0.0


def test_the_runs_offset_lowers_only_shapes_within_the_range_of_its_steps():
    """NOTE [Over-prediction across buckets]: the offset lowers buckets within the range of the
    steps behind it; a longer shape keeps the envelope until a step that long joins them, and so
    does a shorter one."""
    planning = _fitted_planning()
    longer, shorter, shortest = (4, 64), (4, 30), (4, 16)
    longer_before = planning.predict_peak(longer, planning.plan_for(longer))
    shorter_before = planning.predict_peak(shorter, planning.plan_for(shorter))
    shortest_before = planning.predict_peak(shortest, planning.plan_for(shortest))
    for key in ((4, 40), (4, 20), (4, 40), (4, 60)):
        _steady(planning, key, planning.predict_peak(key, planning.plan_for(key)) - 40_000)
    assert planning.run_bias.offset == 40_000 and (planning.run_bias.min_tokens, planning.run_bias.max_tokens) == (80, 240)
    assert planning.predict_peak(shorter, planning.plan_for(shorter)) == shorter_before - 40_000
    assert planning.predict_peak(longer, planning.plan_for(longer)) == longer_before
    assert planning.predict_peak(shortest, planning.plan_for(shortest)) == shortest_before
    planning.cache.put((longer, 0), Plan((0,)))
    assert _steady(planning, longer, planning.predict_peak(longer, planning.plan_for(longer)) - 45_000)[1]
    assert planning.run_bias.max_tokens == 256 and not list(planning.cache.items())  # the plans are redone
    assert planning.predict_peak(longer, planning.plan_for(longer)) == longer_before - 40_000


def test_a_run_where_an_oom_is_fatal_keeps_the_envelope():
    """Under FSDP over several ranks a step predicted under its peak is not replayed: the run's
    offset is learnt but not applied (NOTE [Over-prediction across buckets])."""
    planning = _fitted_planning()
    planning.room.oom_fatal = True
    fresh = (4, 50)
    fresh_before = planning.predict_peak(fresh, planning.plan_for(fresh))
    for key in ((4, 60), (4, 20), (4, 40), (4, 60)):
        _steady(planning, key, planning.predict_peak(key, planning.plan_for(key)) - 40_000)
    assert planning.run_bias.offset == 40_000
    assert planning.predict_peak(fresh, planning.plan_for(fresh)) == fresh_before


def test_retries_in_a_row_grow_the_slack_though_no_bucket_repeats(monkeypatch):
    """NOTE [The slack is priced]: steady steps that all retry, each in a bucket of its own (uneven lengths under
    FSDP, where no clean step ever comes to price one), grow the slack every RETRY_STREAK steps; a clean step
    between them starts the count again."""
    from memfit.engine.plan.room import RETRY_STREAK

    planning = Planning(4, [0, 0, 0, 0], 1_000_000, 0, 8, room=Room(1_000_000, slack_bytes=1000))
    monkeypatch.setattr(planning.search, "slack_cost_ms", lambda key, extra: 0.5)
    step = planning.room.slack_step_bytes
    lengths = iter(range(64, 64 + 8 * 100, 8))
    grown = [planning.apply(ModelUpdate(alloc_retries=True, steady_key=(8, next(lengths)), net_ms=300.0))
             for _ in range(2 * RETRY_STREAK)]
    assert grown == ([False] * (RETRY_STREAK - 1) + [True]) * 2 and planning.slack_bytes == 1000 + 2 * step
    assert not planning.apply(ModelUpdate(steady_key=(8, next(lengths)), net_ms=100.0))  # clean: the count restarts
    assert not any(planning.apply(ModelUpdate(alloc_retries=True, steady_key=(8, next(lengths)), net_ms=300.0))
                   for _ in range(RETRY_STREAK - 1))
    assert planning.slack_bytes == 1000 + 2 * step


def test_step_times_keep_a_bounded_number_of_buckets():
    """A run that meets a new shape bucket every step keeps at most BUCKETS_KEPT buckets' clean steps and waiting
    retries, the latest ones (NOTE [The slack is priced]): host memory bounded whatever the run's length."""
    from memfit.engine.plan.room import BUCKETS_KEPT

    times = StepTimes()
    times.add_clean((8, -1), 90.0)
    for n in range(3 * BUCKETS_KEPT):
        if n % 16 == 0:
            times.add_clean((8, -1), 90.0)  # a bucket seen again and again stays
        times.add_clean((8, n), 100.0)
        times.wait((4, n), 120.0)
    assert len(times.clean_ms) == len(times.waiting_ms) == BUCKETS_KEPT
    assert (8, 3 * BUCKETS_KEPT - 1) in times.clean_ms and (8, 0) not in times.clean_ms and (8, -1) in times.clean_ms


def test_other_streams_pools_are_kept_free_apart_from_the_slack():
    """NOTE [Other streams' pools]: the most the pools were read to hold free is kept free, apart from the slack (its
    retry ceiling untouched); Planning drops its plans when it grows; an OOM's unusable bytes grow the slack only by
    what the pools do not explain."""
    budget = 1_000_000
    room = Room(budget, margin_bytes=1000, slack_bytes=2000)
    assert not room.learn_pools(None) and not room.learn_pools(0)
    assert room.learn_pools(50_000) and room.free_bytes == budget - 1000 - 2000 - 50_000
    assert not room.learn_pools(30_000) and room.pool_bytes == 50_000  # the most read
    assert room.allocator_bytes == 52_000 and room.kept_bytes == 53_000 == budget - room.free_bytes
    assert room.after_oom(40_000) and room.slack_bytes == 2000 and room.margin_bytes > 1000  # the pools explain it
    assert room.after_oom(90_000) and room.slack_bytes == int(1.25 * 40_000)  # the rest is the slack's
    for _ in range(8):  # retries grow the slack up to its ceiling, the pools beside it
        room.after_alloc_retries(None)
    assert room.slack_bytes == int(MAX_RETRY_SLACK_SHARE * budget) and room.pool_bytes == 50_000

    planning = Planning(4, [0, 0, 0, 0], budget, 0, 8, room=Room(budget))
    planning.cache.put(((8, 64), 0), Plan((0,)))
    assert not planning.apply(ModelUpdate(pool_bytes=None)) and list(planning.cache.items())
    assert planning.apply(ModelUpdate(pool_bytes=10_000)) and not list(planning.cache.items())
    assert planning.room_bytes == budget - 10_000
    outcome = StepOutcome(key=(8, 64), plan=Plan(()), warmup=True, outside=0, by_block=[0] * 4, static=0, peak=0,
                          plain_peak=0, transient=None, pool_bytes=20_000)
    assert learner.grow_slack(planning, outcome).pool_bytes == 20_000  # a warm-up step's reading is learnt too
