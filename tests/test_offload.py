"""``offload`` (treatments/offload.py): the prefetch depth (NOTE [Prefetch depth]), the pinned pool
(NOTE [Pinned pool]), what the memory model counts of the prefetched stashes (NOTE [Treated peaks],
model.py) and the price by exposed time (NOTE [Offload price], probe.py), on CPU."""

from __future__ import annotations

import copy

import pytest
import torch

import memfit
from _models import FixedPlan, VOCAB, _text_batch, step_both_and_compare, tiny_wav2vec2
from memfit.engine.plan.model import MemoryModel, spread
from memfit.engine.plan.planner import Plan
from memfit.engine.plan.planning import Planning
from memfit.engine.parts.probe import LinkPrice
from memfit.engine.parts.treatments import HostMemoryError, Offload
from memfit.engine.parts.treatments.offload import _HostPool, pin_on_threads, size_class
from memfit.engine.parts.kind import PartKind




def _llama(layers: int = 6):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=37, vocab_size=VOCAB, attention_dropout=0.1, max_position_embeddings=600)
    return tf.LlamaForCausalLM(cfg).train()


# ---------------------------------------------------------------------------- prefetch depth
def _offloading(n: int, offloaded: tuple[int, ...], depth: int):
    """A tiny Llama of ``n`` blocks, its copy, and ``offloaded`` offloaded every step at prefetch ``depth`` (every saved
    tensor moved): ``(model, reference, controller, offload)``."""
    model = _llama(n)
    reference = copy.deepcopy(model)
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan(offloaded, kinds=("offload",) * len(offloaded))),
                     treatments=("recompute", "offload"))
    offload: Offload = ctl.treatments["offload"]
    offload.min_bytes = 0
    offload.depth_for = lambda key: depth
    return model, reference, ctl, offload


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_backward_fetches_depth_stashes_ahead_and_gradients_stay_exact(depth):
    """NOTE [Prefetch depth]: when backward reaches offloaded block ``p``, stashes ``p`` down to
    ``p - depth`` are back, and none below; the gradients are ``none``'s bit for bit."""
    n = 6
    model, reference, ctl, offload = _offloading(n, tuple(range(n)), depth)
    reached = []
    prefetch = offload._prefetch

    def watched(position, device):
        prefetch(position, device)
        reached.append((position, {s.index for s in offload._stashes if s.fetched}))

    offload._prefetch = watched
    for seed, length in enumerate((24, 40)):
        reached.clear()
        step_both_and_compare(model, reference, _text_batch(2, length, "lm"), seed, f"depth {depth} length {length}")
        assert [p for p, _ in reached][0] == n - 1  # the output's hook, before any unpack
        for position, fetched in reached:
            assert fetched == set(range(max(0, position - depth), n)), (position, fetched)
    assert list(offload.stats.depth_by_step) == [depth, depth] and offload.stats.blocks == 2 * n
    ctl.remove()


@pytest.mark.parametrize("depth", [1, 3, 4, 6])
def test_spread_stashes_are_back_before_backward_reaches_them_and_depth_counts_blocks(depth):
    """NOTE [Spread stashes], [Prefetch depth]: with offloaded blocks 3 apart (0, 3, 6 of 8), each stash is fetched
    when backward reaches a block within ``depth`` above it (hooked on those blocks' outputs): back before backward
    reaches its own block; when it does, the stashes within ``depth`` blocks below are fetched too, none below them;
    the gradients are ``none``'s bit for bit."""
    offloaded = (0, 3, 6)
    model, reference, ctl, offload = _offloading(8, offloaded, depth)
    reached = []
    prefetch = offload._prefetch

    def watched(position, device):  # the first call per stash: its output's hook (unpacks call it again)
        before = {at for at, s in enumerate(offload._stashes) if s.fetched}
        prefetch(position, device)
        if position not in [p for p, _, _ in reached]:
            reached.append((position, before, {at for at, s in enumerate(offload._stashes) if s.fetched}))

    offload._prefetch = watched
    for seed, length in enumerate((24, 40)):
        reached.clear()
        step_both_and_compare(model, reference, _text_batch(2, length, "lm"), seed, f"spread depth {depth}")
        assert [s.index for s in offload._stashes] == list(offloaded)
        assert [p for p, _, _ in reached] == [2, 1, 0]
        for position, before, after in reached:
            assert position in before, (position, before)  # hooked above it: back before backward reached it
            lowest = offloaded[position] - depth
            assert after == {at for at in range(len(offloaded)) if at > position or offloaded[at] >= lowest}, (position, after)
    ctl.remove()


