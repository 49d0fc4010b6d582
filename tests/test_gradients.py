"""Every checkpointing path gives the gradients of training without checkpointing.

Dropout is on in every model: equal gradients need the recompute to replay the same masks.
"""

import copy
import json

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
        # some step does not recompute every block (by default a Llama's blocks may also take
        # `elementwise`, priced by a timed probe: a step may treat every block, some that way)
        assert any(len(r.block_treatments.get("recompute", [])) < r.n_blocks for r in steady)
    if method == "dynamic":
        assert any(0 < r.n_checkpointed for r in steady), "budget never bound: the test checks nothing"
    ctl.remove()


def test_plans_agree_bitwise_with_a_kv_cache_on(tmp_path):
    """GPT-2 builds a KV cache in training by default (``use_cache=True``); a checkpointed
    block cannot write one. Every plan runs its blocks without it (NOTE [No KV cache in
    training]), so `none`, `full` and a partial plan give bitwise equal gradients."""
    torch.manual_seed(0)
    model, make_batch = build("gpt2")
    model.config.use_cache = True
    model.train()
    batch = make_batch(3, 8)  # at this size the cached path rounds differently (transformers 5.23)
    grads = {}
    for method, kwargs in (("none", {}), ("full", {}), ("precomputed", {"path": None})):
        if method == "precomputed":  # blocks 0 and 2 checkpointed, block 1 not
            path = tmp_path / "plans.json"
            path.write_text(json.dumps({"schema_version": 1, "n_blocks": 3, "plans": [{"key": [3, 8], "blocks": [0, 2]}]}))
            kwargs = {"path": path}
        ctl = memfit.fit(model, budget=None, method=method, **kwargs)
        torch.manual_seed(7)
        model(**batch).loss.backward()
        assert ctl.records[-1].plan == {"none": [], "full": [0, 1, 2], "precomputed": [0, 2]}[method]
        ctl.remove()
        grads[method] = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    for method in ("full", "precomputed"):
        for a, b in zip(grads["none"], grads[method]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
