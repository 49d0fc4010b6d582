"""The planner is pure: table-driven cases (habit 4)."""

import itertools
import math
import random

import pytest

from _head_common import plan_with_head
from memfit.engine.plan.planner import (
    InfeasiblePlanError, Plan, PlanCache, _is_homogeneous, plan_blocks, plan_treatments, plan_with_parts,
)

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


def _brute_force(costs, savings, need):
    return min(
        (sum(costs[i] for i in s), s)
        for r in range(0, len(costs) + 1)
        for s in itertools.combinations(range(len(costs)), r)
        if sum(savings[i] for i in s) >= need
    )


def test_classes_match_brute_force():
    """Mixed stacks of classes of identical blocks (Swin stages, encoder/decoder layers):
    the enumeration that solves one class by division is exact, earliest blocks on ties."""
    rng = random.Random(0)
    for _ in range(150):
        n_classes = rng.randint(2, 5)
        pairs = [(rng.choice([0.5, 1.0, 1.5, 2.0]), rng.choice([0, 50, 120, 300, 410])) for _ in range(n_classes)]
        blocks = [rng.randrange(n_classes) for _ in range(rng.randint(3, 10))]
        costs = [pairs[c][0] for c in blocks]
        savings = [pairs[c][1] for c in blocks]
        if sum(savings) == 0 or _is_homogeneous(costs) and _is_homogeneous(savings):
            continue
        need = rng.randint(1, sum(savings))
        plan = plan_blocks(costs, savings, need)
        best_cost, best_set = _brute_force(costs, savings, need)
        assert sum(savings[i] for i in plan.blocks) >= need
        assert plan.cost_ms == pytest.approx(best_cost)
        assert plan.blocks == best_set  # costs are binary fractions: ties are exact, the smallest set wins
        # within a class the earliest blocks are taken
        for cls in set(zip(costs, savings)):
            members = [i for i, p in enumerate(zip(costs, savings)) if p == cls]
            taken = [i for i in plan.blocks if i in members]
            assert taken == members[: len(taken)]


def test_swin_sized_stack_plans_exactly():
    """A Swin-B-sized detector (classes of 2, 2, 18, 2, 6, 6 blocks): exact, every need."""
    sizes = [2, 2, 18, 2, 6, 6]
    pairs = [(1.0, 400), (1.2, 380), (1.5, 350), (2.0, 300), (0.4, 90), (0.3, 20)]
    costs = [pairs[c][0] for c, n in enumerate(sizes) for _ in range(n)]
    savings = [pairs[c][1] for c, n in enumerate(sizes) for _ in range(n)]
    for need in (1, 399, 400, 401, 2500, 7000, sum(savings)):
        plan = plan_blocks(costs, savings, need)
        # exact by DP over counts per class (small numbers: bytes are the units)
        best = {0: 0.0}
        for c, n in enumerate(sizes):
            nxt = {}
            for saved, cost in best.items():
                for k in range(n + 1):
                    s = min(need, saved + k * pairs[c][1])
                    v = cost + k * pairs[c][0]
                    if v < nxt.get(s, float("inf")):
                        nxt[s] = v
            best = nxt
        assert plan.saved_bytes >= need
        assert plan.cost_ms == pytest.approx(best[need])


def test_treatments_of_unlike_blocks_are_the_cheapest_that_cover_the_need():
    """The dynamic programme for stacks of unlike blocks (NOTE [Choosing treatments]) against
    every assignment of keep or one option per block: the same lowest cost, the need covered."""
    import itertools
    import random

    from memfit.engine.plan.planner import InfeasiblePlanError, plan_treatments

    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        n = rng.randint(2, 5)
        kinds = [rng.sample(["recompute", "selective", "offload"], rng.randint(1, 3)) for _ in range(n)]
        options = [[(kind, rng.randint(1, 200), round(rng.uniform(0.5, 20.0), 3)) for kind in ks] for ks in kinds]
        need = rng.randint(1, sum(max(o[1] for o in opts) for opts in options) + 50)
        covering = [pick for pick in itertools.product(*[[None, *opts] for opts in options]) if sum(o[1] for o in pick if o) >= need]
        if not covering:
            with pytest.raises(InfeasiblePlanError):
                plan_treatments(options, need)
            continue
        best = min(sum(o[2] for o in pick if o) for pick in covering)
        plan = plan_treatments(options, need)
        assert plan.saved_bytes >= need
        assert plan.cost_ms == pytest.approx(best, abs=1e-9), (options, need)
        checked += 1
    assert checked > 200


