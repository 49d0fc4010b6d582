"""``host_checkpoint`` (treatments/host_checkpoint.py, NOTE [Checkpoints on the host]): the gradients
of ``none`` bit for bit, the block's input off the device between its forward and its recompute, the
memory model's count of it (NOTE [Treated peaks], model.py), the run's one host pool under the host
budget (NOTE [Host budget], offload.py), on CPU."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

import memfit
from _models import FixedPlan, VOCAB, _text_batch, build_decoder, step_both_and_compare
from memfit.engine.plan.model import MemoryModel
from memfit.engine.plan.planner import Plan
from memfit.engine.parts.treatments import HOST_CHECKPOINT, TREATMENTS, HostCheckpoint, HostMemoryError


def _llama(layers: int = 4):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=37, vocab_size=VOCAB, attention_dropout=0.1, max_position_embeddings=600)
    return tf.LlamaForCausalLM(cfg).train()


def _fit_all(model, n, **kwargs):
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan(tuple(range(n)), kinds=(HOST_CHECKPOINT,) * n)),
                     treatments=("recompute", HOST_CHECKPOINT), announce=False, **kwargs)
    ctl.treatments[HOST_CHECKPOINT].min_bytes = 0  # tiny test tensors move too
    return ctl


@pytest.mark.parametrize("arch, lora", [("llama", False), ("qwen2", False), ("gemma2", False), ("llama", True), ("qwen3_moe", False)])
def test_gradients_are_those_of_none_bit_for_bit(arch, lora):
    """Every block on the host checkpoint, dropout on: the gradients of training without memfit."""
    model, make = build_decoder(arch, lora=lora)
    reference = copy.deepcopy(model)
    from memfit.engine.parts.blocks import find_blocks

    n = len(find_blocks(model, None))
    ctl = _fit_all(model, n)
    for seed, length in enumerate((9, 23)):
        step_both_and_compare(model, reference, make(2, length), seed, f"{arch} length {length}")
    stats = ctl.treatments[HOST_CHECKPOINT].stats
    assert stats.blocks == 2 * n and stats.moved_bytes > 0
    ctl.remove()


def test_the_input_leaves_the_device_until_the_recompute():
    """Between a block's forward and its recompute only the host copy holds its input: the device
    tensor is freed (a weak reference dies), and the block's body runs twice."""
    n = 3
    model = _llama(n)
    ctl = _fit_all(model, n)
    layer = model.model.layers[n - 1]  # the last: nothing after it replaces what the treatment last held
    inputs, runs = [], []
    handle = layer.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
    before_run = ctl.blocks[n - 1].before_run
    ctl.blocks[n - 1].before_run = lambda block: runs.append(1) or before_run(block)  # every run of the body
    loss = model(**_text_batch(2, 16, "lm")).loss
    assert len(runs) == 1 and inputs[0]() is None  # the forward's input is gone
    loss.backward()
    assert len(runs) == 2  # recomputed, from the copy brought back
    handle.remove()
    ctl.remove()


