"""The tiled MLP (treatments/tiled_mlp.py, NOTE [Tiled MLP]) and its treatments ``tiled_mlp``,
``recompute_tiled`` and ``host_checkpoint_tiled``: ``keep``'s gradients (bit for bit in one chunk,
within float32 rounding in several), what a tiled block keeps and makes at once (proxies on CPU),
where it is offered, what the memory model predicts of a tiled re-run, and the planner's choice."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memfit
from _models import (
    FixedPlan, assert_dynamic_treats_long_batches_only, assert_grads_equal, build_decoder, step_both_and_compare,
)
from memfit.engine.parts.blocks import find_blocks
from memfit.engine.plan.planner import Plan
from memfit.engine.parts.treatments import (
    HOST_CHECKPOINT_TILED, RECOMPUTE_TILED, TILED_MLP, TREATMENTS, floor_treatment, resolve,
)
from memfit.engine.parts.treatments import tiled_mlp as tiled_module
from memfit.engine.parts.treatments.tiled_mlp import Chunking, _bounds, tileable_mlps, tiled_mlp

TILED = (TILED_MLP, RECOMPUTE_TILED, HOST_CHECKPOINT_TILED)
#: float32 gradients with the sums over tokens split in chunks: the whole's rounding, a few ulps of the largest
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _lora(model, dropout: float):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _model(arch: str, lora: float | None = None):
    """A tiny decoder of ``arch`` (dropout on in its attention), with LoRA on every linear layer of dropout
    ``lora`` (None: full fine-tuning)."""
    torch.manual_seed(0)
    model, make = build_decoder(arch, False)
    if lora is not None:
        model = _lora(model, lora)
    return model.train(), make


def _fit(model, name: str, chunks: int):
    n = len(find_blocks(model))
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan(tuple(range(n)), kinds=(name,) * n)), treatments=(name,), announce=False)
    ctl.treatments[name].chunking = Chunking(at_least=chunks)
    if name == HOST_CHECKPOINT_TILED:
        ctl.treatments[name].min_bytes = 0  # tiny test tensors move too
    return ctl, n


@contextlib.contextmanager
def _tiled_calls():
    """How many MLP calls ran tiled (the mechanism's one entry), per chunk count."""
    calls: list[int] = []
    plain = tiled_module.tiled_mlp

    def counted(run, x, chunks, params):
        calls.append(chunks)
        return plain(run, x, chunks, params)

    tiled_module.tiled_mlp = counted
    try:
        yield calls
    finally:
        tiled_module.tiled_mlp = plain


def _step_and_compare(model, reference, batch, seed, chunks, context):
    """One step of both; gradients bit for bit in one chunk, within float32 rounding in several."""
    if chunks == 1:
        step_both_and_compare(model, reference, batch, seed, context)
        return
    for m in (model, reference):
        torch.manual_seed(seed)
        m(**batch).loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **TOLERANCE, msg=lambda m: f"{context} {name}: {m}")
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)


# ------------------------------------------------------------------ the mechanism
def test_the_function_recomputes_the_forwards_masks_and_sums_the_chunks_in_float32():
    """A dropout inside the MLP draws the same masks in the backward's chunks as in the forward's: the
    gradients are those of running the chunks with autograd, the input's bit for bit; the parameters'
    are those sums, within float32 rounding (bit for bit in one chunk)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Dropout(0.3), nn.Linear(32, 8))
    reference = copy.deepcopy(mlp)
    weights = torch.linspace(-1, 1, 8)
    for chunks in (1, 3, 26):
        x = torch.randn(2, 13, 8, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        torch.manual_seed(chunks)
        y = tiled_mlp(mlp, x, chunks, list(mlp.parameters()))
        (y * weights).sum().backward()
        torch.manual_seed(chunks)
        rows = x_ref.reshape(-1, 8)
        y_ref = reference(x_ref) if chunks == 1 else torch.cat([reference(rows[a:b]) for a, b in _bounds(26, chunks)]).view(2, 13, 8)
        (y_ref * weights).sum().backward()
        exact = dict(rtol=0, atol=0)
        torch.testing.assert_close(y, y_ref, **exact)
        torch.testing.assert_close(x.grad, x_ref.grad, **exact)
        for p, q in zip(mlp.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **(exact if chunks == 1 else TOLERANCE))
        mlp.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)


def test_each_parameter_gets_one_gradient_accumulation():
    """The MLP's parameters are the Function's inputs: autograd accumulates each one's gradient once
    (DDP's per-parameter hook fires once), not once per chunk, and nothing is written to ``.grad`` aside."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 8))
    fired = {id(p): 0 for p in mlp.parameters()}
    for p in mlp.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.__setitem__(id(p), fired[id(p)] + 1))
    x = torch.randn(3, 10, 8, requires_grad=True)
    tiled_mlp(mlp, x, 5, list(mlp.parameters())).sum().backward()
    assert set(fired.values()) == {1}, fired


