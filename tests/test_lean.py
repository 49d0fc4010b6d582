"""The ``lean`` treatment (treatments/lean.py, NOTE [Lean inputs in a tiled block]): ``keep``'s gradients bit for bit
with the norms and peft LoRA layers saving their bfloat16 input, what a lean block keeps (counted), where the probe
offers it, and that a run plans, records and summarises it by name."""

from __future__ import annotations

import copy

import pytest
import torch

import memfit
from _models import FixedPlan, assert_dynamic_treats_long_batches_only, build_decoder, step_both_and_compare
from memfit.engine.parts.blocks import find_blocks
from memfit.engine.parts.treatments import LEAN, TREATMENTS
from memfit.engine.plan.planner import Plan


def _model(arch: str, lora: float | None, dtype=torch.bfloat16):
    """A tiny decoder of ``arch`` (dropout on in its attention) in ``dtype``, with LoRA on every linear layer of dropout
    ``lora`` (None: full fine-tuning): peft makes the adapters float32 over bfloat16 weights."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model, make = build_decoder(arch, False)
    model.to(dtype)
    if lora is not None:
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=lora, target_modules="all-linear", init_lora_weights=False)
        model = peft.get_peft_model(model, config)
    return model.train(), make


def _fit_lean(model):
    n = len(find_blocks(model))
    return memfit.fit(model, budget=None, method=FixedPlan(Plan(tuple(range(n)), kinds=(LEAN,) * n)), treatments=(LEAN,),
                      announce=False), n


@pytest.mark.parametrize("arch,lora", [("llama", 0.0), ("llama", 0.1), ("llama", None), ("qwen2", 0.0), ("gemma2", 0.1),
                                       ("phi3", 0.0)])
def test_every_block_lean_gives_keeps_gradients_bit_for_bit(arch, lora):
    """Every block ``lean`` (LoRA with and without dropout, whose masks the re-run draws again, or full fine-tuning):
    every gradient bit for bit, over two steps of different lengths; ``remove()`` puts every forward back."""
    model, make = _model(arch, lora)
    reference = copy.deepcopy(model)
    ctl, n = _fit_lean(model)
    for seed, length in enumerate((9, 23)):
        step_both_and_compare(model, reference, make(2, length), seed, f"{arch} lora={lora}, length {length}")
    assert ctl.records[-1].block_treatments == {LEAN: list(range(n))}
    ctl.remove()
    assert all("forward" not in vars(m) for m in model.modules())


def _probe(model, ctl, make):
    from memfit.engine.parts import probe

    captured = {}
    block = ctl.blocks[1]
    handle = block.module.register_forward_pre_hook(lambda m, a, k: captured.update(inputs=(a, k)), with_kwargs=True)
    with torch.no_grad():
        model.eval()(**make(2, 24))
    model.train()
    handle.remove()
    args, kwargs = captured["inputs"]
    with torch.enable_grad():
        measured = probe.probe_treatments(block, args, kwargs, ctl._counter, torch.device("cpu"), ("recompute", LEAN))
        measured["keep"] = probe.probe_block(block, args, kwargs, ctl._counter, False, torch.device("cpu"))
    return measured


def test_the_probe_offers_lean_where_it_keeps_less():
    """A bfloat16 LoRA block keeps less lean than kept (its adapters' and norms' float32 copies), priced; a float32
    block has no copy to spare (its adapters take their input as it is, its norms cast nothing): never offered."""
    model, make = _model("llama", 0.0)
    ctl, _ = _fit_lean(model)
    measured = _probe(model, ctl, make)
    ctl.remove()
    assert LEAN in measured and measured[LEAN][0] < measured["keep"][0], measured
    assert measured[LEAN][1] is not None and measured[LEAN][1] >= 0

    model32, make32 = _model("llama", 0.0, dtype=torch.float32)
    ctl, _ = _fit_lean(model32)
    measured = _probe(model32, ctl, make32)
    ctl.remove()
    assert LEAN not in measured, measured


def test_offered_by_default_to_eager_half_precision_blocks_with_parts_to_run_lean():
    model, _ = _model("llama", 0.0)
    modules = [b for _, b in find_blocks(model)]
    assert TREATMENTS[LEAN].by_default(modules, None)
    assert not TREATMENTS[LEAN].by_default(modules, {"mode": "default"})  # compiled blocks: never
    assert TREATMENTS[LEAN].eager_only
    model32, _ = _model("llama", 0.0, dtype=torch.float32)  # nothing cast: nothing to spare, not probed
    assert not TREATMENTS[LEAN].by_default([b for _, b in find_blocks(model32)], None)


def test_dynamic_runs_long_lora_batches_lean_and_short_ones_untreated(monkeypatch):
    """``dynamic`` with ``lean`` beside recompute under a logical budget of about one block's float32 copies under the
    longest batch's untreated peak, ``lean`` priced cheaper than recompute per byte (as on a GPU: a norm's and a
    rank-wide projection's forward again against the whole block's): the longest batches' plans run blocks lean and
    none recomputed, the short ones' treat nothing; every peak within the budget and every gradient ``keep``'s bit for
    bit."""
    model, make = _model("llama", 0.0)
    copies_per_block = 4 * 96 * model.config.hidden_size * (6 * 4 - 4 * 2)  # six float32 copies, two bf16 inputs
    assert_dynamic_treats_long_batches_only(monkeypatch, model, make, copies_per_block, LEAN)

def test_under_autocast_a_lora_layer_runs_as_peft_runs_it_and_draws_its_dropout_once():
    """Under autocast the adapters' output is not float32 and the lean sum does not apply: the layer runs peft's own
    forward, decided before anything runs, so a LoRA dropout draws its mask once (``keep``'s gradients bit for bit)."""
    from memfit.engine.parts.treatments import tiled_mlp as tiled_module

    model, make = _model("llama", 0.1)
    reference = copy.deepcopy(model)
    ctl, n = _fit_lean(model)
    sums = []
    plain = tiled_module._LoraSum.apply
    tiled_module._LoraSum.apply = lambda *a: sums.append(1) or plain(*a)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step_both_and_compare(model, reference, make(2, 17), 0, "lean under autocast")
    finally:
        tiled_module._LoraSum.apply = plain
    ctl.remove()
    assert sums == []
