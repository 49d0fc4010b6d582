"""Method `reactive`: the DTR eviction policy, exact gradients, a logical budget kept, no leaks."""

import copy
import gc
import random
import weakref

import pytest
import torch
from torch import nn

import memfit
from _models import ARCHS, SIZES, TEXT_SIZES, assert_grads_equal, build, logical_peak
from memfit.engine.plan.model import Curve
from memfit.engine.parts.store import Candidate, RecomputeMismatchError, choose_evictions

C = Candidate  # (index, bytes, cost_ms, last_use)

POLICY_CASES = [
    # (candidates, need_bytes, now, expected), the score is cost_ms / (bytes * (now - last_use))
    ([C(0, 100, 1.0, 0)], 0, 1, []),  # nothing needed
    ([C(0, 100, 1.0, 0)], -5, 1, []),
    ([], 10, 1, []),
    ([C(0, 100, 4.0, 0), C(1, 400, 4.0, 0)], 100, 1, [1]),  # cheapest per byte first
    ([C(0, 100, 1.0, 0), C(1, 100, 3.0, 0)], 150, 1, [0, 1]),  # until enough is freed
    ([C(0, 100, 1.0, 2), C(1, 100, 1.0, 0)], 50, 3, [1]),  # staler first at equal cost per byte
    ([C(0, 100, 2.0, 0), C(1, 100, 1.0, 3)], 50, 4, [0]),  # staleness outweighs twice the cost
    ([C(0, 200, 1.0, 2), C(1, 100, 1.0, 0)], 50, 4, [1]),  # equal scores: staler first
    ([C(5, 200, 2.0, 2), C(3, 100, 1.0, 2)], 50, 4, [3]),  # equal scores and ages: lower index
    ([C(0, 0, 0.0, 0), C(1, 50, 1.0, 1)], 10, 2, [1]),  # frees nothing: never chosen
    ([C(0, 100, 1.0, 0), C(1, 200, 1.0, 1), C(2, 0, 1.0, 0)], 1000, 2, [0, 1]),  # impossible: all that helps
]


@pytest.mark.parametrize("candidates, need_bytes, now, expected", POLICY_CASES)
def test_choose_evictions(candidates, need_bytes, now, expected):
    assert choose_evictions(candidates, need_bytes, now) == expected


def test_choose_evictions_rejects_future_use():
    with pytest.raises(ValueError, match="last_use must be before now=1"):
        choose_evictions([C(0, 100, 1.0, 1)], 10, 1)


def _step_counting_recomputes(ctl, model, batch, seed):
    """One training step; returns how many times each block re-ran in its backward."""
    before = [b.recomputes for b in ctl.blocks]
    torch.manual_seed(seed)
    model(**batch).loss.backward()
    return [b.recomputes - r for b, r in zip(ctl.blocks, before)]


@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_equal_no_checkpointing(arch):
    torch.manual_seed(0)
    model, make_batch = build(arch)
    model.train()
    reference = copy.deepcopy(model)
    batches = [make_batch(3, s) for s in SIZES.get(arch, TEXT_SIZES)]
    largest = max(batches, key=lambda b: next(iter(b.values())).numel())
    budget = (logical_peak(model, largest, "none") + logical_peak(model, largest, "full")) // 2
    ctl = memfit.fit(model, budget=budget, method="reactive")
    for step, batch in enumerate(batches):
        recomputes = _step_counting_recomputes(ctl, model, batch, seed=1000 + step)
        torch.manual_seed(1000 + step)
        reference(**batch).loss.backward()
        assert_grads_equal(model, reference, f"{arch} step {step}")
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        evicted = ctl.records[-1].evicted_blocks
        assert recomputes == [evicted.count(b.index) for b in ctl.blocks], (step, evicted)
    assert any(r.evicted_blocks for r in ctl.records), "budget never bound: the test checks nothing"
    ctl.remove()