class _Float32Made(TorchDispatchMode):
    """Elements of the float32 tensors ops make, by shape."""

    def __init__(self):
        super().__init__()
        self.made: dict[tuple[int, ...], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and not t._is_view():
                self.made[tuple(t.shape)] = self.made.get(tuple(t.shape), 0) + 1
        return out


@pytest.mark.parametrize("chunks", [1, 3])
def test_one_chunk_returns_its_gradients_with_no_float32_sums(chunks):
    """A bfloat16 MLP's parameter gradients are summed in float32 only where there are several chunks: one
    chunk's are returned as they come (the untiled MLP's bits, and no float32 copy of its weights' size)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 8)).to(torch.bfloat16)
    reference = copy.deepcopy(mlp)
    x = torch.randn(2, 12, 8, dtype=torch.bfloat16, requires_grad=True)
    y = tiled_mlp(mlp, x, chunks, list(mlp.parameters()))
    with _Float32Made() as made:
        y.float().square().sum().backward()
    weight_shapes = {tuple(p.shape) for p in mlp.parameters()}
    summed = {shape for shape in made.made if shape in weight_shapes}
    assert summed == (set() if chunks == 1 else weight_shapes), made.made
    if chunks == 1:
        reference(x.detach()).float().square().sum().backward()
        for p, q in zip(mlp.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_the_chunk_count_bounds_one_chunks_tensor():
    """NOTE [Tiled MLP]: chunks enough that one chunk's tokens x intermediate tensor is at most
    ``chunk_bytes``, none under ``min_tokens`` tokens, one at least."""
    chunking = Chunking()
    for tokens, intermediate in ((65536, 14336), (131072, 8960), (8192, 14336), (300, 14336)):
        n = chunking.count(tokens, intermediate, 2)
        per_chunk = -(-tokens // n)
        assert n >= 1 and (per_chunk * intermediate * 2 <= chunking.chunk_bytes or per_chunk <= 2 * chunking.min_tokens), (tokens, n)
        assert n == 1 or per_chunk >= chunking.min_tokens, (tokens, n)
    assert chunking.count(100, 10, 4) == 1 and Chunking(at_least=3).count(100, 10, 4) == 3


# ------------------------------------------------------------------ gradients per family
@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("name", TILED)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "phi3"])
def test_gradients_are_those_of_keep(arch, name, chunks):
    """Every block tiled (dropout on in the attention, and in Phi-3 around the MLP): the gradients of
    every parameter of training without memfit, bit for bit in one chunk; the MLP ran tiled."""
    model, make = _model(arch)
    reference = copy.deepcopy(model)
    ctl, n = _fit(model, name, chunks)
    with _tiled_calls() as calls:
        for seed, length in enumerate((9, 23)):
            _step_and_compare(model, reference, make(2, length), seed, chunks, f"{arch} {name} {chunks} chunks, length {length}")
    # the re-run blocks' MLP runs tiled in their recompute too, unless nothing after it saves (NOTE [Hollow re-runs]:
    # Llama's and Qwen2's residual add; Gemma-2's norm after the MLP and Phi-3's dropout around it save)
    reruns = 2 if name != TILED_MLP and arch in ("gemma2", "phi3") else 1
    assert len(calls) == 2 * n * reruns and set(calls) == {chunks}, calls
    assert all(b.recomputes == (0 if name == TILED_MLP else 2) for b in ctl.blocks)
    ctl.remove()


def test_an_mlp_runs_hollow_only_where_nothing_after_it_saves():
    """NOTE [Hollow re-runs]: read from the graph between an MLP's node and the block's outputs: a residual add saves
    nothing (hollow); a product with a trained tensor saves (not); of two MLPs in a row, the second saves the first's
    output as its input (the first not, the second hollow); the walk stops at the block's inputs."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    params = list(lin.parameters())
    x = torch.randn(2, 3, 8, requires_grad=True)
    inputs = (x * 1.0,)  # the block's input, made by a node outside the block (a saving one: MulBackward keeps nothing here)
    h = inputs[0]
    y = tiled_mlp(lin, h, 1, params)
    assert tiled_module._hollow_mlps(y + h, inputs, {1: y.grad_fn}) == {1}
    w = torch.randn(8, requires_grad=True)
    assert tiled_module._hollow_mlps(y * w + h, inputs, {1: y.grad_fn}) == set()
    second = tiled_mlp(lin, y + h, 1, params)
    assert tiled_module._hollow_mlps(second + h, inputs, {1: y.grad_fn, 2: second.grad_fn}) == {2}
    # a walk past its bound gives up: nothing runs hollow
    y = tiled_mlp(lin, h, 1, params)
    deep = y + h
    for _ in range(8):
        deep = deep + 1.0
    assert tiled_module._hollow_mlps(deep, inputs, {1: y.grad_fn}) == {1}
    bound, tiled_module.HOLLOW_WALK_NODES = tiled_module.HOLLOW_WALK_NODES, 4
    try:
        assert tiled_module._hollow_mlps(deep, inputs, {1: y.grad_fn}) == set()
    finally:
        tiled_module.HOLLOW_WALK_NODES = bound


def test_a_hollow_mlp_computes_nothing_and_cannot_be_differentiated():
    x = torch.randn(4, 8, requires_grad=True)
    out = tiled_module._TiledMlpFunction.apply(tiled_module._Hollow(5, torch.float64), x, 2, False)
    assert out.shape == (4, 5) and out.dtype == torch.float64 and not out.detach().any()
    with pytest.raises(RuntimeError, match="hollow re-run's MLP was differentiated"):
        out.sum().backward()


@pytest.mark.parametrize("name", [RECOMPUTE_TILED, HOST_CHECKPOINT_TILED])
def test_hollow_re_runs_give_keeps_gradients_without_the_checkpoints_early_stop(name):
    """NOTE [Hollow re-runs]: the re-run does not rely on the checkpoint stopping at its last saved tensor: with early
    stop off the ops after a hollow MLP run on its zeros, save nothing, and the gradients are keep's bit for bit."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    model, make = _model("llama")
    reference = copy.deepcopy(model)
    ctl, n = _fit(model, name, 1)
    with set_checkpoint_early_stop(False), _tiled_calls() as calls:
        _step_and_compare(model, reference, make(2, 17), 0, 1, f"{name} without early stop")
    assert len(calls) == n  # the forward's; the re-runs' MLPs ran hollow
    verdicts = ctl.treatments[name]._tiled.verdicts
    assert len(verdicts) == n and all(len(v["hollow"]) == 1 for v in verdicts.values()), verdicts
    ctl.remove()


def test_a_host_checkpoints_tiled_re_run_is_priced_as_recompute_tiled_where_measured():
    """NOTE [Treatment prices]: ``host_checkpoint_tiled`` re-runs the body ``recompute_tiled`` runs (its hollow MLP
    included), so its re-run is that treatment's measured price where warm-up measured it; else the forward again and
    what tiling adds."""
    from types import SimpleNamespace

    from memfit.engine.plan.model import BlockGroupModel

    class Price:  # a fitted time curve of one value
        fitted = True

        def __init__(self, ms):
            self.ms = ms

        def __call__(self, key):
            return self.ms

    group = BlockGroupModel.__new__(BlockGroupModel)
    group.ms = {RECOMPUTE_TILED: Price(7.0), TILED_MLP: Price(3.0)}
    tiled_host = SimpleNamespace(reruns_as=RECOMPUTE_TILED, reruns=True, rerun_keeps=TILED_MLP)
    assert group.rerun_ms(tiled_host, (1, 8), 5.0) == 7.0
    del group.ms[RECOMPUTE_TILED]  # not offered: the forward again and what tiling adds
    assert group.rerun_ms(tiled_host, (1, 8), 5.0) == 8.0
    plain_host = SimpleNamespace(reruns_as=None, reruns=True, rerun_keeps="keep")
    assert group.rerun_ms(plain_host, (1, 8), 5.0) == 5.0


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("name", [TILED_MLP, RECOMPUTE_TILED])
def test_lora_on_every_linear_layer_gives_keeps_gradients(name, chunks):
    """peft LoRA on every linear layer (the MLP's projections among them), no dropout in the adapters:
    the adapters' gradients are ``keep``'s, the base weights get none."""
    model, make = _model("llama", lora=0.0)
    reference = copy.deepcopy(model)
    ctl, n = _fit(model, name, chunks)
    with _tiled_calls() as calls:
        _step_and_compare(model, reference, make(2, 23), 3, chunks, f"lora {name} {chunks} chunks")
    assert calls and set(calls) == {chunks}
    assert all(p.grad is None for nm, p in model.named_parameters() if "mlp" in nm and not p.requires_grad)
    ctl.remove()


def test_a_lora_dropout_inside_the_mlp_leaves_it_untiled_and_unoffered():
    """NOTE [Tiled MLP]: a dropout of p > 0 inside the MLP (LoRA's) would draw its masks chunk by chunk:
    the MLP is not tiled (a plan that names the treatment runs it as it is, with ``keep``'s gradients
    bit for bit) and the probe offers the tiled treatments to none of its blocks."""
    from memfit.engine.parts import probe

    model, make = _model("llama", lora=0.1)
    reference = copy.deepcopy(model)
    assert all(not tileable_mlps(b) for _, b in find_blocks(model))
    ctl, n = _fit(model, TILED_MLP, 3)
    with _tiled_calls() as calls:
        step_both_and_compare(model, reference, make(2, 23), 1, "lora dropout")
    assert calls == []
    args, kwargs = _block_inputs(model, ctl, make(2, 24))
    measured = probe.probe_treatments(ctl.blocks[0], args, kwargs, ctl._counter, torch.device("cpu"), TILED)
    assert not set(measured) & set(TILED), measured
    ctl.remove()


# ------------------------------------------------------------------ memory, by proxies
class _LargestIntermediate(TorchDispatchMode):
    """The most elements of one tensor an op makes whose last dimension is the MLP's intermediate."""

    def __init__(self, widths, hidden):
        super().__init__()
        self.widths, self.hidden, self.largest = set(widths), hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            # made (not a view: a weight's transpose is one), and not weight-shaped (its gradient)
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] in self.widths and not t._is_view()
                    and t.numel() // t.shape[-1] != self.hidden):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_a_tiled_block_keeps_less_by_the_mlps_intermediates_and_makes_one_chunk_at_a_time(arch):
    """Counted (logical accounting), every block under ``tiled_mlp`` keeps ``keep``'s bytes less the MLP's
    intermediates (Llama: gate, its activation, up and their product; Phi-3: the fused projection, the
    activation and the product), no block runs twice, and in the forward and the backward no op makes an
    intermediate-wide tensor of more than one chunk's tokens (``keep`` and ``recompute``: all of them)."""
    model, make = _model(arch)
    config = model.config
    inter, tokens, chunks = config.intermediate_size, 2 * 48, 4
    widths = (inter, 2 * inter)
    batch = make(2, 48)
    saved, largest = {}, {}
    for name in ("keep", "recompute", TILED_MLP, RECOMPUTE_TILED):
        n = len(find_blocks(model))
        plan = Plan(()) if name == "keep" else Plan(tuple(range(n)), kinds=() if name == "recompute" else (name,) * n)
        ctl = memfit.fit(model, budget=None, method=FixedPlan(plan), treatments=(TILED_MLP, RECOMPUTE_TILED), announce=False)
        for t in (TILED_MLP, RECOMPUTE_TILED):
            ctl.treatments[t].chunking = Chunking(at_least=chunks)
        torch.manual_seed(0)
        with _LargestIntermediate(widths, config.hidden_size) as watch:
            model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
        saved[name], largest[name] = ctl.records[-1].saved_activation_bytes, watch.largest
        if name == TILED_MLP:
            assert all(b.recomputes == 0 for b in ctl.blocks)
        ctl.remove()
    per_token = (4 * inter) if arch == "llama" else (2 * inter + inter + inter)  # float32 elements a token's MLP saves
    assert saved["keep"] - saved[TILED_MLP] == n * tokens * per_token * 4, (saved, n * tokens * per_token * 4)
    assert saved[RECOMPUTE_TILED] == saved["recompute"] < saved[TILED_MLP], saved
    chunk = -(-tokens // chunks)
    assert largest["keep"] == largest["recompute"] >= tokens * inter, largest
    assert largest[TILED_MLP] <= chunk * max(widths) and largest[RECOMPUTE_TILED] <= chunk * max(widths), largest
    assert largest[TILED_MLP] < tokens * inter, largest


# ------------------------------------------------------------------ where it is offered
def _block_inputs(model, ctl, batch):
    captured = {}
    handle = ctl.blocks[0].module.register_forward_pre_hook(lambda m, a, k: captured.update(inputs=(a, k)), with_kwargs=True)
    with torch.no_grad():
        model.eval()(**batch)
    model.train()
    handle.remove()
    return captured["inputs"]


def _probe_of(model, ctl, make, *names):
    from memfit.engine.parts import probe

    args, kwargs = _block_inputs(model, ctl, make(2, 24))
    with torch.enable_grad():
        return probe.probe_treatments(ctl.blocks[0], args, kwargs, ctl._counter, torch.device("cpu"), names)


def test_the_probe_measures_what_a_tiled_block_keeps_and_refuses_an_mlp_that_is_not_token_wise():
    """The probe offers ``tiled_mlp`` (less than kept, more than recomputed) and ``recompute_tiled`` (its
    inputs), each with a price; an MLP whose tokens' outputs depend on the others (a mean over the
    sequence) differs in chunks: never offered."""
    model, make = _model("llama")
    ctl = memfit.fit(model, budget=None, method="none", treatments=(TILED_MLP, RECOMPUTE_TILED), announce=False)
    measured = _probe_of(model, ctl, make, TILED_MLP, RECOMPUTE_TILED, "selective")
    assert set(measured) == {"recompute", TILED_MLP, RECOMPUTE_TILED, "selective"}, measured  # recompute: its input
    assert 0 < measured[RECOMPUTE_TILED][0] == measured["recompute"][0] < measured[TILED_MLP][0] and measured[TILED_MLP][1] >= 0.0
    mlp_type = type(ctl.blocks[0].module.mlp)
    plain = mlp_type.forward
    mlp_type.forward = lambda self, x: plain(self, x) - plain(self, x).mean(dim=-2, keepdim=True)
    try:
        assert _probe_of(model, ctl, make, TILED_MLP, RECOMPUTE_TILED, "selective").keys() == {"recompute", "selective"}
    finally:
        mlp_type.forward = plain
    ctl.remove()


def test_offered_by_default_to_eager_blocks_with_a_gated_mlp_only():
    """A run that names no treatments offers ``tiled_mlp`` and ``recompute_tiled`` to eager blocks with a
    gated MLP to tile; not with compiled blocks, not where every MLP has a dropout inside; and
    ``host_checkpoint_tiled`` only on a GPU (as ``host_checkpoint``)."""
    from memfit.engine.run.controller import _run_options

    model, _ = _model("llama")
    modules = [m for _, m in find_blocks(model)]
    names = _run_options(None, False, modules)[0]
    assert TILED_MLP in names and RECOMPUTE_TILED in names and HOST_CHECKPOINT_TILED not in names, names
    compiled = _run_options(None, True, modules)[0]
    assert not set(TILED) & set(compiled), compiled
    with_dropout, _ = _model("llama", lora=0.1)
    assert not set(TILED) & set(_run_options(None, False, [m for _, m in find_blocks(with_dropout)])[0])
    assert all(TREATMENTS[t].eager_only for t in TILED)


def test_the_floor_is_the_re_run_that_keeps_least():
    """NOTE [A replay treats more]: the floor prefers a re-run whose input leaves the device, then one whose
    MLP is tiled; whatever order the run names them in."""
    assert floor_treatment(resolve((HOST_CHECKPOINT_TILED, "host_checkpoint", RECOMPUTE_TILED))) == HOST_CHECKPOINT_TILED
    assert floor_treatment(resolve(("host_checkpoint", HOST_CHECKPOINT_TILED))) == HOST_CHECKPOINT_TILED
    assert floor_treatment(resolve((RECOMPUTE_TILED, "host_checkpoint"))) == "host_checkpoint"
    assert floor_treatment(resolve((TILED_MLP, RECOMPUTE_TILED))) == RECOMPUTE_TILED
    assert floor_treatment(resolve((TILED_MLP,))) == "recompute"


@pytest.mark.parametrize("names, floor", [
    (("recompute", RECOMPUTE_TILED), RECOMPUTE_TILED),
    (("recompute", "host_checkpoint", HOST_CHECKPOINT_TILED, RECOMPUTE_TILED), HOST_CHECKPOINT_TILED),
])
def test_a_replay_of_every_block_recomputed_runs_the_tiled_floor(monkeypatch, names, floor):
    """NOTE [A replay treats more]: where recomputing every block runs out of memory (warm-up's plan at the
    tight end), the replay runs every block on the floor, the tiled re-run that keeps least the run offers,
    and trains: the gradients of none."""
    from memfit.engine.parts.treatments.recompute import Recompute

    model, make = _model("llama")
    reference = copy.deepcopy(model)

    def out_of_memory(self, block, args, kwargs):
        raise torch.OutOfMemoryError("injected: CUDA out of memory")

    monkeypatch.setattr(Recompute, "run", out_of_memory)
    # warm-up long enough for the steps below (the floor's probes make the model ready: it would end after three)
    ctl = memfit.fit(model, budget="1GB", treatments=names, announce=False, warmup_steps=6)
    batch = make(2, 16)
    torch.manual_seed(0)
    ctl.run_step(lambda: model(**batch).loss.backward())
    torch.manual_seed(0)
    reference(**batch).loss.backward()
    assert_grads_equal(model, reference, f"floor {floor}")
    record = ctl.records[-1]
    assert record.oom_retries == 1 and record.phase == "warmup"
    assert record.block_treatments == {floor: [0, 1, 2]}
    # the floor's head is its option that saves most, not the count a plan without a head runs
    options = ctl.planning.parts["head"].options(2 * 16)
    leanest = max(options, key=lambda o: o[2])
    assert record.treatments["head"] == f"{leanest[0]}:{leanest[1]}", (record.treatments, options)
    # NOTE [Warm-up on the floor]: the next warm-up steps of as many tokens or more start there (no failed
    # forward); a shorter one tries every block recomputed again
    for length, retries in ((16, 0), (24, 0), (8, 1)):
        batch = make(2, length)
        ctl.run_step(lambda batch=batch: model(**batch).loss.backward())
        record = ctl.records[-1]
        assert (record.phase, record.oom_retries, record.block_treatments) == ("warmup", retries, {floor: [0, 1, 2]}), length
    ctl.remove()


def test_the_floor_plan_chunks_the_head_the_most():
    """NOTE [A replay treats more]: at an 8B Llama's shape at 64k tokens the floor's head is chunked more than a plan
    without a head runs it (15/16 of the most saved: 16 chunks, 6.4 GiB at the head's moment), in the count that
    saves most."""
    from types import SimpleNamespace

    from memfit.engine.plan.search import Search
    from memfit.engine.parts.treatments.chunked_head import head_options, head_without_a_plan

    options = head_options(65536, 128256, 4096, torch.bfloat16, 0.0, 0.0)
    class Head(memfit.PartKind):
        name = "head"

        def options(self, tokens):
            return options

        def apply(self, option):
            pass

    from memfit.engine.parts.host_weights import NO_WEIGHTS

    planning = SimpleNamespace(registry=resolve(TILED), all_blocks=(0, 1), n_blocks=2, parts={"head": Head()}, weights=NO_WEIGHTS)
    plan = Search(planning).floor(65536)
    assert plan.kinds == (HOST_CHECKPOINT_TILED,) * 2
    assert plan.option("head") == max(options, key=lambda o: o[2])[:2] and plan.option("head")[1] > head_without_a_plan(options)[1], (plan.option("head"), options)
    assert Search(SimpleNamespace(**{**vars(planning), "parts": {}})).floor(65536).option("head") is None
    # where the run offers no other re-run, the floor is every block plainly recomputed (no kinds: the full plan)
    plain = Search(SimpleNamespace(**{**vars(planning), "registry": resolve(("recompute",))})).floor(65536)
    assert plain.blocks == (0, 1) and plain.kinds == ()


# ------------------------------------------------------------------ the memory model and the planner
def _model_with_tiled(tiled_measured: bool):
    from memfit.engine.plan.model import MemoryModel

    model = MemoryModel([0] * 4, treatments=resolve(TILED))
    group = model.group_models[0]
    for t in (16, 32, 64):
        key = (4, t)
        group.bytes["keep"].add(key, 1000.0 * t)
        group.bytes["recompute"].add(key, 50.0 * t)
        group.bytes_curve(RECOMPUTE_TILED).add(key, 50.0 * t)
        group.ms["recompute"].add(key, 0.01 * t)
        if tiled_measured:
            group.bytes_curve(TILED_MLP).add(key, 400.0 * t)
        model.outside.add(key, 10.0 * t)
        model.transient_full.add(key, 2000.0 * t)
    return model


def test_a_tiled_re_run_lowers_the_recompute_bound_by_what_a_tiled_block_keeps_less():
    """NOTE [Treated peaks]: the recompute bound of a plan whose whole re-runs all tile their MLP is lower by
    ``keep`` less ``tiled_mlp`` of a block; with one plain recompute among them, or ``tiled_mlp`` never
    measured, it is the plain bound."""
    key, every = (4, 64), tuple(range(4))
    model = _model_with_tiled(True)
    plain = model.recompute_bytes(key, Plan(every))
    tiled = model.recompute_bytes(key, Plan(every, kinds=(RECOMPUTE_TILED,) * 4))
    mixed = model.recompute_bytes(key, Plan(every, kinds=(RECOMPUTE_TILED, "recompute", RECOMPUTE_TILED, RECOMPUTE_TILED)))
    assert plain - tiled == pytest.approx((1000.0 - 400.0) * 64), (plain, tiled)
    assert mixed == pytest.approx(plain)
    unmeasured = _model_with_tiled(False)
    assert unmeasured.recompute_bytes(key, Plan(every, kinds=(RECOMPUTE_TILED,) * 4)) == pytest.approx(
        unmeasured.recompute_bytes(key, Plan(every)))


def test_dynamic_tiles_the_mlp_of_long_batches_and_leaves_short_ones_untreated(monkeypatch):
    """``dynamic`` with ``tiled_mlp`` beside recompute under a logical budget a block's MLP intermediates
    under the longest batch's untreated peak, ``tiled_mlp`` priced cheaper than recompute per byte (as on a GPU,
    where it adds one MLP forward and a recompute the whole block's): the longest batches' plans tile and
    no plan recomputes, the short ones' treat nothing; every peak within the budget and the gradients ``keep``'s bit for bit (one
    chunk at these sizes)."""
    model, make = _model("llama")
    # one block's MLP intermediates (float32) under the longest batch's untreated peak: tiling two or
    # three blocks covers it with the margin, recomputing one would too, for more time
    saved_per_block = 4 * 96 * 4 * model.config.intermediate_size * 4
    assert_dynamic_treats_long_batches_only(monkeypatch, model, make, saved_per_block, TILED_MLP)

def test_the_planner_swaps_in_the_leaner_re_run_where_only_the_re_run_peak_is_over():
    """NOTE [Leaner re-runs]: a mix whose recompute peak is what is over the room gets every treated block's
    twin that keeps as it does at the backward's start (``recompute_tiled`` for ``recompute``), priced by the
    twins' difference; where even that is over, no mix (the caller keeps its plan); with room, the cheaper
    plain re-run stays."""
    from types import SimpleNamespace

    from memfit.engine.parts.treatments import RECOMPUTE, resolve as resolve_names
    from memfit.engine.plan.search import Search

    model = _model_with_tiled(True)
    for t in (16, 32, 64):
        model.group_models[0].ms_curve(RECOMPUTE_TILED).add((4, t), 0.013 * t)  # a little dearer than recompute
        model.transient_partial.add((4, t), 50.0 * t)  # the backward's start of a partial plan under its re-run peak
    key, names = (4, 64), ("recompute", RECOMPUTE_TILED)
    registry = resolve_names(names)
    options = model.options(key, names)
    planning = SimpleNamespace(registry=registry, treatments=names, model=model,
                               plan_peak=lambda k, plan: int(model.plan_bytes(k, plan)))

    def mix(room: int) -> Plan | None:
        need = int(model.backward_start_bytes(key, Plan(()))) - room
        return Search(planning)._mix_that_fits(key, options, need, room)

    two = Plan((0, 1))
    two_tiled = Plan((0, 1), kinds=(RECOMPUTE_TILED,) * 2)
    start = model.backward_start_bytes(key, two)
    assert model.recompute_bytes(key, two_tiled) < start < model.recompute_bytes(key, two)  # only the re-run peak is over
    plan = mix(int(start) + 1)  # two blocks cover the need; their plain re-run is over the room, the tiled one is not
    assert plan is not None and plan.treatments(4) == [RECOMPUTE_TILED, RECOMPUTE_TILED, "keep", "keep"], plan
    assert plan.cost_ms == pytest.approx(2 * 0.013 * 64)
    roomy = int(model.step_bytes(key, two)) + 1
    assert mix(roomy).treatments(4) == [RECOMPUTE, RECOMPUTE, "keep", "keep"]  # room for the plain re-run: the cheaper stays


# ------------------------------------------------------------------ lean norms and adapters (bf16)
def _bf16_model(arch: str, lora: float | None):
    """``_model`` with bfloat16 weights; a LoRA's adapters float32, as peft makes them over bfloat16 weights."""
    torch.manual_seed(0)
    model, make = build_decoder(arch, False)
    model.to(torch.bfloat16)
    if lora is not None:
        model = _lora(model, lora)
    return model.train(), make


@pytest.mark.parametrize("name", TILED)
@pytest.mark.parametrize("arch,lora", [("llama", 0.0), ("llama", None), ("qwen2", 0.0), ("gemma2", 0.0), ("phi3", 0.0)])
def test_lean_norms_and_adapters_give_keeps_gradients_bit_for_bit(arch, lora, name):
    """NOTE [Lean inputs in a tiled block]: bfloat16 weights, LoRA (float32 adapters) or full fine-tuning, the MLP
    in one chunk: every gradient is ``keep``'s bit for bit with the norms and the adapters outside the MLP re-run
    from their input, which they did (the re-run Function ran for each)."""
    from memfit.engine.parts.treatments.tiled_mlp import lean_parts

    model, make = _bf16_model(arch, lora)
    reference = copy.deepcopy(model)
    ctl, n = _fit(model, name, 1)
    lean = [m for _, b in find_blocks(model) for m in lean_parts(b, tileable_mlps(b))]
    adapters = [m for m in lean if hasattr(m, "lora_A")]
    casts = [vars(m).get("cast_input_dtype_enabled") for m in adapters]
    assert lean and (adapters if lora is not None else not adapters), lean
    runs = []
    plain = tiled_module._rerun
    tiled_module._rerun = lambda run, x, params, chunks=1, draws=True: runs.append(x.dtype) or plain(run, x, params, chunks, draws)
    try:
        for seed, length in enumerate((9, 23)):
            step_both_and_compare(model, reference, make(2, length), seed, f"{arch} lora={lora} {name}, length {length}")
    finally:
        tiled_module._rerun = plain
    # every lean part ran re-run in both steps, but the first norm where nothing before it trains (a LoRA's frozen
    # embeddings: nothing to differentiate, it runs plainly)
    assert len(runs) >= 2 * (len(lean) - (lora is not None)) and set(runs) == {torch.bfloat16}, (len(runs), len(lean))
    ctl.remove()
    assert all("forward" not in vars(m) for m in model.modules()), "the lean forwards are put back"
    assert [vars(m).get("cast_input_dtype_enabled") for m in adapters] == casts, "peft's switch is put back"


def test_a_lora_dropout_outside_the_mlp_draws_the_same_masks_in_the_re_run():
    """A LoRA dropout (p > 0) on the attention's adapters, none in the MLP's (which then tiles): the adapters run lean,
    their masks drawn again from the forward's RNG state: ``keep``'s gradients bit for bit."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model, make = build_decoder("llama", False)
    model.to(torch.bfloat16)
    attention = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                init_lora_weights=False)
    model = peft.get_peft_model(model, attention).train()
    reference = copy.deepcopy(model)
    ctl, n = _fit(model, RECOMPUTE_TILED, 1)
    for seed, length in enumerate((9, 23)):
        step_both_and_compare(model, reference, make(2, length), seed, f"lora dropout, length {length}")
    ctl.remove()


def _saved_by_blocks(model, batch, lean: bool):
    """Elements of the hidden-wide float32 tensors saved in one step with every block's MLP tiled (and its norms and
    adapters lean or not), and the bytes of every distinct storage saved."""
    from memfit.engine.parts.treatments.tiled_mlp import lean_parts, tiled

    blocks = [b for _, b in find_blocks(model)]
    mlps = [m for b in blocks for m in tileable_mlps(b)]
    parts = [m for b in blocks for m in lean_parts(b, tileable_mlps(b))] if lean else []
    hidden, wide, storages, forward = model.config.hidden_size, {}, {}, [True]
    tokens = batch["input_ids"].numel()

    def pack(t):  # what the forward saves (not what the re-runs in backward hold a moment)
        if not forward[0]:
            return t
        if t.dtype == torch.float32 and t.dim() >= 2 and t.shape[-1] == hidden and t.numel() >= tokens * hidden:  # not an adapter's weight
            wide[t.untyped_storage().data_ptr()] = t.numel()
        if not isinstance(t, nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(0)
    with tiled(mlps, Chunking(), parts), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
        forward[0] = False
        loss.backward()
    model.zero_grad(set_to_none=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(wide.values()), sum(v for k, v in storages.items() if k not in params)


def test_a_lean_lora_block_keeps_no_float32_copy_of_its_hidden_states():
    """Counted (every saved tensor of a step, its MLPs tiled): a bfloat16 LoRA block's norms save a float32 copy of
    their input and q, k, v and o's adapters one of theirs; lean, none is saved (the inputs are saved in bfloat16, q,
    k and v's one input once), and the step saves less by at least those copies less the bfloat16 inputs saved
    instead."""
    model, make = _bf16_model("llama", 0.0)
    batch = make(2, 48)
    tokens, hidden, n = 2 * 48, model.config.hidden_size, len(find_blocks(model))
    wide_plain, saved_plain = _saved_by_blocks(model, batch, False)
    wide_lean, saved_lean = _saved_by_blocks(model, batch, True)
    # per block: the two norms' copies and q, k, v and o's adapters' copies (the final norm's outside the blocks)
    assert wide_plain >= n * 6 * tokens * hidden, wide_plain
    assert wide_lean <= tokens * hidden, wide_lean  # the final norm's, outside every block
    # lean saves, per block, the norms' two inputs and the adapters' two (q, k and v's one, o's) in bfloat16 for the six
    # float32 copies; the first block's first norm runs plainly (nothing before it trains: its copy stays)
    assert saved_plain - saved_lean >= (n * (6 * 4 - 4 * 2) - 4) * tokens * hidden, (saved_plain, saved_lean)


@pytest.mark.parametrize("sum_chunk", [64, 2**24])
def test_a_lean_lora_layer_holds_one_float32_output_not_three(monkeypatch, sum_chunk):
    """NOTE [Lean inputs in a tiled block], tracked (torch's MemTracker, every live tensor): a peft LoRA projection over
    bfloat16 weights with float32 adapters sums ``base + lora * scaling`` in float32 (the scaled output, the sum and,
    in backward, their gradients: tokens x out float32 tensors alive together); lean, in chunks of rows, the peak of
    its forward and backward is lower by more than one such tensor, and its output and gradients are peft's bit for
    bit, in one chunk or many."""
    peft = pytest.importorskip("peft")
    from torch.distributed._tools import mem_tracker

    from memfit.engine.parts.treatments.tiled_mlp import tiled

    monkeypatch.setattr(tiled_module, "SUM_CHUNK_ELEMENTS", sum_chunk)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128, bias=False)).to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0"], init_lora_weights=False))
    layer = model.base_model.model[0]
    assert layer.lora_A["default"].weight.dtype == torch.float32
    layer.base_layer.weight.requires_grad_(True)  # MemTracker hooks every parameter's gradient: none frozen
    x = torch.randn(4, 256, 64, dtype=torch.bfloat16)
    weights = torch.randn(4, 256, 128, dtype=torch.bfloat16)  # a loss that saves nothing of the output
    peaks, results = {}, {}
    for lean in (False, True):
        xi = x.clone().requires_grad_()
        tracker = mem_tracker.MemTracker()
        tracker.track_external(model)
        with tiled((), Chunking(), [layer] if lean else []), tracker:
            out = model(xi)
            (out * weights).sum().backward()
        peaks[lean] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        results[lean] = [out.detach(), xi.grad] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad(set_to_none=True)
    for a, b in zip(results[False], results[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # peft at its peak: the base output, the float32 scaled output and sum (forward), or the float32 gradient, its
    # cast and its scaled copy (backward): 14 or 12 bytes an output element; lean 8 or 6 (one float32, the chunks')
    assert peaks[False] - peaks[True] >= 1.25 * (4 * 256 * 128 * 4), peaks


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "phi3"])
def test_a_lean_norm_runs_in_chunks_of_tokens_with_the_same_bits(monkeypatch, arch):
    """NOTE [Lean inputs in a tiled block]: a lean norm runs in chunks of tokens, forward and backward (its own forward
    once per chunk each way), and its output and its input's gradient are the plain norm's bit for bit; a trained
    weight's gradient (a sum over tokens) is the chunks' summed in float32 in a tiled block (an MLP tiled beside it),
    within rounding of the plain one, and in one chunk bit for bit; under ``lean`` alone (no MLP tiled) a trained
    norm runs in one piece, bit for bit."""
    from memfit.engine.parts.treatments.tiled_mlp import tiled

    model, _ = _bf16_model(arch, None)
    block = find_blocks(model)[0][1]
    norm = block.input_layernorm
    x = torch.randn(2, 37, model.config.hidden_size, dtype=torch.bfloat16)
    g = torch.randn_like(x)
    calls, plain = [], type(norm).forward
    monkeypatch.setattr(type(norm), "forward", lambda self, h: calls.append(h.shape) or plain(self, h))
    for trains, chunks, mlps, runs in ((False, 5, [], 5), (True, 5, [block.mlp], 5), (True, 1, [block.mlp], 1),
                                       (True, 5, [], 1)):
        norm.weight.requires_grad_(trains)
        results = []
        for lean in (False, True):
            calls.clear()
            xi = x.clone().requires_grad_()
            with tiled(mlps, Chunking(at_least=chunks), [norm] if lean else []):
                out = norm(xi)
            out.backward(g)
            results.append([out.detach(), xi.grad] + ([norm.weight.grad] if trains else []))
            norm.weight.grad = None
        assert len(calls) == 2 * runs, (trains, calls)  # the lean runs: the chunks forward and again in backward
        chunks = runs
        for a, b in zip(results[0][:2], results[1][:2]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        if trains and chunks == 1:
            torch.testing.assert_close(results[0][2], results[1][2], rtol=0, atol=0)
        elif trains:  # bfloat16 sums either way: the chunks' as close to float64's as the plain one's, within an ulp
            wide = copy.deepcopy(norm).double()
            wide(x.double()).backward(g.double())
            truth = wide.weight.grad
            plain_err, chunked_err = ((r[2].double() - truth).abs().max() for r in results)
            assert results[1][2].dtype == norm.weight.dtype
            assert chunked_err <= plain_err + truth.abs().max() * 2**-8, (plain_err, chunked_err)


class _LargestFloat32(TorchDispatchMode):
    """The most elements of one float32 tensor an op makes (not a view)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and not t._is_view():
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("trained", [False, True])
def test_a_chunked_lean_norm_makes_its_float32_temporaries_a_chunk_at_a_time(trained):
    """Counted (every op's output): an RMSNorm over a bfloat16 input makes float32 tensors of its whole input in
    forward and backward, lean in one piece too; in 8 chunks no op makes a float32 tensor of more than one chunk's
    tokens: a frozen norm's anywhere, a trained one's in a tiled block (its weight's float32 sums are one row wide)."""
    from memfit.engine.parts.treatments.tiled_mlp import tiled

    model, _ = _bf16_model("llama", None)
    block = find_blocks(model)[0][1]
    norm = block.input_layernorm.requires_grad_(trained)
    x = torch.randn(4, 512, model.config.hidden_size, dtype=torch.bfloat16)
    largest = {}
    for at_least in (1, 8):
        xi = x.clone().requires_grad_()
        mode = _LargestFloat32()
        with mode, tiled([block.mlp] if trained else (), Chunking(at_least=at_least, min_tokens=1), [norm]):
            norm(xi).backward(torch.ones_like(x))
        largest[at_least] = mode.largest
    assert largest[1] == x.numel() and largest[8] == x.numel() // 8, largest


def _with_static_bytes():
    """A tiny Llama, its batch maker, and the static bytes a step of it starts with (read from one step's record)."""
    model, make = _model("llama")
    ctl = memfit.fit(model, budget="1GB", treatments=("recompute", RECOMPUTE_TILED), announce=False)
    ctl.run_step(lambda: model(**make(2, 8)).loss.backward())
    static = ctl.records[-1].static_bytes
    ctl.remove()
    model.zero_grad(set_to_none=True)
    return model, make, static


def test_a_first_warm_up_step_whose_block_inputs_alone_are_over_the_budget_starts_on_the_floor():
    """NOTE [Warm-up on the floor]: where every block's input and the last block's MLP run (its gate and up outputs)
    beside the static bytes are already over the budget, the first warm-up step of that length runs the floor plan at
    once (no failed forward to replay); one short enough to be under that bound and the bound of a block's re-run
    tries every block recomputed."""
    model, make, static = _with_static_bytes()
    n, hidden, inter = len(find_blocks(model)), model.config.hidden_size, model.config.intermediate_size
    inputs = n * 2 * 48 * hidden * 4  # every block's float32 input at 2 x 48 tokens
    mlp = 2 * 2 * 48 * inter * 4  # the last block's gate and up outputs beside them
    for budget in (static + inputs - 1, static + inputs + mlp // 2):  # the inputs alone over; with the last MLP run
        ctl = memfit.fit(model, budget=budget, treatments=("recompute", RECOMPUTE_TILED), announce=False)
        for length, treatment in ((48, RECOMPUTE_TILED), (2, "recompute")):  # 2 x 2 x (3 + PROBE_NEED) < 288 inputs
            batch = make(2, length)
            ctl.run_step(lambda batch=batch: model(**batch).loss.backward())
            record = ctl.records[-1]
            assert (record.phase, record.oom_retries, record.block_treatments) == ("warmup", 0, {treatment: list(range(n))}), length
        ctl.remove()
        model.zero_grad(set_to_none=True)


def test_a_warm_up_step_tries_every_block_recomputed_only_where_it_is_expected_to_fit():
    """NOTE [Warm-up on the floor]: under the inputs' bound, before the model can predict, a warm-up step whose block
    inputs and one block's re-run (``PROBE_NEED`` times its input) are over the budget runs the floor, with no failed
    forward, and is not remembered; once the model is ready its prediction decides; a run whose floor is plain
    recompute is unchanged (its floor is that plan)."""
    from memfit.engine.parts.probe import PROBE_NEED

    model, make, static = _with_static_bytes()
    n, hidden = len(find_blocks(model)), model.config.hidden_size
    a_token = hidden * 4  # a block's float32 input a token
    tokens = 2 * 16
    budget = static + (n + PROBE_NEED // 2) * a_token * tokens  # over the re-run's bound, far under the inputs'
    ctl = memfit.fit(model, budget=budget, treatments=("recompute", RECOMPUTE_TILED), announce=False, warmup_steps=6)
    batch = make(2, 16)
    ctl.run_step(lambda: model(**batch).loss.backward())
    first = ctl.records[-1]
    assert (first.phase, first.oom_retries, first.block_treatments) == ("warmup", 0, {RECOMPUTE_TILED: list(range(n))})
    assert ctl.method._floor_tokens is None  # judged again at the next step
    for _ in range(3):
        if not ctl.planning.model.ready:
            ctl.run_step(lambda: model(**batch).loss.backward())
    planning = ctl.planning
    assert planning.model.ready and ctl.method.in_warmup(planning)
    for over, treatment in ((1, RECOMPUTE_TILED), (-1, "recompute")):  # the prediction, whatever the bound says
        planning.plan_peak = lambda key, plan, over=over: planning.room_bytes + over
        ctl.run_step(lambda: model(**batch).loss.backward())
        record = ctl.records[-1]
        assert (record.phase, record.block_treatments) == ("warmup", {treatment: list(range(n))}), over
    ctl.remove()
    model.zero_grad(set_to_none=True)
    plain = memfit.fit(model, budget=budget, treatments=("recompute",), announce=False)
    plain.run_step(lambda: model(**batch).loss.backward())
    assert plain.records[-1].block_treatments == {"recompute": list(range(n))}
    plain.remove()


def test_a_warm_up_step_is_judged_with_the_head_it_runs():
    """NOTE [Warm-up on the floor]: once the model predicts, warm-up's every-block-recomputed plan is judged with the
    LM head as the step runs it (``untreated``: chunked), not kept: the kept head's logits may be over the room where
    the step's own head leaves every block recomputed room to fit."""
    model, make, static = _with_static_bytes()
    n = len(find_blocks(model))
    ctl = memfit.fit(model, budget=static + 2**30, treatments=("recompute", RECOMPUTE_TILED), head=True, announce=False,
                     warmup_steps=6)
    batch = make(2, 16)
    while not ctl.planning.model.ready:
        ctl.run_step(lambda: model(**batch).loss.backward())
    planning = ctl.planning
    assert ctl.method.in_warmup(planning)
    judged, predict = [], planning.plan_peak

    def plan_peak(key, plan):  # over the room with the head kept, within it as the step runs
        judged.append(plan)
        return planning.room_bytes + (1 if plan.option("head") in (None, ("keep", 1)) else -1)

    planning.plan_peak = plan_peak
    ctl.run_step(lambda: model(**batch).loss.backward())
    planning.plan_peak = predict
    record = ctl.records[-1]
    assert judged and judged[-1].option("head") == record.parts.get("head") != ("keep", 1), (judged, record.treatments)
    assert (record.phase, record.block_treatments) == ("warmup", {"recompute": list(range(n))})
    ctl.remove()


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_lean_parts_that_draw_nothing_keep_no_rng_state(monkeypatch, dropout):
    """A lean norm, and a lean adapter without dropout, draw no random numbers: their re-run keeps no RNG state (a
    copy of the CPU generator's and each device's at every call, and a fork in backward); an adapter with dropout
    keeps it, and draws its masks again from it (its gradients bit for bit ``keep``'s: test_lean.py)."""
    peft = pytest.importorskip("peft")
    from memfit.engine.parts.treatments.tiled_mlp import lean_parts, tiled

    torch.manual_seed(0)
    model, make = build_decoder("llama", False)
    model.to(torch.bfloat16)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             init_lora_weights=False)
    model = peft.get_peft_model(model, config).train()
    blocks = [b for _, b in find_blocks(model)]
    parts = [m for b in blocks for m in lean_parts(b, tileable_mlps(b))]
    reads = []
    state = torch.get_rng_state
    monkeypatch.setattr(torch, "get_rng_state", lambda: reads.append(1) or state())
    with tiled([m for b in blocks for m in tileable_mlps(b)], Chunking(), parts):
        model(**make(2, 12)).loss.backward()
    mlps = sum(len(tileable_mlps(b)) for b in blocks)
    adapters = 4 * len(blocks)  # q, k, v and o's lora_A re-run (q, k and v each its own call)
    # each re-run that keeps it reads it twice: kept in forward, forked in backward
    assert len(reads) == 2 * (mlps + (adapters if dropout else 0)), (len(reads), mlps, adapters)


def test_a_run_of_one_length_warmed_up_on_the_floor_leaves_warm_up():
    """NOTE [Warm-up on the floor]: where every step of a run of one length starts on the floor (its block inputs over
    the budget), no block ever runs recomputed; the probe teaches what a checkpoint keeps (``Recompute.probe``), so the
    memory model gets ready and warm-up ends after its steps, as for any run of one length, instead of probing and
    counting every step; its steady steps, which no plan is predicted to fit, run the floor too. The recompute curve
    holds a block's input bytes."""
    model, make, static = _with_static_bytes()
    n, hidden = len(find_blocks(model)), model.config.hidden_size
    ctl = memfit.fit(model, budget=static + n * 2 * 48 * hidden * 4 - 1, treatments=("recompute", RECOMPUTE_TILED), announce=False)
    batch = make(2, 48)
    for _ in range(6):
        ctl.run_step(lambda: model(**batch).loss.backward())
    phases = [r.phase for r in ctl.records]
    # every step on the floor: warm-up's by its bound, the steady ones as the plan where none is predicted to fit
    # (``floor_plan``: the re-run that keeps least, not plain recompute, which keeps the blocks' inputs)
    assert all(r.block_treatments == {RECOMPUTE_TILED: list(range(n))} for r in ctl.records), [r.treatments for r in ctl.records]
    assert "steady" in phases and ctl.planning.model.ready, phases
    curve = ctl.planning.model.group_models[0].bytes["recompute"]
    assert set(curve.ys) == {2 * 48 * hidden * 4}, list(curve.ys)
    ctl.remove()


@pytest.mark.parametrize("arch, offered, verdict", [
    ("llama", True, True),  # pre-norm: the MLP is its input's one consumer (read from the graph once)
    ("cohere", True, None),  # parallel block: autograd sums the MLP's uses first (compared at every probe)
    ("olmo2", False, False),  # post-norm: the residual uses the MLP's input
    ("qwen2_moe", False, False),  # the router and the shared expert's gate use the shared expert's input
])
def test_a_tiled_mlp_is_offered_only_where_its_inputs_gradient_is_summed_in_the_same_order(arch, offered, verdict):
    """NOTE [Tiled MLP]: the tiled Function returns its input's gradient summed over the MLP's own uses; where the
    input has another use and autograd would have summed them in another order, one chunk's gradients are a
    rounding apart from keep's, so the tiled treatments are not offered, and the verdict kept on the block stops
    them from running there (a plan that names them runs the block untiled: keep's gradients bit for bit)."""
    model, make = _model(arch)
    ctl = memfit.fit(model, budget=None, method="none", treatments=TILED, announce=False)
    block = ctl.blocks[0]
    for _ in range(2):  # a second probe: the verdict holds
        measured = _probe_of(model, ctl, make, *TILED)
        assert ({TILED_MLP, RECOMPUTE_TILED} <= set(measured)) is offered and (offered or not set(TILED) & set(measured)), measured
        assert block.tiles_exactly is verdict
    ctl.remove()
    if offered:
        return
    reference = copy.deepcopy(model)
    ctl, _ = _fit(model, TILED_MLP, 1)
    for blk in ctl.blocks:
        blk.tiles_exactly = False
    step_both_and_compare(model, reference, make(3, 40), 7, f"{arch}: a plan naming tiled_mlp")
    ctl.remove()


def test_a_block_whose_mlp_input_has_another_use_tiles_a_rounding_apart():
    """Why the verdict exists (NOTE [Tiled MLP]): ``x + mlp(x)`` tiled in one chunk, forced, gives other bits than keep
    in the gradients before the block; ``mlp(x)`` alone gives keep's."""

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj, self.act_fn = nn.Linear(32, 37), nn.Linear(32, 37), nn.Linear(37, 32), nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self, residual):
            super().__init__()
            self.mlp, self.residual = Mlp(), residual

        def forward(self, x):
            return x + self.mlp(x) if self.residual else self.mlp(x)

    class Net(nn.Module):
        def __init__(self, residual):
            super().__init__()
            self.first, self.layers = nn.Linear(32, 32), nn.ModuleList(Block(residual) for _ in range(2))

        def forward(self, x):
            x = self.first(x)
            for layer in self.layers:
                x = layer(x)
            return x

    for residual in (True, False):
        torch.manual_seed(0)
        model = Net(residual)
        reference = copy.deepcopy(model)
        ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan((0, 1), kinds=(TILED_MLP,) * 2)), treatments=(TILED_MLP,),
                         announce=False)
        x = torch.randn(2, 23, 32)
        model(x).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
        assert ctl.records[-1].block_treatments == {TILED_MLP: [0, 1]}
        assert torch.equal(model.first.weight.grad, reference.first.weight.grad) is (not residual)
        ctl.remove()


@pytest.mark.parametrize("arch, verdict", [("llama", True), ("olmo2", False)])
def test_the_tiled_mlps_verdict_is_its_groups(arch, verdict):
    """NOTE [Tiled MLP]: warm-up probes the first block of a group; what it finds of the tiled MLP's order holds for
    every block of the group, which a floor plan (every block on ``host_checkpoint_tiled`` or ``recompute_tiled``)
    runs tiled or not by it."""
    model, make = _model(arch)
    ctl = memfit.fit(model, budget=10**9, method="dynamic", treatments=TILED, warmup_steps=2, warmup_keys=2, announce=False)
    for length in (16, 24, 32):
        model(**make(2, length)).loss.backward()
    assert [b.tiles_exactly for b in ctl.blocks] == [verdict] * len(ctl.blocks)
    ctl.remove()


def test_the_order_check_reads_an_mlp_called_by_keyword():
    """NOTE [Tiled MLP]: an MLP called with its input by keyword is read as one called by position (its input's other
    use found: not in order); one never called is not noted, and the block's check then says the order may change."""
    from memfit.engine.parts.treatments.tiled_mlp import graph_edges, keeps_sum_order, noting_mlps

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, hidden_states):
            return self.gate_proj(hidden_states) * self.up_proj(hidden_states)

    mlp, unused = Mlp(), Mlp()
    seen = {}
    hooks = noting_mlps([mlp, unused], seen)
    x = torch.randn(2, 4, requires_grad=True) * 1.0
    out = x + mlp(hidden_states=x)
    for hook in hooks:
        hook.remove()
    assert set(seen) == {id(mlp)} and seen[id(mlp)][0] is x
    assert not keeps_sum_order(*seen[id(mlp)], graph_edges([out]))
    alone = {}  # the MLP its input's one consumer: in order
    hooks = noting_mlps([mlp], alone)
    y = x * 2.0
    out = mlp(hidden_states=y)
    hooks[0].remove()
    assert keeps_sum_order(*alone[id(mlp)], graph_edges([out]))