# The LM head as a part (NOTE [The head in the plan]): two recomputable blocks of 100 bytes at
# 10 ms each, a head that saves 300 bytes in 4 chunks (3 ms) or 450 in 8 (5 ms).
HEAD_BLOCKS = [[("recompute", 100, 10.0)]] * 2
HEAD = [("keep", 1, 0, 0.0), ("chunked", 4, 300, 3.0), ("chunked", 8, 450, 5.0)]
HEAD_CASES = [
    # (head options, need, expected blocks, expected head)
    pytest.param(HEAD, 0, (), ("keep", 1), id="budget-not-binding-keeps-head"),
    pytest.param(HEAD, -10, (), ("keep", 1), id="budget-slack-keeps-head"),
    pytest.param(HEAD, 250, (), ("chunked", 4), id="binding-fewest-chunks-that-fit"),
    pytest.param(HEAD, 301, (), ("chunked", 8), id="binding-more-chunks-beat-a-block"),
    pytest.param(HEAD, 500, (0,), ("chunked", 8), id="binding-head-and-a-block"),
    pytest.param(HEAD, 650, (0, 1), ("chunked", 8), id="binding-everything"),
    pytest.param([("keep", 1, 0, 0.0), ("chunked", 4, 300, 25.0)], 100, (0,), ("keep", 1), id="dear-chunking-loses-to-a-block"),
    pytest.param([("keep", 1, 0, 0.0), ("chunked", 4, 300, 25.0)], 250, (), ("chunked", 4), id="blocks-cannot-make-room-head-chunks"),
]


@pytest.mark.parametrize("head, need, blocks, expected_head", HEAD_CASES)
def test_plan_with_head_table(head, need, blocks, expected_head):
    plan = plan_with_head(HEAD_BLOCKS, head, need)
    assert (plan.blocks, plan.option("head")) == (blocks, expected_head)
    costs = dict(((o[0], o[1]), o[3]) for o in head)
    assert plan.cost_ms == pytest.approx(10.0 * len(blocks) + costs[expected_head])
    if need > 0:
        assert plan.saved_bytes >= need


def test_plan_with_head_cannot_fit_names_the_head():
    with pytest.raises(InfeasiblePlanError, match="saves 200 bytes and the head's treatments at most 450 bytes, 651 are needed"):
        plan_with_head(HEAD_BLOCKS, HEAD, 651)


def test_plan_with_head_without_a_head_is_the_blocks_plan():
    for need in (0, 100, 200):
        assert plan_with_head(HEAD_BLOCKS, (), need) == plan_treatments(tuple(map(tuple, HEAD_BLOCKS)), need)
        assert plan_with_head(HEAD_BLOCKS, (), need).option("head") is None


def test_head_label():
    assert Plan(()).part_labels().get("head") is None
    assert Plan(()).with_option("head", ("keep", 1)).part_labels()["head"] == "keep"
    assert Plan((0,)).with_option("head", ("chunked", 8)).part_labels()["head"] == "chunked:8"


def test_a_plan_from_a_records_treatments_is_the_plan_that_wrote_them():
    """Plan.from_treatments is by_treatment's inverse: the plan a step record ran, its head's included."""
    plan = Plan((0, 2, 3, 5), kinds=("elementwise", "recompute", "offload", "recompute")).with_option("head", ("chunked", 8))
    assert Plan.from_treatments(plan.by_treatment(), plan.parts) == plan
    assert Plan.from_treatments({"recompute": [4, 1]}) == Plan((1, 4))  # all recomputed: kinds normalised away
    assert Plan.from_treatments({}) == Plan(())


# NOTE [A bounded planner]: property tests over random stacks of unlike parts.
KINDS = ["recompute", "selective", "offload", "elementwise"]