def test_the_peaks_count_spread_stashes_by_blocks_and_the_blocks_above_them():
    """NOTE [Spread stashes]: 2 blocks of backward are 1 stash ahead 2 or more blocks apart, 2 stashes 1 apart; the
    stashes back count at the backward's start only by what they pass the bytes of the kept blocks more than 2 above
    the topmost one (gone before it comes back)."""
    key, n = (1, 1024), 8
    forward_ms = 0.222 * 1024 + 1.085e-4 * 1024**2
    moved = 980.0 * 1024
    link = LinkPrice(1e9, moved / (1.5 * 2 * forward_ms))  # a copy back over 1.5 blocks of backward: depth 2
    model = _model(link, n)
    assert model.offload_depth(key) == 2
    kept = model.backward_start_bytes(key, Plan(()))
    block = 1000.0 * 1024  # what a kept block frees
    for offloaded, back in (((0, 2), 0.0), ((1, 3), 2 * moved - 2 * block), ((0, 2, 4, 6), 2 * moved), ((4, 5, 6, 7), 3 * moved),
                            ((0, 4), 2 * moved - block)):
        plan = Plan(offloaded, kinds=("offload",) * len(offloaded))
        assert model.backward_start_bytes(key, plan) == pytest.approx(kept - len(offloaded) * moved + max(0.0, back),
                                                                      rel=1e-9), offloaded


def test_a_parameter_made_after_fit_stays_on_the_device():
    """NOTE [Offload]: a weight the block saves for its backward is never copied out, though its storage was made after
    ``fit`` read the parameters' addresses (as FSDP2 gathers a block's weights into new storage for each forward); the
    gradients are ``none``'s bit for bit."""
    model, reference, ctl, offload = _offloading(2, (0,), 1)
    mlp = model.model.layers[0].mlp
    mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.detach().clone())  # a new storage, same values
    weight = mlp.down_proj.weight.untyped_storage().data_ptr()
    assert weight not in offload.excluded
    step_both_and_compare(model, reference, _text_batch(2, 24, "lm"), 0, "a new weight")
    (stash,) = offload._stashes
    assert stash.storages and weight not in stash.storages
    ctl.remove()


def test_the_run_depth_is_the_plans():
    """The depth the treatment runs with is the planning's at the step's shape (the memory model's:
    what the plan counted), read once per step."""
    model = _llama(3)
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan((0, 1, 2), kinds=("offload",) * 3)),
                     treatments=("recompute", "offload"))
    offload: Offload = ctl.treatments["offload"]
    asked = []
    ctl.planning.offload_depth = lambda key: asked.append(key) or 3
    offload.depth_for = ctl.planning.offload_depth
    model(**_text_batch(2, 16, "lm")).loss.backward()
    assert asked == [(2, 16)] and offload.depth == 3
    ctl.remove()


def test_a_block_that_starts_with_a_convolution_reads_its_depth_at_its_samples():
    """The depth is read at the offloaded block's key as the step reads its key (NOTE [What the key cannot see]): a
    Wav2Vec2 feature block's input ``(N, 1, samples)`` channels first, ``(N, samples)``, not one token a row."""
    model = tiny_wav2vec2()
    n = len(memfit.engine.parts.blocks.find_blocks(model))
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan(tuple(range(n)), kinds=("offload",) * n)),
                     treatments=("recompute", "offload"), announce=False)
    assert ctl.blocks[0].channels_first
    offload: Offload = ctl.treatments["offload"]
    asked = []
    offload.depth_for = lambda key: asked.append(key) or 1
    model(input_values=torch.randn(2, 400), labels=torch.tensor([0, 1])).loss.backward()
    assert asked == [(2, 400)]
    ctl.remove()


