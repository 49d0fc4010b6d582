"""Tiny Hugging Face models (random weights, dropout on) and a batch maker for each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memfit.engine.methods import Decision, Method

VOCAB = 97


def _text_batch(n: int, length: int, labels: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (n, length))
    mask = torch.ones(n, length, dtype=torch.long)
    mask[0, length // 2 :] = 0  # padding in one row, as dynamic padding produces
    batch = {"input_ids": ids, "attention_mask": mask}
    if labels == "cls":
        batch["labels"] = torch.randint(0, 2, (n,))
    elif labels == "lm":
        batch["labels"] = ids.clone()
    elif labels == "seq2seq":
        batch["labels"] = torch.randint(3, VOCAB, (n, max(2, length // 2)))
    return batch


def _image_batch(n: int, size: int, **extra) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(n, 3, size, size), "labels": torch.randint(0, 2, (n,)), **extra}


def build(arch: str):
    """Return ``(model, make_batch(n, size))`` for a tiny model of ``arch``.

    Decoders train without a KV cache (``use_cache=False``), as memfit runs every block
    whatever the plan (NOTE [No KV cache in training] in memfit/engine/parts/blocks.py): the reference
    "training without checkpointing" is that same forward.
    """
    import transformers as tf

    d = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=37, vocab_size=VOCAB)
    drop = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    if arch == "bert":
        cfg = tf.BertConfig(**d, **drop, attn_implementation="eager")
        return tf.BertForSequenceClassification(cfg), lambda n, s: _text_batch(n, s, "cls")
    if arch == "roberta":
        cfg = tf.RobertaConfig(**d, **drop, max_position_embeddings=600, pad_token_id=1)
        return tf.RobertaForSequenceClassification(cfg), lambda n, s: _text_batch(n, s, "cls")
    if arch == "distilbert":
        cfg = tf.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=3, n_heads=2, hidden_dim=37, dropout=0.1, attention_dropout=0.1)
        return tf.DistilBertForSequenceClassification(cfg), lambda n, s: _text_batch(n, s, "cls")
    if arch == "electra":
        cfg = tf.ElectraConfig(**d, **drop, embedding_size=16)
        return tf.ElectraForSequenceClassification(cfg), lambda n, s: _text_batch(n, s, "cls")
    if arch == "deberta-v2":
        cfg = tf.DebertaV2Config(**d, **drop, max_relative_positions=64, relative_attention=True, pos_att_type=["p2c", "c2p"])
        return tf.DebertaV2ForSequenceClassification(cfg), lambda n, s: _text_batch(n, s, "cls")
    if arch == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=2, n_positions=600, resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1, use_cache=False)
        return tf.GPT2LMHeadModel(cfg), lambda n, s: _text_batch(n, s, "lm")
    if arch == "llama":
        cfg = tf.LlamaConfig(**d, num_key_value_heads=1, attention_dropout=0.1, max_position_embeddings=600)
        return tf.LlamaForCausalLM(cfg), lambda n, s: _text_batch(n, s, "lm")
    if arch == "t5":
        cfg = tf.T5Config(vocab_size=VOCAB, d_model=32, d_ff=37, d_kv=16, num_layers=2, num_heads=2, dropout_rate=0.1, decoder_start_token_id=0, use_cache=False)
        return tf.T5ForConditionalGeneration(cfg), lambda n, s: _text_batch(n, s, "seq2seq")
    if arch == "vit":
        cfg = tf.ViTConfig(**{k: v for k, v in d.items() if k != "vocab_size"}, **drop, image_size=64, patch_size=8, num_labels=2)
        return tf.ViTForImageClassification(cfg), lambda n, s: _image_batch(n, s, interpolate_pos_encoding=True)
    if arch == "swin":
        cfg = tf.SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, drop_path_rate=0.1, num_labels=2)
        return tf.SwinForImageClassification(cfg), lambda n, s: _image_batch(n, s)
    raise ValueError(arch)


def tiny_wav2vec2():
    """A tiny Wav2Vec2 classifier whose first blocks are convolutions over raw samples (NOTE [What the key cannot see])."""
    tf = pytest.importorskip("transformers")
    config = tf.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                               conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                               num_conv_pos_embedding_groups=2, num_labels=2, mask_time_prob=0.0)
    torch.manual_seed(0)
    return tf.Wav2Vec2ForSequenceClassification(config).train()


def build_decoder(arch: str, lora: bool = False):
    """Return ``(model, make_batch(n, length))`` for a tiny decoder LLM of ``arch`` (dropout on,
    no KV cache); with ``lora``, a peft LoRA model over it whose adapters start random (peft's
    own init zeroes B, which would leave A's gradients zero) with dropout on."""
    import transformers as tf

    d = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, intermediate_size=37,
             vocab_size=VOCAB, max_position_embeddings=600, use_cache=False, attention_dropout=0.1)
    configs = {
        "llama": lambda: tf.LlamaConfig(**d),
        "qwen2": lambda: tf.Qwen2Config(**d),
        "mistral": lambda: tf.MistralConfig(**d),
        "gemma2": lambda: tf.Gemma2Config(**d, head_dim=16, query_pre_attn_scalar=16, sliding_window=16, pad_token_id=0),
        "phi3": lambda: tf.Phi3Config(**d, resid_pdrop=0.1, embd_pdrop=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "qwen3": lambda: tf.Qwen3Config(**d, head_dim=16),
        "gemma3": lambda: tf.Gemma3TextConfig(**d, head_dim=16, query_pre_attn_scalar=16, sliding_window=16, pad_token_id=0),
        # mixture of experts: which experts run, and so what a block saves, depends on the routing
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**d, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
        # blocks whose MLP input has another use (NOTE [Tiled MLP]): post-norm, a parallel block, a shared expert
        "olmo2": lambda: tf.Olmo2Config(**d, pad_token_id=0),
        "cohere": lambda: tf.CohereConfig(**d, pad_token_id=0),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**d, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                               shared_expert_intermediate_size=37),
    }
    try:
        config = configs[arch]()
    except AttributeError:  # a family newer than the installed transformers
        pytest.skip(f"transformers {tf.__version__} has no {arch}")
    model = tf.AutoModelForCausalLM.from_config(config)
    if lora:
        import peft

        # peft's LoRA of fused expert weights takes no dropout: adapt a mixture's attention
        targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if arch.endswith("_moe") else "all-linear"
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=targets, init_lora_weights=False)
        model = peft.get_peft_model(model, config)
    return model, lambda n, s: _text_batch(n, s, "lm")