@pytest.mark.parametrize("lora", [False, True])
def test_a_forward_without_autograd_tiles_the_mlps_that_would_not_fit_the_room(lora):
    """NOTE [Blocks in evaluation]: without the room its gated MLPs run in chunks of at most half of it (each MLP's last
    projection called once a chunk; at least two, at most one a token) and the loss is the plain model's within float32 rounding; with room, or under logical accounting, the model's
    own blocks, bit for bit; training forwards never ask; each MLP's forward is its own after."""
    from _models import build_decoder
    from memfit.engine.parts.treatments.elementwise import elementwise_parts
    from memfit.engine.parts.treatments.tiled_mlp import tiled_evaluation

    model, make = build_decoder("llama", lora=lora)  # LoRA's dropout is on: off in eval mode, so those MLPs tile too
    batch = make(2, 24)
    model.eval()
    with torch.no_grad():
        want = model(**batch).loss
    ctl = memfit.fit(model, budget="100MB", method="dynamic", announce=False)
    assert all(b.evaluation is None for b in ctl.blocks)  # a CPU's logical accounting: nothing runs out of memory
    mlps = [m for b in ctl.blocks for m in elementwise_parts(b.module)[1]]
    assert len(mlps) == len(ctl.blocks)
    calls = []
    for m in mlps:
        m.down_proj.register_forward_hook(lambda *_: calls.append(1))
    rooms, asked = [], []
    for b in ctl.blocks:
        b.evaluation = tiled_evaluation(lambda device: asked.append(device) or rooms[-1])
    whole = 6 * 2 * 24 * 37 * 4  # six float32 tensors of 2 x 24 tokens x 37 features
    for room, per_mlp in ((whole, 2), (whole // 3, 6), (0, 48), (10**12, 1)):  # chunks of at most half the room
        rooms.append(room)
        calls.clear()
        with torch.no_grad():
            got = model(**batch).loss
        assert len(calls) == per_mlp * len(mlps), (room, len(calls))
        if per_mlp == 1:
            assert torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert all("forward" not in m.__dict__ for m in mlps)
    assert len(asked) == 4 * len(mlps)
    model.train()
    model(**batch).loss.backward()  # a training forward (and warm-up's probes): the plan's, never the evaluation's
    assert len(asked) == 4 * len(mlps)
    ctl.remove()
