import pytest
import torch

from _models import ARCHS, build
from memfit.engine.parts.blocks import find_blocks, without_cache

EXPECTED = {
    "bert": ("BertLayer", 3),
    "roberta": ("RobertaLayer", 3),
    "distilbert": ("TransformerBlock", 3),
    "electra": ("ElectraLayer", 3),
    "deberta-v2": ("DebertaV2Layer", 3),
    "gpt2": ("GPT2Block", 3),
    "llama": ("LlamaDecoderLayer", 3),
    "t5": ("T5Block", 4),  # encoder and decoder stacks
    "vit": ("ViTLayer", 3),
    "swin": ("SwinLayer", 4),  # layers inside stages, not the 2 stages
}


@pytest.mark.parametrize("arch", ARCHS)
def test_discovery(arch):
    model, _ = build(arch)
    blocks = find_blocks(model)
    cls, count = EXPECTED[arch]
    assert [type(m).__name__ for _, m in blocks] == [cls] * count


def test_t5_has_both_stacks():
    model, _ = build("t5")
    names = [n for n, _ in find_blocks(model)]
    assert any(n.startswith("encoder.") for n in names) and any(n.startswith("decoder.") for n in names)


def test_module_list_fallback_takes_most_common_class():
    from torch import nn

    class Stage(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(n)])

    model = nn.Module()
    model.stages = nn.ModuleList([Stage(2), Stage(3)])
    names = [n for n, _ in find_blocks(model)]
    assert names == ["stages.0.layers.0", "stages.0.layers.1", "stages.1.layers.0", "stages.1.layers.1", "stages.1.layers.2"]


def test_parallel_lists_of_a_layers_parts_give_the_blocks_and_norms_do_not():
    """XLM keeps a layer's parts in parallel lists: its attentions and feed-forward networks are the blocks, not its
    norms (two a layer, the most items, 1% of the parameters; NOTE [A model's lists]); `dynamic` keeps the gradients
    of training without memfit bit for bit (dropout on) and its steps under the budget."""

    import transformers as tf
    from _models import VOCAB, _text_batch

    config = tf.XLMConfig(emb_dim=32, n_layers=3, n_heads=2, vocab_size=VOCAB, dropout=0.1, attention_dropout=0.1,
                          max_position_embeddings=600, num_labels=2)
    torch.manual_seed(0)
    model = tf.XLMForSequenceClassification(config).train()
    kinds = [type(m).__name__ for _, m in find_blocks(model)]
    assert kinds == ["MultiHeadAttention"] * 3 + ["TransformerFFN"] * 3
    # XLM hands its attentions a KV cache even in training, which memfit drops (NOTE [No KV cache in training]): the
    # reference drops it too (a hook the deep copy keeps), else a cache's layout moves the gradients by a rounding
    for attention in model.transformer.attentions:
        attention.register_forward_pre_hook(lambda m, args, kwargs: without_cache(m, args, kwargs), with_kwargs=True)
    records, budget = _dynamic_between_none_and_full(model, [_text_batch(3, s, "cls") for s in (8, 40, 24, 40)], "xlm")
    assert all(r.peak_allocated_bytes <= budget for r in records[2:]), [r.peak_allocated_bytes for r in records]


