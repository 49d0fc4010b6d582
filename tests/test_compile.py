"""Compiled blocks (NOTE [Compiled blocks], blocks.py): each block's body compiled inside memfit's
wrapper gives the gradients of the same compiled model under ``none`` (dropout on, CPU), whatever
the treatment; its saved tensors are still counted; ``selective`` runs the body compiled again under
an activation memory budget, and keeps less."""

from __future__ import annotations

import copy

import pytest
import torch

import memfit
from torch._dynamo.utils import counters

from _models import build_decoder, step_both_and_compare
from memfit.engine.plan.planner import Plan
from _models import FixedPlan

# aot_eager traces and partitions as inductor does but runs the graph's ATen ops: quick to
# compile on a CPU, and deterministic, so gradients can be compared bitwise
COMPILE = {"backend": "aot_eager"}
# compiled ``selective`` needs inductor (its joint-graph pass: NOTE [Compiled blocks]); on a CPU
# it generates C++ (a compiler is at hand where the tests run), and its fp32 graphs recompute
# bit for bit
INDUCTOR = {"backend": "inductor"}


def _without_dropout(model):
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.0
    return model


def _decoder_and_compiled_none(dropout: bool):
    """A tiny Llama (attention dropout on or off) and a copy of it under compiled ``none``."""
    torch.manual_seed(0)
    model, make_batch = build_decoder("llama")
    if not dropout:
        _without_dropout(model)
    model.train()
    reference = copy.deepcopy(model)
    ref_ctl = memfit.fit(reference, budget=None, method="none", compile=INDUCTOR, announce=False)
    return model, make_batch, reference, ref_ctl


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_blocks_recompute_and_offload_give_the_gradients_of_compiled_none():
    torch.manual_seed(0)
    model, make_batch = build_decoder("llama")
    model.train()
    reference = copy.deepcopy(model)
    ref_ctl = memfit.fit(reference, budget=None, method="none", compile=COMPILE, announce=False)
    n = len(ref_ctl.blocks)
    plans = {
        "recompute": Plan(tuple(range(n))),
        "offload": Plan(tuple(range(n)), kinds=("offload",) * n),
        "mixed": Plan((0, 1), kinds=("offload", "recompute")),
    }
    for name, plan in plans.items():
        ctl = memfit.fit(model, budget=None, method=FixedPlan(plan), treatments=("recompute", "offload"), compile=COMPILE,
                         announce=False)
        ctl.treatments["offload"].min_bytes = 0
        assert all(b.compiled for b in ctl.blocks)
        for seed, length in enumerate((9, 17)):
            before = [b.recomputes for b in ctl.blocks]
            step_both_and_compare(model, reference, make_batch(2, length), seed, f"compiled {name} length {length}")
            rerun = {i for i, kind in enumerate(plan.treatments(n)) if kind == "recompute"}
            assert {b.index for b, r in zip(ctl.blocks, before) if b.recomputes > r} == rerun
        # the compiled graphs' saved tensors reach memfit's hooks: the step counted them
        assert ctl.records[-1].saved_activation_bytes > 0
        assert counters["stats"]["unique_graphs"] >= 1  # dynamo compiled the bodies (no fallback to eager)
        ctl.remove()
        assert "forward" not in model.model.layers[0].__dict__  # unwrapped: the class's forward again
    ref_ctl.remove()


def test_dynamic_with_compiled_blocks_fits_a_budget_with_compiled_none_gradients():
    torch.manual_seed(0)
    model, make_batch = build_decoder("llama")
    model.train()
    reference = copy.deepcopy(model)
    batch = make_batch(2, 64)
    probe = memfit.fit(copy.deepcopy(model), budget=None, method="none", compile=COMPILE, announce=False)
    torch.manual_seed(0)
    probe.model(**batch).loss.backward()
    none_peak = probe.records[-1].peak_allocated_bytes
    probe.remove()
    ref_ctl = memfit.fit(reference, budget=None, method="none", compile=COMPILE, announce=False)
    ctl = memfit.fit(model, budget=int(none_peak * 0.97), method="dynamic", compile=COMPILE, announce=False,
                     head=False)  # head=False: the blocks' bitwise guarantee is checked; a chunked head is close, not bitwise (test_head_archs.py)
    for seed in range(5):
        step_both_and_compare(model, reference, batch, seed, f"dynamic compiled step {seed}")
    steady = ctl.records[-1]
    assert steady.phase != "warmup" and steady.n_checkpointed >= 1  # under the budget only by recomputing
    assert max(r.peak_allocated_bytes for r in ctl.records) <= ctl.planning.budget_bytes
    ctl.remove()
    ref_ctl.remove()


