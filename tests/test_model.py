"""The memory model: envelopes, the two transient regimes, persistence, and what planning does with them."""

import dataclasses

import numpy as np
import pytest

from memfit.engine.plan.model import Curve, MemoryModel
from memfit.engine.shapes import bucket_key, shape_key
from memfit.engine.plan.planner import Plan, plan_blocks
from memfit.engine.plan.learner import would_plan_less
from memfit.engine.plan.planning import Planning


def test_shape_and_bucket_keys():
    assert shape_key([8, 100, 768]) == (8, 100)
    assert shape_key([2, 3, 32, 32]) == (2, 1024)
    assert shape_key([4, 16]) == (4, 1)
    assert bucket_key((8, 100), 16) == (8, 112)
    assert bucket_key((8, 112), 16) == (8, 112)
    assert bucket_key((8, 100), 1) == (8, 100)


def test_curve_is_an_upper_envelope():
    curve = Curve()
    samples = {(4, 10): 1000.0, (4, 20): 2100.0, (4, 40): 3900.0, (8, 30): 6100.0}
    for key, y in samples.items():
        curve.add(key, y)
    for key, y in samples.items():
        assert curve(key) >= y - 1e-6
    assert curve((4, 0)) >= 0.0  # floored at 0 by default


def test_a_size_curve_outside_its_samples_is_bounded_by_its_extreme_samples():
    """NOTE [Sizes outside the samples]: three clustered samples of bytes linear in tokens,
    1% noise: the quadratic through them bends to nothing 20% below them and 10% above them
    (as on the H200 Swin-B detector). Outside them the curve gives at least its nearest
    extreme sample's value scaled by the tokens (below: exactly that). A curve without a
    floor (a transient) keeps its fit."""
    import numpy as np

    samples = {(16, 78400): 0.99, (16, 84672): 1.01, (16, 86240): 0.99}  # bytes per token, noisy
    curve, transient = Curve(), Curve(floor=None)
    for (n, t), per_token in samples.items():
        curve.add((n, t), per_token * 20_000 * n * t)
        transient.add((n, t), per_token * 20_000 * n * t)

    def fit(t):  # the quadratic alone
        curve((16, 80000))
        return sum(c * f for c, f in zip(curve.coef, [16.0, 16.0 * t, 16.0 * t * t])) + curve.shift

    assert fit(65856) < 0.5 * 20_000 * 16 * 65856 and fit(94080) < 0.8 * 20_000 * 16 * 94080  # far below the truth
    smallest, largest = curve((16, 78400)), curve((16, 86240))
    assert curve((16, 65856)) == smallest * float(16 * 65856) / float(16 * 78400) >= 0.99 * 20_000 * 16 * 65856
    assert curve((8, 78400)) == smallest / 2
    assert curve((16, 94080)) == largest * float(16 * 94080) / float(16 * 86240) >= 0.99 * 20_000 * 16 * 94080
    assert curve((16, 80000)) == fit(80000)  # inside: the fit
    assert transient((16, 65856)) != transient((16, 78400))
    ts = np.array([1000, 65856, 78399, 78400, 80000, 86240, 86241, 94080])
    values = [c.values(16, ts) for c in (curve, transient)]
    assert values[0].tolist() == [curve((16, int(t))) for t in ts]
    assert values[1].tolist() == [transient((16, int(t))) for t in ts]


def test_curve_without_floor_goes_negative():
    curve = Curve(intercept=True, floor=None)
    for t in (10, 20, 40):
        curve.add((4, t), -100.0 * 4 * t)
    assert curve((4, 30)) == pytest.approx(-12000.0, rel=1e-6)


def _model(partial_keys):
    model = MemoryModel([0, 0, 0, 0])
    group = model.group_models[0]
    for t in (16, 32, 64, 128):
        key = (4, t)
        group.bytes["keep"].add(key, 1000.0 * 4 * t)
        group.bytes["recompute"].add(key, 100.0 * 4 * t)
        group.ms["recompute"].add(key, 0.01 * t)
        model.outside.add(key, 50.0 * 4 * t)
        model.transient_full.add(key, 300.0 * 4 * t)
    for t in partial_keys:
        model.transient_partial.add((4, t), -200.0 * 4 * t)
    return model


def test_partial_regime_only_interpolates():
    model = _model([16, 32, 64])
    assert model.transient((4, 48), every_block=False) == pytest.approx(-200.0 * 4 * 48, rel=1e-6)
    assert model.transient((4, 48), every_block=True) == pytest.approx(300.0 * 4 * 48, rel=1e-6)
    # beyond the longest partial sample: the conservative full-regime curve
    assert model.transient((4, 128), every_block=False) == pytest.approx(300.0 * 4 * 128, rel=1e-6)
    # below the shortest partial sample: the full-regime curve too
    assert model.transient((4, 8), every_block=False) == pytest.approx(300.0 * 4 * 8, rel=1e-6)
    # a single shape seen: not used at all
    assert _model([16]).transient((4, 16), every_block=False) == pytest.approx(300.0 * 4 * 16, rel=1e-6)
    assert _model([16, 32]).transient((4, 24), every_block=False) == pytest.approx(-200.0 * 4 * 24, rel=1e-6)


def test_above_the_partial_range_the_parts_apart_carry_the_gap_up():
    """NOTE [Above the partial range]: with the parts' moment read apart, a partial plan above the partial curve's
    largest sample reads the full curve less the gap between the two there (never more than the full curve); below
    the range, and in a model that does not read the parts apart, the full curve as before. The planner's rows read
    the same values as a single shape."""
    model = _model([16, 32, 64])
    model.parts_apart = True
    gap = model.transient_full((4, 64)) - model.transient_partial((4, 64))
    assert gap > 0
    for t in (64, 96, 128, 300):
        expected = model.transient_full((4, t)) - gap if t > 64 else model.transient_partial((4, t))
        assert model.transient((4, t), every_block=False) == pytest.approx(expected, rel=1e-9)
        assert model.transient((4, t), every_block=False) < model.transient((4, t), every_block=True)
    assert model.transient((4, 8), every_block=False) == pytest.approx(300.0 * 4 * 8, rel=1e-6)  # below: full
    assert model.transient((4, 128), every_block=True) == pytest.approx(300.0 * 4 * 128, rel=1e-6)
    ts = np.array([8, 16, 48, 64, 66, 72, 128, 300])
    row = model._values(4, ts)["transient"]
    assert row.tolist() == [model._values(4, int(t))["transient"] for t in ts]
    # one shape seen: itself, and the gap above it
    single = _model([64])
    single.parts_apart = True
    assert single.transient((4, 64), every_block=False) == pytest.approx(single.transient_partial((4, 64)))
    assert single.transient((4, 100), every_block=False) < single.transient_full((4, 100))
    assert single.transient((4, 32), every_block=False) == pytest.approx(300.0 * 4 * 32, rel=1e-6)
    # a partial curve above the full one where it was read: the full curve, never more
    over = _model([16, 32, 64])
    over.parts_apart = True
    over.transient_partial.add((4, 64), 1e9)
    assert over.transient((4, 128), every_block=False) == pytest.approx(300.0 * 4 * 128, rel=1e-6)
    # the parts not apart: the full curve above the range, as before
    assert _model([16, 32, 64]).transient((4, 128), every_block=False) == pytest.approx(300.0 * 4 * 128, rel=1e-6)


