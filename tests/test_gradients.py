"""Every checkpointing path gives the gradients of training without checkpointing.

Dropout is on in every model: equal gradients need the recompute to replay the same masks.
"""

import copy

import pytest
import torch

import memfit
from _models import ARCHS, SIZES, TEXT_SIZES, build


def _logical_peak(model, batch, method):
    ctl = memfit.fit(model, budget=None, method=method)
    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    peak = ctl.records[-1].peak_allocated_bytes
    ctl.remove()
    return peak


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
    budget = (_logical_peak(model, largest, "none") + _logical_peak(model, largest, "full")) // 2
    ctl = memfit.fit(model, budget=budget, method=method, warmup_steps=2, warmup_keys=2) if method != "full" else memfit.fit(model, budget=budget, method="full")
    for step, batch in enumerate(batches):
        torch.manual_seed(1000 + step)
        model(**batch).loss.backward()
        torch.manual_seed(1000 + step)
        reference(**batch).loss.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if q.grad is None:
                assert p.grad is None, name
                continue
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m: f"{arch}/{method} step {step} {name}: {m}")
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    records = ctl.records
    assert len(records) == len(batches)
    if method in ("dynamic", "static"):
        steady = [r for r in records if r.phase == "steady"]
        assert steady, "warm-up never ended"
        assert any(r.n_checkpointed < r.n_blocks for r in steady)
    if method == "dynamic":
        assert any(0 < r.n_checkpointed for r in steady), "budget never bound: the test checks nothing"
    ctl.remove()