@pytest.mark.parametrize("slack_share", [0, 0.2])
def test_stream_within_logical_budget(slack_share):
    """Counted bytes stay within the budget, less the allocator slack (NOTE [Allocator slack])."""
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    rng = random.Random(0)
    batches = [make_batch(4, rng.randint(4, 96)) for _ in range(24)]
    longest = make_batch(4, 96)
    none_peak = logical_peak(model, longest, "none")
    budget = (none_peak + logical_peak(model, longest, "full")) // 2
    # Eviction acts between blocks: the margin covers the head and loss after the last block
    # (NOTE [Reactive room]).
    ctl = memfit.fit(model, budget=budget, method="reactive", margin=0.05)
    ctl.planning.slack_bytes = slack = int(slack_share * budget)
    for i, batch in enumerate(batches):
        recomputes = _step_counting_recomputes(ctl, model, batch, seed=i)
        model.zero_grad(set_to_none=True)
        record = ctl.records[-1]
        assert record.accounting == "logical" and record.plan == []
        assert record.peak_allocated_bytes <= budget - slack, record
        assert record.peak_allocated_bytes >= record.static_bytes + record.saved_activation_bytes
        assert recomputes == [record.evicted_blocks.count(b) for b in range(record.n_blocks)], record
    records = ctl.records
    ctl.remove()
    assert none_peak > budget
    assert any(r.evicted_blocks for r in records) and any(not r.evicted_blocks for r in records)
    assert all(r.recompute_ms_est > 0 for r in records if r.evicted_blocks)


def _tanh_net(saved, passed, on_first_output=None):
    """Three blocks; weak references to the storage each block run saves (tanh's output) go to
    ``saved`` and to each block's output to ``passed``. Storages keep their Python object while
    any tensor uses them, so these references die exactly when the memory is released."""

    class Tanh(nn.Module):
        def forward(self, x):
            y = torch.tanh(x)  # tanh saves its own output: the cycle case
            out = y * 2
            saved.append(weakref.ref(y.untyped_storage()))
            passed.append(weakref.ref(out.untyped_storage()))
            return out

    net = nn.Sequential(nn.ModuleList([Tanh() for _ in range(3)]))

    def forward(x):
        for i, layer in enumerate(net[0]):
            x = layer(x)
            if i == 0 and on_first_output is not None:
                x.register_hook(on_first_output)
        return x.sum()

    net.forward = forward
    return net


def _alive(refs):
    return [r() is not None for r in refs]


@pytest.mark.parametrize("budget", [None, 1])  # kept, or every block evicted at once
def test_forward_without_backward_frees_its_graph(budget):
    saved, passed = [], []
    net = _tanh_net(saved, passed)
    ctl = memfit.fit(net, budget=budget, method="reactive", blocks=r"0\.\d+")
    out = net(torch.randn(4, 8, requires_grad=True))
    gc.collect()
    evicted = budget is not None
    assert ctl.records[-1].evicted_blocks == ([0, 1, 2] if evicted else [])
    assert _alive(saved) == [not evicted] * 3, "eviction did not release the saved tensors"
    assert _alive(passed) == [True, True, False]  # inputs of blocks 1 and 2, kept for a recompute
    del out
    gc.collect()
    assert not any(_alive(saved + passed)), "saved activations or kept inputs outlived their graph"
    ctl.remove()


@pytest.mark.parametrize("budget", [None, 1])
def test_backward_recomputes_lazily_and_releases_as_it_goes(budget):
    seen = []
    saved, passed = [], []
    net = _tanh_net(saved, passed, on_first_output=lambda grad: seen.append((_alive(saved), recomputes())))
    ctl = memfit.fit(net, budget=budget, method="reactive", blocks=r"0\.\d+")

    def recomputes():
        return [b.recomputes for b in ctl.blocks]

    net(torch.randn(4, 8, requires_grad=True)).backward()
    # When the gradient reaches block 0's output, blocks 2 and 1 are done: what they saved is
    # released, and when evicted they were recomputed first; block 0 is not recomputed yet.
    evicted = budget is not None
    assert seen == [([not evicted, False, False], [0, int(evicted), int(evicted)])]
    assert recomputes() == [int(evicted)] * 3
    ctl.remove()


def test_recompute_that_saves_differently_raises():
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            y = torch.tanh(x) if self.calls > 1 else torch.tanh(torch.tanh(x))  # saves 2, then 1
            return y * 2

    net = nn.Sequential(nn.ModuleList([Flaky(), Flaky()]))
    net.forward = lambda x: net[0][1](net[0][0](x)).sum()
    ctl = memfit.fit(net, budget=1, method="reactive", blocks=r"0\.\d+")
    loss = net(torch.randn(3, requires_grad=True))
    assert ctl.records[-1].evicted_blocks == [0, 1]
    with pytest.raises(RecomputeMismatchError, match=r"block 0\.1 saved 2 tensors in forward but 1 when recomputed"):
        loss.backward()
    ctl.remove()


