"""Decoder LLMs (Llama, Qwen2, Mistral, Gemma 2, Phi-3, Qwen3, Gemma 3, Qwen3-MoE, OLMo 2, Cohere, Qwen2-MoE), full fine-tuning and LoRA: every
checkpointing plan gives the gradients of training without checkpointing, bitwise.

Dropout is on (attention, and Phi-3's residual and embedding dropout; LoRA's dropout), fp32 on
CPU. The budget sits between the peaks of `none` and `full` at the largest input, so `dynamic`
and `static` must run partial plans: some blocks checkpointed, not all.
"""

import copy

import pytest
import torch

import memfit
from _models import DECODER_ARCHS, TEXT_SIZES, build_decoder, logical_peak, step_both_and_compare
from memfit.engine.parts.blocks import find_blocks

pytest.importorskip("peft")


@pytest.mark.parametrize("lora", [False, True], ids=["full-ft", "lora"])
@pytest.mark.parametrize("arch", DECODER_ARCHS)
def test_decoder_gradients_equal_no_checkpointing(arch, lora):
    torch.manual_seed(0)
    model, make_batch = build_decoder(arch, lora)
    model.train()
    assert len(find_blocks(model)) == 3  # the decoder layers, inside the PeftModel too
    batches = [make_batch(3, s) for s in TEXT_SIZES * 2]
    largest = max(batches, key=lambda b: b["input_ids"].numel())
    budget = (logical_peak(model, largest, "none") + logical_peak(model, largest, "full")) // 2
    for method in ("full", "dynamic", "static"):
        reference = copy.deepcopy(model)
        kwargs = {} if method == "full" else {"warmup_steps": 2, "warmup_keys": 2}
        ctl = memfit.fit(model, budget=budget, method=method, **kwargs)
        for step, batch in enumerate(batches):
            context = f"{arch}/{'lora' if lora else 'full'}/{method} step {step}"
            step_both_and_compare(model, reference, batch, 1000 + step, context)
        records = ctl.records
        ctl.remove()
        assert len(records) == len(batches)
        if method == "full":
            assert all(r.n_checkpointed == r.n_blocks == 3 for r in records)
            continue
        steady = [r for r in records if r.phase == "steady"]
        assert steady, f"{method}: warm-up never ended"
        # a plan that treats part of the stack, or recomputes part of it (by default these blocks may
        # also take `elementwise`, priced by a timed probe: a plan may treat every block, some that way)
        partial = [r for r in steady if 0 < r.n_checkpointed and len(r.block_treatments.get("recompute", [])) < r.n_blocks]
        assert partial, f"{method}: no partial plan, the budget never bound part of the stack: {[r.plan for r in steady]}"
        if method == "dynamic":  # short inputs need no checkpointing at all
            assert any(r.n_checkpointed == 0 for r in steady), [r.plan for r in steady]
