"""``Controller.run_step``: a plain loop survives an OOM inside a block, in forward or backward,
with accumulation windows of 1 and 2 micro-steps, and ends with the weights of a run without it."""

from __future__ import annotations

import copy

import pytest
import torch

import memfit
from _models import InjectOOM, build, logical_peak


class InjectBackwardOOM:
    """Raise torch.OutOfMemoryError in ``module``'s backward on its ``at``-th call."""

    def __init__(self, module, at):
        self.calls, self.at, self.fired = 0, at, 0
        self.handle = module.register_full_backward_pre_hook(self)

    def __call__(self, module, grad_output):
        self.calls += 1
        if self.calls == self.at:
            self.fired += 1
            raise torch.OutOfMemoryError("injected: CUDA out of memory (backward)")


def _train(accumulation: int, inject: str | None, steps: int = 6):
    """Train a tiny BERT with ``dynamic`` under a logical budget through ``run_step``; returns
    the final weights, the records and what the injector fired."""
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    lengths = [12, 40, 24, 40, 8, 32, 40, 16, 36, 20, 40, 28]
    batches = [make_batch(2, length) for length in lengths]
    longest = make_batch(2, 40)
    budget = (logical_peak(model, longest, "none") + logical_peak(model, longest, "full")) // 2
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = memfit.fit(model, budget=budget, method="dynamic", optimizer=optimizer, warmup_steps=2, warmup_keys=2)
    injector = None
    if inject == "forward":
        injector = InjectOOM(ctl.blocks[1].module, at=5)
    elif inject == "backward":
        injector = InjectBackwardOOM(ctl.blocks[1].module, at=4)

    def micro_step(batch, seed):
        torch.manual_seed(seed)  # a loop that seeds each micro-step: dropout masks fixed per batch
        loss = model(**batch).loss / accumulation
        loss.backward()
        return loss.detach()

    losses = []
    for step in range(steps):
        for micro in range(accumulation):
            i = step * accumulation + micro
            losses.append(ctl.run_step(micro_step, batches[i % len(batches)], seed=i))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    records = ctl.records
    ctl.remove()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return weights, records, (injector.fired if injector else 0), losses


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("inject", ["forward", "backward"])
def test_an_oom_in_a_block_is_replayed_to_the_weights_of_a_run_without_it(accumulation, inject):
    reference, ref_records, _, ref_losses = _train(accumulation, None)
    weights, records, fired, losses = _train(accumulation, inject)
    assert fired == 1
    replayed = [r for r in records if r.oom_retries]
    assert len(replayed) == 1 and replayed[0].oom_attempts[0]["stage"] == inject
    assert len(records) == len(ref_records)  # no micro-step lost or recorded twice
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert [float(x) for x in losses] == [float(x) for x in ref_losses]


