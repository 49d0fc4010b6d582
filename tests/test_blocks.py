import pytest

from _models import ARCHS, build
from memfit.engine.parts.blocks import find_blocks

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