def _random_stack(rng, n, byte_scale):
    """``n`` unlike parts of 1-4 treatments each, savings of ``byte_scale`` order (GPU-sized)."""
    return [
        [(kind, rng.randint(byte_scale // 10, byte_scale), round(rng.uniform(0.1, 30.0), 3)) for kind in rng.sample(KINDS, rng.randint(1, 4))]
        for _ in range(n)
    ]


def _most(options):
    return sum(max(o[1] for o in opts) for opts in options)


def _traced_peak_bytes(fn):
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_tight_end_of_unlike_blocks_plans_in_bounded_memory():
    """The case that took a host down: 26 unlike blocks, a need at 0.99 of what they save.
    A table sized in bytes asked 35 GiB; the bounded planner's tables are parts x resolution."""
    rng = random.Random(0)
    opts = [[("recompute", 180_000_000 + rng.randint(0, 9_999_999), 20.0),
             ("elementwise", 40_000_000 + rng.randint(0, 999_999), 3.0)] for _ in range(26)]
    most = _most(opts)
    for frac in (0.5, 0.99, 0.99999, 1.0):
        need = int(most * frac)
        plans = []
        peak = _traced_peak_bytes(lambda: plans.append(plan_treatments(opts, need)))
        assert plans[0].saved_bytes >= need
        assert peak < 26 * 1025 * 64, (frac, peak)  # a few int/float rows of 1,025 per part, not bytes


@pytest.mark.parametrize("seed", range(3))
def test_random_unlike_stacks_cover_the_need_in_bounded_memory(seed):
    """8-128 unlike parts, 1-4 treatments each, with and without head options, needs up to
    0.99999 of the most they save: every plan covers its need, and planning's memory is
    bounded by parts x resolution whatever the need (the proxy for its time: the table's cells)."""
    rng = random.Random(seed)
    for _ in range(5):
        n = rng.randint(8, 128)
        options = _random_stack(rng, n, rng.choice([10**6, 10**8, 10**9]))
        head = [("keep", 1, 0, 0.0)] + [("chunked", c, rng.randint(1, 10**9), rng.uniform(0.5, 40.0)) for c in (2, 4, 8, 16)]
        most = _most(options)
        for frac in (0.1, 0.5, 0.9, 0.999, 0.99999, 1.0):
            need = int(most * frac)
            for heads in ((), head):
                plans = []
                peak = _traced_peak_bytes(lambda: plans.append(plan_with_head(options, heads, need)))
                plan = plans[0]
                kinds = plan.treatments(n)
                saved = sum(next(o[1] for o in options[i] if o[0] == kinds[i]) for i in plan.blocks)
                head_saved = next((o[2] for o in heads if (o[0], o[1]) == plan.option("head")), 0)
                assert saved + head_saved >= need
                assert plan.saved_bytes == saved + head_saved
                assert peak < n * 1025 * 64 + 2**20, (n, frac, peak)


def test_planning_again_and_again_leaves_memory_flat():
    """Memory after many plans is what it was after a few: nothing grows per plan."""
    import tracemalloc

    rng = random.Random(7)
    stacks = [_random_stack(rng, rng.randint(8, 64), 10**9) for _ in range(4)]
    tracemalloc.start()
    try:
        def plan_all(times):
            for i in range(times):
                options = stacks[i % len(stacks)]
                plan_treatments(options, int(_most(options) * rng.uniform(0.5, 0.99999)))

        plan_all(20)
        before = tracemalloc.get_traced_memory()[0]
        plan_all(200)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after - before < 64 * 1024, (before, after)


@pytest.mark.parametrize("seed", range(4))
def test_bounded_plans_are_within_one_quantum_per_part_of_the_optimum(seed):
    """Stacks small enough to enumerate, a coarse resolution so that quantisation bites: the plan
    covers the need, costs no less than the exact optimum, and no more than the exact optimum of a
    need larger by one quantum per part, the quantum being min(need, slack) / resolution."""
    import numpy as np

    rng = random.Random(seed)
    resolution = 16
    checked = 0
    for _ in range(40):
        n = rng.randint(3, 7)
        options = _random_stack(rng, n, 10**9)
        combos = list(itertools.product(*[[None, *opts] for opts in options]))
        saved = np.array([sum(o[1] for o in c if o) for c in combos], dtype=np.int64)
        cost = np.array([sum(o[2] for o in c if o) for c in combos])
        most = _most(options)

        def optimum(need):
            return cost[saved >= need].min()

        for frac in (0.05, 0.3, 0.6, 0.9, 0.99, 0.99999, 1.0):
            need = max(1, int(most * frac))
            plan = plan_treatments(options, need, resolution)
            assert plan.saved_bytes >= need
            assert plan.cost_ms >= optimum(need) - 1e-9
            quantum = max(1, -(-min(need, most - need) // resolution))
            if need + n * quantum <= most:
                assert plan.cost_ms <= optimum(need + n * quantum) + 1e-9, (options, need)
                checked += 1
    assert checked > 100


def test_large_alike_stacks_plan_in_bounded_memory():
    """128 alike blocks with 4 treatments (too many counts to score one by one): the dynamic
    programme's counts, placed in treatment order, cover the need."""
    opts = [("recompute", 200_000_000, 20.0), ("selective", 150_000_000, 9.0), ("offload", 120_000_000, 6.0), ("elementwise", 40_000_000, 3.0)]
    order = {"recompute": 0, "selective": 1, "elementwise": 2, "offload": 3}
    options = [opts] * 128
    for frac in (0.2, 0.7, 0.99999):
        need = int(128 * 200_000_000 * frac)
        plans = []
        peak = _traced_peak_bytes(lambda: plans.append(plan_treatments(options, need, order=order)))
        plan = plans[0]
        assert plan.saved_bytes >= need
        assert peak < 128 * 1025 * 64
        ranks = [order[k] for k in plan.treatments(128) if k != "keep"]
        assert ranks == sorted(ranks)  # placed in order from the first block up
        assert plan.blocks == tuple(range(len(plan.blocks)))


def test_alike_counts_rows_are_every_assignment():
    """The count grid built a column at a time is the filtered product, row for row."""
    from memfit.engine.plan.planner import _counts

    for m in range(6):
        for t in range(1, 4):
            expected = sorted(c for c in itertools.product(range(m + 1), repeat=t) if sum(c) <= m)
            assert sorted(tuple(int(x) for x in row) for row in _counts(m, t)) == expected


@pytest.mark.parametrize("seed", range(8))
def test_alike_counts_scored_but_for_the_last_option_choose_as_every_count_does(seed, monkeypatch):
    """NOTE [Choosing treatments]: where every count of alike blocks per option is too many to score but those of
    all options but the last are not, the last one's count is the fewest that cover the need (every block left
    where it is priced below keep): the same choice, ties included, as scoring every count, and no dynamic
    programme (a 32-block stack with 5 options took it on every decision, 60% of a decision's time)."""
    import numpy as np

    from memfit.engine.plan import planner

    def no_dp(*args):
        raise AssertionError("the dynamic programme ran")

    rng = random.Random(seed)
    for _ in range(12):
        m, k = rng.randrange(3, 13), rng.randrange(2, 6)
        opts = tuple((f"t{j}", rng.randrange(1, 40) * 1_000_000, rng.choice([0.0, -0.5, 1.0, 2.0, round(rng.uniform(0.5, 9), 2)]))
                     for j in range(k))
        order = {o[0]: j for j, o in enumerate(opts)}
        grid = planner._counts(m, k)
        every = (grid, grid @ np.array([o[1] for o in opts], float), grid @ np.array([o[2] for o in opts], float), None)
        most = int(every[1].max())
        monkeypatch.setattr(planner, "_MAX_COMBINATIONS", math.comb(m + k - 1, k - 1))  # every count is one too many
        monkeypatch.setattr(planner, "_choose_by_dp", no_dp)
        reduced = planner._scored(opts, m)
        assert reduced is not None and reduced[3] is not None and len(reduced[0]) < len(grid)
        for need in sorted({1, most // 3, most // 2, most - 1, most, *(rng.randrange(1, most + 1) for _ in range(6))}):
            assert planner._alike(opts, m, need, order, 1024, reduced) == planner._alike(opts, m, need, order, 1024, every), (opts, m, need)
        monkeypatch.undo()


def test_alike_stacks_drop_the_beaten_options_before_scoring_all_but_the_last(monkeypatch):
    """16 alike blocks with 7 options, 2 of them beaten: every count of the 5 others is scored (20,349 rows), not
    every count of 6 of the 7 with the last apart (74,613 rows: on a 1B model's decisions, three times the time)."""
    from memfit.engine.plan import planner

    built = []
    counts = planner._counts.__wrapped__
    monkeypatch.setattr(planner, "_counts", lambda m, t: built.append((m, t)) or counts(m, t))
    opts = [("t0", 10_000_000, 1.0), ("t1", 50_000_000, 8.0), ("t2", 30_000_000, 9.0), ("t3", 20_000_000, 2.5),
            ("t4", 50_000_000, 7.0), ("t5", 35_000_000, 4.0), ("t6", 80_000_000, 12.0)]  # t1 beaten by t4, t2 by t5
    assert math.comb(16 + 7, 7) > planner._MAX_COMBINATIONS
    plan = plan_treatments([tuple(opts)] * 16, 16 * max(o[1] for o in opts) // 2)
    assert built == [(16, 5)] and not {"t1", "t2"} & set(plan.kinds)


@pytest.mark.parametrize("seed", range(6))
def test_alike_stacks_too_large_to_score_plan_the_least_cost_over_every_count(seed, monkeypatch):
    """12 alike blocks with 9 treatments (293,930 counts: more than are scored) are planned over the options no other
    beats, by scoring their counts, not by the dynamic programme (a GPU run's 28 blocks and 9 treatments spent most of
    its decisions there), exactly: the least cost of every count of blocks per treatment that covers the need
    (enumerated here in full)."""
    import numpy as np

    from memfit.engine.plan import planner
    from memfit.engine.plan.planner import _MAX_COMBINATIONS, _counts

    def no_dp(*args):
        raise AssertionError("the dynamic programme ran")

    monkeypatch.setattr(planner, "_choose_by_dp", no_dp)

    rng = random.Random(seed)
    opts = [(f"t{j}", rng.randrange(1, 100) * 1_000_000, round(rng.uniform(0.5, 20.0), 3)) for j in range(9)]
    opts[3] = (opts[3][0], opts[5][1], opts[5][2] + 1.0)  # beaten by t5: saves as much for more time
    m = 12
    grid = _counts(m, len(opts))
    assert len(grid) > _MAX_COMBINATIONS
    saved, cost = grid @ np.array([o[1] for o in opts], float), grid @ np.array([o[2] for o in opts], float)
    most = m * max(o[1] for o in opts)
    for frac in (0.05, 0.3, 0.6, 0.95, 1.0):
        need = int(most * frac)
        plan = plan_treatments([opts] * m, need)
        least = cost[saved >= need].min()
        assert plan.saved_bytes >= need and plan.cost_ms == pytest.approx(least, rel=1e-9), (frac, plan, least)
        assert "t3" not in plan.kinds


@pytest.mark.parametrize("seed", range(3))
def test_the_relaxations_bound_is_never_above_the_exact_optimum(seed):
    """NOTE [Parts beside the blocks]: ``Knapsack.lower_bound`` (each block's options on their lower convex hull,
    shares of two options allowed) is at most the least cost of every assignment that covers the need, and grows
    with the need; inf past what every block treated saves."""
    import numpy as np

    from memfit.engine.plan.planner import Knapsack

    rng = random.Random(seed)
    for n in range(30):
        options = _random_stack(rng, rng.randint(2, 6), 10**9)
        if n % 3 == 0:  # an option priced faster than keep (a cost below 0)
            options[0] = [(options[0][0][0], options[0][0][1], -5.0), *options[0][1:]]
        combos = list(itertools.product(*[[None, *opts] for opts in options]))
        saved = np.array([sum(o[1] for o in c if o) for c in combos], dtype=np.int64)
        cost = np.array([sum(o[2] for o in c if o) for c in combos])
        knapsack, most = Knapsack(options, 1024, None), _most(options)
        bounds = [knapsack.lower_bound(max(1, int(most * frac))) for frac in (0.01, 0.2, 0.5, 0.8, 0.99, 1.0)]
        assert bounds == sorted(bounds)
        for frac, bound in zip((0.01, 0.2, 0.5, 0.8, 0.99, 1.0), bounds):
            assert bound <= cost[saved >= max(1, int(most * frac))].min() + 1e-9
        assert knapsack.lower_bound(0) == 0.0 and knapsack.lower_bound(most + 1) == float("inf")
    one = Knapsack([[("recompute", 100, 10.0), ("selective", 60, 2.0)]] * 2, 1024, None)
    # each block: selective (60 bytes, 2 ms), then recompute's 40 more bytes at 8 ms more: cheapest per byte first
    assert [one.lower_bound(n) for n in (60, 120, 160)] == [2.0, 4.0, pytest.approx(12.0)]
    assert one.lower_bound(30) == pytest.approx(1.0) and one.lower_bound(200) == pytest.approx(20.0)


@pytest.mark.parametrize("seed", range(3))
def test_one_knapsack_plans_each_need_as_a_knapsack_made_for_it(seed):
    """A ``Knapsack`` keeps what it found of its stack (the alike stack's counts scored, the relaxation's steps) from
    one need to the next, as the search's asks use one (NOTE [Planning with the stashes back], search.py): each need's
    plan, estimates included, is the one a knapsack made for that need alone gives, infeasible where that one is."""
    from memfit.engine.plan.planner import Knapsack

    rng = random.Random(seed)
    for n in range(24):
        if n % 2:  # alike blocks: the counts scored, once
            block = [(kind, rng.randint(10**7, 10**8), round(rng.uniform(-2.0, 30.0), 3)) for kind in rng.sample(KINDS, rng.randint(1, 4))]
            options = [block] * rng.randint(2, 16)
        else:
            options = _random_stack(rng, rng.randint(2, 10), 10**8)
        most = _most(options)
        head = [("keep", 1, 0, 0.0), ("chunked", 8, rng.randint(0, most // 4), rng.uniform(-1.0, 5.0))]
        priced = [head[0], (*head[1][:3], head[1][3] + 2.0)]  # the same head priced anew: other parts
        stack = Knapsack(options)
        for i, need in enumerate([int(most * f) for f in (0.3, 0.1, 0.6, 0.6, 0.95, 1.2, 0.5)] + [most + head[1][2] // 2, -5]):
            parts = [("head", priced if i % 4 == 3 else head)] if n % 3 else []
            try:
                want = plan_with_parts(options, parts, need)
            except InfeasiblePlanError:
                with pytest.raises(InfeasiblePlanError):
                    stack.with_parts(parts, need)
                continue
            got = stack.with_parts(parts, need)
            assert (got.blocks, got.kinds, got.parts, got.cost_ms, got.saved_bytes) == \
                (want.blocks, want.kinds, want.parts, want.cost_ms, want.saved_bytes), (n, need)


@pytest.mark.parametrize("seed", range(3))
def test_parts_combinations_the_bound_rules_out_are_not_planned_and_the_plan_is_the_same(seed, monkeypatch):
    """NOTE [Parts beside the blocks]: combinations of the parts' options are planned cheapest bound first, and those
    whose bound is above the best plan found are not planned: the plan is the one every combination planned gives
    (ties to the earlier combination), for fewer plans of the blocks."""
    from memfit.engine.plan import planner

    rng = random.Random(seed)
    planned = {"n": 0, "on": False}
    real = planner.Knapsack.plan

    def counted(self, need):
        planned["n"] += planned["on"]
        return real(self, need)

    monkeypatch.setattr(planner.Knapsack, "plan", counted)
    searches = 0
    for _ in range(40):
        options = _random_stack(rng, rng.randint(4, 24), 10**8)
        most = _most(options)
        head = [("keep", 0, 0, 0.0)] + [("chunked", c, rng.randint(0, most // 8), rng.uniform(0.0, 20.0)) for c in (2, 4, 8, 16)]
        head.append(("chunked", 32, head[2][2], head[2][3]))  # a tie: the earlier combination wins
        parts = [("head", head), ("optimizer", [("keep", 0, 0, 0.0), ("per_tensor", 0, rng.randint(0, most // 16), 3.0)])]
        for frac in (0.2, 0.6, 0.9, 0.99):
            need = int(most * frac)
            with monkeypatch.context() as every:
                every.setattr(planner.Knapsack, "lower_bound", lambda self, need: 0.0)  # every combination planned
                whole = plan_with_parts(options, parts, need)
            planned["on"] = True
            plan = plan_with_parts(options, parts, need)
            planned["on"] = False
            searches += 1
            assert (plan.blocks, plan.kinds, plan.parts, plan.cost_ms) == (whole.blocks, whole.kinds, whole.parts, whole.cost_ms)
    assert planned["n"] < 0.5 * 12 * searches, planned  # of the 12 combinations, under half planned


@pytest.mark.parametrize("seed", range(6))
def test_a_few_odd_blocks_beside_an_alike_group_are_planned_exactly(monkeypatch, seed):
    """NOTE [A few odd blocks]: one or two blocks unlike an alike group (a LoRA stack's first block) are planned as
    their combinations beside the group, never by the quantised dynamic programme: the cheapest cover of every
    assignment of keep or one option per block, the group's treatments in their order from its first block up."""
    import itertools
    import random

    from memfit.engine.plan import planner
    from memfit.engine.plan.planner import InfeasiblePlanError, Knapsack

    def no_dp(*args, **kwargs):
        raise AssertionError("the dynamic programme planned a stack of a few odd blocks")

    monkeypatch.setattr(planner, "_choose_by_dp", no_dp)
    rng = random.Random(seed)
    order = {"recompute": 0, "host": 10, "tiled": 20}
    checked = 0
    for _ in range(40):
        group = [(name, rng.randint(1, 300), round(rng.uniform(0.1, 20.0), 3)) for name in rng.sample(sorted(order), rng.randint(2, 3))]
        odd = [[(name, rng.randint(1, 300), round(rng.uniform(0.1, 20.0), 3)) for name in rng.sample(sorted(order), rng.randint(1, 3))]
               for _ in range(rng.randint(1, 2))]
        m = rng.randint(3, 5)
        options = [*odd[:1], *[group] * m, *odd[1:]]  # the odd ones first and, for two, last
        need = rng.randint(1, sum(max(o[1] for o in opts) for opts in options))
        picks = [pick for pick in itertools.product(*[[None, *opts] for opts in options]) if sum(o[1] for o in pick if o) >= need]
        stack = Knapsack(options, order=order)
        assert stack._odd is not None
        if not picks:
            with pytest.raises(InfeasiblePlanError):
                stack.plan(need)
            continue
        plan = stack.plan(need)
        assert plan.saved_bytes >= need
        assert plan.cost_ms == pytest.approx(min(sum(o[2] for o in pick if o) for pick in picks), abs=1e-9)
        names = plan.treatments(len(options))
        inside = [names[i] for i in range(1, 1 + m)]
        treated = [n for n in inside if n != "keep"]
        assert inside[:len(treated)] == treated and treated == sorted(treated, key=order.__getitem__)  # placed in order
        checked += 1
    assert checked > 20


def test_every_block_re_run_finds_the_full_regime_where_no_mix_with_kept_blocks_fits():
    """NOTE [Every block re-run]: a plan that re-runs every block reads the full regime's transient, here far below
    the partial one, so it fits a room no need in bytes reaches (the kept stack's need is over what every block
    saves). The search plans it as its own stack: every block at its cheapest re-run, the knapsack choosing the host
    checkpoints that bring its own overshoot under the room: the cheapest of the every-block plans that fit."""
    import itertools
    from types import SimpleNamespace

    from memfit.engine.parts.treatments import resolve
    from memfit.engine.plan.model import MemoryModel
    from memfit.engine.plan.search import Search

    names = ("recompute", "host_checkpoint", "tiled_mlp")
    model = MemoryModel([0] * 4, treatments=resolve(names))
    group = model.group_models[0]
    for t in (16, 32, 64):
        key = (4, t)
        group.bytes["keep"].add(key, 1000.0 * t)
        group.bytes["recompute"].add(key, 50.0 * t)
        group.ms["recompute"].add(key, 0.01 * t)
        group.bytes_curve("host_checkpoint").add(key, 10.0 * t)
        group.ms_curve("host_checkpoint").add(key, 0.011 * t)
        group.bytes_curve("tiled_mlp").add(key, 400.0 * t)
        group.ms_curve("tiled_mlp").add(key, 0.001 * t)
        model.outside.add(key, 10.0 * t)
        model.transient_partial.add(key, 3000.0 * t)
        model.transient_full.add(key, 500.0 * t)
    key = (4, 64)
    registry = resolve(names)
    options = model.options(key, names)
    planning = SimpleNamespace(registry=registry, treatments=names, model=model,
                               plan_peak=lambda k, plan: int(model.plan_bytes(k, plan)))
    every = [Plan(tuple(range(4)), kinds=kinds) for kinds in itertools.product(("recompute", "host_checkpoint"), repeat=4)]
    peaks = sorted(int(model.plan_bytes(key, p)) for p in every)
    room = (peaks[0] + peaks[-1]) // 2  # some every-block plans fit, not all
    need = int(model.backward_start_bytes(key, Plan(()))) - room
    assert need > sum(max(o[1] for o in opts) for opts in options)  # no mix covers the kept stack's need

    search = Search(planning)
    assert search._mix_that_fits(key, options, need, room) is None
    plan = search._mix_that_fits(key, options, need, room, every=True)
    assert plan is not None and "keep" not in plan.treatments(4) and planning.plan_peak(key, plan) <= room
    costs = {"recompute": 0.01 * 64, "host_checkpoint": 0.011 * 64}
    fits = [sum(costs[n] for n in p.treatments(4)) for p in every if planning.plan_peak(key, p) <= room]
    assert plan.cost_ms == pytest.approx(min(fits))
    assert search._mix_that_fits(key, options, need, room, every=True, below=4 * 0.01 * 64) is None  # none cheaper


@pytest.mark.parametrize("later_fits", [True, False])
def test_a_fitting_leaner_re_run_is_kept_while_a_later_ask_may_cost_less(later_fits):
    """NOTE [Leaner re-runs]: the first ask's mix is over the room and its leaner twin fits at 21.5 ms; the next ask
    saves more for 5.0 ms. Where that fits it is the plan (the twin had ended the asks before); where it does not,
    the plan is the first twin, never a dearer twin of a later ask."""
    from types import SimpleNamespace

    from memfit.engine.parts.treatments import resolve
    from memfit.engine.plan.search import Search

    names = ("recompute", "recompute_tiled", "elementwise")
    options = [[("recompute", 100, 2.0), ("recompute_tiled", 100, 20.0), ("elementwise", 60, 1.5)]] * 4
    room = 1000

    def peak(key, plan):  # over the room but for the twins (21.5 ms and up) and, where it fits, the second ask's mix
        return room if plan.cost_ms >= 21.5 or (later_fits and plan.cost_ms == pytest.approx(5.0)) else room + 50

    planning = SimpleNamespace(registry=resolve(names), treatments=names, plan_peak=peak,
                               model=SimpleNamespace(offload_depth=lambda key: 1))
    plan = Search(planning)._mix_that_fits((1, 64), options, 150, room)
    assert plan is not None
    if later_fits:
        assert plan.cost_ms == pytest.approx(5.0) and sorted(plan.kinds) == ["elementwise", "elementwise", "recompute"]
    else:
        assert plan.cost_ms == pytest.approx(21.5) and sorted(plan.kinds) == ["elementwise", "recompute_tiled"]


def test_the_planners_examples_hold():
    """The docstrings' examples (plan_treatments, Plan, with_leaner_reruns, every_block_rerun, _frontier) run as
    written."""
    import doctest

    from memfit.engine.plan import planner

    result = doctest.testmod(planner)
    assert result.attempted >= 10 and result.failed == 0


def test_the_plan_cache_holds_a_bounded_number_of_plans_and_rows_dropping_the_oldest():
    """A run of many shapes, static buckets and places of the weights keeps its plans within ``MAX_CACHED``."""
    from memfit.engine.plan.planner import MAX_CACHED

    cache = PlanCache()
    for i in range(MAX_CACHED + 100):
        cache.put(((1, i), (0, ("host", 8))), Plan((i % 3,)))
        cache.put_row((i, 0), [])
    assert len(cache.items()) == MAX_CACHED and len(cache.rows) == MAX_CACHED
    assert cache.peek(((1, 0), (0, ("host", 8)))) is None  # the oldest went first
    assert cache.peek(((1, MAX_CACHED + 99), (0, ("host", 8)))).blocks == ((MAX_CACHED + 99) % 3,)
    cache.put(((1, MAX_CACHED + 99), (0, ("host", 8))), Plan((1,)))  # a key already held: replaced, nothing dropped
    assert len(cache.items()) == MAX_CACHED and cache.peek(((1, 100), (0, ("host", 8)))) is not None