# ---------------------------------------------------------------------------- pinned pool
def test_size_classes_are_at_most_a_quarter_over():
    for n in (1, 4096, 4097, 5000, 2**20, 2**20 + 1, 3 * 2**20 + 7, 10**9):
        size = size_class(n)
        assert n <= size <= max(4096, 1.25 * n), (n, size)
    assert size_class(2**20 + 1) == size_class(2**20 + 2**18)  # near lengths share a buffer


def test_pinned_classes_are_what_the_host_allocator_pins(monkeypatch):
    """NOTE [Pinned pool]: PyTorch's caching host allocator pins the power of two at or above a request,
    so a pinned pool counts that, and its bound holds for what is pinned."""
    from memfit.engine.parts.treatments import offload as module

    for n in (4097, 5000, 2**20, 2**20 + 1, 675282944):
        size = size_class(n, pinned=True)
        assert size >= n and size & (size - 1) == 0 and size < 2 * n, (n, size)
    asked = []
    monkeypatch.setattr(module.torch, "empty", lambda size, dtype, pin_memory: asked.append(size) or torch.zeros(1))
    pool = _HostPool(max_bytes=2**31, pin=True)
    pool.take(675282944)  # a 16k-token block of SmolLM-360M: 1 GiB pinned, not the 768 MiB of a quarter step
    assert asked == [2**30] and pool.total == 2**30


def _allocator_settings(monkeypatch, current: str, cores: int, ranks: str | None):
    """torch's run-time setter recorded, the environment's settings ``current``, ``cores`` usable, ``ranks`` on the host."""
    from memfit.engine.parts.treatments import offload as module

    given = []
    monkeypatch.setattr(module.torch._C, "_accelerator_setAllocatorSettings", given.append)
    monkeypatch.setattr(module.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", current)
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    return given


@pytest.mark.parametrize("current, cores, ranks, threads", [
    ("expandable_segments:True", 16, None, 16), ("", 64, None, 16), ("", 24, "2", 8), ("roundup_power2_divisions:8", 7, None, 4),
    ("", 16, "8", None), ("", 2, None, None), ("expandable_segments:True,pinned_num_register_threads:2", 16, None, None),
    ("pinned_use_cuda_host_register:False", 16, None, None), ("backend:cudaMallocAsync", 16, None, None)])
def test_the_host_allocator_pins_on_this_process_share_of_the_cores(monkeypatch, current, cores, ranks, threads):
    """NOTE [Pinning on threads]: the register way on the largest power of two of threads up to 16 that the process's
    share of the cores allows, given with the settings as they stand (NOTE [The allocator's settings at run time]); none
    under 4 threads, and a process that named either option keeps its own."""
    import os

    given = _allocator_settings(monkeypatch, current, cores, ranks)
    added = pin_on_threads()
    if threads is None:
        assert added is None and given == [] and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == current
        return
    assert added == f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
    assert given == [",".join(filter(None, (current, added)))] and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == given[0]
    assert pin_on_threads() is None and len(given) == 1  # once: the keys are named now


def test_the_pool_turns_pinning_on_threads_on_before_its_first_pinned_buffer_only(monkeypatch):
    from memfit.engine.parts.treatments import offload as module

    calls = []
    monkeypatch.setattr(module, "pin_on_threads", lambda: calls.append(1))
    monkeypatch.setattr(module.torch, "empty", lambda size, dtype, pin_memory: torch.zeros(1))
    pinned, unpinned = _HostPool(max_bytes=2**31, pin=True), _HostPool(max_bytes=2**31, pin=False)
    for _ in range(3):
        pinned.take(5000)
        unpinned.take(5000)
    assert len(calls) == 1


def test_the_pool_reuses_buffers_across_steps_and_lengths():
    """NOTE [Pinned pool]: a repeated length pins nothing new, a near one reuses its class."""
    n = 4
    model = _llama(n)
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan(tuple(range(n)), kinds=("offload",) * n)),
                     treatments=("recompute", "offload"))
    offload: Offload = ctl.treatments["offload"]
    offload.min_bytes = 0
    pins = []
    for length in (64, 64, 63, 64, 40, 64, 40):
        model(**_text_batch(2, length, "lm")).loss.backward()
        model.zero_grad(set_to_none=True)
        pins.append(offload.pool.pins)
    assert pins[1] == pins[0] and pins[2] == pins[1] and pins[3] == pins[2], pins  # 63 fits 64's buffers
    assert pins[5] == pins[4] and pins[6] == pins[5], pins
    ctl.remove()


