"""NOTE [Running statistics] (engine/parts/buffers.py): a block whose forward updates buffers in place (BatchNorm's
running statistics) leaves them, under every treatment and method, as training without memfit leaves them: a re-run
in backward and warm-up's probes restore them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memfit
from _models import FixedPlan, assert_grads_equal, step_both_and_compare
from memfit.engine.plan.planner import Plan


class _Block(nn.Module):
    """A block with a BatchNorm and dropout between two linear layers."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.up, self.norm, self.drop, self.down = nn.Linear(width, 2 * width), nn.BatchNorm1d(2 * width), nn.Dropout(0.2), \
            nn.Linear(2 * width, width)

    def forward(self, x):
        h = self.up(x)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return x + self.down(self.drop(torch.relu(h)))


class _Net(nn.Module):
    def __init__(self, n: int = 3, width: int = 16):
        super().__init__()
        self.embed, self.layers, self.out = nn.Linear(4, width), nn.ModuleList(_Block(width) for _ in range(n)), nn.Linear(width, 1)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h).pow(2).mean()


def _train_and_compare(model, reference, lengths):
    for i, length in enumerate(lengths):
        x = torch.randn(4, length, 4, generator=torch.Generator().manual_seed(i))
        for m in (model, reference):
            torch.manual_seed(i)
            m(x).backward()
        assert_grads_equal(model, reference, f"step {i}")
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, c), name


@pytest.mark.parametrize("treatment", ["recompute", "host_checkpoint", "selective", "offload"])
def test_every_treatment_leaves_the_running_statistics_of_training_without_memfit(treatment):
    torch.manual_seed(0)
    model = _Net().train()
    reference = copy.deepcopy(model)
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan((0, 1, 2), kinds=(treatment,) * 3)), treatments=(treatment,),
                     announce=False)
    if treatment == "host_checkpoint":
        ctl.treatments[treatment].min_bytes = 0  # tiny test tensors move too
    _train_and_compare(model, reference, [8, 12, 8, 16])
    assert ctl.records[-1].block_treatments == {treatment: [0, 1, 2]}
    ctl.remove()


def _budget_treating(model, run) -> int:
    """A budget under ``run(model)``'s untreated peak (logical accounting): the longest batches are treated."""
    probe = copy.deepcopy(model)
    ctl = memfit.fit(probe, budget=None, method="none", announce=False)
    run(probe)
    peak = ctl.records[-1].peak_allocated_bytes
    ctl.remove()
    return int(0.8 * peak)


@pytest.mark.parametrize("method", ["full", "dynamic", "static"])
def test_every_method_and_its_probes_leave_the_running_statistics_of_training_without_memfit(method):
    """``dynamic`` and ``static`` probe every block in warm-up (several runs of each beside the step) and treat the
    longest batches; ``full`` recomputes every block."""
    torch.manual_seed(0)
    model = _Net().train()
    reference = copy.deepcopy(model)
    budget = None if method == "full" else _budget_treating(model, lambda m: m(torch.randn(4, 24, 4)).backward())
    ctl = memfit.fit(model, budget=budget, method=method, announce=False)
    _train_and_compare(model, reference, [8, 16, 24] * 3)
    assert any(r.block_treatments for r in ctl.records), [r.block_treatments for r in ctl.records]
    ctl.remove()


@pytest.mark.parametrize("method", ["full", "dynamic"])
def test_a_mobilevit_keeps_its_batchnorms_statistics(method):
    """A real family whose blocks hold BatchNorms (MobileViT's, from a tiny config): every buffer bit for bit as training
    without memfit leaves it, each count at the steps run, ``dynamic`` at a budget that treats the largest images."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.MobileViTConfig(image_size=64, patch_size=2, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
                                num_attention_heads=2, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, num_labels=2)
    model = tf.MobileViTForImageClassification(config).train()
    reference = copy.deepcopy(model)
    sizes = [32, 48, 64] * 3

    def batch(i, size):
        g = torch.Generator().manual_seed(i)
        return {"pixel_values": torch.randn(2, 3, size, size, generator=g), "labels": torch.randint(0, 2, (2,), generator=g)}

    budget = None if method == "full" else _budget_treating(model, lambda m: m(**batch(0, 64)).loss.backward())
    ctl = memfit.fit(model, budget=budget, method=method, announce=False)
    for i, size in enumerate(sizes):
        step_both_and_compare(model, reference, batch(i, size), i, f"step {i}")
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, c), name
    tracked = [b for name, b in model.named_buffers() if name.endswith("num_batches_tracked")]
    assert tracked and all(int(b) == len(sizes) for b in tracked)
    assert any(r.block_treatments for r in ctl.records)
    ctl.remove()