def test_oom_grows_margin_instead_of_failing():
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    ctl = memfit.fit(model, budget="1GiB", method="reactive")
    before = ctl.planning.margin_bytes
    model(**make_batch(2, 8))
    ctl.note_oom()
    assert ctl.planning.margin_bytes == before + 2**30 // 20
    ctl.remove()


def _under_predict_blocks(ctl, factor):
    """Make the memory model believe blocks save ``factor`` of what they do: a wrong prediction."""
    for group in ctl.planning.model.group_models.values():
        data = group.bytes["keep"].to_dict()
        group.bytes["keep"] = Curve.from_dict({**data, "ys": [y * factor for y in data["ys"]]})
    ctl.planning.cache.clear()


@pytest.mark.parametrize("backstop", [True, False])
def test_dynamic_backstop_survives_a_wrong_prediction(backstop):
    """NOTE [Backstop]: evictions keep the step within budget, gradients stay exact, the model refits."""
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    reference = copy.deepcopy(model)
    longest = make_batch(4, 96)
    budget = (logical_peak(model, longest, "none") + logical_peak(model, longest, "full")) // 2
    ctl = memfit.fit(model, budget=budget, method="dynamic", margin=0.05, backstop=backstop)
    batches = [make_batch(4, t) for t in (40, 60, 80)] + [longest, longest]
    for step, batch in enumerate(batches):
        if step == 3:
            _under_predict_blocks(ctl, 0.2)
        recomputes = _step_counting_recomputes(ctl, model, batch, seed=step)
        torch.manual_seed(step)
        reference(**batch).loss.backward()
        assert_grads_equal(model, reference, f"backstop={backstop} step {step}")
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        record = ctl.records[-1]
        assert recomputes == [
            (b in record.plan) + record.evicted_blocks.count(b) for b in range(record.n_blocks)
        ], record
    wrong, refit = ctl.records[3], ctl.records[4]
    ctl.remove()
    if backstop:
        assert wrong.evicted_blocks, wrong
        assert wrong.peak_allocated_bytes <= budget, wrong
    else:
        assert not wrong.evicted_blocks
        assert wrong.peak_allocated_bytes > budget, wrong  # what the backstop prevents
    # the wrong step taught the model what the blocks save: the next plan fits without evicting
    assert not refit.evicted_blocks and refit.peak_allocated_bytes <= budget, refit
    assert len(refit.plan) > len(wrong.plan)


def _arming(lengths):
    """``dynamic`` on a tiny BERT over ``lengths`` (batch 4) at a budget half-way between the
    96-token step's peaks under ``none`` and ``full``: per steady step, whether each
    un-checkpointed block ran under the backstop's store; the records; the budget."""
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    longest = make_batch(4, 96)
    budget = (logical_peak(model, longest, "none") + logical_peak(model, longest, "full")) // 2
    ctl = memfit.fit(model, budget=budget, method="dynamic", margin=0.05)
    armed = []
    for step, length in enumerate(lengths):
        torch.manual_seed(step)
        loss = model(**make_batch(4, length)).loss
        if not ctl._step.decision.warmup:
            armed.append([b.treatment is ctl.protection.stored for b in ctl.blocks if b.index not in ctl._step.decision.plan.blocks])
        loss.backward()
        model.zero_grad(set_to_none=True)
    records = ctl.records
    ctl.remove()
    return armed, records, budget


def test_backstop_is_armed_only_for_steps_that_could_need_it():
    """NOTE [Backstop]: a step well inside the shapes seen and far below the budget runs its
    un-checkpointed blocks plainly; a step longer than any so far runs them under the store."""
    (short, long_, short_again), records, budget = _arming((40, 60, 80, 24, 96, 24))
    assert short and not any(short), records[3]  # 24 tokens: far below the budget, seen range
    assert long_ and all(long_), records[4]  # 96 tokens: never seen, the model extrapolates
    assert not any(short_again)
    assert all(r.peak_allocated_bytes <= budget for r in records)