def test_the_pool_drops_free_buffers_before_passing_its_limit():
    pool = _HostPool(max_bytes=20000, pin=False)
    a, b = pool.take(8000), pool.take(8000)
    pool.give(a)
    pool.give(b)
    c = pool.take(12000)  # a new class: the free buffers go, not over the limit
    assert pool.total == size_class(12000) and pool.pins == 3
    with pytest.raises(HostMemoryError, match="need .* GiB of pinned host memory, over the host budget"):
        pool.take(12000)  # ``c`` is in use: this one would pass the limit
    pool.give(c)
    assert pool.take(12000) is c


# ---------------------------------------------------------------------------- the model and the price
def _model(link=None, n_blocks=8, keys=(256, 512, 1024, 2048, 4096, 8192, 16384)):
    """A stack whose block saves 1000 bytes per token kept, 50 recomputed, 20 offloaded; its forward
    is linear in tokens plus attention's quadratic term."""
    model = MemoryModel([0] * n_blocks)
    group = model.group_models[0]
    for t in keys:
        key = (1, t)
        group.bytes["keep"].add(key, 1000.0 * t)
        group.bytes["recompute"].add(key, 50.0 * t)
        group.bytes_curve("offload").add(key, 20.0 * t)
        group.ms["recompute"].add(key, 0.222 * t + 1.085e-4 * t * t)
        model.outside.add(key, 10.0 * t)
        model.transient_full.add(key, 0.0)
    model.link = link
    return model


def test_the_peak_counts_depth_plus_one_prefetched_stashes():
    """NOTE [Treated peaks]: an offloading plan holds ``depth + 1`` blocks' moved bytes at the
    backward's start (2 without a link, as before depth existed)."""
    key, n = (1, 1024), 8
    plan = Plan(tuple(range(n)), kinds=("offload",) * n)
    moved = 980.0 * 1024
    alone = _model().backward_start_bytes(key, plan)
    forward_ms = 0.222 * 1024 + 1.085e-4 * 1024**2
    for depth in (1, 2, 3):
        # the copy back takes ``depth - 0.5`` blocks of backward (2 forwards each)
        link = LinkPrice(1e9, moved / ((depth - 0.5) * 2 * forward_ms))
        model = _model(link)
        assert model.offload_depth(key) == depth
        assert model.backward_start_bytes(key, plan) == pytest.approx(alone + (depth - 1) * moved, rel=1e-9)


def test_the_depth_is_bounded():
    link = LinkPrice(1.0, 1.0, max_depth=4)
    assert link.depth(1e6, 1.0) == 4 and link.depth(1.0, 1e6) == 1


def test_the_price_is_the_exposed_copy_time():
    """NOTE [Offload price]: out beyond the forward, back beyond the backward, plus the fixed cost."""
    link = LinkPrice(d2h_bytes_per_ms=100.0, h2d_bytes_per_ms=50.0, fixed_ms=0.05)
    assert link(1000.0, 4.0) == pytest.approx((10 - 4) + (20 - 8) + 0.05)
    assert link(100.0, 4.0) == pytest.approx(0.05)  # hidden both ways


def _chosen(link, tokens: int) -> dict[str, list[int]]:
    """The plan of a stack that must give up 40% of its activations at ``tokens``."""
    model, key = _model(link), (1, tokens)
    n = len(model.groups)
    budget = int(1000 + 0.6 * model.backward_start_bytes(key, Plan(())))
    planning = Planning(n, [0] * n, budget, margin_bytes=0, bucket_tokens=1, treatments=("recompute", "offload"))
    planning.model, planning.static_bytes = model, 1000
    planning.price_offload(link)
    plan = planning.plan_for(key)
    assert plan.blocks and planning.predict_peak(key, plan) <= planning.room_bytes, plan
    return plan.by_treatment()