def test_run_step_returns_the_result_and_without_an_optimizer_keeps_earlier_gradients():
    """Without an optimizer to close windows, gradients present before the call are restored
    before a replay (NOTE [Replay in a plain loop])."""
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    batch = make_batch(2, 16)
    ctl = memfit.fit(model, budget=None, method="dynamic", warmup_steps=1, warmup_keys=1)

    def micro_step(seed):
        torch.manual_seed(seed)
        model(**batch).loss.backward()
        return seed

    assert ctl.run_step(micro_step, 0) == 0
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    injector = InjectOOM(ctl.blocks[0].module, at=1)
    assert ctl.run_step(micro_step, 1) == 1 and injector.fired == 1
    ctl.remove()
    torch.manual_seed(0)
    reference, _ = build("bert")
    reference.train()
    for seed in (0, 1):
        torch.manual_seed(seed)
        reference(**batch).loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(before)
    for got, want in zip(grads, (p.grad for p in reference.parameters() if p.grad is not None)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_run_step_gives_up_with_a_clear_error_when_no_plan_is_safer():
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    ctl = memfit.fit(model, budget=None, method="full")
    InjectOOM(ctl.blocks[0].module, at=1, always=True)
    with pytest.raises(memfit.BudgetTooSmallError, match="cannot adapt its plans"):
        ctl.run_step(lambda: model(**make_batch(2, 8)).loss.backward())
    ctl.remove()


def test_the_controller_counts_optimizer_steps_and_its_summary_names_them_beside_micro_steps(capfd):
    """A plain loop of 3 optimizer steps of 2 micro-steps each: 6 records, 3 optimizer steps counted by
    the optimizer's step hook, and the summary printed at ``remove()`` says both (NOTE [What the summary
    counts]); without an optimizer to hook the count is unknown (None) and only micro-steps are named."""
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = memfit.fit(model, budget=None, method="dynamic", optimizer=optimizer, warmup_steps=1, warmup_keys=1, announce=True)
    for step in range(3):
        for length in (12, 20):
            ctl.run_step(lambda: model(**make_batch(2, length)).loss.backward())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert len(ctl.records) == 6 and ctl.optimizer_steps == 3 and ctl.summary().optimizer_steps == 3
    ctl.remove()
    assert "memfit: 3 optimizer steps, 6 micro-steps (forward + backward; " in capfd.readouterr().err

    unhooked = memfit.fit(model, budget=None, method="dynamic", warmup_steps=1, warmup_keys=1)
    unhooked.run_step(lambda: model(**make_batch(2, 12)).loss.backward())
    assert unhooked.optimizer_steps is None and unhooked.summary().optimizer_steps is None
    unhooked.remove()


def test_what_a_failed_attempt_leaves_allocated_after_its_clean_up_is_said_once_and_recorded(caplog):
    """NOTE [What a failed attempt leaves]: where the static bytes after an OOM's clean-up exceed the failed attempt's
    own (the meter's release reads them: here made to read 1 GiB more, as an H200 read 2.6 GiB after a backward OOM
    among host checkpoints), the attempt records ``left_bytes`` and the run says it once; within the allowance,
    nothing is said."""
    from memfit.engine.run.replay import LEFT_SAID_BYTES

    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    batches = [make_batch(2, n) for n in (12, 40, 24, 40, 8, 32, 40, 16)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = memfit.fit(model, budget="1GB", method="dynamic", optimizer=optimizer, warmup_steps=2, warmup_keys=2)
    extra = iter([2**30, LEFT_SAID_BYTES, 2**30])
    ctl.replay._release = lambda: ctl.meter.static_now() + next(extra)
    injector = InjectOOM(ctl.blocks[1].module, at=3, always=False)
    with caplog.at_level("WARNING", logger="memfit"):
        for i, batch in enumerate(batches):
            if i in (4, 6):
                injector.at, injector.calls = 1, 0  # one more OOM at each of these steps
            ctl.run_step(lambda: model(**batch).loss.backward())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    records = ctl.records
    ctl.remove()
    attempts = [a for r in records for a in r.oom_attempts]
    assert injector.fired == 3 and len(attempts) == 3
    assert [a.get("left_bytes") for a in attempts] == [2**30, None, 2**30]
    assert all(a["static_bytes"] > 0 for a in attempts)
    said = [m for m in caplog.messages if "still allocated after its clean-up" in m]
    assert len(said) == 1 and said[0].startswith("memfit: 1.00 GiB of the failed attempt"), said


@pytest.mark.parametrize("predicted_over", [False, True])
def test_an_oom_on_the_floor_predicted_inside_the_budget_is_run_once_more(predicted_over):
    """NOTE [The floor retried once]: a step that runs out of memory on the floor, which was predicted inside the budget
    (fragmentation, another process), is replayed on it once, to the weights of a run without the OOM; a second OOM
    there, or a floor predicted over the budget, is the budget's limit (one clear error)."""
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    reference = copy.deepcopy(model)
    batches = [make_batch(2, length) for length in (40, 40, 40, 40)]
    budget = logical_peak(model, batches[0], "full") * (19 if predicted_over else 21) // 20
    ctl = memfit.fit(model, budget=budget, method="dynamic", warmup_steps=1, warmup_keys=1)
    for step, batch in enumerate(batches[:3]):
        for m in (model, reference):
            torch.manual_seed(step)
            m(**batch).loss.backward()
    assert ctl.records[-1].n_checkpointed == len(ctl.blocks)  # the floor
    injector = InjectOOM(ctl.blocks[1].module, at=1)

    def micro_step():
        torch.manual_seed(3)
        model(**batches[3]).loss.backward()

    if predicted_over:
        with pytest.raises(memfit.BudgetTooSmallError, match="with every block checkpointed"):
            ctl.run_step(micro_step)
        assert injector.fired == 1
        ctl.remove()
        return
    ctl.run_step(micro_step)
    torch.manual_seed(3)
    reference(**batches[3]).loss.backward()
    assert injector.fired == 1 and ctl.records[-1].oom_retries == 1
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    InjectOOM(ctl.blocks[1].module, at=1, always=True)  # every later forward fails: once more on the floor, then the error
    with pytest.raises(memfit.BudgetTooSmallError, match="with every block checkpointed"):
        ctl.run_step(micro_step)
    ctl.remove()