@pytest.mark.parametrize("dropout", [True, False])
def test_compiled_selective_gives_the_gradients_of_compiled_none_and_keeps_less_without_random_ops(dropout):
    """Every block selective, and a mix: gradients bitwise those of compiled none. A graph that
    draws random numbers keeps what keep keeps (the budgeted partition would recompute the
    seeds); one that draws none keeps less."""
    model, make_batch, reference, ref_ctl = _decoder_and_compiled_none(dropout)
    n = len(ref_ctl.blocks)
    plans = {
        "keep": Plan(()),
        "selective": Plan(tuple(range(n)), kinds=("selective",) * n),
        "mixed": Plan((0, 1, 2), kinds=("selective", "recompute", "offload")),
    }
    saved = {}
    for name, plan in plans.items():
        ctl = memfit.fit(model, budget=None, method=FixedPlan(plan), treatments=("recompute", "selective", "offload"),
                         compile={**INDUCTOR, "activation_memory_budget": 0.0}, announce=False)
        ctl.treatments["offload"].min_bytes = 0
        for seed, length in enumerate((9, 17, 9)):
            before = [b.recomputes for b in ctl.blocks]
            step_both_and_compare(model, reference, make_batch(2, length), seed, f"compiled {name} length {length}")
            # the partitioner's recompute runs inside the compiled backward: no block body runs twice
            rerun = {i for i, kind in enumerate(plan.treatments(n)) if kind == "recompute"}
            assert {b.index for b, r in zip(ctl.blocks, before) if b.recomputes > r} == rerun
        saved[name] = ctl.records[-1].saved_activation_bytes
        ctl.remove()
    ref_ctl.remove()
    if dropout:
        assert saved["selective"] == saved["keep"], saved
    else:
        assert saved["selective"] < saved["keep"], saved


@pytest.mark.parametrize("dropout", [True, False])
def test_blocks_that_draw_random_numbers_are_never_offered_compiled_selective(dropout):
    """The warm-up probe runs a compiled block's eager body once under a dispatch mode: a block
    whose attention draws dropout gets no selective price, so its budgeted compilation never
    runs (it would keep what keep keeps); one that draws none is priced as usual. The check
    moves no RNG: gradients stay those of compiled none."""
    model, make_batch, reference, ref_ctl = _decoder_and_compiled_none(dropout)
    ctl = memfit.fit(model, budget="1GiB", method="dynamic", compile=INDUCTOR, announce=False, head=False)  # head=False: the blocks' bitwise guarantee is checked; a chunked head is close, not bitwise (test_head_archs.py)
    lean_runs = []
    for b in ctl.blocks:
        lean = b.lean_body
        b.lean_body = lambda *a, _lean=lean, **k: (lean_runs.append(1), _lean(*a, **k))[1]
    for seed, length in enumerate((9, 17, 13)):
        step_both_and_compare(model, reference, make_batch(2, length), seed, f"dynamic compiled, step {seed}")
    curves = ctl.planning.model.group_models.values()
    flags = {b.draws_random for b in ctl.blocks} - {None}  # measured on the probed block of each group
    ctl.remove()
    ref_ctl.remove()
    assert flags == {dropout}
    assert all(m.bytes_curve("selective").fitted == (not dropout) for m in curves)
    assert bool(lean_runs) == (not dropout)


def test_runs_random_sees_dropout_and_attention_dropout_only_when_they_draw():
    x = torch.randn(2, 3, 4, 8)
    assert memfit.engine.parts.treatments.runs_random(torch.nn.functional.dropout, x, 0.1, True)
    assert not memfit.engine.parts.treatments.runs_random(torch.nn.functional.dropout, x, 0.1, False)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert memfit.engine.parts.treatments.runs_random(sdpa, x, x, x, dropout_p=0.1)
    assert not memfit.engine.parts.treatments.runs_random(sdpa, x, x, x, dropout_p=0.0)
    assert not memfit.engine.parts.treatments.runs_random(torch.nn.functional.gelu, x)


