"""The optimizer state predicted from ``--optim`` equals what the Trainer's optimizer then keeps."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from memfit.engine.parts.optim_state import KNOWN_OPTIMIZERS, expected_state_bytes


class _Model(nn.Module):
    """A matrix, a vector and a 3-d tensor (Adafactor factors the last two dimensions)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 48)
        self.cube = nn.Parameter(torch.randn(4, 6, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).float().pow(2).sum() + self.cube.float().pow(2).sum()


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return _Model().to(dtype)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors (0-d step counters left out)."""
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "optim, optim_args",
    [
        ("adamw_torch", None),
        ("adamw_torch_fused", None),
        ("sgd", None),
        ("sgd", "momentum=0.9"),
        ("adagrad", None),
        ("rmsprop", None),
        ("rmsprop", "momentum=0.9,centered=True"),
        ("adafactor", None),
    ],
)
def test_expected_state_is_what_the_trainers_optimizer_keeps(tmp_path, optim, optim_args, dtype):
    model = _model(dtype)
    args = TrainingArguments(output_dir=str(tmp_path), optim=optim, optim_args=optim_args, use_cpu=True, report_to="none")
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    optimizer = cls(model.parameters(), **kwargs)
    model(torch.randn(2, 64, dtype=dtype)).backward()
    optimizer.step()
    params = [p for p in model.parameters() if p.requires_grad]
    assert expected_state_bytes(args.optim, params, optim_args) == _state_bytes(optimizer)


def test_quantised_states_count_bytes_and_block_scales():
    big, small = torch.zeros(256, 64), torch.zeros(100)  # 16384 elements are quantised, 100 stay float32
    assert expected_state_bytes("adamw_bnb_8bit", [big]) == 2 * (16384 + 4 * 16384 // 256)
    assert expected_state_bytes("adamw_torch_4bit", [big]) == 2 * (16384 // 2 + 4 * 16384 // 128)
    assert expected_state_bytes("lion_8bit", [small]) == 100 * 4


def test_state_that_depends_on_more_than_the_parameters_is_not_predicted():
    assert expected_state_bytes("galore_adamw", [torch.zeros(8, 8)]) is None
    assert "galore_adamw" not in KNOWN_OPTIMIZERS and "adamw_torch" in KNOWN_OPTIMIZERS