def test_without_a_full_sample_both_regimes_read_the_partial_transient():
    """A run warmed up on the floor never recomputes every block plainly: its one measured transient, the partial
    one, is read for both regimes and at any length (an empty full curve read 0, and a chunked head's saving, which
    holds the kept head's transient, came off nothing: 64k-token plans keeping 60 GiB too much were predicted to fit)."""
    model = MemoryModel([0, 0])
    model.transient_partial.add((1, 64), 5000.0)
    for every in (True, False):
        assert model.transient((1, 64), every_block=every) == pytest.approx(5000.0)
        assert model.transient((1, 128), every_block=every) == pytest.approx(model.transient_partial((1, 128)))
    assert model.transient_partial((1, 128)) > 5000.0
    model.transient_full.add((1, 64), 7000.0)  # a full sample once there is one
    assert model.transient((1, 64), every_block=True) == pytest.approx(7000.0)


def test_a_transient_below_its_samples_is_at_least_the_chord_from_zero():
    """NOTE [Transients below the samples]: warm-up saw long batches only (a 256k-vocabulary model's full
    transient on an H200, convex in the tokens); the line through them, extrapolated to a short batch, gave
    a quarter less than that batch then held (7.0 GB, read), and the step ran out of memory. Below the samples the
    transient is at least the chord from zero to the smallest sample; one that is negative there (gradients
    dominate) keeps its fit, falling with the tokens."""
    warm = Curve(intercept=True, floor=None, linear_until=6)
    for key, y in (((8, 961), 16056860552.0), ((8, 1206), 20178155584.0), ((8, 1868), 34120398304.0)):
        warm.add(key, y)
    (c0, _, c2, _), shift = warm._slots()  # a line on (1, N·T) until six shapes
    fit_alone = c0 + c2 * 8 * 424 + shift
    assert fit_alone < 6.99e9  # the line's own extrapolation: under what the short step held
    assert 6.99e9 <= warm((8, 424)) == pytest.approx(16056860552.0 * 424 / 961, rel=1e-9)
    assert warm((8, 1000)) == pytest.approx(fit_alone + c2 * 8 * (1000 - 424))  # inside: the fit
    assert (warm.values(8, np.array([424, 1000])) == np.array([warm((8, 424)), warm((8, 1000))])).all()  # one evaluator
    falling = Curve(intercept=True, floor=None, linear_until=6)
    for t in (400, 500, 600):
        falling.add((8, t), -3e9 + 1e5 * 8 * t)
    assert falling((8, 100)) == pytest.approx(-3e9 + 1e5 * 800)


def test_transient_is_a_line_until_enough_shapes():
    # Three noisy samples of a linear transient (the H200 warm-up): a quadratic through them
    # would predict far below the line for short batches.
    curve = Curve(intercept=True, floor=None, linear_until=6)
    quadratic = Curve(intercept=True, floor=None)
    for t, noise in ((464, 0.0), (229, 30e6), (420, -20e6)):
        curve.add((32, t), -390e6 + 57e3 * 32 * t + noise)
        quadratic.add((32, t), -390e6 + 57e3 * 32 * t + noise)
    line = lambda t: -390e6 + 57e3 * 32 * t  # noqa: E731
    assert line(300) <= curve((32, 300)) <= line(300) + 60e6  # above the line by about the noise
    assert abs(quadratic((32, 800)) - line(800)) > 2 * abs(curve((32, 800)) - line(800))
    for t in (100, 200, 300, 400, 500, 600):
        curve.add((32, t), -390e6 + 57e3 * 32 * t)
    curve((32, 52))
    assert curve._quadratic  # six distinct shapes: the quadratic term is back


def test_step_peak_is_the_largest_of_three():
    model = _model([16, 32, 64, 128])
    key = (4, 64)
    start = model.activation_bytes(key, Plan(())) - 200.0 * 4 * 64
    assert model.step_bytes(key, Plan(())) == pytest.approx(start)
    # the optimizer step's peak sets a floor no plan lowers
    model.optimizer_bytes = 10 * start
    assert model.step_bytes(key, Plan(())) == model.step_bytes(key, Plan((0, 1, 2, 3))) == 10 * start
    model.optimizer_bytes = 0.0
    # every block: the full regime
    every = (0, 1, 2, 3)
    assert model.step_bytes(key, Plan(every)) == pytest.approx(model.activation_bytes(key, Plan(every)) + 300.0 * 4 * 64)
    # checkpointing block 3 only: block 0..2 still hold their activations while 3 is recomputed
    held = 3 * (1000.0 - 100.0) * 4 * 64
    recompute = model.activation_bytes(key, Plan(every)) + 300.0 * 4 * 64 + held
    assert model.recompute_bytes(key, Plan((3,))) == pytest.approx(recompute)
    assert model.step_bytes(key, Plan((3,))) == pytest.approx(max(recompute, model.backward_start_bytes(key, Plan((3,)))))
    # a first-k plan holds nothing below its topmost block
    assert model.recompute_bytes(key, Plan((0, 1))) == pytest.approx(model.activation_bytes(key, Plan(every)) + 300.0 * 4 * 64)


def test_a_part_rerun_is_bounded_at_the_backward_start_plus_what_it_brings_back():
    """NOTE [Treated peaks]: a block that re-runs its body in part (``selective``) adds, at the
    backward's start, what it did not keep (its ``keep`` bytes less its own), once: not ``full``'s
    transient over the blocks held below it, as a whole recompute on top would. ``elementwise``,
    whose returns the partial transient learns, adds nothing."""
    model = _model([16, 32, 64, 128])
    group, key = model.group_models[0], (4, 64)
    for t in (16, 32, 64, 128):
        group.bytes_curve("selective").add((4, t), 400.0 * 4 * t)
        group.bytes_curve("elementwise").add((4, t), 700.0 * 4 * t)
    back = (1000.0 - 400.0) * 4 * 64  # a selective block's return
    for plan in (Plan((0, 1, 2, 3), kinds=("recompute", "recompute", "selective", "selective")),
                 Plan((2, 3), kinds=("selective", "selective")),
                 Plan((0, 1, 2, 3), kinds=("recompute", "elementwise", "selective", "elementwise"))):
        start = model.backward_start_bytes(key, plan)
        # the whole recompute's bound holds nothing below block 0 or 1, and no selective block over it
        assert model.recompute_bytes(key, plan) <= model.recompute_bytes(key, Plan((0, 1))) + 1e-6
        assert model.step_bytes(key, plan) == pytest.approx(max(start + back, model.recompute_bytes(key, plan)))
    # elementwise declares no return: its plans are bounded by their start and the whole recompute below
    ew = Plan((0, 1, 2, 3), kinds=("recompute", "elementwise", "elementwise", "elementwise"))
    assert model.step_bytes(key, ew) == pytest.approx(
        max(model.backward_start_bytes(key, ew), model.recompute_bytes(key, ew)))
    # recompute alone: unchanged (no part re-run, nothing added)
    assert model.step_bytes(key, Plan((0, 1))) == pytest.approx(
        max(model.backward_start_bytes(key, Plan((0, 1))), model.recompute_bytes(key, Plan((0, 1)))))


