"""Compiled blocks (NOTE [Compiled blocks], blocks.py): each block's body compiled inside memfit's
wrapper gives the gradients of the same compiled model under ``none`` (dropout on, CPU), whatever
the treatment; its saved tensors are still counted; ``selective`` is refused."""

from __future__ import annotations

import copy

import pytest
import torch

import memfit
from torch._dynamo.utils import counters

from _models import build_decoder, step_both_and_compare
from memfit.planner import Plan
from test_treatments import _Fixed

# aot_eager traces and partitions as inductor does but runs the graph's ATen ops: quick to
# compile on a CPU, and deterministic, so gradients can be compared bitwise
COMPILE = {"backend": "aot_eager"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_blocks_recompute_and_offload_give_the_gradients_of_compiled_none():
    torch.manual_seed(0)
    model, make_batch = build_decoder("llama")
    model.train()
    reference = copy.deepcopy(model)
    ref_ctl = memfit.fit(reference, budget=None, method="none", compile=COMPILE, announce=False)
    n = len(ref_ctl.blocks)
    plans = {
        "recompute": Plan(tuple(range(n))),
        "offload": Plan(tuple(range(n)), kinds=("offload",) * n),
        "mixed": Plan((0, 1), kinds=("offload", "recompute")),
    }
    for name, plan in plans.items():
        ctl = memfit.fit(model, budget=None, method=_Fixed(plan), treatments=("recompute", "offload"), compile=COMPILE,
                         announce=False)
        ctl.treatments["offload"].min_bytes = 0
        assert all(b.compiled for b in ctl.blocks)
        for seed, length in enumerate((9, 17)):
            before = [b.recomputes for b in ctl.blocks]
            step_both_and_compare(model, reference, make_batch(2, length), seed, f"compiled {name} length {length}")
            rerun = {i for i, kind in enumerate(plan.treatments(n)) if kind == "recompute"}
            assert {b.index for b, r in zip(ctl.blocks, before) if b.recomputes > r} == rerun
        # the compiled graphs' saved tensors reach memfit's hooks: the step counted them
        assert ctl.records[-1].saved_activation_bytes > 0
        assert counters["stats"]["unique_graphs"] >= 1  # dynamo compiled the bodies (no fallback to eager)
        ctl.remove()
        assert "forward" not in model.model.layers[0].__dict__  # unwrapped: the class's forward again
    ref_ctl.remove()


def test_dynamic_with_compiled_blocks_fits_a_budget_with_compiled_none_gradients():
    torch.manual_seed(0)
    model, make_batch = build_decoder("llama")
    model.train()
    reference = copy.deepcopy(model)
    batch = make_batch(2, 64)
    probe = memfit.fit(copy.deepcopy(model), budget=None, method="none", compile=COMPILE, announce=False)
    torch.manual_seed(0)
    probe.model(**batch).loss.backward()
    none_peak = probe.records[-1].peak_allocated_bytes
    probe.remove()
    ref_ctl = memfit.fit(reference, budget=None, method="none", compile=COMPILE, announce=False)
    ctl = memfit.fit(model, budget=int(none_peak * 0.97), method="dynamic", compile=COMPILE, announce=False)
    for seed in range(5):
        step_both_and_compare(model, reference, batch, seed, f"dynamic compiled step {seed}")
    steady = ctl.records[-1]
    assert steady.phase != "warmup" and steady.n_checkpointed >= 1  # under the budget only by recomputing
    assert max(r.peak_allocated_bytes for r in ctl.records) <= ctl.budget_bytes
    ctl.remove()
    ref_ctl.remove()


def test_selective_is_refused_with_compiled_blocks():
    model, _ = build_decoder("llama")
    with pytest.raises(ValueError, match="selective"):
        memfit.fit(model, budget=None, method="dynamic", treatments=("recompute", "selective"), compile=True, announce=False)
    assert "forward" not in model.model.layers[0].__dict__  # nothing left wrapped