def test_alike_blocks_share_the_compiled_selective_graph():
    """One budgeted backend per run: the blocks' second compilation is one graph, not one per
    block (Dynamo matches a cached graph to its backend object; a backend per block would
    compile each block anew, up to the recompile limit)."""
    model, make_batch = build_decoder("llama")
    _without_dropout(model).train()
    n = len(memfit.engine.parts.blocks.find_blocks(model))
    assert n >= 3
    counters.clear()
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan(tuple(range(n)), kinds=("selective",) * n)),
                     treatments=("recompute", "selective"), compile={**INDUCTOR, "loss": False}, announce=False)
    torch.manual_seed(0)
    model(**make_batch(2, 9)).loss.backward()
    ctl.remove()
    assert counters["stats"]["unique_graphs"] == 1  # the blocks' (the loss, left eager, has none)


def test_dynamic_with_compiled_selective_probes_it_and_fits_the_budget():
    """The warm-up probe measures the budgeted compilation's bytes and price;
    where selective is the cheaper way to free a byte, dynamic's plans use it, within the budget,
    with the gradients of compiled none."""
    from memfit.engine.parts import probe

    priced = []
    original = probe.probe_treatments

    def cheap_selective(*args, **kwargs):
        out = original(*args, **kwargs)
        priced.append(out["selective"])
        return {**out, "selective": (out["selective"][0], 1e-4)}  # the planner must take it where it can

    torch.manual_seed(0)
    model, make_batch = build_decoder("llama")
    _without_dropout(model).train()
    reference = copy.deepcopy(model)
    longest = make_batch(2, 96)
    peaks = {}
    for method in ("none", "full"):
        ctl = memfit.fit(copy.deepcopy(model), budget=None, method=method, compile=INDUCTOR, announce=False)
        torch.manual_seed(0)
        ctl.model(**longest).loss.backward()
        peaks[method] = ctl.records[-1].peak_allocated_bytes
        ctl.remove()
    budget = (peaks["none"] + peaks["full"]) // 2
    ref_ctl = memfit.fit(reference, budget=None, method="none", compile=INDUCTOR, announce=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe, "probe_treatments", cheap_selective)
        ctl = memfit.fit(model, budget=budget, method="dynamic", treatments=("recompute", "selective"),
                         compile=INDUCTOR, announce=False, head=False)  # head=False: the blocks' bitwise guarantee is checked; a chunked head is close, not bitwise (test_head_archs.py)
        for seed, length in enumerate([16, 96, 48, 96, 80, 96]):
            step_both_and_compare(model, reference, make_batch(2, length), seed, f"dynamic compiled step {seed}")
    records = ctl.records
    ctl.remove()
    ref_ctl.remove()
    assert priced and all(nbytes > 0 and ms >= 0 for nbytes, ms in priced), priced
    assert all(r.peak_allocated_bytes <= budget for r in records)
    assert any("selective" in r.treatments for r in records if r.phase == "steady"), [r.treatments for r in records]


def test_compiled_blocks_may_take_selective_by_default_where_inductor_compiles_them():
    """Without named treatments, inductor-compiled blocks may take the budgeted compilation;
    eager blocks and another backend's take recompute alone (no error)."""
    runs = {"inductor": INDUCTOR, "aot_eager": COMPILE, "eager": False}
    kinds = {}
    for name, compile in runs.items():
        model, _ = build_decoder("llama")
        ctl = memfit.fit(model, budget=None, method="dynamic", compile=compile, announce=False)
        kinds[name] = {kind: type(t).__name__ for kind, t in ctl.treatments.items()}
        allowed = ctl.planning.treatments
        ctl.remove()
        assert ("selective" in allowed) == (name == "inductor"), (name, allowed)
    assert kinds["inductor"]["selective"] == "CompiledSelective"
    assert "selective" not in kinds["aot_eager"] and "selective" not in kinds["eager"]
    # named treatments are taken as named
    model, _ = build_decoder("llama")
    ctl = memfit.fit(model, budget=None, method="dynamic", treatments=("recompute",), compile=INDUCTOR, announce=False)
    assert "selective" not in ctl.treatments
    ctl.remove()


