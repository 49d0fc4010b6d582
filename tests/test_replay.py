"""One replay engine: the Trainer's ``training_step`` and ``Controller.run_step`` replay an injected
OOM through the controller's :class:`~memfit.engine.run.replay.Replayer` and end with the same weights."""

from __future__ import annotations

import pytest
import torch

import memfit
from _models import InjectOOM, build, logical_peak
from memfit.engine.run.replay import Replayer

LENGTHS = [12, 40, 24, 40, 8, 32, 40, 16, 36, 20, 40, 28]


def _budget() -> int:
    """Half-way between the longest batch's peak with no block checkpointed and with all."""
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    longest = make_batch(2, 40)
    return (logical_peak(model, longest, "none") + logical_peak(model, longest, "full")) // 2


def _train(tmp_path, through: str, budget: int, accumulation: int, inject_at: int | None):
    """Train a tiny BERT for 6 optimizer steps, every micro-step through the Trainer's
    ``training_step`` or through ``run_step``, each seeded; returns the weights and the controller."""
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    batches = [make_batch(2, length) for length in LENGTHS]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if through == "trainer":
        args = memfit.TrainingArguments(
            output_dir=str(tmp_path / f"{through}-{accumulation}-{inject_at}"), report_to="none", use_cpu=True,
            memory_budget=str(budget), memfit_method="dynamic", gradient_accumulation_steps=accumulation,
        )
        trainer = memfit.Trainer(model=model, args=args)
        ctl = trainer.memfit
        ctl.set_optimizer(optimizer)
        trainer.current_gradient_accumulation_steps = accumulation  # what its training loop sets (the loss's divisor)

        def micro_step(batch):
            return trainer.training_step(model, batch)
    else:
        ctl = memfit.fit(model, budget=budget, method="dynamic", optimizer=optimizer, announce=False)

        def micro_step(batch):
            return ctl.run_step(lambda: (model(**batch).loss / accumulation).backward())
    injector = InjectOOM(ctl.blocks[1].module, at=inject_at) if inject_at else None
    for step in range(6):
        for micro in range(accumulation):
            i = step * accumulation + micro
            torch.manual_seed(i)  # the same dropout masks on both paths
            micro_step(batches[i % len(batches)])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    records = ctl.records
    ctl.remove()
    assert injector is None or injector.fired == 1
    return {k: v.clone() for k, v in model.state_dict().items()}, records


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_and_run_step_replay_an_oom_through_one_replayer_to_the_same_weights(tmp_path, monkeypatch, accumulation):
    budget = _budget()
    replayed = []
    replay_head = Replayer._replay_window

    def spy(self):
        replayed.append(self)
        return replay_head(self)

    monkeypatch.setattr(Replayer, "_replay_window", spy)
    clean, clean_records = _train(tmp_path, "run_step", budget, accumulation, None)
    assert replayed == []
    at = 5 if accumulation == 1 else 8  # a steady micro-step (with accumulation 2, the second of its window)
    runs = {through: _train(tmp_path, through, budget, accumulation, at) for through in ("trainer", "run_step")}
    # each path replayed once, through a Replayer (its controller's own)
    assert len(replayed) == 2 and all(type(r) is Replayer for r in replayed) and replayed[0] is not replayed[1]
    for through, (weights, records) in runs.items():
        assert [r.shape for r in records] == [r.shape for r in clean_records], f"{through}: a batch was lost or doubled"
        assert sum(r.oom_retries for r in records) == 1 and records[at - 1].oom_retries == 1, through
        for name, value in clean.items():
            torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=lambda m: f"{through} {name}: {m}")
