"""Treatments (treatments.py): every way of treating a block gives ``none``'s gradients bitwise
(dropout on, CPU), keeps the bytes it should (logical accounting and the counter), and the planner
weighs them (planning.py, NOTE [Treatments never lose])."""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch

import memfit
from _models import FixedPlan, ARCHS, DECODER_ARCHS, SIZES, TEXT_SIZES, build, build_decoder, logical_peak, step_both_and_compare
from memfit.engine.methods import load_plans, make_method, save_plans
from memfit.engine.plan.planner import Plan
from memfit.engine.run.controller import Controller
from memfit.engine.parts.treatments import HostMemoryError, Offload, Treatment, make_treatments




def _mixes(n: int) -> dict[str, Plan]:
    everything = tuple(range(n))
    cycle = ("selective", "offload", "recompute", "elementwise")
    return {
        "selective": Plan(everything, kinds=("selective",) * n),
        "offload": Plan(everything, kinds=("offload",) * n),
        "elementwise": Plan(everything, kinds=("elementwise",) * n),
        "mixed": Plan(tuple(range(n - 1)), kinds=tuple(cycle[i % 4] for i in range(n - 1))),  # the last kept
    }


_ALL = ("recompute", "selective", "offload", "elementwise")


def _step(model, batch, seed):
    torch.manual_seed(seed)
    model(**batch).loss.backward()


def _step_as_planned(ctl, plan, model, reference, batch, seed, context):
    """One step of ``model`` (under ``ctl``'s ``plan``) and ``reference`` with equal gradients, and
    every block treated as planned: its body run again in backward, or its tensors moved."""
    rerun = {i for i, kind in zip(plan.blocks, plan.kinds) if kind in ("recompute", "selective")}
    moved = {i for i, kind in zip(plan.blocks, plan.kinds) if kind == "offload"}
    before = [b.recomputes for b in ctl.blocks]
    step_both_and_compare(model, reference, batch, seed, context)
    assert {b.index for b, r in zip(ctl.blocks, before) if b.recomputes > r} == rerun, context
    assert {s.index for s in ctl.treatments["offload"]._stashes if s.storages} == moved, context


@pytest.mark.parametrize("arch", ARCHS)
def test_every_treatment_and_mix_gives_the_gradients_of_none(arch):
    torch.manual_seed(0)
    model, make_batch = build(arch)
    model.train()
    reference = copy.deepcopy(model)
    n = len(memfit.engine.parts.blocks.find_blocks(model))
    sizes = SIZES.get(arch, TEXT_SIZES)[:2]
    for name, plan in _mixes(n).items():
        ctl = memfit.fit(model, budget=None, method=FixedPlan(plan), treatments=_ALL)
        # offload everything of any size: the tiny models' tensors are all small
        ctl.treatments["offload"].min_bytes = 0
        for seed, size in enumerate(sizes):
            _step_as_planned(ctl, plan, model, reference, make_batch(2, size), seed, f"{arch} {name} size {size}")
        ctl.remove()


@pytest.mark.parametrize("lora", [False, True], ids=["full-ft", "lora"])
@pytest.mark.parametrize("arch", DECODER_ARCHS)
def test_llm_families_are_exact_under_selective_offload_and_elementwise(arch, lora):
    if lora:
        pytest.importorskip("peft")
    torch.manual_seed(0)
    model, make_batch = build_decoder(arch, lora)
    model.train()
    reference = copy.deepcopy(model)
    n = len(memfit.engine.parts.blocks.find_blocks(model))
    for name, plan in _mixes(n).items():
        ctl = memfit.fit(model, budget=None, method=FixedPlan(plan), treatments=_ALL)
        ctl.treatments["offload"].min_bytes = 0
        _step_as_planned(ctl, plan, model, reference, make_batch(2, 24), 1, f"{arch} {name}")
        ctl.remove()