class _Mlp(nn.Module):
    """A residual MLP block that saves about ``width`` floats per token."""

    def __init__(self, dim: int, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, width), nn.Linear(width, dim)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class _Pyramid(nn.Module):
    """One wide block, then narrow ones: a Swin detector's stage 1 over its later blocks."""

    def __init__(self, dim: int = 16, widths: tuple[int, ...] = (512,) + (16,) * 7):
        super().__init__()
        self.blocks = nn.ModuleList(_Mlp(dim, w) for w in widths)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def test_backstop_reserves_room_for_the_blocks_still_to_run():
    """NOTE [Backstop]: before a late, small block the backstop keeps room for that block, not
    for the largest block of the stack, which ran long before. A plan that fits runs as planned:
    an H200 Swin-S detector evicted in 26 of 56 steps whose peaks were 0.5-0.9 GB under the
    cap, because each detector layer's entry reserved a stage-1 Swin layer's bytes."""
    torch.manual_seed(0)
    model = _Pyramid()
    model.train()
    x = lambda length: torch.randn(4, length, 16)  # noqa: E731
    static = sum(p.numel() * p.element_size() for p in model.parameters()) * 2  # + gradients
    ctl = memfit.fit(model, budget=None, method="none", blocks=r"blocks\.\d+")
    model(x(64)).backward()
    plain = ctl.records[-1].peak_allocated_bytes - static  # what the longest step saves
    ctl.remove()
    model.zero_grad(set_to_none=True)
    wide = 4 * 64 * (16 + 512) * 4  # what block 0 saves: its input and tanh's output
    # room for every block un-checkpointed, not for block 0 again on top of the others; near
    # enough to the budget that the backstop is armed
    budget = static + plain + wide // 2
    ctl = memfit.fit(model, budget=budget, method="dynamic", blocks=r"blocks\.\d+")
    for length in (32, 48, 64, 64):
        model(x(length)).backward()
        model.zero_grad(set_to_none=True)
    steady = ctl.records[-1]
    ctl.remove()
    assert steady.phase == "steady" and steady.plan == [], steady
    assert steady.predicted_peak_bytes <= budget and steady.peak_allocated_bytes <= budget, steady
    assert steady.evicted_blocks == [], steady


def test_a_plan_that_held_on_its_shape_runs_again_without_the_backstop():
    """NOTE [Backstop]: a plan near the budget is armed the first time it runs a shape; once it
    ran that shape under the backstop's threshold, the same plan on the same shape runs plainly."""
    (first, again, third), records, budget = _arming((40, 60, 80, 88, 88, 88))
    assert records[3].plan == records[4].plan == records[5].plan and records[3].plan, records[3:]
    assert first and all(first), records[3]  # never seen: the model extrapolates
    assert again and not any(again), records[4]  # the same plan held on this shape
    assert not any(third)
    assert [r.backstop_armed for r in records] == [False, False, False, True, False, False]  # warm-up: never
    assert all(r.peak_allocated_bytes <= budget and not r.evicted_blocks for r in records)


@pytest.mark.parametrize("backstop", ["auto", True])
def test_the_backstop_arms_only_where_no_caller_replays_an_oom(backstop):
    """NOTE [Protection by expected cost]: under ``run_step`` (which replays an OOM) the default
    backstop never arms; the same steps called directly arm it, as ``backstop=True`` does everywhere."""
    armed = {}
    for via_run_step in (False, True):
        torch.manual_seed(0)
        model, make_batch = build("bert")
        model.train()
        longest = make_batch(4, 96)
        budget = (logical_peak(model, longest, "none") + logical_peak(model, longest, "full")) // 2
        ctl = memfit.fit(model, budget=budget, method="dynamic", margin=0.05, backstop=backstop)
        for step, length in enumerate([16, 48, 32, 64, 80, 96, 24, 88]):

            def micro_step(length=length, step=step):
                torch.manual_seed(step)
                model(**make_batch(4, length)).loss.backward()

            ctl.run_step(micro_step) if via_run_step else micro_step()
            model.zero_grad(set_to_none=True)
        armed[via_run_step] = [r.backstop_armed for r in ctl.records if r.phase == "steady"]
        assert ctl.summary().armed_steps == sum(armed[via_run_step])
        ctl.remove()
    assert any(armed[False]), "the plain loop never armed: the test checks nothing"
    assert armed[True] == (armed[False] if backstop is True else [False] * len(armed[False]))


