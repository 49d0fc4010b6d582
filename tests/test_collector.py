"""The garbage collector's pauses: timed into the records, the heap frozen once steady where memfit treats on CUDA
(NOTE [The collector's pauses], engine/run/collector.py)."""

import gc

import pytest
import torch

import memfit
from _models import build
from memfit.engine.run.collector import Pauses


@pytest.fixture
def unfrozen():
    """A process whose heap is not frozen, and left so; the permanent generation's size then (CPython 3.12 keeps
    objects there that no unfreeze moves)."""
    gc.unfreeze()
    yield gc.get_freeze_count()
    gc.unfreeze()


@pytest.fixture
def no_automatic_collection():
    was = gc.isenabled()
    gc.disable()
    yield
    if was:
        gc.enable()


def test_pauses_time_the_passes_between_takes(no_automatic_collection):
    pauses = Pauses(freeze=False)
    try:
        junk = [[i] for i in range(20000)]
        for item in junk:
            item.append(item)  # cycles: the pass has work
        del junk
        gc.collect()
        assert pauses.take(steady=False) > 0
        assert pauses.take(steady=False) == 0  # taken: the next take starts from 0
    finally:
        pauses.remove()
    gc.collect()
    assert pauses.take(steady=False) == 0  # removed: no longer timed
    assert pauses._timed not in gc.callbacks


def test_the_heap_is_frozen_at_the_first_steady_take_and_unfrozen_at_remove(unfrozen):
    pauses = Pauses(freeze=True)
    pauses.take(steady=False)
    assert gc.get_freeze_count() == unfrozen  # warm-up: not yet
    pauses.take(steady=True)
    frozen = gc.get_freeze_count()
    assert frozen > unfrozen + 1000 and pauses.frozen  # the libraries' objects, at least
    pauses.take(steady=True)
    assert gc.get_freeze_count() == frozen  # once
    pauses.remove()
    assert gc.get_freeze_count() == unfrozen
    pauses.take(steady=True)  # a record closed after remove()
    assert gc.get_freeze_count() == unfrozen


def test_garbage_is_collected_before_the_heap_is_frozen(unfrozen, no_automatic_collection):
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    import weakref

    gone = weakref.ref(a)
    del a, b
    pauses = Pauses(freeze=True)
    try:
        pauses.take(steady=True)
        assert gone() is None  # freed, not frozen for the run
    finally:
        pauses.remove()


def test_a_run_told_not_to_freeze_leaves_the_heap_as_it_is(unfrozen):
    pauses = Pauses(freeze=True)
    pauses.freeze = False  # the FAQ's opt-out: ctl.pauses.freeze = False after fit
    pauses.take(steady=True)
    assert not pauses.frozen and gc.get_freeze_count() == unfrozen
    pauses.remove()


def test_a_heap_the_process_froze_itself_is_left_to_it(unfrozen):
    gc.freeze()
    theirs = gc.get_freeze_count()
    pauses = Pauses(freeze=True)
    pauses.take(steady=True)
    assert not pauses.frozen
    pauses.remove()
    assert gc.get_freeze_count() == theirs  # not unfrozen by memfit


def test_records_hold_the_collectors_time_and_a_cpu_run_does_not_freeze(unfrozen):
    torch.manual_seed(0)
    model, make_batch = build("llama")
    model.train()
    callbacks = len(gc.callbacks)
    ctl = memfit.fit(model, budget="1GB", method="dynamic", announce=False)
    try:
        for i in range(6):
            batch = make_batch(2, 16 + 8 * i)

            def step(batch=batch, i=i):
                model(**batch).loss.backward()
                if i == 5:
                    gc.collect()

            ctl.run_step(step)
            model.zero_grad(set_to_none=True)
        records = ctl.records
        assert records[-1].gc_ms > 0
        assert records[-1].to_dict()["gc_ms"] == records[-1].gc_ms
        assert gc.get_freeze_count() == unfrozen  # logical accounting: steps are long beside a collection
    finally:
        ctl.remove()
    assert len(gc.callbacks) == callbacks


def test_a_trainers_train_leaves_the_heap_unfrozen_and_the_next_train_freezes_again(tmp_path, monkeypatch, unfrozen):
    from memfit.engine.run import collector
    from test_hf import _trainer

    made, frozen_during = [], []
    init, take = collector.Pauses.__init__, collector.Pauses.take

    def forced(self, freeze):  # as on CUDA: a CPU run does not freeze
        init(self, True)
        made.append(self)

    def noted(self, steady):
        ms = take(self, steady)
        frozen_during.append(gc.get_freeze_count() > unfrozen)
        return ms

    monkeypatch.setattr(collector.Pauses, "__init__", forced)
    monkeypatch.setattr(collector.Pauses, "take", noted)
    trainer = _trainer(tmp_path, "thaw", max_steps=8, overwrite_output_dir=True)
    trainer.train()
    assert made and any(frozen_during)  # frozen once steady
    assert gc.get_freeze_count() == unfrozen  # train() returned: unfrozen, still hooked
    assert trainer.memfit is not None and trainer.memfit.pauses.freeze
    frozen_during.clear()
    trainer.train()
    assert any(frozen_during) and gc.get_freeze_count() == unfrozen