def test_the_input_is_what_it_moves_and_the_keyword_inputs_stay():
    """The hidden states are what it moves; what stays on the device (a decoder's position embeddings and mask) is every
    block's, counted outside the blocks by the step, so warm-up's probe counts none of it (NOTE [Checkpoints on the
    host])."""
    from memfit.engine.parts.probe import ProbeKit
    from memfit.engine.parts.accounting import SavedTensorCounter

    model = _llama(2)
    ctl = memfit.fit(model, budget=None, method="none", announce=False)
    block = ctl.blocks[0]
    hidden = torch.randn(2, 16, 32)
    cos_sin = (torch.randn(2, 16, 16), torch.randn(2, 16, 16))
    kit = ProbeKit(block, ((hidden,), {"position_embeddings": cos_sin}), SavedTensorCounter(2), torch.device("cpu"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("memfit.engine.parts.treatments.host_checkpoint.MIN_BYTES", 1)
        kept, price = HostCheckpoint.probe(block, kit)
    assert (kept, price) == (0, None)
    ctl.remove()


def _fill(model: MemoryModel) -> None:
    """One group: a block keeps 1,000 bytes a token, its input 300, on the host checkpoint 10; 2 ms a forward."""
    m = model.group_models[0]
    for tokens in (50, 100, 200):
        k = (1, tokens)
        m.bytes_curve("keep").add(k, 1000.0 * tokens)
        m.bytes_curve("recompute").add(k, 300.0 * tokens)
        m.bytes_curve(HOST_CHECKPOINT).add(k, 10.0 * tokens)
        m.ms_curve("recompute").add(k, 2.0)


def test_the_planner_prices_it_as_a_recompute_plus_the_unhidden_copies():
    """Its price is the block's forward again plus the copies' unhidden part: where the copies cost
    more than the bytes are worth, ``recompute`` alone wherever it saves enough and the host checkpoint
    only past it; where they are nearly hidden, fewer blocks each freeing more."""
    from memfit.engine.plan.planner import plan_treatments

    model = MemoryModel([0] * 4, treatments=TREATMENTS)
    key = (1, 100)
    _fill(model)
    order = {name: t.order for name, t in TREATMENTS.items()}
    dear = model.options(key, ["recompute", HOST_CHECKPOINT], offload_ms=lambda moved, fwd: 5.0)
    by_name = {name: (saved, ms) for name, saved, ms in dear[0]}
    assert by_name["recompute"] == (pytest.approx(70_000, abs=2), pytest.approx(2.0))
    assert by_name[HOST_CHECKPOINT] == (pytest.approx(99_000, abs=2), pytest.approx(7.0))
    assert plan_treatments(dear, 4 * 70_000, order=order).treatments(4) == ["recompute"] * 4
    past = plan_treatments(dear, 4 * 70_000 + 40_000, order=order).treatments(4)
    assert sorted(past) == ["host_checkpoint", "host_checkpoint", "recompute", "recompute"]
    cheap = model.options(key, ["recompute", HOST_CHECKPOINT], offload_ms=lambda moved, fwd: 0.5)
    assert plan_treatments(cheap, 4 * 70_000, order=order).treatments(4) == ["host_checkpoint"] * 3 + ["keep"]
    assert plan_treatments(cheap, 0, order=order).treatments(4) == ["keep"] * 4  # a batch that fits: untouched


def test_the_recompute_bound_counts_what_host_blocks_keep():
    """NOTE [Treated peaks]: in the recompute bound a block on the host checkpoint holds its own
    bytes, not its input, and its stash (with ``depth`` below) is back on the device for its recompute."""
    model = MemoryModel([0] * 4, treatments=TREATMENTS)
    _fill(model)
    key = (1, 100)
    recompute, host = Plan((0, 1, 2, 3)), Plan((0, 1, 2, 3), kinds=(HOST_CHECKPOINT,) * 4)
    # depth 1 without a link: two stashes (29,000 moved bytes each) back at once
    for peak in (model.backward_start_bytes, model.recompute_bytes):
        assert peak(key, host) == pytest.approx(peak(key, recompute) - 4 * 29_000 + 2 * 29_000, abs=4)


def test_the_run_shares_one_host_pool_bounded_by_the_host_budget():
    """Offload and the host checkpoint draw on one pool, bounded by ``host_budget``: a need over it
    fails with one error naming the flag."""
    n = 3
    model = _llama(n)
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan((0, 1, 2), kinds=("offload", HOST_CHECKPOINT, HOST_CHECKPOINT))),
                     treatments=("recompute", "offload", HOST_CHECKPOINT), announce=False, host_budget=10_000)
    offload, host = ctl.treatments["offload"], ctl.treatments[HOST_CHECKPOINT]
    assert offload.pool is host.pool and host.pool.max_bytes == 10_000
    offload.min_bytes = host.min_bytes = 0
    with pytest.raises(HostMemoryError, match="host budget.*--memfit_host_budget"):
        model(**_text_batch(2, 64, "lm")).loss.backward()
    ctl.remove()


def test_host_budget_is_parsed_like_the_budget():
    with pytest.raises(ValueError, match="host_budget="):
        memfit.fit(_llama(2), budget=None, host_budget="lots", announce=False)


def test_it_is_offered_by_default_on_cuda_blocks_only():
    model = _llama(2)
    assert not HostCheckpoint.by_default([model.model.layers[0]], None)
    ctl = memfit.fit(model, budget="1GB", announce=False)
    assert HOST_CHECKPOINT not in ctl.treatments
    ctl.remove()


class _KeywordStack(torch.nn.Module):
    """Blocks called with their hidden states by keyword, and a shared mask beside them."""

    def __init__(self, n=3, width=16):
        super().__init__()
        self.layers = torch.nn.ModuleList(_KeywordBlock(width) for _ in range(n))

    def forward(self, x):
        mask = torch.ones_like(x)
        for layer in self.layers:
            x = layer(hidden_states=x, mask=mask)
        return x.square().mean()


class _KeywordBlock(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, hidden_states, mask):
        return hidden_states + self.drop(torch.tanh(self.lin(hidden_states))) * mask


def test_an_input_passed_by_keyword_moves_too_and_the_shared_ones_stay():
    """Checkpoint's closure would hold a keyword input: the block's own input goes positionally and
    moves; the mask every block receives stays. Gradients are those of plain training, dropout on."""
    torch.manual_seed(0)
    model = _KeywordStack()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 64, 16)
    torch.manual_seed(1)
    reference(x).backward()
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan((0, 1, 2), kinds=(HOST_CHECKPOINT,) * 3)),
                     treatments=("recompute", HOST_CHECKPOINT), blocks=r"layers\.\d+", announce=False)
    host = ctl.treatments[HOST_CHECKPOINT]
    host.min_bytes = 0
    inputs = []
    handle = model.layers[1].register_forward_pre_hook(lambda m, a, kw: inputs.append(weakref.ref(kw["hidden_states"])), with_kwargs=True)
    torch.manual_seed(1)
    loss = model(x)
    assert inputs[0]() is None
    loss.backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert host.stats.moved_bytes == 3 * x.numel() * 4  # each block's input once, never the mask
    handle.remove()
    ctl.remove()


