"""The Trainer integration: records, summary, resume state, OOM replay identity."""

import json

import pytest
import torch
import transformers

import memfit
from _models import VOCAB, build
from _models import InjectOOM as _InjectOOM
from memfit.errors import FlagError
from memfit.engine.plan.planner import Plan


def _dataset(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 60, (n,), generator=g)
    return [{"input_ids": torch.randint(3, VOCAB, (int(length),), generator=g), "labels": int(i % 2)} for i, length in enumerate(lengths)]


def _collate(items):
    length = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), length, dtype=torch.long)
    mask = torch.zeros(len(items), length, dtype=torch.long)
    for row, x in enumerate(items):
        ids[row, : len(x["input_ids"])] = x["input_ids"]
        mask[row, : len(x["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([x["labels"] for x in items])}


def _trainer(tmp_path, name, accumulation=1, method="dynamic", budget="40MB", max_steps=6, **extra):
    torch.manual_seed(0)
    model, _ = build("bert")
    flags = dict(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation,
        max_steps=max_steps,
        learning_rate=1e-3,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        seed=0,
        memory_budget=budget,
        memfit_method=method,
    )
    args = memfit.TrainingArguments(**{**flags, **extra})
    return memfit.Trainer(model=model, args=args, train_dataset=_dataset(), data_collator=_collate)


@pytest.mark.parametrize("accumulation", [1, 4])
def test_oom_replay_gives_identical_weights(tmp_path, accumulation):
    clean = _trainer(tmp_path, "clean", accumulation)
    clean.train()
    faulty = _trainer(tmp_path, "faulty", accumulation)
    # After warm-up. With accumulation 4, an epoch of 6 micro-batches has windows of 4
    # and 2: micro-batch 9 is the third of the window 7..10.
    at = 5 if accumulation == 1 else 9
    injector = _InjectOOM(faulty.memfit.blocks[1].module, at=at)
    faulty.train()
    assert injector.fired == 1
    for (name, p), q in zip(clean.model.named_parameters(), faulty.model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    clean_records = clean.memfit.records
    faulty_records = faulty.memfit.records
    assert len(faulty_records) == len(clean_records) >= 6, "a batch was lost or double-counted"
    assert [r.shape for r in faulty_records] == [r.shape for r in clean_records]
    assert sum(r.oom_retries for r in faulty_records) == 1
    assert faulty_records[at - 1].oom_retries == 1
    lines = [json.loads(x) for x in open(tmp_path / "faulty" / "memfit_steps.jsonl")]
    assert [x["oom_retries"] for x in lines] == [r.oom_retries for r in faulty_records]
    # the failed attempt is described in the replayed step's record
    assert [len(x["oom_attempts"]) for x in lines] == [r.oom_retries for r in faulty_records]
    attempt = lines[at - 1]["oom_attempts"][0]
    assert attempt["stage"] == "forward" and attempt["error"] == "injected: CUDA out of memory"
    assert attempt["phase"] == "steady" and attempt["shape"] == lines[at - 1]["shape"]
    assert attempt["plan"] is not None and attempt["predicted_peak_bytes"] is not None


def test_each_oom_is_logged_and_giving_up_names_the_last_attempt(tmp_path, caplog):
    # from the first (warm-up) forward on, every forward fails: the replays cannot help
    trainer = _trainer(tmp_path, "faulty")
    injector = _InjectOOM(trainer.memfit.blocks[1].module, at=1, always=True)
    with caplog.at_level("WARNING", logger="memfit"), pytest.raises(memfit.BudgetTooSmallError) as error:
        trainer.train()
    replays = [r.getMessage() for r in caplog.records if "replaying it with" in r.getMessage()]
    assert len(replays) == injector.fired == memfit.engine.run.replay.MAX_OOM_RETRIES + 1
    assert "out of memory in forward at shape" in replays[0] and "blocks checkpointed" in replays[0]
    message = str(error.value)
    assert f"still out of memory after {memfit.engine.run.replay.MAX_OOM_RETRIES} replays" in message
    assert "the last: out of memory in forward at shape" in message and "--memory_budget" in message
    # a steady step that fails: one replay with every block checkpointed (NOTE [A replay checkpoints more]), which
    # fails too and is the floor, predicted inside the budget: run once more (NOTE [The floor retried once]), then the
    # budget is too small
    caplog.clear()
    trainer = _trainer(tmp_path, "steady")
    injector = _InjectOOM(trainer.memfit.blocks[1].module, at=5, always=True)
    with caplog.at_level("WARNING", logger="memfit"), pytest.raises(memfit.BudgetTooSmallError, match="with every block"):
        trainer.train()
    assert injector.fired == 3 and sum("replaying it with" in r.getMessage() for r in caplog.records) == 2


def test_a_replay_never_runs_a_plan_no_safer_than_the_failed_one(tmp_path, monkeypatch):
    """NOTE [A replay treats more]: a model that keeps planning nothing for a shape would
    replay the failed plan until the retries run out; the replay checkpoints every block."""
    trainer = _trainer(tmp_path, "faulty")
    monkeypatch.setattr(trainer.memfit.planning, "plan_for", lambda key, whole_row=True: Plan(()))
    injector = _InjectOOM(trainer.memfit.blocks[1].module, at=5)  # a steady step with the empty plan
    trainer.train()
    assert injector.fired == 1
    records = trainer.memfit.records
    replayed = next(r for r in records if r.oom_retries)
    assert replayed.oom_attempts[0]["plan"] == [] and replayed.n_checkpointed == replayed.n_blocks
    assert all(r.n_checkpointed == 0 for r in records if r.phase == "steady" and not r.oom_retries)


def test_oom_with_every_block_checkpointed_is_a_clear_error(tmp_path):
    trainer = _trainer(tmp_path, "full", method="full")
    _InjectOOM(trainer.memfit.blocks[0].module, at=2)
    with pytest.raises(memfit.BudgetTooSmallError, match="cannot adapt its plans"):
        trainer.train()


def test_records_summary_logs_and_state(tmp_path):
    trainer = _trainer(tmp_path, "run", save_strategy="steps", save_steps=3)
    trainer.train()
    out = tmp_path / "run"
    summary = json.loads((out / "memfit_summary.json").read_text())
    assert summary["steps"] == 6 and summary["method"] == "dynamic"
    assert summary["optimizer_steps"] == trainer.state.global_step == 6  # counted by the optimizer's step hook
    assert sum(row["steps"] for row in summary["memory_count"].values()) == 6
    assert summary["max_peak_allocated_bytes"] <= 40 * 10**6
    assert any("memfit/peak_gib" in h for h in trainer.state.log_history)
    state = json.loads((out / "checkpoint-3" / memfit.integrations.hf.STATE_FILE).read_text())
    assert state["model"]["group_models"]
    final = json.loads((out / memfit.integrations.hf.STATE_FILE).read_text())  # the model as the run ended
    assert final["step"] == 6 and final["model"] == trainer.memfit.state_dict()["model"]
    with pytest.raises(FlagError, match="holds an earlier run .*pass --resume_from_checkpoint to continue it"):
        _trainer(tmp_path, "run", save_strategy="steps", save_steps=3).train()  # NOTE [Earlier runs in the output folder]
    earlier = (out / "memfit_steps.jsonl").read_text()
    checkpoint = str(out / "checkpoint-3")
    resumed = _trainer(tmp_path, "run", save_strategy="steps", save_steps=3)
    resumed.train(resume_from_checkpoint=checkpoint)  # given to train() alone, as the Trainer's API allows
    assert all(r.phase == "steady" for r in resumed.memfit.records), "resume ran a new warm-up"
    assert (out / "memfit_steps.run1.jsonl").read_text() == earlier  # the first run's records, kept
    assert len((out / "memfit_steps.jsonl").read_text().splitlines()) == 3  # the resumed run's steps 4-6
    assert json.loads((out / "memfit_summary.json").read_text())["optimizer_steps"] == 3  # this run's, as its records


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"memory_budget": "6GB", "memory_threshold": 7.0}, "disagree"),
        ({"memfit_method": "static", "memfit_max_shape": "8x128"}, "write the largest input as N,T"),
        ({"memfit_margin": 1.5}, r"give a share of the budget in \[0, 1\)"),
        ({"memfit_method": "sometimes"}, "choose one of"),
        ({"memfit_method": "precomputed"}, "needs --memfit_plans_file"),
        ({"memfit_treatments": "recompute,swap"}, r"unknown treatment 'swap'; give auto or one or more of recompute, selective, offload"),
        ({"memfit_treatments": " , "}, "no treatment; give auto or one or more of"),
        ({"memory_budget": "six"}, "not a memory size"),
        ({"memfit_host_budget": "lots"}, "--memfit_host_budget lots: .*not a memory size"),
        ({"gradient_checkpointing": True}, "drop --gradient_checkpointing"),
        ({"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 1}}, "memfit runs under FSDP2 only"),
        ({"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 2, "activation_checkpointing": True}},
         "drop \"activation_checkpointing\" from --fsdp_config"),
    ],
)
def test_argument_errors(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        memfit.TrainingArguments(output_dir=str(tmp_path), report_to="none", **flags)


def test_a_host_budget_flag_is_read_as_a_memory_size(tmp_path):
    args = memfit.TrainingArguments(output_dir=str(tmp_path), report_to="none", memfit_host_budget="2GiB")
    assert args.memfit_host_budget == "2GiB"


def test_accelerate_fsdp_settings_memfit_cannot_run_under_are_refused():
    """An Accelerate config file sets FSDP without --fsdp: the Trainer checks the plugin itself."""
    from accelerate.utils import FullyShardedDataParallelPlugin as Plugin

    from memfit.integrations.hf import check_fsdp_plugin

    with pytest.raises(FlagError, match="fsdp_activation_checkpointing in the Accelerate config file"):
        check_fsdp_plugin(Plugin(fsdp_version=2, activation_checkpointing=True))
    with pytest.raises(FlagError, match="memfit runs under FSDP2 only"):
        check_fsdp_plugin(Plugin(fsdp_version=1))
    check_fsdp_plugin(Plugin(fsdp_version=2))


def test_threshold_is_gigabytes(tmp_path):
    args = memfit.TrainingArguments(output_dir=str(tmp_path), report_to="none", memory_threshold=8)
    assert args.memfit_budget_bytes == 8 * 10**9


def test_rank_paths():
    assert memfit.integrations.hf.rank_path("out/memfit_steps.jsonl", 1, 2) == "out/memfit_steps.rank1.jsonl"
    assert memfit.integrations.hf.rank_path("out/memfit_steps.jsonl", 0, 1) == "out/memfit_steps.jsonl"


def test_a_failure_before_the_first_step_leaves_no_record_file(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "run")
    log = tmp_path / "run" / memfit.integrations.hf.STEPS_FILE
    assert not log.exists()  # made at the first record, not when the model is hooked

    def fail(self, model=None):
        raise memfit.BudgetTooSmallError("injected before the first step")

    monkeypatch.setattr(transformers.Trainer, "create_optimizer", fail)
    with pytest.raises(memfit.BudgetTooSmallError, match="injected"):
        trainer.train()
    assert not log.exists()


def test_compile_flag_compiles_each_block_inside_the_wrappers(tmp_path):
    trainer = _trainer(tmp_path, "compiled", budget="30MB", memfit_compile=True)
    assert trainer.memfit.blocks and all(b.compiled for b in trainer.memfit.blocks)
    # by default (auto) the blocks' second compilation is among the treatments (NOTE [Compiled blocks])
    assert trainer.args.memfit_treatments == "auto"
    assert isinstance(trainer.memfit.treatments["selective"], memfit.engine.parts.treatments.CompiledSelective)
    plain = _trainer(tmp_path, "eager", budget="30MB")
    assert not any(b.compiled for b in plain.memfit.blocks)
    assert "selective" not in plain.memfit.treatments
    lean = _trainer(tmp_path, "lean", budget="30MB", memfit_compile=True, memfit_treatments="recompute")
    assert "selective" not in lean.memfit.treatments
    eager = _trainer(tmp_path, "eager-sel", budget="30MB", memfit_treatments="recompute,selective")
    assert type(eager.memfit.treatments["selective"]) is memfit.engine.parts.treatments.Selective


def test_torch_compile_gives_memfit_compiled_blocks_not_a_compiled_model(tmp_path, capsys):
    """NOTE [--torch_compile compiles the blocks]: HF's flag reaches memfit's compiled blocks with its
    backend, Accelerate compiles nothing around the hooks, and the start line says which flag asked."""
    import torch._dynamo

    torch._dynamo.reset()
    trainer = _trainer(tmp_path, "tc", budget=None, torch_compile=True, torch_compile_backend="aot_eager", max_steps=3)
    assert trainer.args.torch_compile is False and trainer.args.memfit_compile
    assert trainer.args.memfit_compile_flag == "--torch_compile"
    assert trainer.memfit.blocks and all(b.compiled for b in trainer.memfit.blocks)
    trainer.train()
    assert not hasattr(trainer.model_wrapped, "_orig_mod") and not hasattr(trainer.model, "_orig_mod")
    assert "compiled blocks (--torch_compile: each block's body" in capsys.readouterr().err
    records = trainer.memfit.records
    assert records[0].compiled_graphs >= 1 and records[0].compile_ms > 0
    torch._dynamo.reset()


def test_treatments_flag_reaches_the_planner_and_the_records(tmp_path):
    """--memfit_treatments: the planner may use what it names, the blocks can run it, and the
    records say what each block got (here the warm-up's recompute: which treatment the steady
    steps get depends on measured prices, tested in test_treatments)."""
    trainer = _trainer(tmp_path, "mix", budget="30MB", memfit_treatments="selective, offload,recompute")
    assert trainer.memfit.planning.treatments == ("recompute", "selective", "offload")
    assert set(trainer.memfit.treatments) == {"keep", "recompute", "selective", "offload"}
    trainer.train()
    warmup = [r for r in trainer.memfit.records if r.phase == "warmup"]
    assert warmup and all(r.treatments == {"recompute": list(range(r.n_blocks))} for r in warmup)
