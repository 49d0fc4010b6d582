"""The optimizer step's temporaries (NOTE [Optimizer step transient] in engine/parts/optim_state.py),
predicted before the step, against torch's own memory tracker around a real ``step()`` on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from memfit.engine.parts.optim_state import expected_step_transient_bytes, torch_step_transient_bytes


def _params(mixed: bool) -> list[nn.Parameter]:
    """Unequal tensors; ``mixed``: a bf16 group between two float32 ones (torch groups by dtype)."""
    torch.manual_seed(0)
    shapes = [(300, 200), (200,), (250, 100), (64, 64)]
    dtypes = [torch.float32, torch.float32, torch.bfloat16 if mixed else torch.float32, torch.float32]
    return [nn.Parameter(torch.randn(s, dtype=d)) for s, d in zip(shapes, dtypes)]


def _measured_transient_bytes(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], steps: int) -> int:
    """The largest step's peak over what stays after it (parameters, gradients, state)."""
    worst = 0
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        tracker = MemTracker()
        tracker.track_external(*params, optimizer)
        with tracker:
            optimizer.step()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        after = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        worst = max(worst, peak - after)
    return worst


CASES = [
    # (class, options, mixed dtypes, exact): foreach and fused are exact; for-loop is a bound within one largest parameter
    ("AdamW", dict(foreach=True), False, True),
    ("AdamW", dict(foreach=True), True, True),
    ("AdamW", dict(foreach=True, amsgrad=True), False, True),
    ("Adam", dict(foreach=True, weight_decay=0.1), True, True),
    ("AdamW", dict(fused=True), False, True),
    ("SGD", dict(lr=0.1, foreach=True, weight_decay=0.1, momentum=0.9), True, True),
    ("SGD", dict(lr=0.1, foreach=True, momentum=0.9), False, True),
    ("AdamW", dict(foreach=False), False, False),
    ("AdamW", dict(), True, False),  # torch's default on CPU: the for-loop
    ("Adam", dict(foreach=False, weight_decay=0.1), False, False),
    ("SGD", dict(lr=0.1, foreach=False, weight_decay=0.1, momentum=0.9, nesterov=True), False, False),
]


@pytest.mark.parametrize("cls, options, mixed, exact", CASES, ids=[f"{c}-{o}-{'mixed' if m else 'fp32'}" for c, o, m, _ in CASES])
def test_predicted_transient_matches_a_real_step(cls, options, mixed, exact):
    params = _params(mixed)
    optimizer = getattr(torch.optim, cls)(params, **options)
    predicted = torch_step_transient_bytes(optimizer)  # before the first step: no state yet
    measured = _measured_transient_bytes(optimizer, params, steps=2)
    if exact:
        assert predicted == measured
    else:
        largest = max(p.numel() * p.element_size() for p in params)
        assert measured <= predicted <= measured + 2 * largest


def test_parameter_groups_step_one_at_a_time_and_frozen_parameters_count_nothing():
    params = _params(False)
    params[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], foreach=True)
    assert torch_step_transient_bytes(optimizer) == max(params[1].nbytes, params[2].nbytes + params[3].nbytes)


def test_unknown_classes_are_not_predicted_and_no_optimizer_needs_nothing():
    assert torch_step_transient_bytes(torch.optim.Adagrad(_params(False))) is None
    assert torch_step_transient_bytes(None) == 0


def test_trainer_names_predict_the_optimizer_they_make():
    params = _params(False)
    assert expected_step_transient_bytes("adamw_torch_fused", params) == 0
    made = torch.optim.AdamW(params)  # what the Trainer makes for adamw_torch, here on CPU: the for-loop
    assert expected_step_transient_bytes("adamw_torch", params) == torch_step_transient_bytes(made) > 0
    assert expected_step_transient_bytes("adafactor", params) is None


class _Stack(nn.Module):
    """Two blocks memfit treats (``blocks="layers\\\\.\\\\d+"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_a_budget_below_the_step_s_temporaries_is_one_error_naming_them_and_the_fix():
    import memfit
    from memfit.engine.budget import BudgetTooSmallError

    model = _Stack()
    weights = sum(p.nbytes for p in model.parameters())
    static = 4 * weights  # parameters, gradients, AdamW's two moments
    budget = static + weights // 2  # holds them, not the foreach step's sqrt of every second moment
    foreach = torch.optim.AdamW(model.parameters(), foreach=True)
    with pytest.raises(BudgetTooSmallError, match=r"optimizer step temporaries .*fused=True .*no temporaries"):
        memfit.fit(model, budget, "dynamic", optimizer=foreach, blocks=r"layers\.\d+", announce=False)
    ctl = memfit.fit(model, budget, "dynamic", optimizer=torch.optim.AdamW(model.parameters(), fused=True),
                     blocks=r"layers\.\d+", announce=False)
    ctl.remove()
    ctl = memfit.fit(model, static + weights + 1, "dynamic", optimizer=foreach, blocks=r"layers\.\d+", announce=False)
    ctl.remove()