def test_planner_respects_the_optimizer_floor(caplog):
    import logging

    planning = Planning(4, [0, 0, 0, 0], 1_000_000, margin_bytes=0, bucket_tokens=1)
    planning.model = _model([16, 32, 64])
    planning.static_bytes = 200_000
    assert planning.plan_for((4, 16)).blocks == ()
    alone = planning.plan_for((4, 60))
    # an optimizer step over the budget: no plan of the blocks lowers it, so they are planned for their own peaks
    # (NOTE [A plan fits what it decides]; it once sent every block to the floor), and it is said once
    planning.model.optimizer_bytes = 900_000
    planning.cache.clear()
    with caplog.at_level(logging.WARNING, logger="memfit"):
        assert planning.plan_for((4, 60)) == alone and planning.plan_for((4, 64)).blocks != (0, 1, 2, 3)
    said = [r.getMessage() for r in caplog.records if "optimizer step is predicted" in r.getMessage()]
    assert len(said) == 1 and "over the budget of 1000000 bytes" in said[0], said
    assert planning.predict_peak((4, 60), alone) > planning.budget_bytes >= planning.plan_peak((4, 60), alone)


def test_partial_regime_checkpoints_fewer_blocks():
    budget = 1_000_000
    plans = {}
    for name, partial in (("full-only", []), ("two-regimes", [16, 32, 64])):
        planning = Planning(4, [0, 0, 0, 0], budget, margin_bytes=0, bucket_tokens=1)
        planning.model = _model(partial)
        planning.static_bytes = 200_000
        plans[name] = planning.plan_for((4, 60)).blocks
    # Without the partial regime the step is over-predicted by 500 B/token (1000 × 4 × 60 ...)
    assert len(plans["two-regimes"]) < len(plans["full-only"])
    # and the chosen plan is the fewest blocks that fit under the partial-regime prediction
    planning = Planning(4, [0, 0, 0, 0], budget, margin_bytes=0, bucket_tokens=1)
    planning.model = _model([16, 32, 64])
    planning.static_bytes = 200_000
    k = len(plans["two-regimes"])
    assert planning.predict_peak((4, 60), Plan(tuple(range(k)))) <= budget
    assert k == 0 or planning.predict_peak((4, 60), Plan(tuple(range(k - 1)))) > budget


def test_model_roundtrip():
    model = _model([16, 32, 64])
    again = MemoryModel.from_dict(model.to_dict())
    for key in [(4, 20), (4, 50), (4, 100)]:
        assert again.activation_bytes(key, Plan((0, 1))) == pytest.approx(model.activation_bytes(key, Plan((0, 1))))
        for every in (True, False):
            assert again.transient(key, every) == pytest.approx(model.transient(key, every))
        assert again.step_bytes(key, Plan((2,))) == pytest.approx(model.step_bytes(key, Plan((2,))))
    model.optimizer_bytes = 123.0
    assert MemoryModel.from_dict(model.to_dict()).optimizer_bytes == 123.0


def test_over_prediction_matters_only_when_it_checkpointed_more():
    """An over-predicted step teaches the model only if the right prediction would have
    given a cheaper plan (each change of the model replans every shape)."""
    planning = Planning(4, [0, 0, 0, 0], 1_000_000, margin_bytes=0, bucket_tokens=1)
    planning.model = _model([16, 32, 64])
    planning.static_bytes = 200_000
    key = (4, 60)
    plan = planning.plan_for(key)
    assert plan.blocks, "the budget binds at this key"
    one_block = planning.model.savings(key)[0]
    need = int(planning.static_bytes + planning.model.backward_start_bytes(key, Plan(()))) - 1_000_000
    enough = need - (len(plan.blocks) - 1) * one_block  # the over-prediction that frees one block
    assert 0 < enough <= one_block
    assert not would_plan_less(planning, key, plan, 0)
    assert not would_plan_less(planning, key, plan, enough - 1)
    assert would_plan_less(planning, key, plan, enough)
    assert not would_plan_less(planning, key, Plan(()), 10**9)  # checkpointed nothing: nothing to win


def _floor_planning(budget: int) -> Planning:
    """Four alike blocks that every treatment can treat: recompute alone saves too little to be the plan near the
    floor, where host checkpoints (tiled or not) and the tiled MLP make the mixes."""
    planning = Planning(4, [0, 0, 0, 0], budget, margin_bytes=0, bucket_tokens=1,
                        treatments=("recompute", "host_checkpoint", "tiled_mlp", "host_checkpoint_tiled"))
    group = planning.model.group_models[0]
    for t in (32, 64):
        key, share = (1, t), t / 64
        for name, nbytes in (("keep", 9000), ("recompute", 500), ("host_checkpoint", 30), ("tiled_mlp", 2000),
                             ("host_checkpoint_tiled", 30)):
            group.bytes_curve(name).add(key, nbytes * share)
        for name, ms in (("recompute", 1.0), ("host_checkpoint", 1.2), ("tiled_mlp", 0.3), ("host_checkpoint_tiled", 1.5),
                         ("recompute_tiled", 1.3)):
            group.ms_curve(name).add(key, ms * share)
        planning.model.outside.add(key, 100 * share)
        planning.model.transient_full.add(key, 4000 * share)
        planning.model.transient_partial.add(key, 3000 * share)
    planning.static_bytes = 1000
    return planning


def test_an_over_predicted_floor_step_would_plan_less_with_every_treatment():
    """NOTE [What a step teaches]: a step that ran every block as a tiled host checkpoint, over-predicted by more than
    the cheaper mix needs, would have planned less; recompute alone cannot tell (it is no cheaper there, or fits
    nothing), so the run's search answers with every treatment it offers. Where no plan fits the room at all, one
    that fits with the bytes over-predicted is cheaper than the floor."""
    key = (1, 64)
    planning = _floor_planning(6000)
    floor = planning.plan_for(key)
    assert floor.by_treatment() == {"host_checkpoint_tiled": [0, 1, 2, 3]}
    assert planning.search.cost_with_room(key) == pytest.approx(floor.cost_ms)
    cheaper = planning.search.cost_with_room(key, 500)
    assert cheaper < floor.cost_ms
    assert planning.room_bytes == 6000  # asked with more room, the room itself unchanged
    assert not would_plan_less(planning, key, floor, 10)  # the same plan with 10 bytes more
    assert would_plan_less(planning, key, floor, 500)
    assert planning.plan_for(key) == floor  # nothing cached or changed by the asking
    unfit = _floor_planning(900)  # the static bytes alone are over: no plan fits, the floor runs
    floor = unfit.plan_for(key)
    assert unfit.search.cost_with_room(key) == float("inf")
    assert would_plan_less(unfit, key, floor, 5000) and not would_plan_less(unfit, key, floor, 10)


