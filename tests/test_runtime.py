"""The controller under a logical (CPU) budget: plans, records, recomputes, errors."""

import contextlib
import json
import logging
import random
import types

import pytest
import torch
from torch import nn

import memfit
from _models import build, logical_peak
from memfit.engine.methods import save_plans
from memfit.engine.plan.planner import Plan
from memfit.engine.parts.probe import TIMED_RUNS


def _bert():
    torch.manual_seed(0)
    model, make_batch = build("bert")
    model.train()
    return model, make_batch


def _step(model, batch, seed=0):
    torch.manual_seed(seed)
    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)


def _counted_bytes_with_first_k(model, batch, k, tmp_path):
    """Logical peak of one step with blocks 0..k-1 checkpointed, via a plans file."""
    key = (batch["input_ids"].shape[0], batch["input_ids"].shape[1])
    path = tmp_path / f"plan_{k}.json"
    n_blocks = len(memfit.engine.parts.blocks.find_blocks(model))
    save_plans(path, n_blocks, {key: Plan(tuple(range(k)))})
    ctl = memfit.fit(model, budget=None, method="precomputed", path=path)
    _step(model, batch)
    peak = ctl.records[-1].peak_allocated_bytes
    assert ctl.records[-1].n_checkpointed == k
    ctl.remove()
    return peak


@pytest.mark.parametrize("backstop", [False, True])
def test_stream_within_budget_with_fewest_blocks(tmp_path, backstop):
    model, make_batch = _bert()
    rng = random.Random(0)
    lengths = [rng.randint(4, 96) for _ in range(24)]
    n = 4
    full_peak = _counted_bytes_with_first_k(model, make_batch(n, 96), 3, tmp_path)
    none_peak = _counted_bytes_with_first_k(model, make_batch(n, 96), 0, tmp_path)
    budget = (full_peak + none_peak) // 2
    ctl = memfit.fit(
        model, budget=budget, method="dynamic", bucket_tokens=1, log=tmp_path / "steps.jsonl", backstop=backstop
    )
    batches = [make_batch(n, length) for length in lengths]
    for i, batch in enumerate(batches):
        _step(model, batch, seed=i)
    records = ctl.records
    ctl.remove()
    margin = ctl.planning.margin_bytes
    checked = 0
    for record, batch in zip(records, batches):
        assert record.accounting == "logical"
        assert record.peak_allocated_bytes <= budget, record
        if record.phase != "steady" or backstop:
            # The backstop's store keeps each un-checkpointed block's inputs for a recompute
            # (NOTE [Backstop]): the attention mask, which no block saves, lives on: the
            # counts differ from a plain run of the same plan.
            assert not record.evicted_blocks, record
            continue
        counted = [_counted_bytes_with_first_k(model, batch, k, tmp_path) for k in range(record.n_blocks + 1)]
        fewest = next(k for k, b in enumerate(counted) if b <= budget - margin)
        assert record.n_checkpointed == fewest, (record.shape, counted, budget)
        assert record.peak_allocated_bytes == counted[record.n_checkpointed]
        checked += 1
    assert checked >= 10 or backstop
    assert {r.n_checkpointed for r in records if r.phase == "steady"} >= {0, 1}, "budget never bound"
    lines = [json.loads(line) for line in open(tmp_path / "steps.jsonl")]
    assert [line["step"] for line in lines] == [r.step for r in records]
    for field in ("shape", "tokens", "plan", "predicted_peak_bytes", "peak_reserved_bytes", "step_ms", "recompute_ms_est", "oom_retries", "phase", "schema_version"):
        assert field in lines[-1]


def test_recompute_counts_follow_plan(tmp_path):
    model, make_batch = _bert()
    batch = make_batch(2, 16)
    save_plans(tmp_path / "p.json", 3, {(2, 16): Plan((0, 2))})
    ctl = memfit.fit(model, budget=None, method="precomputed", path=tmp_path / "p.json")
    _step(model, batch)
    assert [b.recomputes for b in ctl.blocks] == [1, 0, 1]
    assert [b.forwards for b in ctl.blocks] == [1, 1, 1]
    ctl.remove()


def test_saved_bytes_shrink_with_checkpointing(tmp_path):
    model, make_batch = _bert()
    batch = make_batch(4, 64)
    peaks = [_counted_bytes_with_first_k(model, batch, k, tmp_path) for k in range(4)]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[3]


def test_eval_and_no_grad_untouched():
    model, make_batch = _bert()
    batch = make_batch(2, 16)
    ctl = memfit.fit(model, budget=None, method="full")
    model.eval()
    with torch.no_grad():
        model(**batch)
    model.train()
    with torch.no_grad():
        model(**batch)
    assert ctl.records == []
    assert all(b.runs == 0 and b.forwards == 0 for b in ctl.blocks)
    ctl.remove()


def test_remove_restores_model():
    model, make_batch = _bert()
    batch = make_batch(2, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forwards = {n: type(m).forward for n, m in model.named_modules()}
    ctl = memfit.fit(model, budget=None, method="full")
    _step(model, batch)
    ctl.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert {n: type(m).forward for n, m in model.named_modules()} == forwards
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    model.eval()
    torch.manual_seed(0)
    out1 = model(**batch).logits
    torch.manual_seed(0)
    out2 = model(**batch).logits
    torch.testing.assert_close(out1, out2)


def test_precomputed_roundtrip_and_fallback(tmp_path):
    model, make_batch = _bert()
    budget = None
    ctl = memfit.fit(model, budget=budget, method="full")
    ctl.remove()
    save_plans(tmp_path / "p.json", 3, {(2, 16): Plan((0,)), (2, 32): Plan((0, 1))})
    ctl = memfit.fit(model, budget=None, method="precomputed", path=tmp_path / "p.json")
    for length in (16, 24, 32, 48):
        _step(model, make_batch(2, length))
    assert [r.plan for r in ctl.records] == [[0], [0, 1], [0, 1], [0, 1, 2]]
    ctl.remove()


def test_dynamic_plans_save_for_precomputed(tmp_path):
    model, make_batch = _bert()
    ctl = memfit.fit(model, budget=10**9, method="dynamic", warmup_steps=2, warmup_keys=2)
    for length in (8, 16, 24, 16):
        _step(model, make_batch(2, length))
    ctl.save_plans(tmp_path / "plans.json")
    ctl.remove()
    data = json.loads((tmp_path / "plans.json").read_text())
    assert data["n_blocks"] == 3 and {tuple(p["key"]) for p in data["plans"]} == {(2, 16), (2, 24)}


def test_budget_below_static_need():
    model, _ = _bert()
    opt = torch.optim.AdamW(model.parameters())
    params = sum(p.numel() * 4 for p in model.parameters())
    from memfit.engine.parts.optim_state import torch_step_transient_bytes

    transient = torch_step_transient_bytes(opt)  # the step's temporaries are part of the need
    with pytest.raises(memfit.BudgetTooSmallError, match=f"{4 * params + transient} bytes: parameters"):
        memfit.fit(model, budget=3 * params, method="dynamic", optimizer=opt)
    assert all("forward" not in m.__dict__ for m in model.modules()), "nothing half-installed"


def test_unknown_method():
    model, _ = _bert()
    with pytest.raises(memfit.UnknownMethodError, match="choose one of none, full, dynamic, static, precomputed"):
        memfit.fit(model, budget="1GiB", method="sometimes")


def test_no_blocks_lists_candidates():
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.ReLU()]))
    with pytest.raises(memfit.NoBlocksError, match=r"module lists seen: 1: Linear×1, ReLU×1"):
        memfit.fit(model, budget=None, method="full")


