"""Every checkpointing path gives the gradients of training without checkpointing.

Dropout is on in every model: equal gradients need the recompute to replay the same masks.
"""

import copy

import pytest
import torch

import memfit
from _models import ARCHS, SIZES, TEXT_SIZES, build, logical_peak, step_both_and_compare


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["full", "dynamic", "static"])
def test_gradients_equal_no_checkpointing(arch, method):
    torch.manual_seed(0)
    model, make_batch = build(arch)
    model.train()
    reference = copy.deepcopy(model)
    sizes = SIZES.get(arch, TEXT_SIZES) * 2
    batches = [make_batch(3, s) for s in sizes]
    largest = max(batches, key=lambda b: next(iter(b.values())).numel())
    # A budget between the peaks of `none` and `full` at the largest size: `dynamic` must
    # checkpoint some blocks there and none for the smallest inputs.
    budget = (logical_peak(model, largest, "none") + logical_peak(model, largest, "full")) // 2
    ctl = memfit.fit(model, budget=budget, method=method, warmup_steps=2, warmup_keys=2) if method != "full" else memfit.fit(model, budget=budget, method="full")
    for step, batch in enumerate(batches):
        step_both_and_compare(model, reference, batch, 1000 + step, f"{arch}/{method} step {step}")
    records = ctl.records
    assert len(records) == len(batches)
    if method in ("dynamic", "static"):
        steady = [r for r in records if r.phase == "steady"]
        assert steady, "warm-up never ended"
        assert any(r.n_checkpointed < r.n_blocks for r in steady)
    if method == "dynamic":
        assert any(0 < r.n_checkpointed for r in steady), "budget never bound: the test checks nothing"
    ctl.remove()