def test_a_plan_holding_blocks_below_a_recompute_is_mended():
    """NOTE [Blocks held below a recompute]: the cheapest set leaves two large blocks under
    its topmost one, so the recompute peak is over; the mended plan is the cheapest of the
    plan closed downwards and the shortest covering prefix, not every block."""
    key = (1, 100)
    model = MemoryModel([0, 0, 1, 1, 1, 1])
    for group, (full, cost) in {0: (1000.0, 10.0), 1: (200.0, 1.0)}.items():
        m = model.group_models[group]
        m.bytes["keep"].add(key, full)
        m.bytes["recompute"].add(key, 10.0)
        m.ms["recompute"].add(key, cost)
    model.outside.add(key, 0.0)
    model.transient_full.add(key, 100.0)
    for t in (50, 200):  # the partial regime's transient is lower (as on the H200)
        model.transient_partial.add((1, t), -400.0)
    planning = Planning(6, model.groups, 2000, margin_bytes=0, bucket_tokens=1)
    planning.model = model
    need = int(model.backward_start_bytes(key, Plan(()))) - 2000
    cheapest = plan_blocks(model.costs(key), model.savings(key), need).blocks
    assert cheapest == (2, 3, 4)
    assert model.recompute_bytes(key, Plan(cheapest)) > 2000  # blocks 0 and 1 held under block 4
    plan = planning.plan_for(key)
    assert plan.blocks == (0,)  # cost 10: the closure (0..4) costs 23, every block 24
    assert planning.predict_peak(key, plan) <= 2000


def test_allocator_slack_is_kept_free_by_plans():
    """NOTE [Allocator slack]: a plan fits the budget less the margin *and* the slack."""
    budget, margin, key = 1_000_000, 10_000, (4, 100)

    def fewest_fitting(room):
        planning = Planning(4, [0, 0, 0, 0], budget, margin_bytes=0, bucket_tokens=1)
        planning.model, planning.static_bytes = _model([16, 32, 64]), 200_000
        return next(k for k in range(5) if planning.predict_peak(key, Plan(tuple(range(k)))) <= room)

    plans = {}
    for slack in (0, 150_000):
        planning = Planning(4, [0, 0, 0, 0], budget, margin_bytes=margin, bucket_tokens=1, slack_bytes=slack)
        planning.model, planning.static_bytes = _model([16, 32, 64]), 200_000
        assert planning.room_bytes == budget - margin - slack
        plans[slack] = planning.plan_for(key).blocks
        assert len(plans[slack]) == fewest_fitting(budget - margin - slack)
    assert len(plans[150_000]) > len(plans[0])


def test_learn_slack_only_grows_and_an_oom_replans():
    planning = Planning(4, [0, 0, 0, 0], 1_000_000, margin_bytes=0, bucket_tokens=1, slack_bytes=100)
    planning.model, planning.static_bytes = _model([16, 32, 64]), 200_000
    assert planning.room.learn_slack(200) and planning.slack_bytes == 250
    assert not planning.room.learn_slack(200) and planning.slack_bytes == 250  # only grows
    planning.plan_for((4, 60))
    planning.after_oom(400)
    assert planning.slack_bytes == 500 and planning.margin_bytes == 0
    assert planning.cache.items() == []  # plans made with the old room are dropped


def test_allocator_retries_grow_the_slack_in_steps_up_to_a_ceiling():
    """NOTE [Room]: only a steady step with a retry grows the slack, by RETRY_SLACK_SHARE of the
    budget, never past MAX_RETRY_SLACK_SHARE; each growth drops the cached plans."""
    from types import SimpleNamespace

    from memfit.engine.plan import learner
    from memfit.engine.plan.room import MAX_RETRY_SLACK_SHARE, RETRY_SLACK_SHARE

    budget = 1_000_000
    planning = Planning(4, [0, 0, 0, 0], budget, margin_bytes=0, bucket_tokens=1, slack_bytes=100)
    planning.model, planning.static_bytes = _model([16, 32, 64]), 200_000
    seen = []
    for warmup, retries in [(True, 3), (False, 0), (False, 1), (False, 2), (False, 1), (False, 1), (False, 1)]:
        planning.plan_for((4, 60))
        # a retry not priced yet (net_ms None) grows the slack: NOTE [The slack is priced]
        step = SimpleNamespace(warmup=warmup, alloc_retries=retries, key=(4, 60), net_ms=None, pool_bytes=None,
                               timed_key=None)
        planning.apply(learner.grow_slack(planning, step))
        seen.append((planning.slack_bytes, planning.cache.items() == []))
    step, ceiling = int(RETRY_SLACK_SHARE * budget), int(MAX_RETRY_SLACK_SHARE * budget)
    assert seen == [(100, False), (100, False), (100 + step, True), (100 + 2 * step, True), (100 + 3 * step, True),
                    (ceiling, True), (ceiling, False)]
    assert Planning(4, [0] * 4, None, margin_bytes=0, bucket_tokens=1).room.after_alloc_retries() is False  # no budget, no cap