def test_blocks_by_pattern_on_plain_module():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.GELU()) for _ in range(4)])

        def forward(self, x):
            for layer in self.stack:
                x = layer(x)
            return x.sum()

    torch.manual_seed(0)
    net = Net()
    ctl = memfit.fit(net, budget=None, method="full", blocks=r"stack\.\d+")
    assert [b.name for b in ctl.blocks] == ["stack.0", "stack.1", "stack.2", "stack.3"]
    x = torch.randn(5, 3, 8)
    net(x).backward()
    assert [b.recomputes for b in ctl.blocks] == [1, 1, 1, 1]
    ctl.remove()
    with pytest.raises(memfit.NoBlocksError, match="matched no module"):
        memfit.fit(net, budget=None, method="full", blocks=r"nothing\.\d+")


def test_hf_gradient_checkpointing_conflict():
    model, _ = _bert()
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        memfit.fit(model, budget=None, method="dynamic")


@pytest.mark.parametrize("method", ["none", "dynamic"])  # the live counter; the warm-up probe
def test_forward_without_backward_frees_its_graph(method):
    """A forward that never runs backward (an OOM, the warm-up probe) must not leak."""
    import gc
    import weakref

    made = []

    class Tanh(nn.Module):
        def forward(self, x):
            y = torch.tanh(x)  # tanh saves its own output: the cycle case
            made.append(weakref.ref(y))
            return y * 2

    net = nn.Sequential(nn.ModuleList([Tanh() for _ in range(3)]))

    def forward(x):
        for layer in net[0]:
            x = layer(x)
        return x.sum()

    net.forward = forward
    ctl = memfit.fit(net, budget=None, method=method, blocks=r"0\.\d+")
    x = torch.randn(4, 8, requires_grad=True)
    net.train()
    out = net(x)
    # `dynamic` warm-up also probes every block: the group's first TIMED_RUNS times (NOTE
    # [Cold runs of a block]), the others once (NOTE [Blocks alike only in name])
    assert len(made) == (3 if method == "none" else 3 + TIMED_RUNS + 1 + 1)
    del out
    gc.collect()
    assert all(r() is None for r in made), "saved activations outlived their graph"
    ctl.remove()


class _FakeAllocator:
    """Host-side allocator counters as torch.cuda exposes them, driven by the test."""

    def __init__(self):
        self.allocated = 1000
        self.peak = 1000
        self.reserved = None  # what the allocator holds beyond the peak, when the test says
        self.retries = 0  # allocations served only after releasing the cache (num_alloc_retries)
        #: the allocator's snapshot of segments: (stream, total, allocated) on device 0; the current stream is 0
        self.segments: list[tuple[int, int, int]] = []
        self.snapshots = 0

    def use(self, nbytes):
        self.peak = max(self.peak, self.allocated + nbytes)

    def reset(self, device=None):
        self.peak = self.allocated

    def patch(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: max(self.peak, self.reserved or 0))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        # the meter's one-read path (NOTE [Cheap allocator reads]) where torch has it
        monkeypatch.setattr(torch._C, "_cuda_memoryStats", self.stats, raising=False)
        monkeypatch.setattr(torch.cuda, "memory_snapshot", self.snapshot)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))

    def snapshot(self):
        self.snapshots += 1
        return [{"device": 0, "stream": stream, "total_size": total, "allocated_size": allocated}
                for stream, total, allocated in self.segments]

    def stats(self, device=None):
        reserved = max(self.peak, self.reserved or 0)
        return {"allocated_bytes": {"all": {"current": self.allocated, "peak": self.peak}},
                "reserved_bytes": {"all": {"current": reserved, "peak": self.peak}},
                "num_alloc_retries": self.retries}


def _use_cuda_meter(ctl, counts_always=True):
    """Make ``ctl`` read memory through the CUDA meter (whose torch.cuda calls the test patches).

    ``counts_always``: every step counts its saved tensors, as the tests that drive a fake
    allocator from the counter's bytes need (a real allocator sees them whether counted or not).
    """
    from memfit.engine.run.meter import CudaMeter

    # the fake allocator's static memory is what it says: no gradient is missing
    ctl.meter = CudaMeter(torch.device("cpu"), [], 0)
    ctl.meter.counts_always = counts_always
    if hasattr(ctl.protection, "meter"):
        ctl.protection.meter = ctl.meter


def _on_fake_allocator(monkeypatch, ctl, optimizer, margin=None, counts_always=True):
    """Make ``ctl`` account as on CUDA against a :class:`_FakeAllocator` the test drives."""
    fake = _FakeAllocator()
    fake.patch(monkeypatch)
    _use_cuda_meter(ctl, counts_always)
    if margin is not None:
        ctl.planning.margin_bytes = margin
    ctl.set_optimizer(optimizer)
    return fake


def _half_budget_on_fake_allocator(monkeypatch, method="dynamic", **kwargs):
    """bert under half-way between ``none``'s and ``full``'s logical peak at 4×96, accounting
    on a :class:`_FakeAllocator` with a 3% margin: ``(model, make_batch, inner, budget, ctl, fake)``."""
    model, make_batch = _bert()
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    longest = make_batch(4, 96)
    budget = (logical_peak(model, longest, "none") + logical_peak(model, longest, "full")) // 2
    ctl = memfit.fit(model, budget=budget, method=method, **kwargs)
    fake = _on_fake_allocator(monkeypatch, ctl, inner, margin=int(0.03 * budget))
    return model, make_batch, inner, budget, ctl, fake


def test_work_aside_from_a_step_stays_out_of_its_peak(monkeypatch):
    """NOTE [Work aside from the step]: what runs in the CUDA meter's ``aside`` (warm-up's head probe)
    is not in the step's peak, which is the larger of the peaks before and after it."""
    from memfit.engine.run.meter import CudaMeter
    from memfit.engine.run.step import StepState

    fake = _FakeAllocator()
    fake.patch(monkeypatch)
    meter = CudaMeter(torch.device("cpu"), [], 0)

    def step_peak(aside: bool, after: int) -> int:
        step = StepState(t0=0.0, static_bytes=1000)
        meter.start_step(step)
        fake.use(500)  # the forward so far
        with meter.aside(step) if aside else contextlib.nullcontext():
            fake.use(10_000)  # the probe's kept head
        fake.use(after)
        return meter.peaks(step).peak

    assert step_peak(aside=False, after=200) == 11_000  # read as the step's without it
    assert step_peak(aside=True, after=200) == 1500  # the forward's, before it
    assert step_peak(aside=True, after=700) == 1700  # what came after, where higher