def _counted(model, batch, plan, min_bytes=0):
    ctl = memfit.fit(model, budget=None, method=FixedPlan(plan), treatments=("recompute", "selective", "offload"))
    ctl.treatments["offload"].min_bytes = min_bytes
    _step(model, batch, 0)
    model.zero_grad(set_to_none=True)
    record = ctl.records[-1]
    ctl.remove()
    return record


def test_treatments_keep_less_than_keep_and_selective_more_than_recompute():
    """Logical accounting counts what each treatment keeps on the device: selective keeps its
    inputs and matmul outputs (more than recompute's inputs, less than keep), offload keeps
    only the tensors under its threshold."""
    torch.manual_seed(0)
    model, make_batch = build("llama")
    model.train()
    batch = make_batch(4, 64)
    n = len(memfit.engine.parts.blocks.find_blocks(model))
    every = tuple(range(n))
    saved = {
        "keep": _counted(model, batch, Plan(())).saved_activation_bytes,
        "recompute": _counted(model, batch, Plan(every)).saved_activation_bytes,
        "selective": _counted(model, batch, Plan(every, kinds=("selective",) * n)).saved_activation_bytes,
        "offload-all": _counted(model, batch, Plan(every, kinds=("offload",) * n), min_bytes=0).saved_activation_bytes,
        "offload-none": _counted(model, batch, Plan(every, kinds=("offload",) * n), min_bytes=2**40).saved_activation_bytes,
    }
    assert saved["recompute"] < saved["selective"] < saved["keep"], saved
    assert saved["offload-all"] < saved["recompute"], saved  # only what is saved outside the blocks
    assert saved["offload-none"] == saved["keep"], saved  # nothing big enough to move


def test_offload_moves_every_block_storage_once_and_frees_device_copies():
    """The stream-free path: each saved storage goes to the host once per block, comes back in
    backward, and the block's device copies are released once all its tensors were unpacked."""
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan((0, 1, 2), kinds=("offload",) * 3)),
                     treatments=("recompute", "offload"))
    offload: Offload = ctl.treatments["offload"]
    offload.min_bytes = 0
    _step(model, make_batch(2, 16), 0)
    stashes = list(offload._stashes)
    assert [s.index for s in stashes] == [0, 1, 2]
    assert all(s.handles >= len(s.storages) > 0 for s in stashes)
    assert all(s.unpacked == s.handles and s.fetched for s in stashes)
    assert all(entry.device is None for s in stashes for entry in s.storages.values())  # device copies released
    ctl.remove()


def test_the_host_pool_has_a_limit_with_a_clear_error():
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan((0,), kinds=("offload",))), treatments=("recompute", "offload"))
    ctl.treatments["offload"].min_bytes = 0
    ctl.treatments["offload"].pool.max_bytes = 1024  # the run's one pool (NOTE [Host budget])
    with pytest.raises(HostMemoryError, match="need .* GiB of pinned host memory, over the host budget"):
        _step(model, make_batch(2, 16), 0)
    ctl.remove()


def test_unknown_treatment_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown treatment 'fold'; choose from keep, recompute, selective, offload"):
        make_treatments(("fold",))