@pytest.mark.parametrize("seed", range(6))
def test_a_row_of_plans_equals_the_per_key_plans(seed):
    """NOTE [Planning a row]: the vectorised row gives, bucket by bucket, the very plan the
    per-key planner gives (same floats, same order), for budgets from loose to infeasible."""
    import random

    rng = random.Random(seed)
    model = MemoryModel([0] * 6, bucket_tokens=8)
    group = model.group_models[0]
    a, q = rng.uniform(500, 2000), rng.uniform(0, 8)
    for t in rng.sample(range(8, 400), 5):
        key = (4, t)
        group.bytes["keep"].add(key, (a + q * t) * 4 * t * rng.uniform(0.97, 1.03))
        group.bytes["recompute"].add(key, 0.05 * a * 4 * t)
        group.ms["recompute"].add(key, 0.01 * t + rng.uniform(0, 0.1))
        model.outside.add(key, 50.0 * 4 * t)
        model.transient_full.add(key, 300.0 * 4 * t - 5000)
    for t in rng.sample(range(40, 300), rng.choice([0, 1, 3, 5])):
        model.transient_partial.add((4, t), -200.0 * 4 * t + rng.uniform(-2000, 2000))
    model.optimizer_bytes = rng.choice([0.0, 300_000.0])
    model.observe_key((4, 392))
    every = model.step_bytes((4, 400), Plan(tuple(range(6))))
    for budget in (int(every * f) + 250_000 for f in (0.8, 1.0, 1.3, 2.0, 4.0, 8.0)):
        row = Planning(6, [0] * 6, budget, margin_bytes=20_000, bucket_tokens=8, slack_bytes=5_000)
        row.model, row.static_bytes = model, 250_000
        static_bucket = row._static_bucket()
        row.rows.from_row((4, 8), static_bucket)  # one miss plans the whole row
        assert len(row.cache.rows) == 1
        from_row = {(4, t): row.rows.from_row((4, t), static_bucket) for t in range(1, 400)}
        assert len(row.cache.rows) == 1  # every length up to the longest shape came from that row
        alone = Planning(6, [0] * 6, budget, margin_bytes=20_000, bucket_tokens=8, slack_bytes=5_000)
        alone.model, alone.static_bytes = model, 250_000
        for key, plan in from_row.items():
            assert plan is None or plan == alone.search.plan(key), (budget, key)
        planned = [p for p in from_row.values() if p is not None]
        assert len(planned) > len(from_row) // 2 or budget < every  # None: infeasible, planned per key
        assert any(p.blocks for p in planned) or budget > 2 * every


def test_a_bucket_is_planned_for_its_longest_shape_seen_not_its_edge():
    """NOTE [Plan for the longest shape seen]: a bucket's plan and prediction are made for the
    longest length the run met in it; shorter shapes of the bucket share that plan, and a longer
    one is planned anew. The edge (48) is a length no batch had, and planning there
    checkpointed more than any batch of the bucket needed."""
    model = _model([16, 32, 64])

    def fewest(budget, t):
        planning = Planning(4, [0] * 4, budget, margin_bytes=0, bucket_tokens=1)
        planning.model, planning.static_bytes = model, 200_000
        plan = planning.plan_for((4, t))
        return len(plan.blocks) if planning.predict_peak((4, t), plan) <= budget else None  # None: nothing fits

    budget = next(b for b in range(200_000, 2_000_000, 1000) if fewest(b, 48) and fewest(b, 44) < fewest(b, 48))
    planning = Planning(4, [0] * 4, budget, margin_bytes=0, bucket_tokens=8)
    planning.model, planning.static_bytes = model, 200_000
    plan_44 = planning.plan_for((4, 44))  # bucket 41-48
    assert len(plan_44.blocks) == fewest(budget, 44) < fewest(budget, 48)
    assert planning.predict_peak((4, 44), plan_44) == int(200_000 + model.step_bytes((4, 44), plan_44))
    assert planning.plan_for((4, 42)).blocks == plan_44.blocks  # a shorter shape of the bucket: the same plan
    assert planning.predict_peak((4, 42), plan_44) == planning.predict_peak((4, 44), plan_44)
    assert len(planning.plan_for((4, 47)).blocks) == fewest(budget, 47)  # a longer one: planned anew
    assert planning.plan_for((4, 44)).blocks == planning.plan_for((4, 47)).blocks  # which the bucket then uses

    # from a row: where every length up to the edge gets the same plan, it serves the bucket
    planning.model.observe_key((4, 48))
    planning.cache.clear()
    planning.longest_in_bucket.clear()
    while not planning.cache.settled(3):
        planning.plan_for((4, 8))
    plans = {t: len(planning.plan_for((4, t)).blocks) for t in range(9, 49)}  # each the longest of its bucket yet
    assert planning.cache.rows  # read from a row
    assert plans == {t: fewest(budget, t) for t in range(9, 49)}  # per length, as if planned alone
    same = next(t for t in range(33, 40) if len({plans[u] for u in range(t, 41)}) == 1)
    planning.cache.clear()
    planning.longest_in_bucket.clear()
    for _ in range(4):  # settle again
        planning.plan_for((4, 8))
    plan_same = planning.plan_for((4, same)).blocks
    misses = planning.cache.misses
    assert planning.plan_for((4, 40)).blocks == plan_same and planning.cache.misses == misses  # no replan
    # where the plan changes inside the bucket (15 needs more than 16: the partial range begins
    # at 16), a longer shape of it is planned anew
    assert plans[15] > plans[16]
    planning.plan_for((4, 9))
    misses = planning.cache.misses
    assert len(planning.plan_for((4, 15)).blocks) == plans[15] and planning.cache.misses == misses + 1


def test_a_row_reaches_a_few_buckets_past_the_longest_shape():
    """NOTE [Planning a row]: a row is planned up to the longest shape seen rounded up to 8
    buckets, so a step a little longer than any before reads its plan from the same row
    instead of replanning the whole row."""
    planning = Planning(4, [0, 0, 0, 0], 1_000_000, margin_bytes=0, bucket_tokens=4)
    planning.model, planning.static_bytes = _model([16, 32, 64]), 200_000
    planning.model.bucket_tokens = 4
    planning.model.observe_key((4, 100))
    for _ in range(4):  # settle the cache
        planning.plan_for((4, 20))
    planning.plan_for((4, 60))
    (row,) = planning.cache.rows.values()
    assert row["longest"] == 128  # 100 tokens rounded up to 8 buckets of 4
    planning.model.observe_key((4, 120))
    alone = Planning(4, [0, 0, 0, 0], 1_000_000, margin_bytes=0, bucket_tokens=4)
    alone.model, alone.static_bytes = planning.model, planning.static_bytes
    assert planning.plan_for((4, 120)).blocks == alone.plan_for((4, 120)).blocks
    assert list(planning.cache.rows.values()) == [row]  # read from that row, not a new one


def test_rows_wait_until_the_plan_cache_has_settled():
    """NOTE [Planning a row]: right after a clear of a cache that served few requests (a model
    still learning) a miss plans its key alone; once the cache, or the one before its last
    clear, has served more than a few requests, a miss plans the row."""
    planning = Planning(4, [0, 0, 0, 0], 1_000_000, margin_bytes=0, bucket_tokens=4)
    planning.model, planning.static_bytes = _model([16, 32, 64]), 200_000
    planning.model.bucket_tokens = 4
    planning.model.observe_key((4, 128))
    for t in (20, 24, 28):
        planning.plan_for((4, t))
    assert planning.cache.rows == {}  # each planned alone
    planning.plan_for((4, 60))
    assert len(planning.cache.rows) == 1  # settled: the whole row
    planning.cache.clear()  # a correction of a settled model: its plans will last too
    planning.plan_for((4, 64))
    assert len(planning.cache.rows) == 1
    for _ in range(2):  # a model changing at every step
        planning.cache.clear()
        planning.plan_for((4, 60))
    assert planning.cache.rows == {}