def test_layers_listed_beside_checkpointing_layers_are_blocks_too():
    """NOTE [A layer's list]: an item of a list that holds checkpointing layers is a block too where it has parameters,
    holds no block and is no container (MobileViT's MobileNet stages before its MobileViT layers); one without
    parameters, and a list elsewhere, are not."""
    from torch import nn
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Layer(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

    model = nn.Module()
    model.stem = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
    model.layers = nn.ModuleList([nn.Conv1d(8, 8, 1), nn.Identity(), Layer(), nn.ModuleList([nn.Linear(8, 8)]), Layer()])
    assert [n for n, _ in find_blocks(model)] == ["layers.0", "layers.2", "layers.4"]


def test_mobilevits_mobilenet_stages_are_blocks_and_full_recomputes_them():
    """MobileViT (a tiny config): its two MobileNet stages, listed before its MobileViT layers and not checkpointing
    layers, are blocks; ``full`` then keeps under a fifth of what it kept without them (the stages' activations)."""
    tf = pytest.importorskip("transformers")
    import memfit

    config = tf.MobileViTConfig(image_size=64, patch_size=2, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
                                num_attention_heads=2, num_labels=2)
    torch.manual_seed(0)
    model = tf.MobileViTForImageClassification(config).train()
    assert [type(m).__name__ for _, m in find_blocks(model)] == ["MobileViTMobileNetLayer"] * 2 + ["MobileViTLayer"] * 3
    batch = {"pixel_values": torch.randn(2, 3, 64, 64), "labels": torch.tensor([0, 1])}
    peaks = {}
    for method in ("none", "full"):
        ctl = memfit.fit(model, budget=None, method=method, announce=False)
        model(**batch).loss.backward()
        peaks[method] = ctl.records[-1].peak_allocated_bytes
        model.zero_grad(set_to_none=True)
        ctl.remove()
    assert peaks["full"] < peaks["none"] / 5, peaks


def test_a_layer_holding_a_layers_worth_of_its_own_work_is_the_block():
    """NOTE [Nested layers]: checkpointing layers inside another are the blocks (a stage's layers) unless the outer
    layer holds, outside them, at least as many parameters as its smallest inner layer (Zamba 2's hybrid layer: a
    shared transformer beside a Mamba layer), which would otherwise be in no block."""
    from torch import nn
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Inner(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

    class Outer(GradientCheckpointingLayer):
        def __init__(self, own: int):
            super().__init__()
            self.layers = nn.ModuleList([Inner(), Inner()])
            self.own = nn.Linear(own, own, bias=False)

    model = nn.Module()
    model.stages = nn.ModuleList([Outer(2), Outer(9)])  # 4 parameters of its own (a stage), 81 (a hybrid)
    assert [n for n, _ in find_blocks(model)] == ["stages.0.layers.0", "stages.0.layers.1", "stages.1"]


def test_a_checkpointing_layers_own_list_of_layers_gives_the_blocks():
    """NOTE [Nested layers]: a checkpointing layer holding, as its direct child, a list of two or more modules of one
    class is a stage of them (Swin V2's stage: its layers transformers does not checkpoint), and they are the blocks
    unless the layer's own work outweighs one of them (MobileBERT's attention beside its feed-forward networks); a
    list deeper down (a mixture's experts under its MLP) leaves the layer whole."""
    from torch import nn
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Stage(GradientCheckpointingLayer):
        def __init__(self, own: int):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
            self.own = nn.Linear(own, own, bias=False)

    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    class Decoder(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = nn.Linear(8, 8), Moe()

    model = nn.Module()
    model.stages = nn.ModuleList([Stage(2), Stage(9)])  # 4 parameters of its own (a stage), 81 (more than a layer's 72)
    model.layers = nn.ModuleList([Decoder(), Decoder()])
    assert [n for n, _ in find_blocks(model)] == ["stages.0.blocks.0", "stages.0.blocks.1", "stages.1", "layers.0", "layers.1"]


@pytest.mark.parametrize("family", ["Swinv2", "DonutSwin", "MaskFormerSwin", "FocalNet"])
def test_stages_checkpointed_whole_are_planned_by_their_layers(family):
    """NOTE [Nested layers]: the families whose stages transformers checkpoints (their layers listed in the stage) are
    planned by their layers, each stage's layers in order, whichever of the two transformers checkpoints."""
    tf = pytest.importorskip("transformers")
    if not hasattr(tf, f"{family}Config"):
        pytest.skip(f"transformers {tf.__version__} has no {family}")
    extra = {} if family == "FocalNet" else {"num_heads": [2, 2], "window_size": 4}
    config = getattr(tf, f"{family}Config")(image_size=64, patch_size=4, embed_dim=16, depths=[2, 3], **extra)
    model = getattr(tf, f"{family}Model")(config)
    assert [type(m).__name__ for _, m in find_blocks(model)] == [f"{family}Layer"] * 5


def test_swin_v2s_layers_are_the_blocks_and_its_gradients_stay_exact():
    """Swin V2 checkpoints its stages, not its layers: the layers are the blocks (NOTE [Nested layers]), each a
    treatment of its own, and every plan gives the gradients of training without memfit, bit for bit (drop path and
    dropout on)."""

    import transformers as tf
    from _models import _image_batch

    config = tf.Swinv2Config(image_size=64, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4,
                             hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, drop_path_rate=0.1, num_labels=2)
    torch.manual_seed(0)
    model = tf.Swinv2ForImageClassification(config).train()
    assert [type(m).__name__ for _, m in find_blocks(model)] == ["Swinv2Layer"] * 4
    _dynamic_between_none_and_full(model, [_image_batch(2, s) for s in (32, 64, 48, 64)], "swinv2")


def test_zamba2s_hybrid_layer_is_one_block_and_its_gradients_stay_exact():
    """Zamba 2 (transformers' tiny config): its hybrid layer, a shared transformer beside a Mamba layer, is a block
    whole; every plan gives the gradients of training without memfit, bit for bit."""

    import transformers as tf
    from _models import VOCAB, _text_batch

    if not hasattr(tf, "Zamba2Config"):
        pytest.skip(f"transformers {tf.__version__} has no Zamba2")
    config = tf.Zamba2Config(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=37,
                             vocab_size=VOCAB, max_position_embeddings=600, use_cache=False, attention_dropout=0.1,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2, layers_block_type=["mamba", "hybrid", "mamba"],
                             hybrid_layer_ids=[1], mamba_d_state=16, n_mamba_heads=4, mamba_headdim=16,
                             attention_head_dim=16, use_mamba_kernels=False, chunk_size=16)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).train()
    assert [n for n, _ in find_blocks(model)] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    _dynamic_between_none_and_full(model, [_text_batch(3, s, "lm") for s in (8, 40, 24, 40)], "zamba2")


def test_a_list_of_lists_gives_the_inner_lists_items_never_the_lists():
    """Funnel's encoder holds a list of lists of layers: the layers are the blocks (a list is never called, and
    blocks that are lists ran no step: nothing was recorded or treated)."""
    from torch import nn

    model = nn.Module()
    model.blocks = nn.ModuleList([nn.ModuleList([nn.Linear(4, 4)]) for _ in range(3)])  # a stage of one layer each
    model.head = nn.ModuleList([nn.Conv1d(4, 4, 1) for _ in range(2)])
    assert [n for n, _ in find_blocks(model)] == ["blocks.0.0", "blocks.1.0", "blocks.2.0"]


@pytest.mark.parametrize("method", ["full", "dynamic"])
def test_a_block_called_twice_in_one_forward_is_refused_with_what_to_change(method):
    """NOTE [A block runs once a step]: a module whose weights are shared across layers (ALBERT runs its one layer
    group once per layer) would be counted, treated and probed as one block running once (the learner failed with a
    KeyError); the second start of its forward in one step is refused, naming the block and what to change."""
    from torch import nn

    import memfit
    from memfit.engine.parts.blocks import NoBlocksError

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def forward(self, x):
            for _ in range(3):
                x = torch.tanh(self.layer(x))
            return x

    model = Shared().train()
    ctl = memfit.fit(model, budget=None if method == "full" else 10**9, method=method, blocks=[model.layer], announce=False)
    with pytest.raises(NoBlocksError, match=r"block 0 \(layer\) ran twice in one forward.*pass blocks="):
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    ctl.remove()


def _seq2seq(width=16):
    """Two stacks of blocks: an encoder on the source, a decoder on the target (a length of its own)."""
    from torch import nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(width, width)

        def forward(self, x):
            return x + torch.relu(self.proj(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = nn.ModuleList(Layer() for _ in range(2)), nn.ModuleList(Layer() for _ in range(2))

        def forward(self, source, target):
            for layer in self.encoder:
                source = layer(source)
            for layer in self.decoder:
                target = layer(target)
            return source.pow(2).mean() + target.pow(2).mean()

    return Net().train()


@pytest.mark.parametrize("decoder_lengths, said", [((8, 24, 40), True), ((8, 8, 8), False)])
def test_a_block_whose_length_the_key_does_not_carry_is_said_once(caplog, decoder_lengths, said):
    """NOTE [What the key cannot see]: a decoder whose length varies under one source length (the step's key) is said
    once, with what to change; one whose length follows the key is not."""
    import memfit

    model = _seq2seq()
    ctl = memfit.fit(model, budget=10**8, method="dynamic", announce=False)
    with caplog.at_level("WARNING", logger="memfit"):
        for _ in range(3):
            for length in decoder_lengths:
                model(torch.randn(2, 16, 16), torch.randn(2, length, 16)).backward()
    ctl.remove()
    messages = [m for m in caplog.messages if "the plans follow the first block's input" in m]
    assert len(messages) == int(said), messages
    if said:
        assert "rows and length (2, 16), but block 2" in messages[0] and "blocks=" in messages[0]


def test_a_decoder_llm_of_uneven_lengths_is_not_said(caplog):
    """Every block of a decoder runs on the first block's rows and length: nothing to say."""
    import memfit
    from _models import build_decoder

    model, make = build_decoder("llama")
    ctl = memfit.fit(model.train(), budget=10**8, method="dynamic", announce=False)
    with caplog.at_level("WARNING", logger="memfit"):
        for length in (8, 24, 40, 8, 24, 40):
            model(**make(2, length)).loss.backward()
    ctl.remove()
    assert not [m for m in caplog.messages if "the plans follow the first block's input" in m]


def test_an_audio_model_is_planned_by_its_samples_and_nothing_is_said(caplog):
    """NOTE [What the key cannot see]: Wav2Vec2's first block is a convolution over raw samples, ``(N, 1, samples)``:
    read channels first, the step's key is ``(N, samples)``, which its encoder layers' frames follow (nothing to say),
    and ``dynamic``'s gradients stay those of training without memfit."""
    import copy

    import memfit
    from _models import step_both_and_compare, tiny_wav2vec2

    model = tiny_wav2vec2()
    reference = copy.deepcopy(model)
    ctl = memfit.fit(model, budget=10**8, method="dynamic", announce=False)
    assert [b.channels_first for b in ctl.blocks][:2] == [True, True] and not ctl.blocks[-1].channels_first
    with caplog.at_level("WARNING", logger="memfit"):
        for i, samples in enumerate((400, 800, 1200) * 2):
            batch = {"input_values": torch.randn(2, samples, generator=torch.Generator().manual_seed(i)),
                     "labels": torch.tensor([0, 1])}
            step_both_and_compare(model, reference, batch, i, f"step {i}")
    assert sorted({tuple(r.shape) for r in ctl.records}) == [(2, 1, 400), (2, 1, 800), (2, 1, 1200)]
    assert not [m for m in caplog.messages if "the plans follow the first block's input" in m]
    ctl.remove()


def test_the_key_check_keeps_a_bounded_record():
    """NOTE [What the key cannot see]: the blocks' shapes are kept for the first ``MAX_KEYS`` step keys only, so a run
    of ever new lengths holds at most that many keys' worth, whatever its length."""
    from memfit.engine.shapes import KeyCheck

    check = KeyCheck()
    blocks = 24
    for t in range(3 * KeyCheck.MAX_KEYS):
        assert check.note((2, t), {i: (2, t) for i in range(blocks)}) is None
    assert len(check._keys) == KeyCheck.MAX_KEYS and len(check._seen) == KeyCheck.MAX_KEYS * blocks
    assert check.note((2, 0), {0: (2, 5)}) is not None  # a key kept still checks


def _dynamic_between_none_and_full(model, batches, name: str):
    """``dynamic`` under a budget halfway between ``none``'s and ``full``'s logical peaks at ``batches[1]`` (2 warm-up
    steps): every step's gradients those of training without memfit, bit for bit, some block treated; the records
    and the budget."""
    import copy

    import memfit
    from _models import logical_peak, step_both_and_compare

    budget = (logical_peak(model, batches[1], "none") + logical_peak(model, batches[1], "full")) // 2
    reference = copy.deepcopy(model)
    ctl = memfit.fit(model, budget=budget, method="dynamic", warmup_steps=2, warmup_keys=2, announce=False)
    for step, batch in enumerate(batches):
        step_both_and_compare(model, reference, batch, 100 + step, f"{name} step {step}")
    records = ctl.records
    ctl.remove()
    assert any(r.n_checkpointed for r in records)
    return records, budget