def test_a_replay_of_every_block_recomputed_runs_the_floor_plan(monkeypatch):
    """NOTE [A replay treats more]: where recomputing every block runs out of memory (warm-up's plan at the
    tight end), the replay runs every block on the host checkpoint, and trains: the gradients of none."""
    from memfit.engine.parts.treatments.recompute import Recompute

    model, make = build_decoder("llama")
    reference = copy.deepcopy(model)

    def out_of_memory(self, block, args, kwargs):
        raise torch.OutOfMemoryError("injected: CUDA out of memory")

    monkeypatch.setattr(Recompute, "run", out_of_memory)
    ctl = memfit.fit(model, budget="1GB", treatments=("recompute", HOST_CHECKPOINT), announce=False)
    ctl.treatments[HOST_CHECKPOINT].min_bytes = 0
    batch = make(2, 16)
    torch.manual_seed(0)
    ctl.run_step(lambda: model(**batch).loss.backward())
    torch.manual_seed(0)
    reference(**batch).loss.backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    record = ctl.records[-1]
    assert record.oom_retries == 1 and record.phase == "warmup"
    assert record.block_treatments == {HOST_CHECKPOINT: [0, 1, 2]}
    ctl.remove()


def test_without_a_floor_treatment_the_replays_end_in_one_clear_error(monkeypatch):
    from memfit.engine.parts.treatments.recompute import Recompute
    from memfit.engine.budget import BudgetTooSmallError

    model, make = build_decoder("llama")

    def out_of_memory(self, block, args, kwargs):
        raise torch.OutOfMemoryError("injected: CUDA out of memory")

    monkeypatch.setattr(Recompute, "run", out_of_memory)
    ctl = memfit.fit(model, budget="1GB", treatments=("recompute",), announce=False)
    batch = make(2, 16)
    with pytest.raises(BudgetTooSmallError, match="still out of memory"):
        ctl.run_step(lambda: model(**batch).loss.backward())
    ctl.remove()


def test_out_of_memory_at_the_floor_is_one_clear_error_at_once(monkeypatch):
    """The floor plan itself out of memory: no safer plan exists, so the first such replay ends in one error
    naming the shape, the floor and what to change (no eight replays of the same plan)."""
    from memfit.engine.budget import BudgetTooSmallError
    from memfit.engine.parts.treatments.recompute import Recompute

    model, make = build_decoder("llama")

    def out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("injected: CUDA out of memory")

    monkeypatch.setattr(Recompute, "run", out_of_memory)
    monkeypatch.setattr(HostCheckpoint, "_forward", out_of_memory)
    ctl = memfit.fit(model, budget="1GB", treatments=("recompute", HOST_CHECKPOINT), announce=False)
    batch = make(2, 16)
    with pytest.raises(BudgetTooSmallError, match=r"every block on host_checkpoint .*shape \[2, 16, 32\].*--max_seq_length"):
        ctl.run_step(lambda: model(**batch).loss.backward())
    assert len(ctl.replay.oom.attempts) == 2  # the warm-up's recompute, then the floor
    ctl.remove()


def test_a_part_with_a_leaner_way_replays_the_floor_once_more(monkeypatch):
    """NOTE [A replay treats more]: the floor out of memory asks each part beside the blocks for a leaner way
    (``PartKind.leaner``: the LM head's leanest implementation); one that has one replays the step, and the floor
    out of memory again with none left is the one clear error."""
    from memfit.engine.budget import BudgetTooSmallError
    from memfit.engine.parts.kind import PartKind
    from memfit.engine.parts.treatments.recompute import Recompute

    class Thinning(PartKind):
        name = "thin"

        def __init__(self):
            self.asked = []

        def options(self, tokens):
            return (("keep", 1, 0, 0.0),)

        def apply(self, option):
            pass

        def leaner(self, tokens):
            self.asked.append(tokens)
            return len(self.asked) == 1  # one leaner way, then none

    model, make = build_decoder("llama")

    def out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("injected: CUDA out of memory")

    monkeypatch.setattr(Recompute, "run", out_of_memory)
    monkeypatch.setattr(HostCheckpoint, "_forward", out_of_memory)
    part = Thinning()
    ctl = memfit.fit(model, budget="1GB", treatments=("recompute", HOST_CHECKPOINT), parts=[part], announce=False)
    batch = make(2, 16)
    with pytest.raises(BudgetTooSmallError, match=r"every block on host_checkpoint"):
        ctl.run_step(lambda: model(**batch).loss.backward())
    assert part.asked == [32, 32]
    assert len(ctl.replay.oom.attempts) == 3  # the warm-up's recompute, the floor, the floor with the part leaner
    ctl.remove()