def test_block_peaks_predict_the_largest_at_least_as_long_then_scale():
    """NOTE [Room inside a block]: a block's peak at a length is the largest seen at any
    length at least as long; beyond the longest, scaled by the power its last two samples show
    (clamped to 1..2), 2 from one sample."""
    from memfit.engine.run.protection import BlockPeaks, requested_bytes

    peaks = BlockPeaks()
    assert peaks.predict(0, 100) == 0
    peaks.add(0, 100, 1000)
    assert peaks.predict(0, 50) == 1000 and peaks.predict(0, 200) == 4000  # one sample: quadratic
    peaks.add(0, 200, 2000)  # linear growth seen
    assert peaks.predict(0, 150) == 2000 and peaks.predict(0, 400) == 4000
    peaks.add(0, 100, 1500)  # a larger value at a length keeps the larger
    assert peaks.predict(0, 100) == 2000 and peaks.predict(1, 100) == 0
    assert requested_bytes("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has") == int(1.5 * 2**30)
    assert requested_bytes("out of memory") is None


def _reactive_on_fake_allocator(monkeypatch, budget):
    """A BERT under ``reactive`` (no margin) whose memory is read from a fake allocator."""
    from test_runtime import _on_fake_allocator

    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memfit.fit(model, budget=budget, method="reactive", margin=0.0)
    return model, make_batch, inner, ctl, _on_fake_allocator(monkeypatch, ctl, inner, margin=0)


def _two_steps(model, make_batch, inner, ctl):
    """Two steps of one 2×8 batch in a plain loop; the run's records, the controller removed."""
    batch = make_batch(2, 8)
    for seed in range(2):
        torch.manual_seed(seed)
        model(**batch).loss.backward()
        inner.step()
        model.zero_grad(set_to_none=True)
    records = ctl.records
    ctl.remove()
    return records


def test_reactive_keeps_a_blocks_own_peak_free_at_its_entry(monkeypatch):
    """On the (fake) allocator, a block that allocates far more inside it than it saves is
    learnt on its first run; at the next step of that shape its entry keeps that much free,
    which evicts blocks where the first step, not knowing, evicted none."""
    model, make_batch, inner, ctl, fake = _reactive_on_fake_allocator(monkeypatch, 10**6)
    ctl.blocks[2].module.attention.register_forward_pre_hook(lambda *_: fake.use(2 * 10**6))  # inside block 2
    records = _two_steps(model, make_batch, inner, ctl)
    assert records[0].evicted_blocks == []
    assert records[1].evicted_blocks, "the learnt peak of block 2 made no room"
    assert ctl.protection.peaks.predict(2, 16) >= 2 * 10**6 - 10**4


def test_a_reactive_replay_never_repeats_the_failed_plan():
    """NOTE [A reactive replay differs]: an OOM inside a block under ``reactive`` (run_step)
    is replayed with the first blocks recomputed, a plan the failed attempt did not run; the
    shape's later steps keep it; the weights are those of a run without the OOM."""
    from _models import InjectOOM

    def train(inject):
        torch.manual_seed(0)
        model, make_batch = build("bert")
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ctl = memfit.fit(model, budget=None, method="reactive", optimizer=optimizer)
        if inject:
            InjectOOM(ctl.blocks[1].module, at=2)
        for step in range(4):
            def micro(step=step):
                torch.manual_seed(step)
                model(**make_batch(2, 16)).loss.backward()
            ctl.run_step(micro)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        records = ctl.records
        ctl.remove()
        return records, {k: v.clone() for k, v in model.state_dict().items()}

    plain, reference = train(False)
    records, weights = train(True)
    assert [r.plan for r in plain] == [[]] * 4
    assert records[1].oom_retries == 1 and records[1].oom_attempts[0]["plan"] == []
    assert records[1].plan == [0] and records[2].plan == [0] == records[3].plan
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0)


def test_an_oom_inside_a_block_teaches_its_peak(monkeypatch):
    """NOTE [Room inside a block]: the allocation that failed inside a block (allocated then,
    plus the request the message names, less the block's entry) becomes its learnt peak."""
    model, make_batch, inner, ctl, fake = _reactive_on_fake_allocator(monkeypatch, 10**9)
    fired = []

    def fail_once(*_):
        if not fired:
            fired.append(1)
            fake.allocated += 5000  # what the block allocated before the request that failed
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 MiB. GPU 0 has a total capacity")

    ctl.blocks[2].module.attention.register_forward_pre_hook(fail_once)
    batch = make_batch(2, 8)

    def micro():
        model(**batch).loss.backward()

    ctl.run_step(micro)
    ctl.remove()
    assert fired and ctl.protection.peaks.predict(2, 16) == 5000 + 3 * 2**20


