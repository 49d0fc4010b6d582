"""The planner is pure: table-driven cases (habit 4)."""

import itertools

import pytest

from memfit.planner import InfeasiblePlanError, PlanCache, plan_blocks

CASES = [
    # (costs, savings, need, expected blocks)
    pytest.param([1, 1, 1, 1], [100, 100, 100, 100], 0, (), id="budget-not-binding"),
    pytest.param([1, 1, 1, 1], [100, 100, 100, 100], -50, (), id="budget-slack"),
    pytest.param([1, 1, 1, 1], [100, 100, 100, 100], 100, (0,), id="homogeneous-one"),
    pytest.param([1, 1, 1, 1], [100, 100, 100, 100], 101, (0, 1), id="homogeneous-rounds-up"),
    pytest.param([1, 1, 1, 1], [100, 100, 100, 100], 400, (0, 1, 2, 3), id="homogeneous-all"),
    pytest.param([5, 1, 1], [300, 100, 100], 200, (1, 2), id="mixed-two-cheap-beat-one-dear"),
    pytest.param([1, 1, 5], [100, 100, 300], 350, (0, 2), id="mixed-dear-block-needed"),
    pytest.param([2, 3, 1], [200, 300, 50], 300, (1,), id="mixed-single-best"),
    pytest.param([1, 4, 4, 1], [10, 400, 400, 10], 400, (1,), id="mixed-earliest-on-tie"),
]


@pytest.mark.parametrize("costs, savings, need, expected", CASES)
def test_plan_table(costs, savings, need, expected):
    plan = plan_blocks(costs, savings, need)
    assert plan.blocks == expected
    if expected:
        assert plan.saved_bytes >= need


def test_infeasible_raises():
    with pytest.raises(InfeasiblePlanError, match="saves 300 bytes, 301 are needed"):
        plan_blocks([1, 1, 1], [100, 100, 100], 301)


def test_knapsack_matches_brute_force():
    costs = [3.0, 1.0, 2.5, 0.5, 4.0, 1.5]
    savings = [700, 150, 520, 90, 1000, 260]
    for need in range(100, sum(savings) + 1, 137):
        best = min(
            (sum(costs[i] for i in s), s)
            for r in range(1, len(costs) + 1)
            for s in itertools.combinations(range(len(costs)), r)
            if sum(savings[i] for i in s) >= need
        )
        plan = plan_blocks(costs, savings, need)
        assert sum(savings[i] for i in plan.blocks) >= need
        assert plan.cost_ms == pytest.approx(best[0])


def test_cache_counts_hits():
    cache = PlanCache()
    assert cache.get("k") is None
    cache.put("k", plan_blocks([1], [1], 1))
    assert cache.get("k").blocks == (0,)
    assert (cache.hits, cache.misses) == (1, 1)
    cache.clear()
    assert cache.get("k") is None
