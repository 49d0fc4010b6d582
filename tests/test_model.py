"""The memory model: envelopes, the two transient regimes, persistence, and what planning does with them."""

import pytest

from memfit.model import Curve, MemoryModel, bucket_key, shape_key
from memfit.runtime import Planning


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
        group.full_bytes.add(key, 1000.0 * 4 * t)
        group.kept_bytes.add(key, 100.0 * 4 * t)
        group.cost_ms.add(key, 0.01 * t)
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
    # fewer than three shapes seen: not used at all
    assert _model([16, 32]).transient((4, 24), every_block=False) == pytest.approx(300.0 * 4 * 24, rel=1e-6)


def test_partial_regime_checkpoints_fewer_blocks():
    budget = 1_000_000
    plans = {}
    for name, partial in (("full-only", []), ("two-regimes", [16, 32, 64])):
        planning = Planning(4, [0, 0, 0, 0], budget, margin_bytes=0, bucket_tokens=1)
        planning.model = _model(partial)
        planning.static_bytes = 200_000
        plans[name] = planning.plan_for((4, 60))
    # Without the partial regime the step is over-predicted by 500 B/token (1000 × 4 × 60 ...)
    assert len(plans["two-regimes"]) < len(plans["full-only"])
    # and the chosen plan is the fewest blocks that fit under the partial-regime prediction
    planning = Planning(4, [0, 0, 0, 0], budget, margin_bytes=0, bucket_tokens=1)
    planning.model = _model([16, 32, 64])
    planning.static_bytes = 200_000
    k = len(plans["two-regimes"])
    assert planning.predict_peak((4, 60), tuple(range(k))) <= budget
    assert k == 0 or planning.predict_peak((4, 60), tuple(range(k - 1))) > budget


def test_model_roundtrip():
    model = _model([16, 32, 64])
    again = MemoryModel.from_dict(model.to_dict())
    for key in [(4, 20), (4, 50), (4, 100)]:
        assert again.activation_bytes(key, (0, 1)) == pytest.approx(model.activation_bytes(key, (0, 1)))
        for every in (True, False):
            assert again.transient(key, every) == pytest.approx(model.transient(key, every))