def test_reactive_keeps_the_heads_peak_free_at_the_last_block(monkeypatch):
    """NOTE [Room inside a block]: what runs after the last block (head, logits, loss) is read as
    a window too: the first step learns it at its forward's end (and makes room for the
    backward then); the next step's last block keeps it free, so blocks are evicted before the
    head runs, where the first step evicted none."""
    model, make_batch, inner, ctl, fake = _reactive_on_fake_allocator(monkeypatch, 10**6)
    evicted_before_head = []

    def head(*_):
        evicted_before_head.append(list(ctl.protection.store.evicted_blocks))
        fake.use(2 * 10**6)  # the head's logits

    model.classifier.register_forward_pre_hook(head)
    batch = make_batch(2, 8)
    for seed in range(2):
        torch.manual_seed(seed)
        model(**batch).loss.backward()
        inner.step()
        model.zero_grad(set_to_none=True)
    ctl.remove()
    assert evicted_before_head[0] == [] and evicted_before_head[1], evicted_before_head
    assert ctl.protection.peaks.predict(memfit.engine.run.protection.BlockPeaks.TAIL, 16) >= 2 * 10**6 - 10**4


def test_the_cuda_meter_reads_the_allocator_once_per_reading(monkeypatch):
    """NOTE [Cheap allocator reads]: a reactive step on the (fake) allocator reads its counters
    through the one nested read, never the public per-value calls that flatten the whole
    statistics dict, and at most four times per block (entry room, window start, window peak
    and the step's own readings)."""
    model, make_batch, inner, ctl, fake = _reactive_on_fake_allocator(monkeypatch, 10**9)
    reads = []
    nested = fake.stats
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda device=None: reads.append(1) or nested(device), raising=False)

    def public(*_args, **_kwargs):
        raise AssertionError("a public torch.cuda reader was called")

    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, public)
    records = _two_steps(model, make_batch, inner, ctl)
    assert len(records) == 2 and reads
    assert len(reads) <= 2 * (4 * len(ctl.blocks) + 8), len(reads)


def test_allocator_retries_grow_the_room_reactive_keeps_free(monkeypatch):
    """NOTE [Room] (planning.py): under ``reactive`` a step the allocator served only by releasing
    its cache grows the slack by RETRY_SLACK_SHARE of the budget, and the next step's block
    entries keep it free: that step evicts blocks where the steps before evicted none."""
    import memfit.engine.plan.room

    budget = 10**6
    # a CPU's step times cannot price a retry: each is taken to cost more than any growth (NOTE [The slack is priced])
    monkeypatch.setattr(memfit.engine.plan.room.StepTimes, "retry_ms", lambda self, bucket, net_ms: float("inf"))
    model, make_batch, inner, ctl, fake = _reactive_on_fake_allocator(monkeypatch, budget)
    assert ctl.planning.slack_bytes == 0
    fake.allocated = fake.peak = budget - 40_000  # room for a block's bytes, not for the growth
    batch = make_batch(2, 8)
    slacks = []
    for seed in range(4):
        torch.manual_seed(seed)
        model(**batch).loss.backward()
        fake.retries += int(seed == 1)
        inner.step()
        model.zero_grad(set_to_none=True)
        slacks.append(ctl.planning.slack_bytes)  # a step is learnt when the next one starts
    torch.manual_seed(4)
    model(**batch).loss.backward()
    records = ctl.records
    ctl.remove()
    assert [r.alloc_retries for r in records[:4]] == [0, 1, 0, 0]
    # priced with the step after it (its aftermath: NOTE [The slack is priced]), learnt as the next one starts
    grown = int(memfit.engine.plan.room.RETRY_SLACK_SHARE * budget)
    assert slacks == [0, 0, 0, grown] and ctl.planning.slack_bytes == grown
    assert records[0].evicted_blocks == [] == records[1].evicted_blocks == records[2].evicted_blocks
    assert records[3].evicted_blocks, "the grown slack made no room"
