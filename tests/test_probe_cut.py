"""Probing on a cut (NOTE [Probing on a cut], engine/parts/probe.py): a long warm-up step's probes run on the first
positions of its input where the whole might not fit, scaled back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _models import DECODER_ARCHS, VOCAB, build_decoder
from memfit.engine.parts import probe
from memfit.engine.parts.accounting import SavedTensorCounter
from memfit.engine.parts.blocks import find_blocks


def _inputs_of(model, block, length):
    """The (args, kwargs) ``block`` receives in a forward of ``length`` tokens (no padding)."""
    seen = []
    handle = block.register_forward_pre_hook(lambda m, a, kw: seen.append((a, kw)), with_kwargs=True)
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, length))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize("arch", DECODER_ARCHS)
def test_a_cut_input_is_the_input_of_a_shorter_sequence(arch):
    """Cut to its first positions, a block's input is what the block receives for that shorter sequence
    (hidden states aside, whose values differ): same shapes for every tensor, same masks and rotary tables."""
    model, _ = build_decoder(arch)
    model.eval()
    block = find_blocks(model, None)[1][1]
    long_args, long_kwargs = _inputs_of(model, block, 96)
    short_args, short_kwargs = _inputs_of(model, block, 40)
    cut_args, cut_kwargs = probe._cut(long_args, long_kwargs, 40)
    flat = lambda a, kw: [t for t in torch.utils._pytree.tree_leaves((a, kw)) if isinstance(t, torch.Tensor)]
    cut, short = flat(cut_args, cut_kwargs), flat(short_args, short_kwargs)
    assert [t.shape for t in cut] == [t.shape for t in short]
    for a, b in zip(cut[1:], short[1:]):  # masks, positions, rotary tables: equal
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe"])
def test_a_probe_on_a_cut_scales_to_the_whole(arch):
    """A block's probe on the first half of its input, scaled by two, is no more than the probe of the whole
    (what attention keeps per pair of positions comes out low: plans then treat more, never fewer) and
    most of it (the tiny test blocks are attention-heavy; a real block's MLP is linear in tokens)."""
    model, _ = build_decoder(arch)
    model.train()
    block = find_blocks(model, None)[1][1]
    args, kwargs = _inputs_of(model, block, 128)
    args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    counter = SavedTensorCounter(3)

    class _Block:
        def __init__(self, module):
            self.module, self.index = module, 1

        def body(self, *a, **kw):
            return self.module.forward(*a, **kw)

    whole, _ = probe.probe_block(_Block(block), args, kwargs, counter, False, torch.device("cpu"))
    half, _ = probe.probe_block(_Block(block), *probe._cut(args, kwargs, 64), counter, False, torch.device("cpu"))
    assert 0.6 * whole <= 2 * half <= whole


def test_the_cut_is_the_longest_whose_need_fits_half_the_room(monkeypatch):
    """No cut without a cap, on a CPU, or where the need fits; else the longest length whose estimated need
    (PROBE_NEED x the input's bytes, scaled) fits half of what the budget leaves free."""
    x = torch.empty(1, 16384, 4096, dtype=torch.bfloat16, device="meta")
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 15 * 2**30)
    need = probe.PROBE_NEED * 16384 * 4096 * 2  # 8 GiB
    assert probe.cut_length((x,), {}, None, cuda) == 0
    assert probe.cut_length((x,), {}, 24 * 2**30, torch.device("cpu")) == 0
    assert probe.cut_length((x,), {}, 16 * 2**30 + 2 * need, cuda) == 0
    length = probe.cut_length((x,), {}, 24 * 2**30, cuda)
    half_free = (9 * 2**30 - 2**27) // 2  # 9 GiB left, less the block's own 128 MiB input, halved
    assert length == int(16384 * half_free / need)
    assert probe.PROBE_NEED * length * 4096 * 2 <= half_free
    # 32 blocks each holding a 128 MiB input by the last: 4 GiB less free, a shorter cut
    assert probe.cut_length((x,), {}, 24 * 2**30, cuda, n_blocks=32) == int(16384 * ((9 * 2**30 - 32 * 2**27) // 2) / need)
    assert probe.cut_length((x,), {}, 15 * 2**30, cuda) == probe.MIN_CUT  # nothing free: the shortest cut


def test_a_warm_up_step_on_a_cut_learns_scaled_probes(monkeypatch):
    """Through a whole run: a warm-up step forced onto a cut records its probes scaled to the step's length,
    and the gradients are untouched (the probes run apart)."""
    import copy

    import memfit
    from _models import step_both_and_compare

    model, make = build_decoder("llama")
    reference = copy.deepcopy(model)
    monkeypatch.setattr(probe, "cut_length", lambda args, kwargs, budget, device, n_blocks=1: 24)
    seen = []
    learn = memfit.engine.plan.learner.learn_probes
    monkeypatch.setattr(memfit.engine.plan.learner, "learn_probes", lambda planning, key, probes, treated=None: seen.append((key, dict(probes))) or learn(planning, key, probes, treated))
    ctl = memfit.fit(model, budget="1GB", announce=False)
    step_both_and_compare(model, reference, make(2, 48), 0, "cut probes")
    key, probes = seen[0]
    assert key == (2, 48)
    assert all(nbytes > 0 for nbytes, _ in probes.values())
    # a recomputed block keeps its input: the cut's, scaled back, is the whole input's (a view of the whole input was
    # counted by its storage and scaled again: 65,536 tokens cut to 64 on an H200 made it 512 GiB, not 512 MiB)
    hidden = 2 * 48 * model.config.hidden_size * 4
    assert set(ctl.planning.model.group_models[0].bytes["recompute"].ys) == {hidden}
    ctl.remove()


def test_a_cut_owns_its_storage():
    """Every cut tensor is a copy of the first positions, not a view: a probe counts storages."""
    x = torch.randn(1, 96, 8, requires_grad=True)
    cos = torch.randn(1, 96, 4)
    mask = torch.zeros(1, 1, 96, 96).expand(2, 1, 96, 96)
    args, kwargs = probe._cut((x,), {"position_embeddings": (cos, cos), "attention_mask": mask}, 24)
    cut = [args[0], *kwargs["position_embeddings"], kwargs["attention_mask"]]
    assert [tuple(t.shape) for t in cut] == [(1, 24, 8), (1, 24, 4), (1, 24, 4), (2, 1, 24, 24)]
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in cut)
    assert args[0].requires_grad and torch.equal(args[0], x[:, :24]) and torch.equal(cut[3], mask[..., :24, :24])


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_warm_up_steps_probes_leave_the_recomputed_blocks_counting_their_input(arch):
    """Warm-up recomputes every block while the probes run the block under every treatment, forward and backward (the
    lean and tiled parts' re-runs save tensors in the backward). Nothing a probe saves reaches the step's counter: a
    recomputed block is counted its input, the first block (whose mask and rotary tables others share) exactly its
    hidden states. Counted into it, a probe's norm copies made a Gemma-2 block's recompute curve 2.4 GiB at 8 x 1,206
    tokens (one H200) where it keeps 44 MB, and every long step was planned as if nothing fitted."""
    import copy

    import memfit

    peft = pytest.importorskip("peft")
    model, make = build_decoder(arch)
    model.to(torch.bfloat16)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(model, config).train()
    ctl = memfit.fit(model, budget="60MB", announce=False)
    assert {"lean", "tiled_mlp"} <= set(ctl.treatments), sorted(ctl.treatments)  # the probes whose backward re-runs
    batch = make(8, 96)
    ctl.run_step(lambda: model(**batch).loss.backward())
    record = ctl.records[-1]
    assert set(record.block_treatments) == {"recompute"}, record.treatments
    hidden = 8 * 96 * model.config.hidden_size * 2
    curve = ctl.planning.model.group_models[0].bytes["recompute"]
    assert set(curve.ys) == {hidden}, (list(curve.ys), hidden)  # the step's count and the probe's, alike
    ctl.remove()


def test_a_blocks_probe_times_the_plain_block_once_for_every_treatment(monkeypatch):
    """NOTE [Cold runs of a block]: the treatments a block's probe times (elementwise, lean, the tiled ones) are each
    compared with the same plain runs, timed beside the first: the plain block runs TIMED_RUNS times in all, and the
    tiled treatments' token-wise check runs once."""
    import memfit
    from memfit.engine.parts.treatments import tiled_mlp as tiled_module

    peft = pytest.importorskip("peft")
    model, make = build_decoder("llama")
    model.to(torch.bfloat16)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(model, config).train()
    ctl = memfit.fit(model, budget="60MB", announce=False)
    timed = {"elementwise", "lean", "tiled_mlp", "recompute_tiled"}
    assert timed <= set(ctl.treatments), sorted(ctl.treatments)
    block = ctl.blocks[1]
    captured = {}
    handle = block.module.register_forward_pre_hook(lambda m, a, k: captured.update(inputs=(a, k)), with_kwargs=True)
    with torch.no_grad():
        model.eval()(**make(2, 24))
    model.train()
    handle.remove()
    plain, checks = [], []
    timing = probe.ProbeKit.forward_backward_ms
    monkeypatch.setattr(probe.ProbeKit, "forward_backward_ms",
                        lambda kit, body, *contexts: (plain.append(1) if body is block.body and len(contexts) == 1 else None)
                        or timing(kit, body, *contexts))
    checking = tiled_module._probe_tiled
    monkeypatch.setattr(tiled_module, "_probe_tiled", lambda b, kit: checks.append(1) or checking(b, kit))
    args, kwargs = captured["inputs"]
    with torch.enable_grad():
        measured = probe.probe_treatments(block, args, kwargs, ctl._counter, torch.device("cpu"), tuple(sorted(timed)))
    assert timed | {"recompute"} == set(measured), measured  # recompute's probe reads its input, untimed
    assert (len(plain), len(checks)) == (probe.TIMED_RUNS, 1)
    ctl.remove()


def _probe_runs(monkeypatch, names):
    """A tiny Llama's second block probed under ``names``: its timed plain runs, each treatment's timed runs (by the
    contexts' types) and the block's forwards in all."""
    import memfit

    model, _ = build_decoder("llama")
    model.to(torch.bfloat16).train()  # half precision: lean keeps less than plain (NOTE [Lean inputs in a tiled block])
    ctl = memfit.fit(model, budget=None, method="none", treatments=names, announce=False)
    block = ctl.blocks[1]
    args, kwargs = _inputs_of(model, block.module, 24)
    plain, treated, forwards = [], [], []
    timing = probe.ProbeKit.forward_backward_ms
    monkeypatch.setattr(probe.ProbeKit, "forward_backward_ms", lambda kit, body, *contexts: (
        plain.append(1) if body is block.body and len(contexts) == 1 else treated.append(1)) or timing(kit, body, *contexts))
    body = block.body
    block.body = lambda *a, **k: forwards.append(1) or body(*a, **k)
    with torch.enable_grad():
        measured = probe.probe_treatments(block, args, kwargs, ctl._counter, torch.device("cpu"), names)
    ctl.remove()
    return measured, len(plain), len(treated), len(forwards), block


@pytest.mark.parametrize("name", ["elementwise", "lean"])
def test_a_treatment_checked_bit_for_bit_is_timed_once_fewer_with_the_plain_block(monkeypatch, name):
    """NOTE [Cold runs of a block]: the bit-for-bit check ran the treatment and the plain block at this size (their cold
    runs), so its price takes TIMED_RUNS - 1 timed runs of each; the check's two runs and these are all the block ran."""
    measured, plain, treated, forwards, _ = _probe_runs(monkeypatch, (name,))
    assert name in measured, measured
    assert (plain, treated) == (probe.TIMED_RUNS - 1, probe.TIMED_RUNS - 1)
    assert forwards == 2 + 2 * (probe.TIMED_RUNS - 1)


def test_a_block_whose_gradients_do_not_repeat_is_found_so_once():
    """``runs_as_plain``: where the plain block's gradients differ from run to run (an attention backward that sums with
    atomics), the outputs decide, and the block remembers it: a later check runs the plain block once, not twice."""
    from memfit.engine.parts.treatments.elementwise import _leaner, runs_as_plain

    class Noisy(torch.autograd.Function):
        calls = 0

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            Noisy.calls += 1
            return g * (1 + Noisy.calls * 2.0**-10)

    model, _ = build_decoder("llama")
    plain_forward = type(model.model.layers[1]).forward

    def noisy_forward(self, *args, **kwargs):  # the output's gradient scaled anew at every backward
        out = plain_forward(self, *args, **kwargs)
        return (Noisy.apply(out[0]), *out[1:]) if isinstance(out, tuple) else Noisy.apply(out)

    import memfit

    ctl = memfit.fit(model.train(), budget=None, method="none", treatments=("elementwise",), announce=False)
    block = ctl.blocks[1]
    inputs = _inputs_of(model, block.module, 24)
    noisy = noisy_forward.__get__(block.module)
    runs = []
    block.body = lambda *a, **k: runs.append(1) or noisy(*a, **k)
    kit = probe.ProbeKit(block, probe._detached(*inputs), ctl._counter, torch.device("cpu"))
    with torch.enable_grad():
        for expected_runs in (3, 2, 2):
            runs.clear()
            assert runs_as_plain(block, kit, lambda: _leaner(block.module, []), kit.shield())
            assert (len(runs), block.repeats_gradients) == (expected_runs, False)  # True until the first check
    ctl.remove()


@pytest.mark.parametrize("plan_kinds, holding", [((), 3), (("host_checkpoint",) * 3, 0), (("recompute", "host_checkpoint", "recompute"), 2)])
def test_the_cut_counts_the_inputs_the_plan_holds_on_the_device(monkeypatch, plan_kinds, holding):
    """The cut leaves room for the inputs the warm-up plan's blocks hold on the device by the last: every block's where
    they are recomputed, none where they go to the host (a floor warm-up step is cut no shorter than its room asks)."""
    from types import SimpleNamespace

    from memfit.engine.parts.treatments import resolve
    from memfit.engine.plan.planner import Plan

    asked = []
    monkeypatch.setattr(probe, "cut_length", lambda args, kwargs, budget, device, n_blocks=1: asked.append(n_blocks) or 0)
    monkeypatch.setattr(probe, "probe_block", lambda *a: (1, None))
    plan = Plan((0, 1, 2), kinds=plan_kinds)
    step = SimpleNamespace(probed_groups={0}, probe_length=None, decision=SimpleNamespace(plan=plan), probes={}, treated_probes={})
    planning = SimpleNamespace(model=SimpleNamespace(groups=[0, 0, 0]), budget_bytes=2**30, n_blocks=3,
                               registry=resolve(("recompute", "host_checkpoint")), recompute_only=True)
    x = torch.zeros(1, 8, 4)
    probe._probe_warmup(step, SimpleNamespace(index=1), (x,), {}, None, torch.device("cpu"), planning)
    assert asked == [holding]


def test_a_key_every_curve_has_sampled_is_not_probed_again(monkeypatch):
    """NOTE [Probing a key once]: a run of one length probes every block in its first warm-up step only; its later
    warm-up steps probe none (their curves hold that key); a new length is probed; the curves are the same as with a
    probe every step (bytes: each key's largest, the same bytes)."""
    import memfit

    probed = []
    plain = probe._probe_warmup
    monkeypatch.setattr(probe, "_probe_warmup", lambda step, block, *a: probed.append((step.key, block.index)) or plain(step, block, *a))
    model, make = build_decoder("llama")
    n = len(find_blocks(model))
    ctl = memfit.fit(model, budget="1GB", announce=False, treatments=("recompute", "elementwise"), warmup_steps=4)
    for length in (24, 24, 24, 32):
        batch = make(2, length)
        ctl.run_step(lambda batch=batch: model(**batch).loss.backward())
        model.zero_grad(set_to_none=True)
    assert [r.phase for r in ctl.records] == ["warmup"] * 4
    assert [key for key, _ in probed] == [(2, 24)] * n + [(2, 32)] * n, probed
    bytes_once = {name: list(c.ys) for name, c in ctl.planning.model.group_models[0].bytes.items()}
    ctl.remove()
    monkeypatch.setattr(probe, "_probe_warmup", plain)
    # the same run with every warm-up step probed (the check off): the same largest bytes per key
    model2, make2 = build_decoder("llama")
    ctl = memfit.fit(model2, budget="1GB", announce=False, treatments=("recompute", "elementwise"), warmup_steps=4)
    monkeypatch.setattr(probe, "sampled_at", lambda planning, index, key: False)
    for length in (24, 24, 24, 32):
        batch = make2(2, length)
        ctl.run_step(lambda batch=batch: model2(**batch).loss.backward())
        model2.zero_grad(set_to_none=True)
    again = ctl.planning.model.group_models[0].bytes
    assert {name: max(c.ys) for name, c in again.items() if c.ys} == {name: max(ys) for name, ys in bytes_once.items() if ys}
    ctl.remove()


def test_a_blocks_warm_up_probe_runs_aside_from_its_step(monkeypatch):
    """NOTE [Work aside from the step] (meter.py): every block's warm-up probe runs inside the meter's ``aside`` of
    its step (on CUDA the step's peak is carried and the allocator's counter reset after it, so what the probe held
    is never read as the step's)."""
    import contextlib

    import memfit
    from memfit.engine.run.meter import Meter

    inside, probed = [], []

    @contextlib.contextmanager
    def aside(self, step):
        inside.append(step)
        try:
            yield
        finally:
            inside.pop()

    plain = probe._probe_warmup
    monkeypatch.setattr(Meter, "aside", aside)
    monkeypatch.setattr(probe, "_probe_warmup", lambda step, block, *a: probed.append(list(inside)) or plain(step, block, *a))
    model, make = build_decoder("llama")
    ctl = memfit.fit(model, budget="1GB", announce=False, treatments=("recompute",))
    batch = make(2, 24)
    ctl.run_step(lambda: model(**batch).loss.backward())
    assert probed and all(len(seen) == 1 and seen[0] is not None for seen in probed)
    ctl.remove()


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_host_checkpoints_probe_counts_none_of_the_inputs_every_block_is_given(arch, monkeypatch):
    """NOTE [Checkpoints on the host]: on a padded batch every layer is given the same mask and rotary tables, which the
    step counts outside the blocks (a storage several blocks save); ``host_checkpoint``'s probe, of the whole input or a
    cut, counts none of them as the block's, where the step's count of the blocks beside it holds them outside."""
    from memfit.engine.parts.accounting import SavedTensorCounter
    from memfit.engine.parts.treatments import host_checkpoint
    from memfit.engine.parts.treatments.host_checkpoint import HostCheckpoint

    monkeypatch.setattr(host_checkpoint, "MIN_BYTES", 0)  # the tiny blocks' inputs are worth a copy here
    model, make = build_decoder(arch)
    model.train()
    blocks = [module for _, module in find_blocks(model, None)]
    seen, counter = [], SavedTensorCounter(len(blocks), exclude=list(model.parameters()))

    def enter(index):
        def hook(module, args, kwargs):
            seen.append((args, kwargs)) if index == 1 else None
            counter.current = index
        return hook

    handles = [b.register_forward_pre_hook(enter(i), with_kwargs=True) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(lambda *a: setattr(counter, "current", -1)) for b in blocks]
    counter.start()
    model(**make(2, 96))
    counter.stop()
    for h in handles:
        h.remove()
    args, kwargs = seen[0]
    given = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)][1:]
    assert given and counter.outside_bytes > 0  # what the blocks share, counted outside them
    block, cpu = SimpleNamespace(module=blocks[1], index=1, body=blocks[1].forward), torch.device("cpu")
    detached = probe._detached(args, kwargs)
    for inputs in (detached, probe._cut(*detached, 48)):
        assert HostCheckpoint.probe(block, probe.ProbeKit(block, inputs, counter, cpu)) == (0, None)
