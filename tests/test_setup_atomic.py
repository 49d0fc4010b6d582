"""Setup is all or nothing (NOTE [Setup is all or nothing] in engine/run/controller.py): any error raised by
``memfit.fit`` or the memfit Trainer before the first step leaves the model exactly as it was, and a
later ``fit`` on it works."""

from __future__ import annotations

import gc

import pytest
import torch

import memfit
from _models import build_decoder


def _snapshot(model: torch.nn.Module) -> dict:
    """What memfit may change on a model: each module's own forward and loss function, its hooks,
    and every parameter (identity and value)."""
    out = {}
    for name, module in model.named_modules():
        own = {k: module.__dict__.get(k) for k in ("forward", "loss_function")}
        hooks = tuple(tuple(getattr(module, h)) for h in (
            "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
        ))
        out[name] = (type(module), own, hooks, tuple(module._modules))
    out["parameters"] = tuple((n, id(p), p.detach().clone()) for n, p in model.named_parameters())
    return out


def _assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for name in before:
        if name == "parameters":
            assert [(n, i) for n, i, _ in before[name]] == [(n, i) for n, i, _ in after[name]]
            for (_, _, a), (_, _, b) in zip(before[name], after[name]):
                assert torch.equal(a, b)
        else:
            assert before[name] == after[name], name


REJECTED = [
    pytest.param(dict(treatments=["bogus"]), "unknown treatment 'bogus'", id="treatment"),
    pytest.param(dict(method="bogus"), "unknown method 'bogus'", id="method"),
    pytest.param(dict(head="bogus"), "head='bogus'", id="head"),
    pytest.param(dict(head_logits="bogus"), "head_logits='bogus'", id="head_logits"),
    pytest.param(dict(compile={"recompile_limit": 0}), "recompile_limit 0", id="compile-option"),
    pytest.param(dict(blocks="nomatch"), "matched no module", id="blocks"),
    pytest.param(dict(margin=-1), "margin=-1", id="margin"),
    pytest.param(dict(bucket_tokens=0), "bucket_tokens=0", id="bucket_tokens"),
    pytest.param(dict(method="static", max_shape="x"), "max_shape='x'", id="max_shape"),
    pytest.param(dict(method="precomputed", path="/nonexistent/plans.json"), "does not exist", id="plans-file"),
    pytest.param(dict(budget="1KB"), "is below what training needs", id="budget-too-small"),
    pytest.param(dict(budget="-3GB"), "budget='-3GB'", id="budget-negative"),
    pytest.param(dict(warmup_steps=-1), "warmup_steps", id="warmup_steps"),
    pytest.param(dict(parts=["x"]), "each must be a memfit.PartKind", id="parts-not-a-kind"),
    pytest.param(dict(parts=[memfit.PartKind()]), "needs a name of its own", id="parts-unnamed"),
]


@pytest.mark.parametrize("kwargs, match", REJECTED)
def test_a_rejected_argument_leaves_the_model_as_it_was(kwargs, match):
    model, make = build_decoder("llama")
    before = _snapshot(model)
    args = dict(budget="100MB", announce=False)
    args.update(kwargs)
    with pytest.raises(Exception, match=match):
        memfit.fit(model, **args)
    _assert_same(before, _snapshot(model))
    ctl = memfit.fit(model, budget="100MB", announce=False)  # not "already wrapped by memfit"
    ctl.run_step(lambda: model(**make(2, 8)).loss.backward())
    ctl.remove()
    model.zero_grad(set_to_none=True)
    _assert_same(before, _snapshot(model))


@pytest.mark.parametrize("where", ["memfit.engine.run.controller.GatheredParameters", "memfit.engine.run.controller.start_line",
                                   "memfit.engine.run.controller.compile_loss"])
