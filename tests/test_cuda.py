"""GPU checks of the CPU proxies against the real allocator (skipped without CUDA)."""

import pytest
import torch

import memfit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _bert(layers=4):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=layers)
    return BertForSequenceClassification(cfg).cuda().train()


def _batch(n, length):
    ids = torch.randint(1000, 30000, (n, length), device="cuda")
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 2, (n,), device="cuda")}


@pytest.mark.parametrize("method", ["none", "full"])
def test_counted_saved_bytes_match_allocator(method):
    model = _bert()
    ctl = memfit.fit(model, budget=None, method=method)
    batch = _batch(16, 256)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = model(**batch).loss
    torch.cuda.synchronize()
    retained = torch.cuda.memory_allocated() - before
    counted = ctl._counter.total_bytes
    loss.backward()
    model.zero_grad(set_to_none=True)
    ctl.remove()
    # What forward leaves allocated is what it saved for backward (plus the loss and logits).
    assert counted == pytest.approx(retained, rel=0.05), (counted, retained)


def test_dynamic_stays_under_cap_and_predicts_peak():
    model = _bert(layers=6)
    opt = torch.optim.AdamW(model.parameters())
    budget = 3 * 10**9
    ctl = memfit.fit(model, budget=budget, method="dynamic", optimizer=opt)
    for step, length in enumerate([64, 128, 256, 512, 384, 512, 96, 448, 512, 200]):
        model(**_batch(24, length)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    records = ctl.records
    ctl.remove()
    torch.cuda.set_per_process_memory_fraction(1.0)
    assert all(r.accounting == "cuda" for r in records)
    assert all(r.peak_allocated_bytes <= budget for r in records)
    steady = [r for r in records if r.phase == "steady"]
    assert any(0 < r.n_checkpointed < r.n_blocks for r in steady)
    for r in steady:
        assert r.peak_allocated_bytes <= r.predicted_peak_bytes * 1.10 + 2**20, r