def test_curve_values_are_each_curves_own_values_bit_for_bit():
    """``Curve.values`` over a row of shapes (NOTE [One evaluator]) returns, for every kind of
    curve, exactly the floats ``Curve.__call__`` returns key by key."""
    import random

    import numpy as np

    rng = random.Random(3)
    curves = [
        Curve(),  # no samples
        Curve(intercept=True, floor=None, linear_until=6),  # still a line (3 keys < 6)
        Curve(intercept=True, floor=None),
        Curve(),
        Curve(intercept=True),
        Curve(intercept=True, linear_until=6, envelope=False),  # a price (NOTE [Central prices])
    ]
    for curve in curves[1:]:
        for t in rng.sample(range(8, 500), 3 if curve.linear_until else 7):
            curve.add((4, t), rng.uniform(-1e6, 1e7) + 1234.5 * t + 0.37 * t * t)
    ts = np.arange(8, 520, 8)
    values = [c.values(4, ts) for c in curves]
    for curve, row in zip(curves, values):
        assert row.tolist() == [curve((4, int(t))) for t in ts]


@pytest.mark.parametrize("seed", range(4))
def test_refit_equals_numpy_least_squares(seed):
    """NOTE [Refit in Python]: the normal-equation sums and the Jacobi solve give the values
    (fit plus envelope shift) of ``np.linalg.lstsq`` on the same scaled system, also when
    every sample has one row count (the slots 1 and N are then collinear)."""
    import random

    import numpy as np


    def _features(n, t, intercept, quadratic):  # the least-squares columns: [1,] N, N·T, N·T² (or [1,] N·T)
        tokens = n * t
        f = [n, tokens, tokens * t] if quadratic else [tokens]
        return [1.0] + f if intercept else f

    rng = random.Random(seed)
    for _ in range(60):
        curve = Curve(intercept=rng.random() < 0.5, floor=None, linear_until=rng.choice([0, 4]))
        one_n = rng.random() < 0.5
        for _ in range(rng.randint(1, 40)):
            n, t = (32 if one_n else rng.choice([8, 16, 32])), rng.randint(32, 512)
            curve.add((n, t), rng.uniform(-1e6, 1e6) + 3.0 * n * t + 0.01 * n * t * t + 5e7 * curve.intercept)
        keys = sorted(curve._by_key)
        nt = np.array(keys, dtype=float)
        a = np.column_stack(np.broadcast_arrays(*_features(nt[:, 0], nt[:, 1], curve.intercept, len(keys) >= curve.linear_until)))
        b = np.array([curve._by_key[k] for k in keys])
        scale = np.maximum(np.abs(a).max(axis=0), 1.0)
        coef = np.linalg.lstsq(a / scale, b, rcond=None)[0] / scale
        expected = a @ coef + max(0.0, float((b - a @ coef).max()))
        got = np.array([curve(k) for k in keys])
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-9 * np.abs(b).max())
        assert (got >= b - 1e-12 * np.abs(b).max()).all()  # an upper envelope of its samples (to rounding)


def _optimizer_step(above_static: int, static: int):
    """A finished step whose optimizer step peaked ``above_static`` over its ``static`` bytes."""
    from memfit.engine.plan.learner import StepOutcome
    from memfit.engine.plan.planner import Plan

    return StepOutcome(key=(4, 16), plan=Plan(()), warmup=False, outside=0, by_block=[0] * 4, static=static, peak=0,
                       plain_peak=0, transient=0, optimizer_above_static=above_static)


def test_an_optimizer_peak_that_cannot_change_a_plan_keeps_the_cache():
    """Plans read the optimizer step's peak only through static + max(activations, it) <=
    room: a larger one that stays within the room keeps every cached plan."""
    import memfit
    from memfit.engine.plan.learner import learn_optimizer_peak
    from _models import build

    model, _ = build("bert")
    ctl = memfit.fit(model, budget=1_000_000, method="dynamic", margin=0.0)
    planning = ctl.planning
    planning.model, planning.static_bytes = _model([16, 32, 64]), 200_000  # a 4-block model
    planning.n_blocks, planning.all_blocks = 4, (0, 1, 2, 3)
    cached = {t: planning.plan_for((4, t)).blocks for t in (16, 60, 100)}
    planning.apply(learn_optimizer_peak(planning, _optimizer_step(700_000, 200_000)))  # 200k + 700k <= room: no plan can change
    assert planning.model.optimizer_bytes == 700_000 and planning.cache.items() != []
    fresh = Planning(4, [0, 0, 0, 0], 1_000_000, margin_bytes=planning.margin_bytes, bucket_tokens=planning.bucket_tokens,
                     slack_bytes=planning.slack_bytes)
    fresh.model, fresh.static_bytes = planning.model, 200_000
    assert {t: fresh.plan_for((4, t)).blocks for t in cached} == cached
    planning.apply(learn_optimizer_peak(planning, _optimizer_step(900_000, 200_000)))  # over the room: every plan is dropped
    assert planning.cache.items() == []
    ctl.remove()


def test_split_gives_a_new_group_a_copy_of_its_old_groups_curves():
    """NOTE [Blocks alike only in name] (learner.py): splitting keeps what the group learnt
    for both parts, and a new group may not merge blocks of two groups."""
    model = MemoryModel([0, 0, 1, 0])
    model.group_models[0].bytes["keep"].add((2, 8), 100.0)
    model.group_models[1].bytes["keep"].add((2, 8), 7.0)
    model.split([0, 2, 1, 2])
    assert model.groups == [0, 2, 1, 2]
    assert sorted(model.group_models) == [0, 1, 2]
    assert model.block_bytes(1, (2, 8), "keep") == model.block_bytes(0, (2, 8), "keep") == pytest.approx(100.0)
    model.group_models[2].bytes["keep"].add((2, 16), 300.0)  # the copy learns alone
    assert not model.group_models[0].bytes["keep"].has((2, 16))
    assert model.activation_bytes((2, 8), Plan(())) == pytest.approx(3 * 100.0 + 7.0)
    with pytest.raises(ValueError, match="merge"):
        model.split([0, 0, 0, 2])