def test_short_sequences_recompute_and_long_ones_offload_on_a_fast_link():
    """The block moves 980 bytes per token; a link of 980 bytes/ms copies a block in ``T`` ms each
    way. Short sequences are copy-bound (the copy costs more than the forward it replaces): a run of
    offloaded blocks never pays, and only the blocks the forward hides one after another are offloaded
    (NOTE [Spread stashes]: 256 tokens, a copy out over 4 blocks' forwards: block 0 alone), the rest
    recomputed. Long ones hide the copy under attention's quadratic compute: offload. A link ten times
    slower offloads only what the forward hides (its copy out over 5 of the 8 forwards: block 0)."""
    fast, slow = LinkPrice(980.0, 980.0), LinkPrice(98.0, 98.0)
    assert spread(_model(fast), (1, 256), "offload") == [0]
    short = _chosen(fast, 256)
    assert set(short) == {"recompute", "offload"} and short["offload"] == [0]
    assert len(_chosen(fast, 16384).get("offload", [])) > 1
    assert spread(_model(slow), (1, 16384), "offload") == [0]
    assert _chosen(slow, 16384).get("offload", [0]) == [0]


def test_spread_picks_the_blocks_whose_copies_out_the_forward_hides_one_after_another():
    """NOTE [Spread stashes]: a copy out that takes 3 blocks' forwards: every third block from the bottom, the last
    one whose copy ends with the forward (12 of 16: its copy over blocks 13-15); none where a copy outlasts the whole
    forward, none without a link."""
    key = (1, 1024)
    forward_ms = 0.222 * 1024 + 1.085e-4 * 1024**2
    moved = 980.0 * 1024
    assert spread(_model(LinkPrice(moved / (3 * forward_ms), 1.0), 16), key, "offload") == [0, 3, 6, 9, 12]
    assert spread(_model(LinkPrice(moved / (16 * forward_ms), 1.0), 16), key, "offload") == []
    assert spread(_model(None, 16), key, "offload") == []
    # planned: the spread blocks offloaded at the link's fixed price, the rest as the need asks; fits, and cheaper
    planning, key = _planning(lambda link: link, 2.5, tokens=1024, head=False, n_blocks=16)
    planning.price_offload(LinkPrice(moved / (3 * forward_ms), moved / (3 * forward_ms)))
    plan = planning.plan_for(key)
    assert planning.predict_peak(key, plan) <= planning.room_bytes, plan
    assert plan.by_treatment()["offload"] == [0, 3, 6] and "recompute" not in plan.by_treatment(), plan
    assert plan.cost_ms == pytest.approx(3 * planning.model.link.fixed_ms)


def _FixedOnly(link):  # noqa: N802 (a price class's stand-in)
    """loop_bench's ``dynamic+offload-free`` price: the link's fixed cost only, its depth kept."""
    return _loop_bench()[0]._FreeOffload(link)


class _Head(PartKind):
    """An LM head part for the planner (treatments/chunked_head.py HeadPart's planning side): per token
    it saves 300 bytes in 2 chunks and 600 in one token a chunk, each priced over a block's recompute."""

    name = "head"

    def choose_by_plans(self, plan_ms, key=None, shape=None) -> bool:
        return True  # one implementation: nothing for the plans to choose (NOTE [The plans choose the implementation])

    def options(self, tokens: int):
        return (("keep", 1, 0, 0.0), ("chunked", 2, 300 * tokens, 5e4), ("chunked", tokens, 600 * tokens, 1e6))

    def saved_bytes(self, tokens: int, head) -> int:
        return next((saved for name, n, saved, _ in self.options(tokens) if (name, n) == tuple(head or ())), 0)

    def transient_saved_bytes(self, tokens: int, head) -> int:
        return 0  # all of the saving is saved bytes

    def head_bytes(self, tokens: int):
        return 700 * tokens, 100 * tokens, tokens