def test_an_error_late_in_setup_undoes_every_earlier_change(monkeypatch, where):
    """An error after the blocks are wrapped and the head switched (in the middle of setup, and at
    its very end: the start line) undoes both."""
    model, _ = build_decoder("llama")
    before = _snapshot(model)

    def fail(*_args, **_kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(where, fail)
    callbacks = list(gc.callbacks)
    with pytest.raises(RuntimeError, match="injected"):
        memfit.fit(model, budget="100MB", announce=True)
    _assert_same(before, _snapshot(model))
    assert gc.callbacks == callbacks  # the collector's timer off again (NOTE [The collector's pauses])


def test_a_failed_block_compile_unwraps_the_blocks_already_wrapped(monkeypatch):
    """Wrapping stops at the third block: the first two are unwrapped again."""
    from memfit.engine.parts import blocks as blocks_module

    model, _ = build_decoder("llama")
    before = _snapshot(model)
    calls = []

    def compile_some(self, *args, **kwargs):
        calls.append(self.index)
        if self.index == 2:
            raise RuntimeError("injected compile error")

    monkeypatch.setattr(blocks_module.Block, "compile", compile_some)
    with pytest.raises(RuntimeError, match="injected compile error"):
        memfit.fit(model, budget="100MB", announce=False, compile={"backend": "eager"}, treatments=["recompute"])
    assert calls == [0, 1, 2]
    _assert_same(before, _snapshot(model))


def test_a_trainer_whose_train_fails_before_its_first_step_leaves_the_model_and_trains_later(tmp_path):
    """The memfit Trainer's train() fails before its first step (an output folder of an earlier run):
    the model is unhooked; fixed, a later train() hooks it again and trains."""
    from memfit import Trainer, TrainingArguments

    model, make = build_decoder("llama")
    before = _snapshot(model)
    out = tmp_path / "out"
    out.mkdir()
    (out / "memfit_steps.jsonl").write_text("{}\n")
    data = [{k: v[0] for k, v in make(1, 8).items()} for _ in range(4)]
    args = TrainingArguments(output_dir=str(out), max_steps=2, per_device_train_batch_size=2, report_to="none",
                             save_strategy="no", use_cpu=True, memory_budget="100MB")
    trainer = Trainer(model=model, args=args, train_dataset=data)
    assert trainer.memfit is not None
    with pytest.raises(Exception, match="overwrite_output_dir"):
        trainer.train()
    assert trainer.memfit is None
    _assert_same({k: v for k, v in before.items() if k != "parameters"},
                 {k: v for k, v in _snapshot(model).items() if k != "parameters"})
    trainer.args.overwrite_output_dir = True
    trainer.train()
    assert trainer.memfit is not None and trainer.memfit.records


def test_deepspeed_is_refused_once_naming_fsdp_and_the_model_is_left_as_it_was(monkeypatch, tmp_path):
    """NOTE [DeepSpeed is refused]: ``memfit.fit`` on a model whose parameters ZeRO-3 partitioned (``ds_id``) raises one
    ValueError naming FSDP2, and the memfit Trainer under ``--deepspeed`` one FlagError (``memfit train`` exits 2 on it)
    naming ``--fsdp``; neither changes the model."""
    import transformers

    from memfit import Trainer, TrainingArguments
    from memfit.errors import FlagError

    model, make = build_decoder("llama")
    before = _snapshot(model)
    first = next(model.parameters())
    first.ds_id = 0  # what ZeRO-3 sets on every parameter it partitions
    with pytest.raises(ValueError, match="DeepSpeed .*ZeRO-3 partitioned parameters.*FSDP2"):
        memfit.fit(model, budget="100MB", announce=False)
    del first.ds_id
    _assert_same(before, _snapshot(model))

    made = transformers.Trainer.create_accelerator_and_postprocess

    def as_under_deepspeed(self):  # what Trainer sets where Accelerate holds a DeepSpeed plugin
        made(self)
        self.is_deepspeed_enabled = True

    monkeypatch.setattr(transformers.Trainer, "create_accelerator_and_postprocess", as_under_deepspeed)
    data = [{k: v[0] for k, v in make(1, 8).items()} for _ in range(2)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2, report_to="none",
                             save_strategy="no", use_cpu=True, memory_budget="100MB")
    with pytest.raises(FlagError, match="--deepspeed: memfit does not run under DeepSpeed ZeRO; drop --deepspeed and .*--fsdp"):
        Trainer(model=model, args=args, train_dataset=data)
    _assert_same(before, _snapshot(model))