def test_backward_and_optimizer_peaks_are_read_apart(monkeypatch):
    """NOTE [Three peaks]: the optimizer step's peak is learned apart from the transient."""
    model, make_batch = _bert()
    inner = torch.optim.SGD(model.parameters(), lr=0.0)

    class Wrapped(torch.optim.Optimizer):  # as accelerate wraps the torch optimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer
            self.param_groups, self.state = optimizer.param_groups, optimizer.state

        def step(self, closure=None):
            return self.optimizer.step(closure)

    ctl = memfit.fit(model, budget=None, method="dynamic")  # three warm-up steps: every block checkpointed
    fake = _on_fake_allocator(monkeypatch, ctl, Wrapped(inner))
    inner.register_step_pre_hook(lambda *_: fake.use(700))  # runs after memfit's: the step's temporaries
    for seed in range(3):
        batch = make_batch(2, 16)
        loss = model(**batch).loss
        fake.use(300)  # the backward's peak
        loss.backward()
        inner.step()
        model.zero_grad(set_to_none=True)
    records = ctl.records
    ctl.remove()
    assert [r.peak_allocated_bytes for r in records] == [1700, 1700, 1700]  # the larger of the two
    assert ctl.planning.model.optimizer_bytes == 700
    # the transient came from the backward's peak alone (minus the counted saved tensors)
    full = ctl.planning.model.transient_full
    assert max(full.ys) <= 300
    assert not ctl._optimizer_handles


def _count_plans(monkeypatch, ctl, planned):
    """Append to ``planned`` one entry per plan made (a row or one key): a miss of the plan cache."""
    search, rows = ctl.planning.search, ctl.planning.rows
    original_plan, original_row = search.plan, rows._row
    monkeypatch.setattr(search, "plan", lambda k: planned.append(("plan", k)) or original_plan(k))
    monkeypatch.setattr(rows, "_row", lambda k: planned.append(("_row", k)) or original_row(k))


def test_plans_stay_cached_once_the_model_fits(monkeypatch):
    """A steady step that the model predicts within the margin changes nothing: plans stay cached."""
    model, make_batch = _bert()
    longest = make_batch(4, 96)
    budget = (
        logical_peak(model, longest, "none") + logical_peak(model, longest, "full")
    ) // 2
    ctl = memfit.fit(model, budget=budget, method="dynamic")
    planned = []  # one entry per plan made (a row or one key): a miss of the plan cache
    _count_plans(monkeypatch, ctl, planned)
    lengths = [24, 96, 48, 72, 88, 40]
    for rnd in range(6):
        for i, length in enumerate(lengths):
            _step(model, make_batch(4, length), seed=10 * rnd + i)
        # every shape has run as a steady step, and a bucket over-predicted twice had its
        # prediction corrected, which replans that bucket once (NOTE [Bias per bucket])
        if rnd == 3:
            seen = len(planned)
    records = ctl.records
    ctl.remove()
    assert seen >= 1
    assert len(planned) == seen, planned[seen:]  # rounds 5 and 6: cache hits only
    assert not any(r.planned for r in records[-2 * len(lengths):])  # and their records say so
    assert sum(r.planned for r in records) >= 1
    assert {r.n_checkpointed for r in records if r.phase == "steady"} != {0}, "budget never bound"
    assert all(r.peak_allocated_bytes <= budget for r in records)