def _loss_saved_bytes(model, labels, dtype) -> tuple[float, int]:
    """The model's loss function on random logits, and the bytes of the logits-sized tensors
    autograd keeps for its backward (distinct storages of at least the logits' elements, the
    logits' own aside)."""
    torch.manual_seed(0)
    logits = torch.randn(*labels.shape, model.config.vocab_size, dtype=dtype, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = (t.numel(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)
    loss.backward()
    ptr = logits.untyped_storage().data_ptr()
    return loss.item(), sum(b for p, (n, b) in saved.items() if n >= logits.numel() and p != ptr)


@pytest.mark.parametrize("precision", [torch.bfloat16, torch.float32])
def test_compiled_blocks_compile_the_loss_which_keeps_no_log_softmax(precision):
    """With compile, the model's loss function is compiled too, with batch and length dynamic from
    its first call (NOTE [Dynamic batch and length]): the eager cross-entropy keeps a float32
    log-softmax as large as the logits for its backward, the compiled one recomputes it at every
    length (of bf16 logits it keeps their float32 upcast instead); the loss agrees with the eager
    one's, and remove() gives the model its own loss function back."""
    model, make_batch = build_decoder("llama")
    _without_dropout(model).train().to(precision)
    results = {}
    for name, compile in (("compiled", INDUCTOR), ("eager", {**INDUCTOR, "loss": False})):
        ctl = memfit.fit(model, budget=None, method="none", compile=compile, announce=False)
        assert ("_loss_function" in model.__dict__) == (name == "compiled")
        torch.manual_seed(0)
        results[name] = [_loss_saved_bytes(model, make_batch(2, length)["labels"], precision) for length in (24, 40)]
        ctl.remove()
        assert "_loss_function" not in model.__dict__
    upcast = 1 if precision == torch.bfloat16 else 0
    for length, (compiled_loss, compiled_bytes), (eager_loss, eager_bytes) in zip((24, 40), results["compiled"], results["eager"]):
        float32_logits = 2 * length * model.config.vocab_size * 4
        assert eager_bytes >= float32_logits  # the float32 log-softmax
        assert compiled_bytes == upcast * float32_logits, (length, compiled_bytes)
        assert compiled_loss == pytest.approx(eager_loss, rel=1e-2 if precision == torch.bfloat16 else 1e-5)


def test_compile_loss_option_must_be_a_bool():
    model, _ = build_decoder("llama")
    with pytest.raises(ValueError, match="compile's loss 'no'"):
        memfit.fit(model, budget=None, method="none", compile={"loss": "no"}, announce=False)
    assert "forward" not in model.model.layers[0].__dict__ and "_loss_function" not in model.__dict__


def test_compiled_selective_needs_inductor():
    model, _ = build_decoder("llama")
    with pytest.raises(ValueError, match="inductor backend"):
        memfit.fit(model, budget=None, method="dynamic", treatments=("recompute", "selective"), compile=COMPILE,
                   announce=False)
    assert "forward" not in model.model.layers[0].__dict__  # nothing left wrapped


@pytest.mark.parametrize("bad", [1.0, -0.1, "half"])
def test_compiled_selective_budget_must_be_a_share_below_one(bad):
    model, _ = build_decoder("llama")
    with pytest.raises(ValueError, match="activation_memory_budget"):
        memfit.fit(model, budget=None, method="dynamic", treatments=("recompute", "selective"),
                   compile={"activation_memory_budget": bad}, announce=False)
    assert "forward" not in model.model.layers[0].__dict__  # nothing left wrapped


@pytest.mark.parametrize("bad", [0, 2.5, "many", True])
def test_recompile_limit_must_be_a_whole_number_from_one(bad):
    model, _ = build_decoder("llama")
    with pytest.raises(ValueError, match="recompile_limit"):
        memfit.fit(model, budget=None, method="dynamic", compile={"recompile_limit": bad}, announce=False)
    assert "forward" not in model.model.layers[0].__dict__  # nothing left wrapped


@pytest.mark.parametrize("takes_limit", [True, False])
def test_both_compilations_of_a_lora_block_stay_compiled_under_a_limit_enough_for_one(monkeypatch, takes_limit):
    """NOTE [Recompile limit]: under LoRA the first block's input needs no gradient and the
    others' do, so one compilation of the body has two variants and memfit's two (keep and
    selective) have four; with Dynamo's limit at 1, enough for a whole-model compile, all four
    are still compiled, none run eagerly. A torch.compile that takes no ``recompile_limit`` gets
    Dynamo's config raised while the blocks are wrapped, and put back after."""
    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    if not takes_limit:
        monkeypatch.setattr(memfit.engine.parts.blocks, "_compile_takes_limit", lambda: False)
    elif not memfit.engine.parts.blocks._compile_takes_limit():
        pytest.skip("this torch.compile takes no recompile_limit")
    with torch._dynamo.config.patch(recompile_limit=1):
        torch.manual_seed(0)
        model, make_batch = build_decoder("llama", lora=True)
        model.train()
        method = FixedPlan(Plan((0,), kinds=("selective",)))  # block 0 (input without grad) selective, the rest kept
        ctl = memfit.fit(model, budget=None, method=method, treatments=("recompute", "selective"),
                         compile={**INDUCTOR, "loss": False}, announce=False)
        limits = []
        for plan in (method.plan, Plan((1,), kinds=("selective",))):  # then block 0 kept, block 1 selective
            method.plan = plan
            torch.manual_seed(0)
            model(**make_batch(2, 9)).loss.backward()
            limits.append(torch._dynamo.config.recompile_limit)
        variants = len(_debug_get_cache_entry_list(ctl.blocks[0].eager_body.__code__))
        ctl.remove()
        after = torch._dynamo.config.recompile_limit
    assert variants == 4
    assert limits == [1 if takes_limit else 4] * 2 and after == 1


def test_a_new_batch_size_or_length_after_the_first_step_compiles_nothing():
    """NOTE [Dynamic batch and length]: the first step compiles the blocks' bodies (and the loss)
    with batch and length dynamic, so later sizes reuse those graphs; the records say so (the loss,
    by the compile option loss False, stays eager here)."""
    torch.manual_seed(0)
    model, make_batch = build_decoder("llama")
    model.train()
    ctl = memfit.fit(model, budget=None, method="none", compile={**COMPILE, "loss": False}, announce=False)
    for n, length in ((2, 9), (2, 17), (3, 13), (4, 40)):
        model(**make_batch(n, length)).loss.backward()
    first, *later = ctl.records
    assert first.compiled_graphs >= 1 and first.compile_ms > 0
    assert [r.compiled_graphs for r in later] == [0, 0, 0]
    assert sum(r.compile_ms for r in later) == 0
    summary = ctl.summary()
    assert summary.steady_compiled_graphs == 0 and summary.compile_ms == pytest.approx(first.compile_ms)
    ctl.remove()


def test_a_length_or_batch_equal_to_a_feature_size_compiles_nothing():
    """NOTE [Dynamic batch and length]: the rotary tables' head dimension (16 here) is a feature;
    once a call has shown it apart from the batch and length, a later length or batch of 16 does
    not mark it too (which would compile another graph)."""
    torch.manual_seed(0)
    model, make_batch = build_decoder("llama")
    model.train()
    assert model.config.hidden_size // model.config.num_attention_heads == 16
    ctl = memfit.fit(model, budget=None, method="none", compile={**COMPILE, "loss": False}, announce=False)
    for n, length in ((2, 9), (2, 16), (16, 5), (3, 13)):
        model(**make_batch(n, length)).loss.backward()
    records = ctl.records
    ctl.remove()
    assert records[0].compiled_graphs >= 1 and [r.compiled_graphs for r in records[1:]] == [0, 0, 0]


def test_dynamic_dims_never_mark_a_dimension_seen_as_a_feature():
    from memfit.engine.parts.blocks import DynamicDims

    marked = []

    def dims(t):
        return sorted(getattr(t, "_dynamo_weak_dynamic_indices", set()))

    mark = DynamicDims()
    for length in (9, 16):
        hidden, cos = torch.randn(2, length, 32), torch.randn(1, length, 16)
        mark((hidden,), {"position_embeddings": (cos,)})
        marked.append((dims(hidden), dims(cos)))
    assert marked == [([0, 1], [1]), ([0, 1], [1])]
    fresh = torch.randn(1, 16, 16)
    DynamicDims()((torch.randn(2, 16, 32),), {"cos": fresh})  # no history: the coincidence is marked
    assert dims(fresh) == [1, 2]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_after_a_probing_warm_up_new_lengths_and_batch_sizes_compile_nothing(backend):
    """NOTE [Dynamic batch and length]: under dynamic the warm-up probe calls each block's compiled
    body directly, and the loss is compiled too; both are marked at their first call, so the run
    compiles one graph per body and one for the loss, in its first step, and no later step (new
    lengths, new batch sizes) compiles any (sizes kept under the 4,096 rows where
    inductor's C++ code takes a guard)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    model, make_batch = build_decoder("llama")
    _without_dropout(model).train()
    ctl = memfit.fit(model, budget="1GiB", method="dynamic", treatments=("recompute",), compile={"backend": backend},
                     announce=False, head=False)
    shapes = [(2, 9), (2, 17), (3, 13), (4, 40), (2, 33), (5, 21), (3, 64), (2, 100), (6, 7)]
    for n, length in shapes:
        model(**make_batch(n, length)).loss.backward()
    records = ctl.records
    body_variants = len(_debug_get_cache_entry_list(ctl.blocks[0].eager_body.__code__))
    ctl.remove()
    assert records[0].compiled_graphs == 2 and records[0].compile_ms > 0  # the blocks' body and the loss
    assert [r.compiled_graphs for r in records[1:]] == [0] * (len(shapes) - 1)
    assert sum(r.compile_ms for r in records[1:]) == 0
    assert body_variants == 1
    assert len(_debug_get_cache_entry_list(ForCausalLMLoss.__code__)) == 1
    assert any(r.phase == "steady" for r in records)


def test_compile_clock_counts_the_lazy_backward_compile_of_a_static_graph():
    """A graph compiled for static sizes compiles its backward at its first backward, outside
    Dynamo's timer: the clock counts it too, so a step's compile_ms is all its compiling."""
    from memfit.engine.parts.blocks import compile_clock

    f = torch.compile(lambda x: (x.sin() * x.cos()).sum(), backend="aot_eager", dynamic=False)
    x = torch.randn(8, 8, requires_grad=True)
    start = compile_clock()
    y = f(x)
    after_forward = compile_clock()
    y.backward()
    after_backward = compile_clock()
    assert after_forward[0] > start[0] and after_forward[1] == start[1] + 1
    assert after_backward[0] > after_forward[0] and after_backward[1] == after_forward[1]


@pytest.mark.parametrize("sweep", [True, False])
def test_warm_up_compiles_the_sides_of_the_size_guards_below_its_steps(monkeypatch, sweep):
    """NOTE [Guard sides in warm-up]: inductor's C++ code takes a guard on more than 4,096 rows;
    a warm-up of longer steps compiles both of its sides (the blocks' body and the loss), so no
    later step, shorter or unaligned, compiles. Without the sweep the first short step does."""
    from memfit.engine.parts.guard_sides import GuardSides

    if not sweep:
        monkeypatch.setattr(GuardSides, "open", lambda self: None)
    torch.manual_seed(0)
    model, make_batch = build_decoder("llama")
    _without_dropout(model).train()
    ctl = memfit.fit(model, budget="1GiB", method="dynamic", treatments=("recompute",), compile=INDUCTOR,
                     announce=False, head=False)
    for n, length in ((8, 520), (8, 530), (8, 541), (2, 9), (3, 13), (2, 33), (8, 100), (4, 300)):
        model(**make_batch(n, length)).loss.backward()
    records, cut_calls = ctl.records, ctl.sides.cut_calls
    ctl.remove()
    assert [r.phase for r in records] == ["warmup"] * 3 + ["steady"] * 5
    steady_graphs = sum(r.compiled_graphs for r in records[3:])
    if sweep:
        assert steady_graphs == 0 and cut_calls > 0
    else:
        assert steady_graphs > 0 and cut_calls == 0


def test_the_guard_sweep_changes_no_gradient_and_counts_no_saved_tensor(monkeypatch):
    """NOTE [Guard sides in warm-up] Rule 4: the cut calls draw from a forked RNG (dropout on),
    return gradients only to their own inputs and save under their own hooks: a warm-up step's
    gradients are bitwise those of the same step without the sweep, and so are its counted bytes
    (the head kept: its chunks are chosen by timing, and what a chunked head saves differs with
    them)."""
    from memfit.engine.parts.guard_sides import GuardSides

    results = []
    for sweep in (True, False):
        if not sweep:
            monkeypatch.setattr(GuardSides, "open", lambda self: None)
        torch.manual_seed(0)
        model, make_batch = build_decoder("llama")
        model.train()
        ctl = memfit.fit(model, budget="1GiB", method="dynamic", treatments=("recompute",), compile=COMPILE,
                         announce=False, head=False)
        batch = make_batch(3, 40)
        torch.manual_seed(1)
        model(**batch).loss.backward()
        results.append(([p.grad.clone() for p in model.parameters()], ctl.records[0].saved_activation_bytes,
                        ctl.sides.cut_calls))
        ctl.remove()
    (swept, swept_bytes, calls), (plain, plain_bytes, no_calls) = results
    assert calls > 0 and no_calls == 0
    assert swept_bytes == plain_bytes
    for a, b in zip(swept, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cut_lengths_halve_the_call_on_both_sides_of_an_alignment_to_8():
    from memfit.engine.parts.guard_sides import cut_lengths

    assert cut_lengths(100) == [96, 95, 48, 47, 24, 23, 8, 7]
    assert cut_lengths(2048)[:3] == [2047, 1024, 1023] and min(cut_lengths(2048)) == (2048 >> 6) - 1
    assert 64 not in cut_lengths(130, taken={64}) and 56 in cut_lengths(130, taken={64})  # a head dimension
    assert cut_lengths(8) == [7] and cut_lengths(7) == []


def test_a_call_that_cannot_be_cut_ends_its_sweep_with_one_debug_line(caplog):
    from memfit.engine.parts.guard_sides import GuardSides

    def only_40(x):
        if x.shape[1] != 40:
            raise RuntimeError("shape mismatch")
        return x * 2

    sides = GuardSides()
    sides.open()
    x = torch.randn(2, 40, 4, requires_grad=True)
    with caplog.at_level("DEBUG", logger="memfit"):
        out = sides.call(only_40, "f", lambda a, k: None, (x,), {})
        sides.call(only_40, "f", lambda a, k: None, (x.detach(),), {})  # another signature: the callable is done
    torch.testing.assert_close(out, x * 2)  # the real call's result, whatever the sweep met
    assert sides.cut_calls == 1
    # a diagnostic, nothing to act on: DEBUG, not a warning amid the progress bar (NOTE [Quiet until asked])
    assert [r.levelname for r in caplog.records if "could not run a compiled call" in r.getMessage()] == ["DEBUG"]
    sides.close()
    sides.call(lambda t: t, "g", lambda a, k: None, (x,), {})
    assert sides.cut_calls == 1  # closed: nothing runs


def test_alike_blocks_share_one_sweep_a_step():
    """NOTE [Guard sides in warm-up]: alike blocks share their compiled code, so a warm-up step cuts
    the first block's call only (per compilation and input signature), not every block's."""
    from memfit.engine.parts.guard_sides import cut_lengths

    torch.manual_seed(0)
    model, make_batch = build_decoder("llama")
    _without_dropout(model).train()
    ctl = memfit.fit(model, budget="1GiB", method="dynamic", treatments=("recompute",), compile={**COMPILE, "loss": False},
                     announce=False, head=False)
    model(**make_batch(3, 40)).loss.backward()
    cut_calls = ctl.sides.cut_calls
    ctl.remove()
    assert len(ctl.blocks) > 1 and 0 < cut_calls <= len(cut_lengths(40))


def test_a_cut_input_is_laid_out_as_the_model_lays_out_one_of_that_length():
    """NOTE [Guard sides in warm-up] Rule 3: the compiler guards on strides and views too, so a cut
    dense tensor is dense in its order of dimensions (size-1 ones included), a broadcast one stays
    broadcast, and only a view is cut as a view."""
    from memfit.engine.parts.guard_sides import _cut

    length, new = 40, 24
    cos = torch.randn(1, length, 16)
    assert _cut(cos, length, new).stride() == torch.randn(1, new, 16).stride() and not _cut(cos, length, new)._is_view()
    mask = torch.ones(1, 1, length, length, dtype=torch.bool).expand(3, 1, length, length)
    assert _cut(mask, length, new).stride() == torch.ones(1, 1, new, new).expand(3, 1, new, new).stride()
    transposed = torch.randn(3, 16, length).transpose(1, 2)
    assert _cut(transposed, length, new).stride() == torch.randn(3, 16, new).transpose(1, 2).stride()
    strided = torch.randn(3, length, 32)[..., ::2]  # not dense: a view, as the model's would be
    assert _cut(strided, length, new).stride() == strided.stride()
    hidden = torch.randn(3, length, 16, requires_grad=True)
    cut = _cut(hidden, length, new)
    assert cut.shape == (3, new, 16) and cut.requires_grad and cut.is_leaf
    assert _cut(torch.ones(3, 16), length, new).shape == (3, 16)