def test_a_price_is_the_least_squares_line_of_each_keys_fastest_sample():
    """NOTE [Central prices]: a treatment's time curve is fitted through its samples, not above
    them, keeps a key's smallest sample, and is a line in tokens until six keys are seen."""
    import numpy as np

    from memfit.engine.plan.model import BlockGroupModel

    group = BlockGroupModel()
    noisy = {(8, 961): 0.713, (8, 1206): 1.029, (8, 1868): 0.147}  # one H200 repeat's selective prices
    for key, ms in noisy.items():
        group.ms_curve("selective").add(key, ms)
    group.ms_curve("selective").add((8, 1206), 1.5)  # a slower run at a key seen: the faster stays
    tokens = np.array([n * t for n, t in noisy], dtype=float)
    line = np.polyfit(tokens, list(noisy.values()), 1)
    for (n, t), x in zip(noisy, tokens):
        assert group.ms_curve("selective")((n, t)) == pytest.approx(max(0.0, np.polyval(line, x)), abs=1e-9)
    assert group.ms_curve("selective")((8, 1206)) < 1.029  # through the noise, not above it
    envelope = Curve(intercept=True)  # what a size gets: above every sample
    for key, ms in noisy.items():
        envelope.add(key, ms)
    assert envelope((8, 1206)) >= 1.029 - 1e-9
    # round trip, and a file written before prices were central loads them central
    again = BlockGroupModel.from_dict(group.to_dict())
    assert not again.ms_curve("selective").envelope and again.bytes["keep"].envelope
    # state saved with one field per treatment (before curves were keyed by name) loads so
    old = {"full_bytes": envelope.to_dict(), "cost_ms": group.ms_curve("recompute").to_dict(), "selective_ms": group.ms["selective"].to_dict()}
    for curve in old.values():
        curve.pop("envelope")
    loaded = BlockGroupModel.from_dict(old)
    assert not loaded.ms["recompute"].envelope and loaded.bytes["keep"].envelope and not loaded.ms["selective"].envelope
    assert loaded.bytes["keep"]((8, 1206)) == envelope((8, 1206)) and loaded.ms["selective"]((8, 961)) == group.ms["selective"]((8, 961))


def test_the_learner_returns_updates_and_planning_alone_applies_them():
    """Item 3 of issue 38: learner functions write nothing; Planning.apply adds the samples and
    drops its own cached plans."""
    from memfit.engine.plan import learner
    from memfit.engine.plan.learner import StepOutcome

    planning = Planning(4, [0, 0, 0, 0], 1_000_000, margin_bytes=0, bucket_tokens=1)
    planning.model, planning.static_bytes = _model([16, 32, 64]), 200_000
    planning.plan_for((4, 60))
    before = planning.model.to_dict()
    outcome = StepOutcome(key=(4, 70), plan=Plan(()), warmup=True, outside=10, by_block=[1000] * 4, static=200_000,
                          peak=0, plain_peak=0, transient=None)
    update = learner.learn_step(planning, outcome, None, (4, 70))
    assert planning.model.to_dict() == before and planning.cache.items() != []  # nothing written yet
    assert (("bytes", 0, "keep"), (4, 70), 1000) in update.samples and update.seen_key == (4, 70)
    assert planning.apply(update) and planning.cache.items() == []
    assert planning.model.group_models[0].bytes["keep"].has((4, 70)) and planning.model.max_key == (4, 70)


def test_a_curves_memo_stays_bounded_over_many_shapes():
    """Chat data asks a new shape nearly every step and a curve gains no sample on most of them: what it memoises
    stays under ``MEMO_LIMIT`` values, and a value asked after the memo was dropped is the same."""
    from memfit.engine.plan.model import MEMO_LIMIT, Curve

    curve = Curve()
    for t in (16, 64, 256):
        curve.add((2, t), 1000.0 * t)
    first = curve((2, 100))
    for t in range(3 * MEMO_LIMIT):
        curve((2, 300 + t))
        assert len(curve._memo) <= MEMO_LIMIT
    assert curve((2, 100)) == first


def test_a_floor_step_teaches_the_full_regime_in_full_terms():
    """NOTE [Full terms of a re-run step]: a step whose every block re-ran as a tiled host checkpoint teaches the full
    transient its whole-step transient plus what a kept block's re-run holds beyond the tiled one's, less the stashes
    back during the re-run; the plan it ran is then predicted at the peak it read, and plain host checkpoints (whose
    re-run holds a kept block) that much higher. A step with a block not re-run teaches no full sample."""
    from memfit.engine.plan import learner
    from memfit.engine.plan.learner import StepOutcome

    planning = Planning(4, [0, 0, 0, 0], 10**9, margin_bytes=0, bucket_tokens=1,
                        treatments=("recompute", "host_checkpoint", "tiled_mlp", "host_checkpoint_tiled"))
    group, key = planning.model.group_models[0], (1, 64)
    for name, nbytes in (("keep", 9000), ("recompute", 500), ("host_checkpoint", 30), ("tiled_mlp", 2000),
                         ("host_checkpoint_tiled", 30)):
        group.bytes_curve(name).add(key, nbytes)
    planning.model.outside.add(key, 100)
    floor = Plan((0, 1, 2, 3), kinds=("host_checkpoint_tiled",) * 4)
    gap = planning.model.rerun_gap(key, floor)
    assert gap is not None and gap < 9000 - 2000  # the kept block's bytes beyond the tiled re-run's, less a stash back
    outcome = StepOutcome(key=key, plan=floor, warmup=True, outside=100, by_block=[30] * 4, static=0, peak=4000,
                          plain_peak=4000, transient=4000 - 220)
    update = learner.learn_step(planning, outcome, None, key)
    assert (("transient_full",), key, 4000 - 220 + gap) in update.samples
    planning.apply(update)
    assert planning.model.step_bytes(key, floor) == pytest.approx(4000, rel=1e-6)
    plain = Plan((0, 1, 2, 3), kinds=("host_checkpoint",) * 4)
    assert planning.model.step_bytes(key, plain) == pytest.approx(4000 + 9000 - 2000, rel=1e-6)
    mixed = Plan((0, 1, 2), kinds=("host_checkpoint_tiled",) * 3)
    assert planning.model.rerun_gap(key, mixed) is None
    assert not [s for s in learner.learn_step(planning, dataclasses.replace(outcome, plan=mixed), None, key).samples
                if s[0] == ("transient_full",)]


@pytest.mark.parametrize("full", [0, 3000, 20000])
def test_a_re_run_s_lesser_bytes_come_off_no_more_transient_than_was_learnt(full):
    """NOTE [Full terms of a re-run step]: what every block re-run tiled holds less than a kept block's re-run comes off
    the full transient, never more than it holds. A meter that reads no transient (the logical one) leaves the curve
    at 0: the tiled plan is then predicted at what its blocks and the outside hold, not a tiled MLP's saving under it."""
    planning = Planning(4, [0, 0, 0, 0], 10**9, margin_bytes=0, bucket_tokens=1,
                        treatments=("recompute", "tiled_mlp", "recompute_tiled"))
    group, key = planning.model.group_models[0], (1, 64)
    for name, nbytes in (("keep", 9000), ("recompute", 500), ("tiled_mlp", 2000), ("recompute_tiled", 500)):
        group.bytes_curve(name).add(key, nbytes)
    planning.model.outside.add(key, 100)
    if full:
        planning.model.transient_full.add(key, full)
    tiled = Plan((0, 1, 2, 3), kinds=("recompute_tiled",) * 4)
    held = 100 + 4 * 500  # the outside and what each re-run block keeps
    assert planning.model.step_bytes(key, tiled) == pytest.approx(held + max(0, full - (9000 - 2000)), rel=1e-6)
    assert planning.model.step_bytes(key, Plan((0, 1, 2, 3))) == pytest.approx(held + full, rel=1e-6)


