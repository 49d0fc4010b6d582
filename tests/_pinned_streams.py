"""CPU training streams whose plans and predictions are pinned (tests/test_pinned_plans.py).

Each stream trains a small model under a logical budget for a fixed list of batch shapes and
returns, per step, what the engine decided and predicted. The fixture
``tests/fixtures/pinned_plans.json`` holds what the engine gave when the streams were
written; a change of the engine that alters any plan or prediction fails the test.

Two sources of noise are fixed, so that a stream is a pure function of the code:

* a probe's price (a block's forward time) is replaced by a function of its bytes and its
  index (``PROBE_MS_PER_MB``): the plans of a mixed stack depend on the prices;
* the reactive store's clock advances 1 ms per reading, so every stored block costs the same.

Run ``python tests/_pinned_streams.py`` to rewrite the fixture (only when a change of plans
is intended; say why in the commit).
"""

from __future__ import annotations

import json
import random
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from _models import logical_peak

FIXTURE = Path(__file__).parent / "fixtures" / "pinned_plans.json"
#: a probe's price in ms per MB saved, times (1 + 0.25 * (block index % 3))
PROBE_MS_PER_MB = 1.0


def _probe_ms(nbytes: int, index: int) -> float:
    return nbytes / 1e6 * PROBE_MS_PER_MB * (1 + 0.25 * (index % 3))


class _Clock:
    """A perf_counter that advances 1 ms per reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-3
        return self.now


@contextmanager
def deterministic_prices():
    """Probe prices from bytes; the reactive store's clock in fixed ticks."""
    from memfit.engine.parts import store as store_module
    from memfit.engine.parts import probe as probe_module

    original = probe_module.probe_block

    def priced(block, args, kwargs, counter, timed, device):
        nbytes, ms = original(block, args, kwargs, counter, timed, device)
        return nbytes, (_probe_ms(nbytes, block.index) if timed else None)

    clock = _Clock()

    class _Time:
        perf_counter = staticmethod(clock.perf_counter)

    saved_time = store_module.time
    probe_module.probe_block = priced
    store_module.time = _Time
    try:
        yield
    finally:
        probe_module.probe_block = original
        store_module.time = saved_time


def _text_batch(n: int, length: int, vocab: int, lm: bool, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[0, length // 2 :] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    batch["labels"] = ids.clone() if lm else torch.randint(0, 2, (n,), generator=g)
    return batch


def _model(arch: str):
    """``(model, make_batch(step, size))`` for a stream's architecture (random weights, dropout on)."""
    import transformers as tf

    torch.manual_seed(0)
    vocab = 97
    if arch == "bert6":
        cfg = tf.BertConfig(
            hidden_size=32, num_hidden_layers=6, num_attention_heads=2, intermediate_size=37, vocab_size=vocab,
            hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, attn_implementation="eager",
        )
        return tf.BertForSequenceClassification(cfg), lambda step, t: _text_batch(4, t, vocab, False, step)
    if arch == "llama4":
        cfg = tf.LlamaConfig(
            hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, intermediate_size=37,
            vocab_size=vocab, attention_dropout=0.1, max_position_embeddings=600, use_cache=False,
        )
        return tf.LlamaForCausalLM(cfg), lambda step, t: _text_batch(4, t, vocab, True, step)
    if arch == "t5":
        cfg = tf.T5Config(
            vocab_size=vocab, d_model=32, d_ff=37, d_kv=16, num_layers=3, num_heads=2, dropout_rate=0.1,
            decoder_start_token_id=0, use_cache=False,
        )

        def t5_batch(step: int, t: int) -> dict:
            batch = _text_batch(4, t, vocab, False, step)
            g = torch.Generator().manual_seed(step + 7)
            batch["labels"] = torch.randint(3, vocab, (4, max(2, t // 2)), generator=g)
            return batch

        return tf.T5ForConditionalGeneration(cfg), t5_batch
    if arch == "swin":
        cfg = tf.SwinConfig(
            image_size=64, patch_size=4, embed_dim=16, depths=[2, 2, 2], num_heads=[2, 2, 2], window_size=4,
            hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, drop_path_rate=0.1, num_labels=2,
        )

        def image_batch(step: int, side: int) -> dict:
            g = torch.Generator().manual_seed(step)
            return {"pixel_values": torch.randn(4, 3, side, side, generator=g), "labels": torch.randint(0, 2, (4,), generator=g)}

        return tf.SwinForImageClassification(cfg), image_batch
    raise ValueError(arch)


def _sizes(arch: str, steps: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    if arch == "swin":
        return [rng.choice([64, 96, 128]) for _ in range(steps)]
    return [rng.randint(4, 96) for _ in range(steps)]


#: name -> (architecture, method, fit keyword arguments, steps, budget share between none and full)
STREAMS: dict[str, tuple[str, str, dict, int, float]] = {
    "bert6-dynamic": ("bert6", "dynamic", {}, 28, 0.5),
    "bert6-dynamic-tight": ("bert6", "dynamic", {}, 20, 0.2),
    "bert6-dynamic-nobackstop": ("bert6", "dynamic", {"backstop": False}, 28, 0.5),
    "bert6-static": ("bert6", "static", {}, 16, 0.5),
    "bert6-reactive": ("bert6", "reactive", {"margin": 0.05}, 14, 0.5),
    # recompute alone: by default a gated MLP's blocks are also offered ``elementwise``, priced by its
    # timed probe, which no fixture can pin (its plans are tested in test_treatments.py)
    "llama4-dynamic": ("llama4", "dynamic", {"bucket_tokens": 1, "treatments": ("recompute",)}, 20, 0.4),
    "t5-dynamic": ("t5", "dynamic", {}, 16, 0.5),
    "swin-dynamic": ("swin", "dynamic", {}, 16, 0.5),
    "swin-static": ("swin", "static", {}, 12, 0.5),
    "swin-dynamic-tight": ("swin", "dynamic", {}, 16, 0.25),
}

#: record fields pinned per step
FIELDS = ("shape", "plan", "phase", "predicted_peak_bytes", "peak_allocated_bytes", "evicted_blocks", "backstop_armed")


def run_stream(name: str) -> dict:
    """Train stream ``name``; return its budget and per-step fields."""
    import memfit

    arch, method, kwargs, steps, share = STREAMS[name]
    model, make_batch = _model(arch)
    model.train()
    sizes = _sizes(arch, steps, seed=len(name))
    largest = make_batch(0, max(sizes))
    none_peak, full_peak = logical_peak(model, largest, "none"), logical_peak(model, largest, "full")
    budget = int(full_peak + share * (none_peak - full_peak))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with deterministic_prices():
        # the head left to the model: a planned head runs the implementation its warm-up timed
        # fastest, which no fixture can pin (the head's plans are tested in test_head_plan.py)
        ctl = memfit.fit(model, budget=budget, method=method, optimizer=optimizer, head=False, **kwargs)
        for step, size in enumerate(sizes):
            torch.manual_seed(step)
            model(**make_batch(step, size)).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        records = ctl.records
        ctl.remove()
    return {"budget_bytes": budget, "steps": [{f: getattr(r, f) for f in FIELDS} for r in records]}


def main() -> None:
    names = sys.argv[1:] or list(STREAMS)
    data = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    for name in names:
        data[name] = run_stream(name)
        plans = [len(s["plan"]) for s in data[name]["steps"]]
        print(f"{name}: budget {data[name]['budget_bytes']}, checkpointed per step {plans}", flush=True)
    FIXTURE.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