def _planning(price, share: float, tokens: int = 16384, head: bool = True, n_blocks: int = 8):
    """The stack of ``_model`` on a link slow enough for the deepest prefetch (``depth + 1`` = 5 of its 8
    blocks' moved bytes back at once), priced by ``price(link)``, its head planned, under a budget that
    needs ``share`` of one block's recompute saving."""
    link = LinkPrice(50.0, 50.0)
    model, key = _model(link, n_blocks), (1, tokens)
    assert model.offload_depth(key) == 4
    budget = int(1000 + model.backward_start_bytes(key, Plan(())) - share * 950 * tokens)
    planning = Planning(n_blocks, [0] * n_blocks, budget, margin_bytes=0, bucket_tokens=1,
                        treatments=("recompute", "offload"))
    planning.model, planning.static_bytes = model, 1000
    if head:
        planning.add_part(_Head())
        planning.model.part_saving["head"] = planning.parts["head"].saved_bytes
    planning.price_offload(price(link))
    return planning, key


@pytest.mark.parametrize("share, treated", [(0.9, {"offload": 1}), (2.5, {"offload": 8}), (4.5, {"recompute": 5})])
@pytest.mark.parametrize("head", [True, False])
def test_offload_priced_at_its_fixed_cost_plans_a_mix_that_fits_not_the_last_resort(share, treated, head):
    """An offloading plan holds up to ``depth + 1`` stashes that the knapsack's savings leave out, less what the
    kept blocks more than ``depth`` above them held, gone before any comes back (NOTE [Spread stashes]): one
    offloaded block under 7 kept ones saves all it moves; 2.5 blocks' need takes all 8 (5 stashes back), and 4.5
    blocks' no offloading fits, recompute does. Where its answer is over the room it is asked again for more (NOTE [Planning with the
    stashes back]). With the head planned, such a plan once fell to the last resort (every block recomputed, the
    head one token a chunk: a step at static memory taking seconds) though keeping blocks fitted."""
    planning, key = _planning(_FixedOnly, share, head=head)
    plan = planning.plan_for(key)
    assert planning.predict_peak(key, plan) <= planning.room_bytes, plan
    # 1 offloaded under 7 kept saves what it moves; more bring back more than the kept blocks 4 above them held
    assert {name: len(blocks) for name, blocks in plan.by_treatment().items()} == treated, plan
    assert plan.option("head") == (("keep", 1) if head else None)  # a chunk costs more than an offloaded block
    _assert_nothing_treated_that_fits_kept(planning, key, plan)


@pytest.mark.parametrize("price", [_FixedOnly, lambda link: link])
@pytest.mark.parametrize("share", [-1.0, 0.5, 1.5, 3.0, 6.0])
def test_keep_wins_where_it_fits(price, share):
    """No block is treated, and the head not chunked, where keeping it would still fit the room."""
    planning, key = _planning(price, share)
    plan = planning.plan_for(key)
    assert planning.predict_peak(key, plan) <= planning.room_bytes, plan
    if share < 0:
        assert plan.blocks == () and plan.option("head") == ("keep", 1)
    _assert_nothing_treated_that_fits_kept(planning, key, plan)


def _assert_nothing_treated_that_fits_kept(planning, key, plan):
    treatments = plan.treatments(planning.n_blocks)
    for i in plan.blocks:
        kept = [t if j != i else "keep" for j, t in enumerate(treatments)]
        blocks = tuple(j for j, t in enumerate(kept) if t != "keep")
        fewer = Plan(blocks, kinds=tuple(kept[j] for j in blocks)).with_option("head", plan.option("head"))
        assert planning.predict_peak(key, fewer) > planning.room_bytes, (plan, i)
    if plan.option("head") not in (None, ("keep", 1)):
        kept_head = Plan(plan.blocks, kinds=plan.kinds).with_option("head", ("keep", 1))
        assert planning.predict_peak(key, kept_head) > planning.room_bytes, plan