DECODER_ARCHS = ["llama", "qwen2", "mistral", "gemma2", "phi3", "qwen3", "gemma3", "qwen3_moe", "olmo2", "cohere", "qwen2_moe"]


class InjectOOM:
    """Raise torch.OutOfMemoryError from inside ``module`` on its ``at``-th training forward
    (``always``: and on every one after it)."""

    def __init__(self, module, at, always=False):
        self.calls, self.at, self.always, self.fired = 0, at, always, 0
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if not module.training or not torch.is_grad_enabled():
            return
        self.calls += 1
        if self.calls == self.at or (self.always and self.calls > self.at):
            self.fired += 1
            raise torch.OutOfMemoryError("injected: CUDA out of memory")


ARCHS = ["bert", "roberta", "distilbert", "electra", "deberta-v2", "gpt2", "llama", "t5", "vit", "swin"]
# (batch rows, sizes) per kind: sequence lengths for text, image sides for vision.
SIZES = {"vit": [32, 48, 64], "swin": [32, 48, 64]}
TEXT_SIZES = [8, 24, 40, 16]


def step_both_and_compare(model, reference, batch, seed: int, context: str) -> None:
    """One forward + backward of ``model`` and ``reference`` under the same seed (same dropout
    masks); their gradients must be bitwise equal; both are zeroed after."""
    for m in (model, reference):
        torch.manual_seed(seed)
        m(**batch).loss.backward()
    assert_grads_equal(model, reference, context)
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)


def assert_grads_equal(model, reference, context: str) -> None:
    """Bitwise-equal gradients (``None`` where the reference has none)."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m: f"{context} {name}: {m}")


def logical_peak(model, batch, method: str) -> int:
    """Counted (logical) peak of one forward + backward of ``batch`` under ``method``."""
    import memfit

    ctl = memfit.fit(model, budget=None, method=method)
    torch.manual_seed(0)
    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    peak = ctl.records[-1].peak_allocated_bytes
    ctl.remove()
    return peak


#: Small data files copied from ../shared/data (each folder has a SOURCE.md).
FIXTURES = Path(__file__).parent / "fixtures"
#: A 2-layer BERT config with the uncased vocabulary, for task and CLI runs.
TINY_BERT = {
    "model_type": "bert",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 37,
    "vocab_size": 30522,
}



class FixedPlan(Method):
    """A test's own method: every step runs ``plan``."""

    name = "fixed"

    def __init__(self, plan):
        self.plan = plan

    def decide(self, planning, key, failed=None):
        return Decision(self.plan, count=True)


def assert_dynamic_treats_long_batches_only(monkeypatch, model, make, under_bytes: int, treatment: str) -> None:
    """``dynamic`` with ``treatment`` beside recompute under a logical budget ``under_bytes`` below the longest
    batch's (4 x 96) untreated peak, ``treatment`` priced cheaper than recompute per byte (as on a GPU, where a
    recompute runs the whole block again): over steps of mixed lengths, each compared with the reference's gradients
    bit for bit, the longest batches' plans give blocks ``treatment`` and none recomputed, the short ones' (4 x 16
    tokens or fewer) treat nothing, and every peak is within the budget."""
    import copy

    import memfit
    from memfit.engine.parts import probe

    original = probe.probe_treatments

    def priced(*args, **kwargs):
        out = original(*args, **kwargs)
        if treatment in out:
            out[treatment] = (out[treatment][0], 1e-4)
        return out

    monkeypatch.setattr(probe, "probe_treatments", priced)
    reference = copy.deepcopy(model)
    budget = logical_peak(model, make(4, 96), "none") - under_bytes
    ctl = memfit.fit(model, budget=budget, method="dynamic", treatments=("recompute", treatment), announce=False)
    for seed, length in enumerate([16, 96, 48, 80, 96, 8, 88, 96, 12, 92]):
        step_both_and_compare(model, reference, make(4, length), seed, f"step {seed}")
    records = ctl.records
    ctl.remove()
    assert all(r.peak_allocated_bytes <= budget for r in records)
    steady = [(r.tokens, r.treatments) for r in records if r.phase == "steady"]
    longest_plans = [t for tokens, t in steady if tokens == 4 * 96]
    short_plans = [t for tokens, t in steady if tokens <= 4 * 16]
    assert longest_plans and all(treatment in t for t in longest_plans), steady
    assert not any("recompute" in t for _, t in steady), steady
    assert short_plans and not any(set(t) - {"head"} for t in short_plans), steady

