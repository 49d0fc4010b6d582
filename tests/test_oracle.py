"""The oracle: a sweep finds the fewest first blocks that fit each bucket; `memfit train` runs it."""

import json
import random

import pytest
import torch

import memfit
from _models import TINY_BERT, build
from memfit.engine.methods import save_plans
from memfit.engine.plan.planner import Plan
from memfit.tools.bench.oracle import sweep
from memfit.tasks._common import minilm_path
from memfit.cli.train import run


def _step(model):
    def step(batch):
        torch.manual_seed(0)
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def _counted_with_first_k(model, batch, k, tmp_path) -> int:
    """Logical peak of one step with blocks 0..k-1 checkpointed, through a plans file."""
    key = tuple(batch["input_ids"].shape)
    path = tmp_path / f"first_{k}.json"
    save_plans(path, len(memfit.engine.parts.blocks.find_blocks(model)), {key: Plan(tuple(range(k)))})
    ctl = memfit.fit(model, budget=None, method="precomputed", path=path)
    _step(model)(batch)
    peak = ctl.records[-1].peak_allocated_bytes
    ctl.remove()
    return peak


def test_sweep_finds_the_fewest_first_blocks_per_bucket(tmp_path):
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    rng = random.Random(0)
    batches = [make_batch(4, rng.randint(4, 96)) for _ in range(12)] + [make_batch(2, 96)]
    none_peak = _counted_with_first_k(model, make_batch(4, 96), 0, tmp_path)
    full_peak = _counted_with_first_k(model, make_batch(4, 96), 3, tmp_path)
    budget = (none_peak + full_peak) // 2
    plans, rows = sweep(model, batches, _step(model), budget, bucket_tokens=8)

    buckets = {(b["input_ids"].shape[0], -(-b["input_ids"].shape[1] // 8) * 8) for b in batches}
    assert sorted(tuple(r["bucket"]) for r in rows) == sorted(buckets)
    for row in rows:
        longest = max(
            (b for b in batches if (b["input_ids"].shape[0], -(-b["input_ids"].shape[1] // 8) * 8) == tuple(row["bucket"])),
            key=lambda b: b["input_ids"].shape[1],
        )
        assert tuple(row["key"]) == tuple(longest["input_ids"].shape)
        counted = [_counted_with_first_k(model, longest, k, tmp_path) for k in range(4)]
        fewest = next(k for k, c in enumerate(counted) if c <= row["room_bytes"])
        assert row["k"] == fewest and row["fits"], (row, counted)
        assert plans[tuple(row["key"])] == tuple(range(fewest))
    assert {r["k"] for r in rows} >= {0, 1}, "the budget never bound"
    assert not any(b.grad is not None for b in model.parameters())  # nothing hooked or left behind
    assert not any(type(m).__module__.startswith("memfit") for m in model.modules())  # unwrapped


def test_sweep_keeps_every_block_where_nothing_fits(tmp_path):
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    full_peak = _counted_with_first_k(model, make_batch(4, 64), 3, tmp_path)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = max(full_peak - 1, 2 * params + 1)
    plans, rows = sweep(model, [make_batch(4, 64)], _step(model), budget)
    assert rows[0]["k"] == 3 and not rows[0]["fits"]
    assert plans == {(4, 64): (0, 1, 2)}


@pytest.fixture(scope="module")
def tiny_flags(tmp_path_factory):
    config = tmp_path_factory.mktemp("config") / "tiny-bert.json"
    config.write_text(json.dumps({**TINY_BERT, "num_hidden_layers": 4}))
    return ["--config_name", str(config), "--tokenizer_name", str(minilm_path()), "--synthetic", "48",
            "--do_train", "--max_steps", "6", "--per_device_train_batch_size", "8", "--report_to", "none",
            "--save_strategy", "no", "--seed", "3"]


@pytest.mark.slow
def test_train_oracle_runs_the_swept_plans_and_leaves_training_unchanged(tiny_flags, tmp_path):
    """`--memfit_method oracle` sweeps, then trains on the swept plans with the weights,
    data order and random state of a run without it: the losses are those of `none`."""
    base = run("token-classification", [*tiny_flags, "--memfit_method", "none", "--output_dir", str(tmp_path / "none")])
    steps = [json.loads(x) for x in (tmp_path / "none" / "memfit_steps.jsonl").read_text().splitlines()]
    saved = [r["saved_activation_bytes"] for r in steps]
    budget_gb = (steps[-1]["static_bytes"] + (min(saved) + max(saved)) / 2) / 1e9  # binds on the longer batches
    out = tmp_path / "oracle"
    metrics = run("token-classification", [*tiny_flags, "--oracle", "--memory_threshold",
                                           f"{budget_gb:.9f}", "--output_dir", str(out)])
    assert metrics["train_loss"] == pytest.approx(base["train_loss"], rel=1e-5)
    swept = json.loads((out / "memfit_oracle.json").read_text())
    plans = {tuple(p["key"]): tuple(p["blocks"]) for p in json.loads((out / "memfit_oracle_plans.json").read_text())["plans"]}
    records = [json.loads(x) for x in (out / "memfit_steps.jsonl").read_text().splitlines()]
    assert [r["shape"][:2] for r in records] == [r["shape"][:2] for r in steps]  # same batches, same order
    assert {r["method"] for r in records} == {"oracle"} and len(records) == 6
    for record in records:
        key = tuple(record["shape"][:2])
        larger = min(k for k in plans if k[0] == key[0] and k[1] >= key[1])
        assert tuple(record["plan"]) == plans[key if key in plans else larger]
    assert any(r["k"] > 0 for r in swept["rows"]) and any(r["k"] < 4 for r in swept["rows"]), swept["rows"]


def test_oracle_needs_a_budget(tiny_flags, tmp_path):
    with pytest.raises(ValueError, match="--oracle needs a budget: set --memory_threshold"):
        run("token-classification", [*tiny_flags, "--oracle", "--output_dir", str(tmp_path)])


def test_oracle_is_no_method_users_train_with(tmp_path):
    from memfit.integrations.hf import TrainingArguments
    from memfit.engine.methods import UnknownMethodError

    with pytest.raises(UnknownMethodError, match="--memfit_method 'oracle' is unknown"):
        TrainingArguments(output_dir=str(tmp_path), memfit_method="oracle", memory_budget="1GiB", report_to="none")


def test_sweep_only_then_train_on_the_plans(tiny_flags, tmp_path):
    """`memfit bench` sweeps in one process and times another, which starts cold as the
    other methods' runs do: --oracle_sweep_only, then --oracle_plans_file."""
    flags = [*tiny_flags, "--oracle", "--memory_threshold", "0.02"]
    assert run("token-classification", [*flags, "--oracle_sweep_only", "true", "--output_dir", str(tmp_path / "s")]) == {}
    plans_file = tmp_path / "s" / "memfit_oracle_plans.json"
    assert plans_file.exists() and not (tmp_path / "s" / "memfit_steps.jsonl").exists()  # swept, not trained
    run("token-classification", [*flags, "--oracle_plans_file", str(plans_file), "--output_dir", str(tmp_path / "t")])
    assert not (tmp_path / "t" / "memfit_oracle.json").exists()  # no second sweep
    plans = {tuple(p["key"]): tuple(p["blocks"]) for p in json.loads(plans_file.read_text())["plans"]}
    records = [json.loads(x) for x in (tmp_path / "t" / "memfit_steps.jsonl").read_text().splitlines()]
    assert len(records) == 6 and {r["method"] for r in records} == {"oracle"}
    for record in records:
        key = tuple(record["shape"][:2])
        assert tuple(record["plan"]) == plans[min(k for k in plans if k[0] == key[0] and k[1] >= key[1])]
