"""The optimizer step as a part (NOTE [The optimizer step's treatments] in
engine/parts/optimizer_step.py): a budget that holds weights, gradients and state but not the
foreach step's temporaries trains with the per-tensor step, whose updates equal foreach's bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

import memfit
from memfit.engine.budget import BudgetTooSmallError
from memfit.engine.parts.optimizer_step import PER_TENSOR, OptimizerStepPart, _transients, choose_step, expected_step_bytes


class _Stack(nn.Module):
    """Many equal tensors: foreach's temporaries (about all of them at once) far above the
    per-tensor step's (a few of the largest)."""

    def __init__(self, n: int = 12, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, ctl=None) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 64)
        loss = (ctl.run_step(model, x) if ctl else model(x)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _budgets(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, dict]:
    weights = sum(p.nbytes for p in model.parameters())
    return 4 * weights, _transients(optimizer, None)  # parameters, gradients, AdamW's two moments


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_per_tensor_updates_equal_foreach_bit_for_bit(kind):
    torch.manual_seed(0)
    ref, treated = _Stack(), _Stack()
    treated.load_state_dict(ref.state_dict())
    make = (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)) if kind == "AdamW" else (
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1, foreach=True))
    ref_opt, opt = make(ref.parameters()), make(treated.parameters())
    _train(ref, ref_opt, 2)
    _train(treated, opt, 2)
    made = _transients(opt, None)
    assert choose_step(opt, made[PER_TENSOR], None) == made[PER_TENSOR] < made["as_made"]  # room for per tensor only
    part = OptimizerStepPart(opt)
    assert part.at_moment(made[PER_TENSOR], 0)[:2] == (PER_TENSOR, 1) and part.at_moment(made["as_made"], 0)[:2] == ("keep", 1)
    part.apply((PER_TENSOR, 1))
    assert all(g["foreach"] is False for g in opt.param_groups)
    _train(ref, ref_opt, 3)
    _train(treated, opt, 3)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), treated.parameters()))
    part.apply(None)
    assert all(g["foreach"] is True for g in opt.param_groups)


def test_choose_step_leaves_a_step_that_fits_and_one_that_cannot_fit_either_way():
    model = _Stack()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    made = _transients(opt, None)
    assert choose_step(opt, made["as_made"], None) == made["as_made"]
    assert choose_step(opt, made[PER_TENSOR] - 1, None) == made[PER_TENSOR]  # neither fits: the least, which the check names
    assert choose_step(opt, None, None) == made["as_made"]
    assert all(g["foreach"] is True for g in opt.param_groups)  # counting changes nothing
    fused = torch.optim.AdamW(model.parameters(), fused=True) if torch.cuda.is_available() else None
    if fused is not None:
        assert choose_step(fused, 0, None) == 0 and OptimizerStepPart(fused).options(0) == (("keep", 1, 0, 0.0),)


def test_fit_under_a_budget_below_foreach_s_temporaries_trains_per_tensor_and_remove_restores_it():
    torch.manual_seed(0)
    model, ref = _Stack(), _Stack()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    static, made = _budgets(model, opt)
    budget = static + (made[PER_TENSOR] + made["as_made"]) // 2  # the per-tensor step fits, foreach's does not
    ctl = memfit.fit(model, budget, "dynamic", optimizer=opt, blocks=r"layers\.\d+", announce=False)
    _train(model, opt, 3, ctl)
    assert all(g["foreach"] is False for g in opt.param_groups)  # each step's plan ran it per tensor
    assert [r.treatments.get("optimizer_step") for r in ctl.records] == ["per_tensor:1"] * 3
    ctl.remove()
    assert all(g["foreach"] is True for g in opt.param_groups)
    _train(ref, torch.optim.AdamW(ref.parameters(), foreach=True), 3)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))


def test_the_per_tensor_step_s_peak_is_what_the_choice_counted():
    model = _Stack()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    made = _transients(opt, None)
    OptimizerStepPart(opt).apply((PER_TENSOR, 1))
    params = list(model.parameters())
    worst = 0
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        tracker = MemTracker()
        tracker.track_external(*params, opt)
        with tracker:
            opt.step()
        snap = tracker.get_tracker_snapshot
        worst = max(worst, snap("peak")[torch.device("cpu")]["Total"] - snap("current")[torch.device("cpu")]["Total"])
    assert 0 < worst <= made[PER_TENSOR] < made["as_made"]