def test_plans_files_carry_treatments_and_schema_1_files_load(tmp_path):
    plan = Plan((0, 2), kinds=("selective", "offload"))
    save_plans(tmp_path / "p.json", 3, {(4, 16): plan, (4, 32): Plan((0, 1, 2))}, fingerprint="abc")
    plans, n_blocks, fingerprint = load_plans(str(tmp_path / "p.json"))
    assert plans[(4, 16)] == Plan((0, 2), kinds=("selective", "offload")) and plans[(4, 32)].kinds == ()
    assert (n_blocks, fingerprint) == (3, "abc")
    old = {"schema_version": 1, "n_blocks": 3, "plans": [{"key": [4, 16], "blocks": [0, 1]}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    plans, n_blocks, fingerprint = load_plans(str(tmp_path / "old.json"))
    assert plans == {(4, 16): Plan((0, 1))} and n_blocks == 3 and fingerprint == ""


@pytest.mark.parametrize("treatment", ["selective", "elementwise"])
def test_dynamic_with_treatments_fits_the_budget_exactly_and_mixes_when_cheaper(monkeypatch, treatment):
    """``dynamic`` given a treatment beside recompute under a logical budget: gradients equal
    ``none``'s, every peak within the budget, and, where the treatment is priced cheaper per byte
    than recompute (as the probe measures it on a GPU), plans that use it."""
    from memfit.engine.parts import probe

    original = probe.probe_treatments

    def cheap(*args, **kwargs):
        out = original(*args, **kwargs)
        nbytes, _ = out[treatment]
        return {**out, treatment: (nbytes, 1e-4)}  # nearly free: the planner must take it

    monkeypatch.setattr(probe, "probe_treatments", cheap)
    torch.manual_seed(0)
    model, make_batch = build("llama")
    model.train()
    reference = copy.deepcopy(model)
    longest = make_batch(4, 96)
    budget = (logical_peak(model, longest, "none") + logical_peak(model, longest, "full")) // 2
    ctl = memfit.fit(model, budget=budget, method="dynamic", treatments=("recompute", treatment))
    for seed, length in enumerate([16, 96, 48, 80, 96, 64, 88, 96]):
        step_both_and_compare(model, reference, make_batch(4, length), seed, f"step {seed}")
    records = ctl.records
    ctl.remove()
    steady = [r for r in records if r.phase == "steady"]
    assert all(r.peak_allocated_bytes <= budget for r in records)
    assert any(treatment in r.treatments for r in steady), [r.treatments for r in steady]


def test_the_planner_keeps_recompute_where_treatments_are_dearer():
    """NOTE [Treatments never lose]: a mix is taken only when it is cheaper than the
    recompute-only plan; priced dearer, selective is never chosen."""
    from memfit.engine.plan.model import MemoryModel
    from memfit.engine.plan.planning import Planning

    model = MemoryModel([0] * 4)
    group = model.group_models[0]
    for t in (16, 32, 64):
        key = (4, t)
        group.bytes["keep"].add(key, 1000.0 * t)
        group.bytes["recompute"].add(key, 50.0 * t)
        group.ms["recompute"].add(key, 0.01 * t)
        group.bytes_curve("selective").add(key, 400.0 * t)
        model.outside.add(key, 10.0 * t)
        model.transient_full.add(key, 0.0)
    for ms, cheap in ((1e-6, True), (10.0, False)):
        group.ms["selective"] = type(group.ms_curve("selective"))(intercept=True)
        for t in (16, 32, 64):
            group.ms_curve("selective").add((4, t), ms)
        planning = Planning(4, [0] * 4, 200_000, margin_bytes=0, bucket_tokens=1, treatments=("recompute", "selective"))
        planning.model, planning.static_bytes = model, 100_000
        plan = planning.plan_for((4, 64))
        alone = planning.search.recompute_plan((4, 64))  # what recompute alone would run
        assert plan.blocks and planning.predict_peak((4, 64), plan) <= planning.room_bytes
        if cheap:
            assert "selective" in plan.by_treatment() and plan.cost_ms < alone.cost_ms, (plan, alone)
        else:
            assert plan == alone and set(plan.by_treatment()) == {"recompute"}, (plan, alone)


def test_the_selective_policy_recomputes_an_attention_that_draws_dropout():
    """NOTE [Selective policy]: a kept op is not run in backward; an attention kernel drawing a
    dropout mask must run, or every later mask of the recompute would differ from the forward's."""
    from torch.utils.checkpoint import CheckpointPolicy

    from memfit.engine.parts.treatments import keep_matmul_and_attention

    aten = torch.ops.aten
    q = k = v = torch.zeros(1, 1, 4, 8)
    efficient = aten._scaled_dot_product_efficient_attention.default
    assert keep_matmul_and_attention(None, efficient, q, k, v, None, True, 0.0, False) is CheckpointPolicy.MUST_SAVE
    assert keep_matmul_and_attention(None, efficient, q, k, v, None, True, 0.1, False) is CheckpointPolicy.PREFER_RECOMPUTE
    flash = aten._scaled_dot_product_flash_attention.default
    assert keep_matmul_and_attention(None, flash, q, k, v, dropout_p=0.1) is CheckpointPolicy.PREFER_RECOMPUTE
    assert keep_matmul_and_attention(None, aten.mm.default, q, k) is CheckpointPolicy.MUST_SAVE
    assert keep_matmul_and_attention(None, aten.add.Tensor, q, k) is CheckpointPolicy.PREFER_RECOMPUTE


def test_recompute_is_always_at_hand():
    """Warm-up, ``full`` and replays treat every block with recompute, whatever treatments are
    named: naming only ``selective`` (or ``keep``) must not take it away."""
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    for named in (("selective",), ("keep", "offload"), ("keep", "recompute")):
        ctl = memfit.fit(model, budget=None, method="full", treatments=named)
        assert ctl.planning.treatments[0] == "recompute" and "keep" not in ctl.planning.treatments
        model(**make_batch(2, 16)).loss.backward()
        model.zero_grad(set_to_none=True)
        assert ctl.records[-1].treatments == {"recompute": list(range(len(ctl.blocks)))}
        ctl.remove()


def test_recompute_is_at_hand_without_fit():
    """A Controller made directly, and make_treatments, add recompute as fit does: a ``full`` step
    of a Controller named only ``selective`` recomputes every block (NOTE [Recompute always at hand])."""
    assert list(make_treatments(("selective",))) == ["keep", "recompute", "selective"]
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    ctl = Controller(model, None, make_method("full"), treatments=("selective",))
    assert ctl.planning.treatments == ("recompute", "selective")
    assert list(ctl.treatments) == ["keep", "recompute", "selective"]
    model(**make_batch(2, 16)).loss.backward()
    assert ctl.records[-1].treatments == {"recompute": list(range(len(ctl.blocks)))}
    ctl.remove()


def test_a_selective_price_is_each_parts_fastest_run(monkeypatch):
    """NOTE [Cold runs of a block]: the selective probe times the plain forward, the forward
    under the cache and the recompute TIMED_RUNS times each, interleaved, and prices the
    fastest of each: one slow run (here the first round's) does not set the price."""
    from memfit.engine.parts import probe

    torch.manual_seed(0)
    model, make_batch = build("llama")
    model.train()
    ctl = memfit.fit(model, budget=None, method="none", treatments=("recompute", "selective"))
    block = ctl.blocks[0]
    batch = make_batch(2, 24)
    captured = {}

    def grab(module, args, kwargs):
        captured["inputs"] = (args, kwargs)

    handle = block.module.register_forward_pre_hook(grab, with_kwargs=True)
    model(**batch)
    handle.remove()
    rounds = {"plain": [5.0, 1.0, 1.2], "forward": [9.0, 2.2, 2.0], "recompute": [9.0, 0.6, 0.5]}
    order = iter([part for r in range(probe.TIMED_RUNS) for part in ("plain", "forward", "recompute")])
    calls = []

    def fake_elapsed(device, fn, sync=True):
        fn()
        part = next(order)
        calls.append(part)
        return rounds[part][sum(1 for c in calls if c == part) - 1]

    monkeypatch.setattr(probe, "_elapsed_ms", fake_elapsed)
    args, kwargs = captured["inputs"]
    out = probe.probe_treatments(block, args, kwargs, ctl._counter, torch.device("cpu"), ("selective",))
    ctl.remove()
    assert len(calls) == 3 * probe.TIMED_RUNS
    assert out["selective"][1] == pytest.approx((2.0 - 1.0) + 0.5)  # not (9 - 5) + 9
    assert out["selective"][0] > 0


class _Twin(Treatment):
    """A treatment defined in the test suite, not in src/ (NOTE [A treatment is a plug-in]):
    a whole-block checkpoint whose own probe measures it at nearly no time, so the planner
    must prefer it to ``recompute`` wherever a block must give up its activations."""

    name = "twin"
    help = "recompute, priced by its own probe"
    holds_inputs = True
    reruns = True
    order = 5
    probed: list = []

    @classmethod
    def probe(cls, block, kit):
        cls.probed.append(block.index)
        return kit.distinct_bytes(kit.inputs()), 1e-3

    def run(self, block, args, kwargs):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(block.run_body, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def test_a_treatment_defined_outside_src_is_probed_priced_and_chosen_with_exact_gradients():
    """Adding a treatment needs no edit of src/: given by class, warm-up probes it, the model
    keys its curves by its name, the planner prices and chooses it, blocks run it, and the
    gradients equal ``none``'s."""
    _Twin.probed = []
    torch.manual_seed(0)
    model, make_batch = build("llama")
    model.train()
    reference = copy.deepcopy(model)
    longest = make_batch(4, 96)
    budget = (logical_peak(model, longest, "none") + logical_peak(model, longest, "full")) // 2
    ctl = memfit.fit(model, budget=budget, method="dynamic", treatments=("recompute", _Twin))
    assert "twin" in ctl.treatments and isinstance(ctl.treatments["twin"], _Twin)
    for seed, length in enumerate([16, 96, 48, 80, 96, 64, 88, 96]):
        step_both_and_compare(model, reference, make_batch(4, length), seed, f"step {seed}")
    records = ctl.records
    groups = list(ctl.planning.model.group_models.values())
    ctl.remove()
    assert _Twin.probed, "warm-up probed it"
    assert all(g.bytes["twin"].fitted and g.ms["twin"].fitted for g in groups)
    steady = [r for r in records if r.phase == "steady"]
    assert all(r.peak_allocated_bytes <= budget for r in records)
    assert any("twin" in r.treatments for r in steady), [r.treatments for r in steady]
    # not "never recompute": recompute's price is a line through measured times, which on a loaded
    # machine can fall below the twin's declared 1e-3 ms at some shapes


def _block_inputs(ctl, model, batch):
    captured = {}

    def grab(module, args, kwargs):
        captured["inputs"] = (args, kwargs)

    handle = ctl.blocks[0].module.register_forward_pre_hook(grab, with_kwargs=True)
    model(**batch)
    handle.remove()
    return captured["inputs"]


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_elementwise_frees_the_mlps_and_norms_outputs_and_reruns_no_matmul(arch):
    """NOTE [Elementwise recompute]: counted (logical accounting), a block under ``elementwise`` keeps
    less than kept and more than recomputed; its backward runs the matmuls a kept block's does and no
    more (``recompute`` runs the forward's again), and no block body runs twice."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model, make_batch = build_decoder(arch, False)
    model.train()
    batch = make_batch(2, 24)
    n = len(memfit.engine.parts.blocks.find_blocks(model))
    every = tuple(range(n))
    saved, matmuls = {}, {}
    for name, plan in (("keep", Plan(())), ("recompute", Plan(every)), ("elementwise", Plan(every, kinds=("elementwise",) * n))):
        ctl = memfit.fit(model, budget=None, method=FixedPlan(plan), treatments=_ALL)
        torch.manual_seed(0)
        loss = model(**batch).loss
        with CountMatmuls() as counting:
            loss.backward()
        model.zero_grad(set_to_none=True)
        saved[name], matmuls[name] = ctl.records[-1].saved_activation_bytes, counting.n
        if name == "elementwise":
            assert all(b.recomputes == 0 for b in ctl.blocks)
        ctl.remove()
    # each block frees its activation's output and the product, and each of its two norms its
    # normalised rows and its output (the projections save it): float32, 2 x 24 tokens
    config, tokens = model.config, 2 * 24
    freed = n * tokens * 4 * (2 * config.intermediate_size + 2 * 2 * config.hidden_size)
    assert saved["recompute"] < saved["elementwise"] <= saved["keep"] - freed, (saved, freed)
    assert matmuls["elementwise"] == matmuls["keep"] < matmuls["recompute"], matmuls


def test_elementwise_is_offered_only_where_the_block_computes_what_its_modules_do():
    """NOTE [Elementwise recompute]: the probe measures what the block keeps under it and its price;
    a gated MLP whose forward does more than its four attributes say (a scaling) gets None: never
    planned, since the treatment's MLP would not be the model's."""
    ctl, block, probe_of = _first_block_probe()
    measured = probe_of("elementwise", "selective")
    assert 0 < measured["elementwise"][0] and measured["elementwise"][1] >= 0.0
    assert set(measured) == {"recompute", "elementwise", "selective"} and probe_of("selective")  # recompute: its input
    with _mlp_scaled(block):
        assert "elementwise" not in probe_of("elementwise")
    ctl.remove()


def _first_block_probe():
    """A tiny Llama's run, its first block, and ``probe_of(*names)``: what warm-up's probe measures of
    that block under each treatment named (on its inputs of a 2 x 24 batch)."""
    from memfit.engine.parts import probe

    torch.manual_seed(0)
    model, make_batch = build_decoder("llama", False)
    model.train()
    ctl = memfit.fit(model, budget=None, method="none", treatments=_ALL)
    block = ctl.blocks[0]
    args, kwargs = _block_inputs(ctl, model, make_batch(2, 24))
    return ctl, block, lambda *names: probe.probe_treatments(block, args, kwargs, ctl._counter, torch.device("cpu"), names)


@contextlib.contextmanager
def _mlp_scaled(block):
    """The block's MLP computing more than its four attributes say (its output doubled)."""
    mlp = block.module.mlp
    plain = type(mlp).forward
    type(mlp).forward = lambda self, x: plain(self, x) * 2.0
    try:
        yield
    finally:
        type(mlp).forward = plain


def test_elementwise_puts_back_a_forward_wrapped_on_the_instance():
    """A norm whose forward a library wrapped on the instance runs that wrapper under the checkpoint and
    keeps it after the step; a gated MLP wrapped so is left as it is (NOTE [Elementwise recompute])."""
    from memfit.engine.parts.treatments.elementwise import _leaner, elementwise_parts

    torch.manual_seed(0)
    model, make_batch = build_decoder("llama", False)
    block = memfit.engine.parts.blocks.find_blocks(model)[0][1]
    norms, mlps = elementwise_parts(block)
    calls = []
    norm, mlp = norms[0], mlps[0]
    plain = norm.forward

    def wrapped(x, *args, **kwargs):
        calls.append(1)
        return plain(x, *args, **kwargs)

    norm.forward = wrapped
    mlp.forward = mlp.forward  # an instance attribute: the MLP is no longer rewritten
    assert mlp not in elementwise_parts(block)[1]
    with _leaner(block, []):
        assert norm.forward is not wrapped
        norm(torch.randn(2, 3, model.config.hidden_size, requires_grad=True)).sum().backward()
    assert norm.forward is wrapped and calls == [1, 1]  # the forward, and its recompute in backward


def test_an_eager_only_treatment_asked_for_with_compiled_blocks_is_said_never_planned(caplog):
    """Nothing is silent: ``elementwise`` treats eager blocks only (its probe offers it for none that is
    compiled), so a run that compiles its blocks and names it says once that it is never planned."""
    import logging

    from memfit.engine.run.controller import _run_options

    with caplog.at_level(logging.WARNING, logger="memfit"):
        names, _ = _run_options(("elementwise",), True)
        _run_options(("elementwise",), False)
    assert "elementwise" in names
    said = [r.getMessage() for r in caplog.records]
    assert said == ["memfit: 'elementwise' treats eager blocks only; with the blocks compiled it is never planned"]


def test_elementwise_is_offered_by_default_to_eager_blocks_with_a_gated_mlp():
    """A run that names no treatments offers ``elementwise`` where its blocks have a gated MLP and run
    eagerly (:meth:`Treatment.by_default`); named treatments are taken as named, and BERT's blocks
    (norms, no gated MLP) and compiled blocks are not offered it."""
    from memfit.engine.run.controller import _run_options

    decoder, _ = build_decoder("llama")
    bert, _ = build("bert")
    for model, offered in ((decoder, True), (bert, False)):
        ctl = memfit.fit(model, budget=None, method="dynamic", announce=False)
        assert ("elementwise" in ctl.planning.treatments) == offered, (type(model).__name__, ctl.planning.treatments)
        ctl.remove()
    ctl = memfit.fit(decoder, budget=None, method="dynamic", treatments=("recompute",), announce=False)
    assert "elementwise" not in ctl.planning.treatments
    ctl.remove()
    modules = [m for _, m in memfit.engine.parts.blocks.find_blocks(decoder)]
    assert "elementwise" in _run_options(None, False, modules)[0]
    assert "elementwise" not in _run_options(None, True, modules)[0]


class _GatedNormBlock(torch.nn.Module):
    """A block with a norm (``RMSNorm``: float32 inside, bf16 out) and a gated MLP; ``in_place`` changes
    the norm's input after the norm has run, as a residual added in place would."""

    def __init__(self, act_fn: torch.nn.Module, in_place: bool = False):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
        import transformers as tf

        config = tf.LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=2)
        self.norm = LlamaRMSNorm(8)
        self.mlp = LlamaMLP(config)
        self.mlp.act_fn = act_fn
        self.in_place = in_place
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2.0
        y = self.norm(h)
        if self.in_place:
            h.add_(1.0)
        return self.mlp(y) + h


def test_elementwise_takes_nothing_changed_in_place_for_what_it_computes_again():
    """NOTE [Elementwise recompute]: an activation that works in place leaves the MLP as the model runs
    it (gradients bit for bit); a norm whose input is changed in place after it ran cannot be computed
    again, and backward says so rather than giving other gradients (the probe then never offers it)."""
    from memfit.engine.parts.treatments.elementwise import _leaner

    def grads(block: torch.nn.Module, lean: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        x = torch.randn(2, 5, 8, dtype=torch.bfloat16, requires_grad=True)
        with _leaner(block, []) if lean else contextlib.nullcontext():
            out = block(x)
        out.float().pow(2).sum().backward()
        got = [x.grad] + [p.grad.clone() for p in block.parameters()]
        block.zero_grad(set_to_none=True)
        return got

    torch.manual_seed(0)
    block = _GatedNormBlock(torch.nn.SiLU(inplace=True))
    for a, b in zip(grads(block, False), grads(block, True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    block = _GatedNormBlock(torch.nn.SiLU(), in_place=True)
    grads(block, False)
    with pytest.raises(RuntimeError, match="changed in place"):
        grads(block, True)


class _Jitter(torch.autograd.Function):
    """The identity, whose backward adds a little more at every call: a kernel that accumulates with
    atomics in a different order each time (cuDNN's attention backward)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _Jitter.calls += 1
        return grad + _Jitter.calls * 1e-3


def test_elementwise_is_offered_where_the_plain_blocks_backward_is_not_reproducible():
    """The probe compares gradients bit for bit only where the plain block's own are reproducible; an
    attention whose backward is not (atomics) leaves the forward outputs to decide, as they did for
    every block before, so such a block may still take ``elementwise``; a scaled MLP still may not."""
    ctl, block, probe_of = _first_block_probe()
    handle = block.module.self_attn.register_forward_hook(lambda m, a, out: (_Jitter.apply(out[0]), *out[1:]))
    try:
        assert "elementwise" in probe_of("elementwise")
        with _mlp_scaled(block):
            assert "elementwise" not in probe_of("elementwise")
    finally:
        handle.remove()
    ctl.remove()