# ---------------------------------------------------------------------------- the GPU job's pieces, on CPU
def _loop_bench():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("loop_bench", root / "benchmarks" / "loop_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, root


def test_the_offload_call_parses_and_keeps_to_its_time(tmp_path):
    """The llm suite's ``offload-long`` call: loop_bench takes its arguments, knows its methods, and the
    call stops inside the job's 240 s."""
    import sys

    loop_bench, root = _loop_bench()
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        from suites import Context
        from suites import llm
    finally:
        sys.path.remove(str(root / "benchmarks"))
    (call,) = [c for c in llm.calls(llm.SUITE, Context(raw=tmp_path, quick=False, cuda=True)) if c.name == "offload-long"]
    (command,) = call.commands
    assert command[1].endswith("loop_bench.py")
    args = loop_bench._parse(list(command[2:]))
    assert args.budgets == [0.5] and args.repeats == 3 and args.lengths == "fixed:8192,16384" and args.batch == 1
    for name in args.methods:
        assert name in ("plain", "none") or loop_bench._memfit_config(name) or name in loop_bench.PEERS, name
    assert call.timeout_s <= 220 and args.time_limit_s <= call.timeout_s - 45 and args.steps - args.steady_from >= 8


def test_the_offload_fields_of_a_run_are_compact_json():
    """loop_bench's ``offload`` field from a CPU run's treatment and records; ``dynamic+offload-free``'s
    price keeps the link's depth."""
    import json
    from types import SimpleNamespace

    loop_bench, _ = _loop_bench()
    n = 3
    model = _llama(n)
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan((1, 2), kinds=("offload",) * 2)),
                     treatments=("recompute", "offload"))
    ctl.treatments["offload"].min_bytes = 0
    for length in (16, 24, 16):
        model(**_text_batch(2, length, "lm")).loss.backward()
        model.zero_grad(set_to_none=True)
    fields = loop_bench._offload_fields(SimpleNamespace(steady_from=1), ctl.treatments["offload"], ctl.records)
    ctl.remove()
    assert fields["steps"] == 3 and fields["blocks"] == 6 and fields["depths"] == [1]
    # what ran, beside what the records say the plans gave: every step, its two blocks, their bytes
    assert fields["planned_blocks"] == 6 and fields["blocks_per_step_max"] == 2
    stats = ctl.treatments["offload"].stats
    assert list(stats.blocks_by_step) == [2, 2, 2] and sum(stats.moved_bytes_by_step) == stats.moved_bytes > 0
    assert stats.moved_bytes_by_step[0] == stats.moved_bytes_by_step[2] > 0  # the same length, the same bytes
    assert fields["moved_gib_per_step_max"] == round(max(stats.moved_bytes_by_step) / 2**30, 3)
    assert fields["offloaded_blocks_by_tokens"] == {"48": [[1, 2]], "32": [[1, 2]]}
    assert fields["exposed_ms_per_step_median"] is None  # no CUDA: no waits timed
    json.dumps(fields)
    link = LinkPrice(100.0, 50.0, fixed_ms=0.05)
    free = loop_bench._FreeOffload(link)
    assert free(1e6, 1.0) == 0.05 and free.depth(1e6, 1.0) == link.depth(1e6, 1.0) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_depth_keeps_the_gradients_and_the_waits_are_timed():
    """The side-stream path with a deeper prefetch: ``none``'s gradients (to the GPU's run-to-run
    noise), every stash fetched, and the compute stream's waits read once the steps are done."""
    n = 6
    model = _llama(n).cuda()
    reference = copy.deepcopy(model)
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan(tuple(range(n)), kinds=("offload",) * n)),
                     treatments=("recompute", "offload"))
    offload: Offload = ctl.treatments["offload"]
    offload.min_bytes = 0
    offload.depth_for = lambda key: 3
    batch = {k: v.cuda() for k, v in _text_batch(2, 64, "lm").items()}
    for m in (model, reference):
        for step in range(2):
            torch.manual_seed(step)
            m(**batch).loss.backward()
    torch.cuda.synchronize()
    assert all(s.fetched and s.unpacked == s.handles for s in offload._stashes)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6)
    offload.start_step()  # reads the finished steps' waits
    stats = offload.exposed()
    assert len(stats.exposed_ms_by_step) == 2 and stats.exposed_back_ms >= 0 and offload.pool.pins > 0
    ctl.remove()