def test_a_budget_below_even_the_per_tensor_step_is_one_error_and_leaves_the_optimizer_as_made():
    model = _Stack()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    static, made = _budgets(model, opt)
    with pytest.raises(BudgetTooSmallError, match=r"optimizer step temporaries"):
        memfit.fit(model, static + made[PER_TENSOR] // 2, "dynamic", optimizer=opt, blocks=r"layers\.\d+", announce=False)
    assert all(g["foreach"] is True for g in opt.param_groups)


def test_the_trainer_s_expected_step_counts_the_per_tensor_step_where_foreach_would_not_fit(monkeypatch):
    from memfit.engine.parts import optim_state

    chosen = optim_state._implementation
    # torch's choice on an accelerator (foreach), where a CPU's is the for-loop
    monkeypatch.setattr(optim_state, "_implementation",
                        lambda params, group: "foreach" if group.get("foreach") is None else chosen(params, group))
    params = list(_Stack().parameters())
    made = expected_step_bytes("adamw_torch", params, 0.0, None)
    per_tensor = optim_state.expected_step_transient_bytes("adamw_torch", params, 0.0, foreach=False)
    assert per_tensor < made
    assert expected_step_bytes("adamw_torch", params, 0.0, made) == made  # foreach's fits: as made
    assert expected_step_bytes("adamw_torch", params, 0.0, made - 1) == per_tensor  # it does not: per tensor
    assert expected_step_bytes("adamw_torch_fused", params, 0.0, 0) == 0


def test_the_step_part_is_chosen_per_step_from_the_room_and_taught_in_untreated_terms():
    """NOTE [A part kind's moment]: Planning runs the optimizer step's cheapest option whose temporaries fit the room
    above static (the larger of the formula's and what steps read), takes its saving off the step's moment in the
    memory model, lets a larger margin switch it to per tensor and a smaller one back, and the learner adds the
    saving back to what a treated step read."""
    from memfit.engine.plan import learner
    from memfit.engine.plan.learner import StepOutcome
    from memfit.engine.plan.planner import Plan
    from memfit.engine.plan.planning import Planning

    opt = torch.optim.AdamW(_Stack().parameters(), foreach=True)
    part = OptimizerStepPart(opt)
    made, per_tensor = part.made, part.made - part.options(0)[1][2]
    static = 10_000
    planning = Planning(2, [0, 0], static + (made + per_tensor) // 2, margin_bytes=0, bucket_tokens=1)
    planning.static_bytes = static
    planning.add_part(part)
    assert planning.parts == {} and planning.moment_parts == {"optimizer_step": part}
    assert planning.moment_options((1, 8)) == {"optimizer_step": (PER_TENSOR, 1)}
    assert planning.model.step_saved == made - per_tensor
    planning.model.optimizer_bytes = float(made)  # as a step would have read it untreated
    assert planning.model.step_bytes((1, 8), Plan(())) == per_tensor  # the moment's peak, per tensor
    outcome = StepOutcome(key=(1, 8), plan=Plan(()), warmup=False, outside=0, by_block=[0, 0], static=static,
                          peak=static + per_tensor, plain_peak=static + per_tensor, transient=None,
                          optimizer_above_static=per_tensor)
    assert learner.learn_optimizer_peak(planning, outcome).optimizer_above_static == made  # untreated terms
    planning.room.margin_bytes = -made  # room for foreach's temporaries
    assert planning.moment_options((1, 8)) == {"optimizer_step": ("keep", 1)} and planning.model.step_saved == 0
    planning.static_bytes = static + 2 * made  # the state still to come is in static (NOTE [Static at the step's peak])
    assert planning.moment_options((1, 8)) == {"optimizer_step": (PER_TENSOR, 1)}
    planning.remove_part("optimizer_step")
    assert planning.moment_options((1, 8)) == {}


def test_the_state_still_to_come_is_static_once(monkeypatch):
    """NOTE [Static at the step's peak]: before the optimizer's first step both meters count its whole state to come in
    the static bytes, and the head's check reads those bytes as they are (it added the state again: on CUDA, a 1.24B
    model's AdamW state counted twice refused a cap it fits); after the step the state is there and counted once."""
    from _head_common import head_batch, head_model

    from memfit.engine.parts.accounting import expected_optimizer_bytes, optimizer_state_bytes
    from memfit.engine.parts.treatments.chunked_head import RunHead
    from memfit.engine.run import meter as meters

    model = head_model()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    expected = expected_optimizer_bytes(opt)
    assert expected == 2 * params
    cuda = meters.CudaMeter(torch.device("cpu"), list(model.parameters()), 2 * params)
    logical = meters.LogicalMeter(torch.device("cpu"), 2 * params)
    monkeypatch.setattr(meters, "_allocator", lambda device, stats=None: (params, params, params, params))
    for meter in (cuda, logical):
        meter.optimizer, meter.expected_optimizer_bytes = opt, expected
        assert meter.static_now() == 2 * params + expected, meter.kind  # no gradient yet (cuda), none counted twice

    seen = []
    check = RunHead.check_fits
    monkeypatch.setattr(RunHead, "check_fits", lambda self, tokens, static, budget: (seen.append(static),
                                                                                       check(self, tokens, static, budget)))
    ctl = memfit.fit(model, budget="1GB", method="dynamic", optimizer=opt, head=True)
    try:
        for step in range(2):
            batch = head_batch(step, 0, 16)
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        ctl.remove()
    assert seen and seen[0] == 2 * params + expected  # weights, gradients, the state to come: each once
    assert seen[-1] == 2 * params + optimizer_state_bytes(opt)  # after the first step: the state made (its step counters
    assert 0 <= seen[-1] - seen[0] < 1024                         # too), counted once
