"""Exactness of the planned head through ``memfit.fit`` (issue 39): for each decoder family memfit
recognises, tied embeddings and LoRA, a few steps whose head runs chunked (warm-up's plans chunk it)
give the weights of training without memfit within ``torch.testing.assert_close``'s float32
defaults (chunking reorders the loss's float additions: not bitwise). Keep vs chunked on one
forward, family by family, is tests/test_head.py's."""

from __future__ import annotations

import copy

import pytest
import torch

tf = pytest.importorskip("transformers")

import memfit  # noqa: E402
from _models import build_decoder  # noqa: E402

LENGTHS = (12, 20, 9, 16)


def _train(base, make, **fit_kwargs):
    model = copy.deepcopy(base).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = memfit.fit(model, optimizer=optimizer, announce=False, **{"head": "auto", **fit_kwargs}) if fit_kwargs else None
    torch.manual_seed(5)
    batches = [make(3, length) for length in LENGTHS]
    for i, batch in enumerate(batches):
        torch.manual_seed(100 + i)  # the same dropout masks with and without memfit
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    heads = [] if ctl is None else [r.treatments.get("head") for r in ctl.records]
    if ctl is not None:
        ctl.remove()
    return model, heads


def _check(base, make):
    reference, _ = _train(base, make)
    model, heads = _train(base, make, budget="1GB", method="dynamic")
    assert any(h and h.startswith("chunked:") for h in heads), heads
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3"])
def test_fit_with_a_chunked_head_trains_each_family_to_the_plain_weights(arch):
    torch.manual_seed(0)
    _check(*build_decoder(arch))


def test_fit_with_a_chunked_head_and_tied_embeddings():
    torch.manual_seed(0)
    base, make = build_decoder("llama")
    base.config.tie_word_embeddings = True
    base.lm_head.weight = base.model.embed_tokens.weight
    _check(base, make)


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_fit_with_a_chunked_head_and_lora(arch):
    pytest.importorskip("peft")
    torch.manual_seed(0)
    _check(*build_decoder(arch, lora=True))