@pytest.mark.parametrize("over_budget", [False, True])
def test_a_floor_inside_the_margins_is_run_without_saying_it_is_over_the_budget(caplog, over_budget):
    """NOTE [Over the room, not the budget]: where no plan fits the room, the floor runs; it is said to need more than
    the budget only where its predicted peak is over the budget itself, and the figure said is that peak."""
    import logging

    probe = Planning(4, [0, 0, 0, 0], 10**9, margin_bytes=0, bucket_tokens=1)
    probe.model, probe.static_bytes = _model([16, 32, 64]), 200_000
    peak = probe.predict_peak((4, 64), probe.search.floor(256))
    budget = peak - 1000 if over_budget else peak + 1000
    planning = Planning(4, [0, 0, 0, 0], budget, margin_bytes=5000, bucket_tokens=1)
    planning.model, planning.static_bytes = _model([16, 32, 64]), 200_000
    with caplog.at_level(logging.DEBUG, logger="memfit"):
        plan = planning.plan_for((4, 64))
    assert plan.blocks == (0, 1, 2, 3)
    said = [r.getMessage() for r in caplog.records if "predicted to need" in r.getMessage()]
    assert len(said) == int(over_budget), said
    if over_budget:
        assert planning.budget.size(peak) in said[0]


def test_planning_s_records_per_shape_and_plan_stay_bounded(caplog):
    """A run of ever new shapes (chat data, any length) grows neither the bias record per bucket and plan nor the
    set of shapes already said not to fit past MAX_KEPT, and a shape no plan fits is still said at warning once."""
    import logging

    from memfit.engine.plan import planning as planning_module
    from memfit.engine.plan.planning import MAX_KEPT, BucketBias

    bias = BucketBias()
    for t in range(MAX_KEPT + 500):
        bias.observe((1, t), Plan((0,)), 1000.0, 1.0)
    assert len(bias.errors) == MAX_KEPT
    planning = Planning(2, [0, 0], 10**9, margin_bytes=0, bucket_tokens=1)
    with caplog.at_level(logging.DEBUG, logger="memfit"):
        logs = [planning.search._infeasible_log((1, t)) for t in range(MAX_KEPT + 500)]
    assert len(planning.search.infeasible_keys) <= MAX_KEPT
    assert logs[0] == planning_module.logger.warning and all(log == planning_module.logger.debug for log in logs[1:])


def test_a_search_reads_the_curves_once_and_each_peak_is_the_plans_own(monkeypatch):
    """NOTE [A search reads the curves once]: inside ``with ShapePeaks(model, key)`` each peak at ``key`` is the one the
    plan asked alone gives, bit for bit (treated and offloaded blocks, the link's depth, a part's saving), from the
    curves read once; a part priced anew inside the block is priced anew; another shape reads its own; each block ends
    as it began. A search (Planning.plan_for on a miss) is such a block."""
    from memfit.engine.parts.probe import LinkPrice
    from memfit.engine.plan.model import ShapePeaks

    model = _model([16, 32, 64, 128])
    group = model.group_models[0]
    for t in (16, 32, 64, 128):
        group.bytes_curve("selective").add((4, t), 400.0 * 4 * t)
        group.bytes_curve("offload").add((4, t), 20.0 * 4 * t)
    model.link = LinkPrice(100.0, 50.0, max_depth=3)
    saving = {"chunked": 5_000.0}
    model.part_saving = {"head": lambda tokens, option: int(saving.get(option[0], 0) * tokens)}
    key, other = (4, 64), (4, 100)
    plans = [Plan(()), Plan((0, 1)), Plan((3,)), Plan((0, 1, 2, 3), kinds=("recompute", "selective", "offload", "offload")),
             Plan((1, 2), kinds=("offload", "selective")).with_option("head", ("chunked", 8))]

    def peaks(k):
        return [(model.backward_start_bytes(k, p), model.recompute_bytes(k, p), model.step_bytes(k, p), model.plan_bytes(k, p))
                for p in plans]

    alone, alone_other, depth = peaks(key), peaks(other), model.offload_depth(key)
    assert depth > 1  # the link's, at this shape
    read, real = [], MemoryModel._values
    monkeypatch.setattr(MemoryModel, "_values", lambda self, n, t: read.append((n, t)) or real(self, n, t))
    with ShapePeaks(model, key) as shape:
        assert model.searched is shape and peaks(key) == alone and peaks(key) == alone and model.offload_depth(key) == depth
        assert read == [key]  # once, whatever is asked there
        assert peaks(other) == alone_other
        with ShapePeaks(model, other):
            assert peaks(other) == alone_other and peaks(key) == alone
        assert model.searched is shape
        saving["chunked"] = 9_000.0  # the head priced anew while the search runs
        anew = peaks(key)
    assert model.searched is None and anew[-1] != alone[-1] and anew[:-1] == alone[:-1]
    assert anew == peaks(key)  # what the plans give alone, priced so
    planning = Planning(4, [0] * 4, 10**9, 0, 8, treatments=("recompute", "selective"))
    planning.model = model
    planning.static_bytes = int(10**9 - 0.9 * model.backward_start_bytes(key, Plan(())))
    read.clear()
    assert planning.plan_for(key).blocks and read == [key]


def test_a_plans_layout_is_made_once_and_anew_after_a_split():
    """A plan's layout (what the peak formula needs of it) is made once and kept, read only (the same plans come back
    step after step), at most ``LAYOUTS_KEPT`` of them; a split of the groups makes them anew: a plan's peaks after it
    are those of a model made with the new groups."""
    from memfit.engine.plan.model import LAYOUTS_KEPT

    model = MemoryModel([0] * 12)
    group = model.group_models[0]
    for t in (16, 32, 64):
        group.bytes["keep"].add((4, t), 1000.0 * 4 * t)
        group.bytes["recompute"].add((4, t), 100.0 * 4 * t)
        model.transient_full.add((4, t), 300.0 * 4 * t)
    plan, key = Plan((0, 5), kinds=("recompute", "selective")), (4, 32)
    assert model.layouts(plan) is model.layouts(Plan((0, 5), kinds=("recompute", "selective")))
    before = model.step_bytes(key, plan)
    model.split([0] * 6 + [1] * 6)
    model.group_models[1].bytes["keep"].add((4, 32), 3000.0 * 4 * 32)  # the new group keeps more
    fresh = MemoryModel.from_dict(model.to_dict())
    assert model.step_bytes(key, plan) == fresh.step_bytes(key, plan) != before
    for n in range(LAYOUTS_KEPT + 10):
        model.layouts(Plan(tuple(i for i in range(12) if n >> i & 1)))
    assert len(model.layouts._made) <= LAYOUTS_KEPT