def test_plans_stay_cached_under_a_noisy_allocator(monkeypatch):
    """The H200's pattern on CPU: peaks known to the model up to a few MB of allocator noise.

    Step peak = static + the counted saved bytes + a transient linear in tokens + noise
    below 0.3% of the budget (a tenth of the margin); the optimizer step adds a constant.
    Once every shape has run, such noise must not change the model (each change clears
    every cached plan: the 2026-11-22 H200 run replanned two steady steps in three).
    """
    model, make_batch, inner, budget, ctl, fake = _half_budget_on_fake_allocator(monkeypatch, backstop=False)
    inner.register_step_pre_hook(lambda *_: fake.use(budget // 50))
    planned = []
    _count_plans(monkeypatch, ctl, planned)
    rng = random.Random(0)
    lengths = [24, 96, 48, 72, 88, 40, 64, 80]
    for rnd in range(7):
        for i, length in enumerate(lengths):
            batch = make_batch(4, length)
            torch.manual_seed(10 * rnd + i)
            loss = model(**batch).loss
            saved = ctl._counter.total_bytes
            fake.use(saved + 40 * 4 * length - 2000 + rng.randint(0, int(0.003 * budget)))
            loss.backward()
            inner.step()
            model.zero_grad(set_to_none=True)
        # every shape has run as a steady step, the model has settled, and a bucket over-predicted
        # twice had its prediction corrected (NOTE [Bias per bucket]); noise never corrects one
        if rnd == 4:
            seen = len(planned)
    records = ctl.records
    ctl.remove()
    assert len(planned) == seen, planned[seen:]  # rounds 6 and 7: cache hits only
    steady = [r for r in records if r.phase == "steady"]
    assert {r.n_checkpointed for r in steady} != {0}, "budget never bound"
    assert all(r.peak_allocated_bytes <= budget for r in steady)


@pytest.mark.parametrize("workspace", [0, 50_000])
def test_first_steps_transient_and_margin(monkeypatch, workspace):
    """The optimizer state that the first step creates is not in its backward's transient,
    nor what else it allocates and keeps (``workspace``: cuBLAS's, 35.5 MB on an H200, left
    the full-regime curve that high for a whole run), and warm-up misses leave the margin
    alone (both cost the H200 run of 2026-11-22 a block)."""
    model, make_batch = _bert()
    inner = torch.optim.AdamW(model.parameters(), lr=0.0)
    longest = make_batch(4, 96)
    budget = (logical_peak(model, longest, "none") + logical_peak(model, longest, "full")) // 2
    ctl = memfit.fit(model, budget=budget, method="dynamic", backstop=False)
    margin = int(0.03 * budget)
    fake = _on_fake_allocator(monkeypatch, ctl, inner, margin=margin)
    state_bytes = ctl.meter.expected_optimizer_bytes
    assert state_bytes > 0

    created = []

    def create_state(*_):
        if not created:  # AdamW's first step allocates its state
            created.append(state_bytes)
            fake.allocated += state_bytes
            fake.use(0)

    inner.register_step_post_hook(create_state)

    def transient(length):
        return -300 + 40 * 4 * length

    for i, length in enumerate([96, 24, 60, 80, 40]):
        torch.manual_seed(i)
        loss = model(**make_batch(4, length)).loss
        if i == 0:
            fake.allocated += workspace  # made by the first step, kept by every later one
        fake.use(ctl._counter.total_bytes + transient(length))
        loss.backward()
        inner.step()
        model.zero_grad(set_to_none=True)
    records = ctl.records
    ctl.remove()
    full = ctl.planning.model.transient_full
    warm = [r for r in records if r.phase == "warmup"]
    assert len(warm) == 3 and len(full.xs) == 3
    for (n, t), y in zip(full.xs, full.ys):
        assert y == pytest.approx(transient(t), abs=64), (t, y)  # the first step's too
    assert ctl.planning.margin_bytes == margin


def test_the_partial_transient_learns_the_backwards_start_not_a_recompute(monkeypatch):
    """NOTE [Reading the backward's start]: bytes that only a recompute in backward holds
    (blocks left un-checkpointed under it: 1.5 GB on the H200 Swin-T detector) count in the
    step's peak but are not the partial plan's transient, which is read at the first recompute."""
    model, make_batch, inner, budget, ctl, fake = _half_budget_on_fake_allocator(monkeypatch, backstop=False)
    extra = budget // 20
    start = []  # this step's start of backward, above static
    for block in ctl.blocks:
        body = block.body

        def recompute_holds_more(*args, _body=body, **kwargs):
            if start:  # in backward, after the block's before_run: the recompute holds more
                fake.use(start[0] + extra)
            return _body(*args, **kwargs)

        block.body = recompute_holds_more

    def transient(length):
        return -300 + 40 * 4 * length

    for i, length in enumerate([96, 24, 60, 80, 40, 96, 72, 88, 56]):
        torch.manual_seed(i)
        loss = model(**make_batch(4, length)).loss
        start.append(ctl._counter.total_bytes + transient(length))
        fake.use(start[0])  # the backward's start
        loss.backward()
        start.clear()
        inner.step()
        model.zero_grad(set_to_none=True)
    records = ctl.records
    ctl.remove()
    partial = [r for r in records if r.phase == "steady" and 0 < r.n_checkpointed < r.n_blocks]
    assert partial, "no step ran a partial plan"
    for r in partial:  # the recompute's bytes are in the step's peak
        assert r.peak_allocated_bytes >= r.static_bytes + r.saved_activation_bytes + extra
    curve = ctl.planning.model.transient_partial
    assert curve.distinct_keys >= 2  # it learned ...
    assert max(curve.ys) <= transient(96)  # ... the starts alone, never a recompute's bytes


def test_a_blocks_first_run_at_a_size_is_not_its_recompute_cost(monkeypatch):
    """NOTE [Cold runs of a block]: a block's first run at each new size (kernel loading,
    library heuristics, allocator growth: 40-599 ms for 1.5-11 ms layers on the H200 Swin-B
    detector) does not price the block: the probe's faster run does."""
    import time as _time

    model, make_batch = _bert()
    ctl = memfit.fit(model, budget=None, method="dynamic")
    first_run_ms = 300.0
    ran = set()
    for block in ctl.blocks:
        body = block.body

        def slow_once(*args, _body=body, _group=type(block.module), **kwargs):
            size = (_group, tuple(args[0].shape))
            if size not in ran:  # the first run of this kind of block at this size
                ran.add(size)
                _time.sleep(first_run_ms / 1e3)
            return _body(*args, **kwargs)

        block.body = slow_once
    for i, length in enumerate([40, 24, 32]):  # the warm-up steps probe, each at a new size
        _step(model, make_batch(2, length), seed=i)
    costs = [c for g in ctl.planning.model.group_models.values() for c in g.ms["recompute"].ys]
    ctl.remove()
    assert len(costs) == 3
    assert max(costs) < first_run_ms / 2, costs


def test_the_probes_runs_are_not_the_steps_saved_tensors():
    """A warm-up step (every block checkpointed, each group probed twice) counts what `full`
    counts: the probes' saved tensors go to their own counters, not to the step's."""
    model, make_batch = _bert()
    batch = make_batch(2, 40)
    counted = {}
    for method in ("full", "dynamic"):
        ctl = memfit.fit(model, budget=None, method=method)
        _step(model, batch)
        record = ctl.records[-1]
        assert record.n_checkpointed == record.n_blocks
        counted[method] = (record.saved_activation_bytes, record.peak_allocated_bytes)
        ctl.remove()
    assert counted["dynamic"] == counted["full"]


def test_an_oom_in_a_recompute_is_described_in_the_replayed_record():
    """An OOM raised while backward recomputes a checkpointed block: the replayed step's
    record says it failed in backward, with the plan that ran and the allocator's message."""
    model, make_batch = _bert()
    longest = make_batch(4, 96)
    budget = (logical_peak(model, longest, "none") + logical_peak(model, longest, "full")) // 2
    ctl = memfit.fit(model, budget=budget, method="dynamic", warmup_steps=2, warmup_keys=2)
    for i, length in enumerate((40, 96)):
        _step(model, make_batch(4, length), seed=i)
    in_backward = {"on": False, "fired": 0}

    def fail_in_recompute(module, args):
        if in_backward["on"] and not in_backward["fired"]:
            in_backward["fired"] += 1
            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 MiB")

    # inside the block: its recompute runs the body, not the hooked module call
    handle = ctl.blocks[0].module.attention.register_forward_pre_hook(fail_in_recompute)
    batch = make_batch(4, 96)
    for attempt in range(2):
        torch.manual_seed(5)
        loss = model(**batch).loss
        in_backward["on"] = True
        try:
            loss.backward()
            failed = None
        except torch.OutOfMemoryError as exc:
            failed = str(exc)
        in_backward["on"] = False
        if failed is None:
            break
        del loss
        model.zero_grad(set_to_none=True)
        ctl.note_oom(failed)
    model.zero_grad(set_to_none=True)
    handle.remove()
    record = ctl.records[-1]
    ctl.remove()
    assert in_backward["fired"] == 1 and record.oom_retries == 1
    (described,) = record.oom_attempts
    assert described["stage"] == "backward"
    assert 0 in described["plan"] and described["phase"] == "steady"
    assert described["error"].startswith("injected: CUDA out of memory")
    assert described["shape"] == record.shape
    assert record.to_dict()["oom_attempts"] == [described]


def test_allocator_retries_in_steady_steps_grow_the_slack_and_the_plans(monkeypatch):
    """NOTE [Room]: a steady step the allocator served only by releasing its cache grows the
    slack by RETRY_SLACK_SHARE of the budget, up to MAX_RETRY_SLACK_SHARE, and the plans are
    redone with it; a warm-up step's retries and a step without any leave the slack alone."""
    import memfit.engine.plan.room
    from memfit.engine.plan.planner import Plan

    # this small model's plans lie further apart than the ceiling: a higher one here
    monkeypatch.setattr(memfit.engine.plan.room, "MAX_RETRY_SLACK_SHARE", 1 / 3)
    # a CPU's step times cannot price a retry: each is taken to cost more than any growth (NOTE
    # [The slack is priced]; the priced rule is tested in test_room.py)
    monkeypatch.setattr(memfit.engine.plan.room.StepTimes, "retry_ms", lambda self, bucket, net_ms: float("inf"))
    model, make_batch, inner, budget, ctl, fake = _half_budget_on_fake_allocator(monkeypatch, backstop=False)
    planning, key = ctl.planning, (4, 96)
    step, ceiling = int(memfit.engine.plan.room.RETRY_SLACK_SHARE * budget), int(budget / 3)
    step_retries = {1: 2, 5: 1, 6: 0, 7: 3, 8: 1, 9: 1, 10: 1, 11: 1, 12: 1, 13: 1, 14: 1}  # step index -> retries it causes
    slacks = []  # after each step was learnt (a step is closed when the next one's forward starts)
    for i in range(16):
        torch.manual_seed(i)
        if i == 4:  # after the warm-up: room for two treated blocks, half a growth to spare
            assert [r.phase for r in ctl.records] == ["warmup"] * 4 and slacks[-1] == planning.slack_bytes
            planning.slack_bytes = budget - planning.margin_bytes - planning.predict_peak(key, Plan((0, 1))) - step // 2
            planning.cache.clear()
            slacks[-1] = planning.slack_bytes
        loss = model(**make_batch(*key)).loss
        if i:
            slacks.append(planning.slack_bytes)
        fake.use(ctl._counter.total_bytes + 40 * 4 * 96)
        fake.retries += step_retries.get(i, 0)
        loss.backward()
        inner.step()
        model.zero_grad(set_to_none=True)
    records = ctl.records[:15]
    ctl.remove()
    assert [r.alloc_retries for r in records] == [step_retries.get(i, 0) for i in range(15)]
    # a retry is priced with the step after it (its aftermath), from RETRY_STREAK in a row at once (NOTE [The slack is
    # priced]): the slack grows after steps 6, 9, 10, ...
    expected, streak, pending = [slacks[3]], 0, False
    for i in range(4, 15):
        if step_retries.get(i, 0):
            streak += 1
            grows, pending = (True, False) if streak >= memfit.engine.plan.room.RETRY_STREAK else (False, True)
        else:
            streak, grows, pending = 0, pending, False
        expected.append(min(ceiling, expected[-1] + step) if grows else expected[-1])
    assert slacks[3:] == expected and expected[-1] == expected[-2] == ceiling  # it stops at the ceiling
    assert expected[3] > expected[2] == expected[1]  # the retry at 5 grew it after 6, its aftermath
    assert records[6].n_checkpointed == 2 and records[7].n_checkpointed == 3  # less room: one more block treated
    for i in range(4, 15):  # each plan fits the room its step began with
        assert records[i].predicted_peak_bytes <= budget - planning.margin_bytes - slacks[i - 1]


def test_an_oom_from_allocator_slack_grows_the_slack_not_the_margin(monkeypatch):
    """NOTE [Allocator slack]: an OOM while reserved-but-unallocated bytes exceeded the slack
    teaches the slack (1.25 × them) and replans; one the slack already covered grows the margin."""
    model, make_batch = _bert()
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    budget = 4 * 10**6
    ctl = memfit.fit(model, budget=budget, method="dynamic", backstop=False)
    fake = _on_fake_allocator(monkeypatch, ctl, inner)
    margin, slack = ctl.planning.margin_bytes, ctl.planning.slack_bytes
    assert slack == 0  # made on the CPU: logical accounting keeps none

    def failing_step(unusable, seed):
        torch.manual_seed(seed)
        model(**make_batch(2, 16))
        fake.use(50_000)
        fake.reserved = fake.peak + unusable
        ctl.note_oom("CUDA out of memory. Tried to allocate 2.00 MiB")
        fake.reserved = None

    ctl.planning.plan_for((2, 16))
    failing_step(80_000, 0)
    assert ctl.planning.slack_bytes == 100_000 and ctl.planning.margin_bytes == margin
    assert ctl.planning.cache.items() == []
    failing_step(40_000, 1)  # the slack covered this one: the prediction was wrong
    assert ctl.planning.slack_bytes == 100_000 and ctl.planning.margin_bytes == margin + budget // 20
    _step(model, make_batch(2, 16), seed=2)
    record = ctl.records[-1]
    ctl.remove()
    assert record.oom_retries == 2
    first, second = record.oom_attempts
    assert first["unusable_reserved_bytes"] == 80_000 and first["slack_bytes"] == 0
    assert second["unusable_reserved_bytes"] == 40_000 and second["slack_bytes"] == 100_000


def _partial_transient_run(monkeypatch):
    """A dynamic bert controller on the fake allocator whose steps hold a known transient, after
    warm-up and more than 8 shorter partial shapes (the partial curve's first-shapes rule is
    spent): ``(ctl, budget, run)``, where ``run(length, seed)`` trains one step and returns its record."""
    model, make_batch = _bert()
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    longest = make_batch(4, 96)
    budget = int(0.7 * (logical_peak(model, longest, "none") + logical_peak(model, longest, "full")))
    ctl = memfit.fit(model, budget=budget, method="dynamic", backstop=False)
    fake = _on_fake_allocator(monkeypatch, ctl, inner, margin=int(0.03 * budget))
    block_bytes = {}

    def run(length, seed):
        torch.manual_seed(seed)
        loss = model(**make_batch(4, length)).loss
        saved = ctl._counter.total_bytes
        every = len(ctl._step.decision.plan.blocks) == len(ctl.blocks)
        if every:  # full: the top block is recomputed on top of what is kept
            block_bytes[length] = max(ctl.planning.model.group_models[0].bytes["keep"].ys or [0])
        fake.use(saved + 40 * 4 * length - 2000 + (block_bytes.get(length, 0) if every else 0))
        loss.backward()
        inner.step()
        model.zero_grad(set_to_none=True)
        return ctl.records[-1]

    for i, length in enumerate([24, 48, 72, 28, 32, 36, 40, 44, 52, 56, 60, 64, 68]):
        run(length, i)
    assert ctl.planning.model.transient_partial.distinct_keys >= 8
    assert ctl.planning.model.transient_partial.max_tokens < 4 * 92
    return ctl, budget, run


def test_partial_transient_extends_its_range_to_longer_shapes(monkeypatch):
    """NOTE [Two transient regimes]: a partial plan longer than the partial curve's samples is
    predicted with the full regime (a recomputed block on top: too high); once such a step has
    run, the partial curve covers it and its plan bucket, and the same shape is predicted right."""
    ctl, budget, run = _partial_transient_run(monkeypatch)
    # 94 tokens, past the partial curve's samples: the full regime's guess first, then the range covers it
    first, again = run(94, 20), run(94, 21)
    ctl.remove()
    assert first.phase == again.phase == "steady"
    assert 0 < first.n_checkpointed < first.n_blocks, first  # a partial plan
    assert first.predicted_peak_bytes > first.peak_allocated_bytes + 0.01 * budget  # the full regime's guess
    assert ctl.planning.model.partial_covers(4 * 96)
    # the second is predicted with the partial curve: over by far less than the first
    first_over = first.predicted_peak_bytes - first.peak_allocated_bytes
    assert abs(again.predicted_peak_bytes - again.peak_allocated_bytes) < first_over / 4, (first_over, again)


def test_a_plan_that_checkpoints_nothing_does_not_extend_the_partial_range(monkeypatch):
    """NOTE [Two transient regimes]: only a step that checkpointed something teaches the
    partial transient a shape beyond its range (an empty plan's transient is not that regime's)."""
    from memfit.engine.methods import Decision

    ctl, _, run = _partial_transient_run(monkeypatch)
    partial = ctl.planning.model.transient_partial
    covered = partial.max_tokens
    original = ctl.method.decide
    monkeypatch.setattr(ctl.method, "decide", lambda planning, key, failed=None: Decision(Plan(())))
    empty = run(92, 20)
    assert empty.n_checkpointed == 0 and partial.max_tokens == covered  # not extended
    monkeypatch.setattr(ctl.method, "decide", original)
    again = run(92, 21)
    ctl.remove()
    assert 0 < again.n_checkpointed < again.n_blocks and partial.max_tokens == 4 * 92  # extended


def test_static_does_not_relearn_from_shorter_over_predicted_steps(monkeypatch):
    """``static`` runs the largest shape's plan for every batch: a shorter step's peak far below
    its prediction would make a cheaper plan *for that shape*, which ``static`` never uses, so it
    must not change the model (each change replans: an H200 static run replanned in half its steps)."""
    model, make_batch, inner, budget, ctl, fake = _half_budget_on_fake_allocator(monkeypatch, "static", max_shape=(4, 96))
    planned = []
    original = ctl.planning.search.plan
    monkeypatch.setattr(ctl.planning.search, "plan", lambda k: planned.append(k) or original(k))
    # warm-up, then 9 steady shapes (the partial transient's first-shapes rule is spent), then
    # new shapes inside that range: only an over-prediction could teach the model there
    first = [96, 48, 72] + [24, 32, 40, 48, 56, 64, 72, 80, 88]
    for i, length in enumerate(first + [28, 36, 44, 52, 60, 68]):
        if i == len(first) + 1:  # (the step at 88 extended the partial range: 28 replans)
            seen = len(planned)
        torch.manual_seed(i)
        loss = model(**make_batch(4, length)).loss
        # shorter steps peak far below what the model predicts for them (by 0.1 × budget)
        fake.use(ctl._counter.total_bytes + 40 * 4 * length - (0 if length == 96 else budget // 10))
        loss.backward()
        inner.step()
        model.zero_grad(set_to_none=True)
    records = ctl.records
    ctl.remove()
    steady = [r for r in records if r.phase == "steady"]
    assert {tuple(r.plan) for r in steady} != {()}, "budget never bound"
    assert set(planned) == {(4, 96)}  # static plans the largest shape only
    assert len(planned) == seen, planned[seen:]  # the last five steps: no replan


class _MaybeWide(nn.Module):
    """A layer of one class and size; a ``wide`` one saves a second activation of its
    input's size (as a shifted Swin layer keeps a mask the unshifted one has not)."""

    def __init__(self, dim, wide):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.wide = wide

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.wide:
            h = h * torch.sigmoid(h)  # sigmoid's output and h: two more saved tensors
        return torch.nn.functional.dropout(h, 0.1, self.training) + x


class _MixedStack(nn.Module):
    def __init__(self, dim=16, wide=(False, True, False, True, False, True)):
        super().__init__()
        self.layers = nn.ModuleList(_MaybeWide(dim, w) for w in wide)
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def test_blocks_of_one_class_that_save_different_bytes_are_planned_apart(caplog):
    """NOTE [Blocks alike only in name]: warm-up probes every block; a group whose members
    save different bytes is split, so a plan that holds the larger kind predicts its bytes
    (the H200 Swin-B detector's OOM: a held shifted layer priced as the unshifted one)."""
    torch.manual_seed(0)
    net = _MixedStack().train()
    x_long = torch.randn(8, 96, 16)
    # a budget between full's and none's peak at the longest shape: a partial plan
    peaks = {}
    for method in ("none", "full"):
        ctl = memfit.fit(net, budget=None, method=method, blocks=r"layers\.\d+")
        net(x_long).backward()
        net.zero_grad(set_to_none=True)
        peaks[method] = ctl.records[-1].peak_allocated_bytes
        ctl.remove()
    budget = (peaks["none"] + peaks["full"]) // 2
    ctl = memfit.fit(net, budget=budget, method="dynamic", blocks=r"layers\.\d+", bucket_tokens=1)
    assert ctl.planning.model.groups == [0] * 6  # one class, one size: one group before warm-up
    rng = random.Random(0)
    with caplog.at_level(logging.DEBUG, logger="memfit"):
        for step in range(12):
            torch.manual_seed(step)
            t = 96 if step in (2, 5, 9) else rng.choice([48, 64, 80])
            net(torch.randn(8, t, 16)).backward()
            net.zero_grad(set_to_none=True)
    records = ctl.records
    ctl.remove()
    # said at DEBUG, not amid the progress bar (NOTE [Quiet until asked] in memfit/cli/said.py)
    split = [r.levelname for r in caplog.records if "planned apart now" in r.getMessage()]
    assert split and set(split) == {"DEBUG"}, split
    groups = ctl.planning.model.groups
    assert groups[0] == groups[2] == groups[4] != groups[1] == groups[3] == groups[5]
    steady = [r for r in records if r.phase == "steady" and r.n_checkpointed < r.n_blocks]
    assert steady and any(set(range(1, 6, 2)) - set(r.plan) for r in steady), "no plan held a wide block"
    for r in steady:
        assert not r.evicted_blocks and r.oom_retries == 0
        assert r.peak_allocated_bytes <= r.predicted_peak_bytes + budget // 1000, r  # the fit rounds


class _Biased(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x, bias):
        return torch.tanh(self.lin(x)) + bias  # saves x (lin) and its output (tanh), never `bias`


def test_the_record_says_what_the_backstop_kept_only_as_block_inputs(monkeypatch):
    """A step with the backstop armed keeps each un-checkpointed block's inputs for a
    recompute; the record counts those that no saved tensor holds (here `bias`, once, though
    every block takes it), and 0 on a step that ran plainly."""
    from memfit.engine.run.protection import Backstop

    torch.manual_seed(0)
    layers = nn.ModuleList(_Biased(8) for _ in range(3))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = layers

        def forward(self, x):
            bias = torch.randn(x.shape[-1]).expand_as(x).contiguous()
            for layer in self.layers:
                x = layer(x, bias)
            return x.square().mean()

    net = Net().train()
    armed = {"on": False}
    monkeypatch.setattr(Backstop, "_armed", lambda self, key, plan: armed["on"])
    ctl = memfit.fit(net, budget=10**9, method="dynamic", blocks=r"layers\.\d+", warmup_steps=1, warmup_keys=1)
    x = torch.randn(4, 5, 8)
    for on in (False, False, True, False):
        armed["on"] = on
        net(x).backward()
        net.zero_grad(set_to_none=True)
    ctl.remove()
    records = ctl.records
    assert [r.backstop_armed for r in records[1:]] == [False, True, False]
    bias_bytes = x.numel() * x.element_size()
    assert [r.backstop_input_bytes for r in records] == [0, 0, bias_bytes, 0]


class _Residual(nn.Module):
    """Saves ``2 * x`` (its linear's input) but never ``x``: a block input that only the
    backstop's store keeps, as a bf16 Swin layer's LayerNorm saves its fp32 cast."""

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.lin(2 * x)) + x


def test_an_armed_step_teaches_what_its_plan_holds_run_plainly():
    """NOTE [Backstop]: an armed step holds its stores' inputs on top of its plan; the model
    learns the plan's bytes without them, so the margin does not grow and, once each plan has
    run armed, `dynamic` plans as it does without the backstop (on the H200 Swin-T detector
    those inputs, learnt, left unarmed steps 0.8-2.0 GB over-predicted and the margin at 1.13
    GB where `static`'s stayed at 0.75; on this stack they grew the margin to 29% of the
    budget, and every 96- and 80-token step ran all blocks checkpointed)."""
    torch.manual_seed(0)
    net = nn.Sequential(*(_Residual(16) for _ in range(6)), nn.Linear(16, 1)).train()
    x_long = torch.randn(8, 96, 16)
    peaks = {}
    for method in ("none", "full"):
        ctl = memfit.fit(net, budget=None, method=method, blocks=r"^[0-5]$")
        net(x_long).square().mean().backward()
        net.zero_grad(set_to_none=True)
        peaks[method] = ctl.records[-1].peak_allocated_bytes
        ctl.remove()
    budget = (peaks["none"] + peaks["full"]) // 2
    runs = {}
    for backstop in (True, False):
        ctl = memfit.fit(net, budget=budget, method="dynamic", blocks=r"^[0-5]$", bucket_tokens=1, backstop=backstop)
        margin = ctl.planning.margin_bytes
        rng = random.Random(0)
        for step in range(30):
            torch.manual_seed(step)
            net(torch.randn(8, rng.choice([48, 64, 80, 96]), 16)).square().mean().backward()
            net.zero_grad(set_to_none=True)
        runs[backstop] = ctl.records
        ctl.remove()
        assert ctl.planning.margin_bytes == margin, backstop
    steady = [r for r in runs[True] if r.phase == "steady"]
    armed = [r for r in steady if r.backstop_armed]
    assert len(armed) >= 3 and all(r.backstop_input_bytes > 0 for r in armed)
    assert {r.n_checkpointed for r in steady} > {0}, "budget never bound"
    for r in steady:
        assert r.peak_allocated_bytes <= budget and r.oom_retries == 0, r
        if not r.backstop_armed:  # run plainly: no eviction, predicted right
            assert not r.evicted_blocks and abs(r.predicted_peak_bytes - r.peak_allocated_bytes) <= budget // 1000, r
    # from step 11 on (each plan has run armed once) the same plans as without the backstop
    assert [r.plan for r in runs[True][10:]] == [r.plan for r in runs[False][10:]]


def test_an_armed_steps_peaks_lose_only_the_inputs_of_the_stores_still_alive():
    """What an armed step's peak holds of its stores' inputs: all of them at the backward's
    start (or with no recompute), only the stores below the first recomputed block after it."""
    from memfit.engine.plan.learner import Peaks, _plain_peaks
    from memfit.engine.plan.planner import Plan

    inputs = [10, 0, 20, 40]  # per block; block 1 checkpointed
    plan = Plan((1,))

    def plain(peak, start, rest, evicted=(), stores=inputs):
        return _plain_peaks(Peaks(peak=peak, reserved=peak, rest=rest, start=start), plan, evicted, stores, peak)

    assert plain(1000, 900, 800, stores=[0] * 4) == (1000, 900)
    assert plain(1000, None, 1000) == (930, None)
    # the start (every store alive) or the rest (block 0's store alone: block 1 is recomputed first)
    assert plain(1000, 1000, 800) == (930, 930)
    assert plain(990, 900, 990) == (980, 830)
    # an evicted block 2 is recomputed first: blocks 0 and 1 below it
    assert plain(990, 900, 990, evicted=[2]) == (980, 830)
    assert plain(990, 900, 990, evicted=[3]) == (960, 830)


def test_only_steps_that_can_teach_count_their_saved_tensors(monkeypatch):
    """NOTE [Counting what teaches] / [Which steps count]: on CUDA a step counts its saved
    tensors in warm-up, at more tokens than any counted step (or fewer), after an uncounted
    step of its bucket peaked above its prediction, and once in COUNT_EVERY steps; the others
    (a length inside the counted range: 24 here) run no pack hook past the embeddings (the
    counter's pack calls are the proxy)."""
    from memfit.engine.parts.accounting import SavedTensorCounter
    from memfit.engine.methods import dynamic

    monkeypatch.setattr(dynamic, "COUNT_EVERY", 12)
    packs = []
    original_pack = SavedTensorCounter._pack
    monkeypatch.setattr(SavedTensorCounter, "_pack", lambda self, t: packs.append(1) or original_pack(self, t))
    model, make_batch = _bert()
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memfit.fit(model, budget=10**9, method="dynamic", backstop=False, bucket_tokens=8)
    fake = _on_fake_allocator(monkeypatch, ctl, inner, counts_always=False)
    lengths = [16, 32, 48, 16, 32, 24, 32, 56, 16, 32, 16, 16, 16]
    counted, pack_calls = [], []
    for step, length in enumerate(lengths):
        torch.manual_seed(step)
        before = len(packs)
        loss = model(**make_batch(4, length)).loss
        pack_calls.append(len(packs) - before)
        if step == 8:  # an uncounted repeat that peaks far above what was predicted for it
            fake.use(10**8)
        loss.backward()
        inner.step()
        model.zero_grad(set_to_none=True)
        counted.append(ctl.records[-1].counted)
    records = ctl.records
    ctl.remove()
    phases = [r.phase for r in records]
    assert phases[:3] == ["warmup"] * 3 and phases[3:] == ["steady"] * (len(lengths) - 3)
    # warm-up (16-48); 16, 32 and 24 inside that range; 56, longer than any counted; step 8 repeats
    # 16 uncounted but peaks far above its prediction, so 16's next step (10) counts; the 12th
    # decision (COUNT_EVERY)
    assert counted == [True, True, True, False, False, False, False, True, False, False, True, True, False]
    # an uncounted step packs only what the embeddings save before the first block stops the counter
    uncounted = {calls for calls, c in zip(pack_calls, counted) if not c}
    steady_counted = [calls for calls, c, r in zip(pack_calls, counted, records) if c and r.phase == "steady"]
    assert len(uncounted) == 1 and 10 * max(uncounted) < min(steady_counted)
    assert all(r.saved_activation_bytes == 0 for r in records if not r.counted)
    assert memfit.engine.records.summarize(records).counted_steps == sum(counted) == 6


def test_a_forward_that_raises_leaves_no_hook_of_memfit_on_autograds_stack():
    """The counter's saved-tensor hooks come off autograd's stack when the forward raises
    (an OOM the caller handles without note_oom, e.g. Accelerate's batch-size search)."""
    from _models import InjectOOM

    model, make_batch = _bert()
    ctl = memfit.fit(model, budget=None, method="dynamic")
    InjectOOM(ctl.blocks[1].module, at=1)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    with pytest.raises(torch.OutOfMemoryError):
        model(**make_batch(2, 8))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    ctl.remove()


@pytest.mark.parametrize(
    "lengths, warm",
    [
        ([64] * 20, 4),  # one shape: 3 steps, then 3 repeats in a row end warm-up
        ([64, 128] * 10, 5),  # two alternating shapes
        ([64, 128, 192] + [64] * 17, 3),  # three distinct token counts: warm-up ends at the minimum
        ([64, 128, 64, 192, 64, 256] + [64] * 14, 4),  # new shapes keep coming: warmup_keys decides
    ],
)
def test_dynamic_warmup_ends_when_the_data_repeats_its_shapes(lengths, warm):
    """Waiting for ``warmup_keys`` distinct token counts would probe up to ``max_warmup_steps``
    steps on data of one or two fixed lengths; ``warmup_steps`` repeats in a row end it."""
    from types import SimpleNamespace

    from memfit.engine.methods import make_method
    from memfit.engine.plan.planner import Plan

    method = make_method("dynamic")
    planning = SimpleNamespace(
        model=SimpleNamespace(ready=True), all_blocks=(0, 1), bucket_tokens=8,
        plan_for=lambda key, whole_row=False: Plan(()),
        budget_bytes=None, input_bytes_per_token=0, mlp_bytes_per_token=0, static_bytes=0, n_blocks=2,  # no budget: no floor
        gathered_block_bytes=0,
    )
    warmups = [method.decide(planning, (1, n)).warmup for n in lengths]
    assert warmups == [True] * warm + [False] * (len(lengths) - warm)


def test_the_warm_up_bound_counts_a_blocks_gathered_parameters():
    """NOTE [Warm-up on the floor] under FSDP2: every block's input, the last block's MLP and the parameters FSDP2
    gathers for that block are held at once beside the rank's static shards; a budget the inputs alone fit but not with
    the gathered block is over the bound. ``gathered_param_bytes`` counts a DTensor shard's parameters whole, and a
    parameter the rank holds whole not at all."""
    from types import SimpleNamespace

    from memfit.engine.methods.dynamic import _inputs_over
    from memfit.engine.parts.accounting import gathered_param_bytes

    planning = SimpleNamespace(budget_bytes=10_000, input_bytes_per_token=4, mlp_bytes_per_token=8, static_bytes=5_000,
                               n_blocks=10, gathered_block_bytes=0)
    tokens = 90  # 5,000 + (10 x 4 + 8) x 90 = 9,320: under
    assert not _inputs_over(planning, tokens)
    planning.gathered_block_bytes = 1_000  # 10,320: over
    assert _inputs_over(planning, tokens)

    class Shard(torch.nn.Parameter):  # what a rank holds of a DTensor parameter: numel() is the whole's
        def to_local(self):
            return self

    whole, shard = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    shard.weight = Shard(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert gathered_param_bytes(whole) == 0 and gathered_param_bytes(shard) == 16 * 2


def test_a_bucket_over_predicted_step_after_step_is_corrected(monkeypatch):
    """NOTE [Bias per bucket], on a fake allocator: from the first steady step on, every step peaks
    3% of the budget under what warm-up taught (a synthetic, plan-independent bias); after two such
    steps the bucket's predictions follow, within 1% of the budget (the issue's criterion)."""
    model, make_batch, inner, budget, ctl, fake = _half_budget_on_fake_allocator(monkeypatch, backstop=False)
    key, offset = (4, 96), int(0.03 * budget)
    for i in range(10):
        torch.manual_seed(i)
        loss = model(**make_batch(*key)).loss
        steady = ctl._step.decision is not None and not ctl._step.decision.warmup
        fake.use(ctl._counter.total_bytes + 40 * 4 * 96 - (offset if steady else 0))
        loss.backward()
        inner.step()
        model.zero_grad(set_to_none=True)
    records = [r for r in ctl.records if r.phase == "steady"]
    ctl.remove()
    errors = [r.predicted_peak_bytes - r.peak_allocated_bytes for r in records]
    assert len(errors) >= 5 and min(errors[:2]) > 0.02 * budget  # the bias, seen twice
    assert abs(sorted(errors[2:])[len(errors[2:]) // 2]) <= 0.01 * budget  # then corrected


def test_a_storage_saved_by_several_blocks_is_counted_outside_them():
    """NOTE [Storages saved by several blocks]: a storage a second block (or the code outside the
    blocks) saves too leaves its first block's bytes for the outside bytes, once; one saved twice
    by one block stays in it; the total is what the storages hold."""
    from memfit.engine.parts.accounting import OUTSIDE, SavedTensorCounter

    counter = SavedTensorCounter(3)
    shared, mask, own = torch.zeros(100), torch.zeros(50), [torch.zeros(10 * (i + 1)) for i in range(3)]
    for i in range(3):
        counter.count_inputs(i, (own[i], shared), {"mask": mask if i else None})
        counter.count_tensor(i, own[i])  # again, by the same block
    counter.count_tensor(OUTSIDE, own[2])  # the head saves the last block's tensor too
    assert counter.by_block == [40, 80, 0]
    assert counter.outside_bytes == 400 + 200 + 120
    assert counter.total_bytes == sum(t.untyped_storage().nbytes() for t in (shared, mask, *own))


def test_every_recomputed_block_keeps_its_input_alone_where_the_attention_mask_is_shared():
    """NOTE [Storages saved by several blocks]: on a padded batch every layer receives one attention
    mask and the same rotary tables; with every block recomputed, each block's bytes are its own input
    (the first block's as the others'), and the shared tensors are counted once, outside."""
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=37, vocab_size=128, use_cache=False)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).train()
    ctl = memfit.fit(model, budget=10**9, method="full", announce=False, head=False)
    ids = torch.randint(0, 128, (4, 24))
    mask = torch.ones_like(ids)
    mask[0, 16:] = 0  # a padded row: the model builds a 4D mask every layer gets
    seen = {}
    ctl._counter.stop = lambda stop=ctl._counter.stop: (seen.update(by_block=list(ctl._counter.by_block),
                                                                    outside=ctl._counter.outside_bytes), stop())[1]
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    hidden = 4 * 24 * 32 * 4  # one block's float32 input
    assert seen["by_block"] == [hidden] * 3
    assert seen["outside"] > 0
    ctl.remove()


def test_a_partial_plan_the_partial_transient_does_not_predict_yet_counts():
    """NOTE [Which steps count]: inside the counted range, a step whose plan is partial at a length the
    partial transient does not predict yet counts (it is what teaches that curve; uncounted, the full
    regime's guess stayed a block and the gradients too high step after step); a step whose partial
    plan the curve predicts, one that treats every block and one that treats none do not."""
    from memfit.engine.methods.dynamic import Dynamic
    from memfit.engine.plan.planner import Plan

    class Model:
        ready, groups = True, [0, 0, 0, 0]

        def partial_predicts(self, tokens):
            return tokens <= 100

    plans = {(4, 20): Plan((0, 1)), (4, 50): Plan((0, 1)), (4, 60): Plan((0, 1, 2, 3)), (4, 70): Plan(()),
             (4, 80): Plan((0, 1, 2, 3), kinds=("recompute", "recompute", "recompute", "offload"))}

    class Planning:
        bucket_tokens, model, all_blocks = 1, Model(), (0, 1, 2, 3)

        def plan_for(self, key, whole_row=False):
            return plans[key]

    method = Dynamic()
    method._steady, method._counted_range = True, (0, 10**6)
    counted = {key: method.decide(Planning(), key).count for key in plans}
    assert counted == {(4, 20): False, (4, 50): True, (4, 60): False, (4, 70): False, (4, 80): True}


def test_other_streams_pools_are_read_at_the_first_step_and_after_a_retry_and_kept_free(monkeypatch):
    """NOTE [Other streams' pools] (room.py): the CUDA meter reads what other streams' pools hold free at the run's
    first step and after a step the allocator retried, not at the others; the record says it, and the room keeps
    the most read free (the current stream's free bytes and other streams' allocated bytes not counted)."""
    import memfit.engine.plan.room

    monkeypatch.setattr(memfit.engine.plan.room.StepTimes, "retry_ms", lambda self, bucket, net_ms: 0.0)
    model, make_batch, inner, budget, ctl, fake = _half_budget_on_fake_allocator(monkeypatch)
    fake.segments = [(0, 10**6, 10), (7, 5000, 1000), (9, 3000, 3000)]  # the current stream's, two others'
    room = ctl.planning.room
    free_before = room.free_bytes
    for seed in range(4):
        torch.manual_seed(seed)
        model(**make_batch(4, 32)).loss.backward()
        if seed == 2:  # this step retried, and a third stream's pool grew
            fake.segments.append((11, 6000, 0))
            fake.retries += 1
        elif seed == 3:
            fake.segments = [(7, 5000, 1000)]  # a pool that shrank: the most read is kept
        inner.step()
        model.zero_grad(set_to_none=True)
    records = ctl.records
    ctl.remove()
    assert [r.stream_pool_bytes for r in records] == [4000, None, 10_000, None]
    assert fake.snapshots == 2
    assert room.pool_bytes == 10_000 and room.free_bytes == free_before - 10_000
