"""GPU checks of the CPU proxies against the real allocator (skipped without CUDA)."""

import gc
import os

import pytest
import torch

import memfit
from memfit.engine.budget import parse_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _bert(layers=4):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=layers)
    return BertForSequenceClassification(cfg).cuda().train()


def _batch(n, length):
    ids = torch.randint(1000, 30000, (n, length), device="cuda")
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 2, (n,), device="cuda")}


class _Counting(memfit.engine.methods.Method):
    """Every step runs ``plan`` and counts its saved tensors (on CUDA a step counts only when asked)."""

    name = "counting"

    def __init__(self, plan):
        self.plan = plan

    def decide(self, planning, key, failed=None):
        return memfit.engine.methods.Decision(self.plan, count=True)


def _plans(n):
    from memfit.engine.plan.planner import Plan

    every = tuple(range(n))
    return {
        "none": Plan(()), "full": Plan(every), "selective": Plan(every, kinds=("selective",) * n),
        "offload": Plan(every, kinds=("offload",) * n),
    }


@pytest.mark.parametrize("method", ["none", "full", "selective", "offload"])
def test_counted_saved_bytes_match_allocator(method):
    model = _bert()
    ctl = memfit.fit(model, budget=None, method=_Counting(_plans(4)[method]), treatments=("recompute", "selective", "offload"))
    batch = _batch(16, 256)
    gc.collect()  # earlier tests' models go now, not during the forward measured
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")
    before = torch.cuda.memory_allocated()
    loss = model(**batch).loss
    torch.cuda.synchronize()
    # a free waiting on another stream's copy (offload's record_stream) is processed at the next allocation
    torch.empty(1, device="cuda")
    retained = torch.cuda.memory_allocated() - before - 512
    counted = ctl._counter.total_bytes
    loss.backward()
    model.zero_grad(set_to_none=True)
    ctl.remove()
    # What forward leaves allocated is what it saved for backward (plus the loss and logits);
    # an offloaded block leaves only what it kept on the device once its copies are done.
    assert counted == pytest.approx(retained, rel=0.05), (counted, retained)


@pytest.mark.parametrize("treatment", ["selective", "offload"])
def test_treatments_on_cuda_give_the_gradients_of_none_and_lower_the_peak(treatment):
    """The real offload path (side stream, pinned pool, prefetch) and selective checkpointing on
    the GPU: the gradients of ``none`` (to the GPU's own run-to-run noise); what the forward
    leaves allocated drops by what the counter says the treatment keeps off the device; and
    the step's peak is lower. The peak drops by less: it comes in backward, where one block's
    recompute (or prefetched copies) and the backward's own temporaries are live, which the
    memory model learns per treatment (engine/parts/probe.py)."""
    import copy

    model = _bert(layers=6)
    reference = copy.deepcopy(model)
    peaks, grads, counted, retained = {}, {}, {}, {}
    for name, m, plan in (("none", reference, "none"), (treatment, model, treatment)):
        ctl = memfit.fit(m, budget=None, method=_Counting(_plans(6)[plan]), treatments=("recompute", "selective", "offload"))
        torch.manual_seed(0)
        batch = _batch(16, 384)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        torch.manual_seed(1)
        loss = m(**batch).loss
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # frees waiting on the side stream's copies are processed now
        retained[name] = torch.cuda.memory_allocated() - before
        counted[name] = ctl._counter.total_bytes
        loss.backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated()
        grads[name] = [p.grad.clone() for p in m.parameters()]
        ctl.remove()
        del loss
    for got, want in zip(grads[treatment], grads["none"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    freed = counted["none"] - counted[treatment]
    assert freed > 0.25 * counted["none"], counted
    assert retained["none"] - retained[treatment] == pytest.approx(freed, rel=0.1), (retained, counted)
    assert peaks[treatment] < peaks["none"] - 0.05 * freed, (peaks, counted)


def test_dynamic_stays_under_cap_and_predicts_peak():
    model = _bert(layers=6)
    opt = torch.optim.AdamW(model.parameters())
    budget = 3 * 10**9
    ctl = memfit.fit(model, budget=budget, method="dynamic", optimizer=opt)
    for step, length in enumerate([64, 128, 256, 512, 384, 512, 96, 448, 512, 200]):
        model(**_batch(24, length)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    records = ctl.records
    ctl.remove()
    torch.cuda.set_per_process_memory_fraction(1.0)
    assert all(r.accounting == "cuda" for r in records)
    assert all(r.peak_allocated_bytes <= budget for r in records)
    steady = [r for r in records if r.phase == "steady"]
    assert any(0 < r.n_checkpointed < r.n_blocks for r in steady)
    for r in steady:
        assert r.peak_allocated_bytes <= r.predicted_peak_bytes * 1.10 + 2**20, r


def test_a_cap_makes_the_allocators_new_segments_expandable(monkeypatch):
    """NOTE [Expandable segments under a cap]: ``memfit.fit`` under a cap turns the allocator's expandable segments
    on where the user's settings do not name them: a segment made after it expands."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    model = _bert(layers=2)
    ctl = memfit.fit(model, budget=3 * 10**9, method="dynamic")
    block = torch.empty(96 * 2**20, dtype=torch.uint8, device="cuda")
    ptr = block.data_ptr()
    segments = [s for s in torch.cuda.memory_snapshot()
                if s["address"] <= ptr < s["address"] + s["total_size"]]
    ctl.remove()
    torch.cuda.set_per_process_memory_fraction(1.0)
    assert segments and segments[0].get("is_expandable"), segments
    assert "expandable_segments:True" in os.environ["PYTORCH_CUDA_ALLOC_CONF"]


def _llama_cuda(layers=6):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=512, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=1376, vocab_size=1000, max_position_embeddings=4096, use_cache=False)
    cfg._attn_implementation = "eager"  # deterministic backward: the two runs compare bit for bit
    return tf.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).train()


def test_host_checkpoint_on_cuda_frees_the_inputs_and_gives_recomputes_gradients():
    """NOTE [Checkpoints on the host] on the real allocator, with this torch's checkpoint: after the
    forward the blocks' inputs are off the device (what the forward leaves allocated drops by about
    every block's input against ``recompute``), the gradients are ``recompute``'s bit for bit, and
    the host copies came back."""
    import copy

    from memfit.engine.plan.planner import Plan

    n = 6
    model = _llama_cuda(n)
    reference = copy.deepcopy(model)
    ids = torch.randint(10, 1000, (1, 64), device="cuda")
    reference(input_ids=ids, labels=ids).loss.backward()  # what CUDA makes once (cuBLAS's workspace) is made now
    reference.zero_grad(set_to_none=True)
    retained, grads, inputs = {}, {}, {}
    for name, m in (("recompute", reference), ("host_checkpoint", model)):
        ctl = memfit.fit(m, budget=None, method=_Counting(Plan(tuple(range(n)), kinds=(name,) * n)),
                         treatments=("recompute", "host_checkpoint"), announce=False)
        ids = torch.randint(10, 1000, (4, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        batch = {"input_ids": ids, "labels": ids}
        inputs[name] = 4 * 2048 * 512 * 2
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.manual_seed(1)
        loss = m(**batch).loss
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # frees waiting on the side stream's copies are processed now
        retained[name] = torch.cuda.memory_allocated() - before
        loss.backward()
        torch.cuda.synchronize()
        grads[name] = [p.grad.clone() for p in m.parameters()]
        if name == "host_checkpoint":
            stats = ctl.treatments[name].stats
            assert stats.blocks == n and stats.moved_bytes >= n * inputs[name]
        ctl.remove()
        del loss
    for got, want in zip(grads["host_checkpoint"], grads["recompute"]):
        assert torch.equal(got, want)
    freed = retained["recompute"] - retained["host_checkpoint"]
    assert freed == pytest.approx(n * inputs["recompute"], rel=0.1), retained  # every block's, the embeddings' output too


def test_the_tiled_mlp_lowers_the_allocators_peak_by_the_mlps_intermediates():
    """NOTE [Tiled MLP] on the real allocator: a two-block Llama (bf16, 16k tokens, an MLP 8x its width),
    one forward and backward: ``tiled_mlp``'s peak is under ``keep``'s, and ``recompute_tiled``'s under
    ``recompute``'s, by more than two of the MLP's ``tokens x intermediate`` tensors (a block keeps four;
    a chunk of 2,048 tokens holds an eighth of one each)."""
    import transformers as tf

    from memfit.engine.plan.planner import Plan
    from memfit.engine.parts.treatments import RECOMPUTE_TILED, TILED_MLP
    from memfit.engine.parts.treatments.tiled_mlp import Chunking

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=1024, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=1000, max_position_embeddings=16384)
    model = tf.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
    tokens = 16384
    ids = torch.randint(0, 1000, (1, tokens), device="cuda")
    peaks = {}
    for name in ("keep", "recompute", TILED_MLP, RECOMPUTE_TILED):
        plan = Plan(()) if name == "keep" else Plan((0, 1), kinds=() if name == "recompute" else (name, name))
        ctl = memfit.fit(model, budget=None, method=_Counting(plan), treatments=(TILED_MLP, RECOMPUTE_TILED), announce=False)
        for t in (TILED_MLP, RECOMPUTE_TILED):
            ctl.treatments[t].chunking = Chunking(chunk_bytes=32 * 2**20)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        model.zero_grad(set_to_none=True)
        ctl.remove()
    intermediate = tokens * cfg.intermediate_size * 2  # one tokens x intermediate tensor, bf16
    assert peaks[TILED_MLP] < peaks["keep"] - 2 * intermediate, peaks
    assert peaks[RECOMPUTE_TILED] < peaks["recompute"] - 2 * intermediate, peaks


@pytest.mark.parametrize("method", ["dynamic", "none"])
def test_a_treating_run_on_cuda_freezes_the_heap_once_steady_and_remove_unfreezes(method):
    gc.unfreeze()
    unfrozen = gc.get_freeze_count()  # CPython 3.12 keeps objects there that no unfreeze moves
    model = _bert(2)
    ctl = memfit.fit(model, budget="20GB" if method == "dynamic" else None, method=method, announce=False)
    try:
        for i in range(12):  # three lengths again and again: warm-up ends
            ctl.run_step(lambda i=i: model(**_batch(4, (64, 128, 96)[i % 3])).loss.backward())
            model.zero_grad(set_to_none=True)
        steady = [r for r in ctl.records if r.phase == "steady"]
        assert steady, [r.phase for r in ctl.records]
        assert (gc.get_freeze_count() > unfrozen) == (method == "dynamic")  # NOTE [The collector's pauses]
    finally:
        ctl.remove()
    assert gc.get_freeze_count() == unfrozen


@pytest.mark.parametrize("arch, verdict", [("llama", True), ("olmo2", False)])
def test_the_tiled_mlps_order_check_on_cuda_holds_and_dynamic_keeps_nones_gradients(arch, verdict):
    """NOTE [Tiled MLP] on CUDA: warm-up's probes read the MLP input's uses from the plain run's graph (Llama: the
    MLP alone, tiled bit for bit; OLMo 2's post-norm residual: never tiled), the verdict is the group's, and a plan
    forcing ``tiled_mlp`` on every block in one chunk gives ``none``'s gradients bit for bit either way."""
    import copy

    from _models import FixedPlan, build_decoder, step_both_and_compare
    from memfit.engine.plan.planner import Plan
    from memfit.engine.parts.treatments import HOST_CHECKPOINT_TILED, RECOMPUTE_TILED, TILED_MLP
    from memfit.engine.parts.treatments.tiled_mlp import Chunking

    tiled = (TILED_MLP, RECOMPUTE_TILED, HOST_CHECKPOINT_TILED)
    torch.manual_seed(0)
    model, make = build_decoder(arch)
    model = model.cuda().train()
    reference = copy.deepcopy(model)

    def batch(n, length):
        return {k: v.cuda() for k, v in make(n, length).items()}

    ctl = memfit.fit(model, budget="1GB", method="dynamic", treatments=tiled, warmup_steps=2, warmup_keys=2, announce=False)
    for length in (16, 24, 32):
        model(**batch(2, length)).loss.backward()
    assert [b.tiles_exactly for b in ctl.blocks] == [verdict] * len(ctl.blocks)
    verdicts = [b.tiles_exactly for b in ctl.blocks]
    ctl.remove()
    model.zero_grad(set_to_none=True)
    n = len(verdicts)
    ctl = memfit.fit(model, budget=None, method=FixedPlan(Plan(tuple(range(n)), kinds=(TILED_MLP,) * n)), treatments=tiled,
                     announce=False)
    ctl.treatments[TILED_MLP].chunking = Chunking(at_least=1)
    for blk, v in zip(ctl.blocks, verdicts):
        blk.tiles_exactly = v
    for seed, length in ((7, 40), (8, 24)):
        step_both_and_compare(model, reference, batch(3, length), seed, f"{arch}, seed {seed}")
    ctl.remove()


def test_a_cap_is_set_after_the_garbage_holding_device_memory_is_collected():
    """An earlier model left in a reference cycle holds its device memory until the collector's next full pass:
    ``fit`` with a budget collects it first, so it counts neither against the cap nor in the static part."""
    import gc

    class Cycle:
        def __init__(self):
            self.me, self.tensor = self, torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    model = _bert(2)
    gc.collect()
    gc.disable()  # no automatic pass in between: only fit's
    try:
        Cycle()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        ctl = memfit.fit(model, budget="20GB", method="dynamic", announce=False)
        assert torch.cuda.memory_allocated() < held - 200 * 2**20
    finally:
        gc.enable()
    ctl.remove()


@pytest.mark.parametrize("budget, with_logits", [("2GiB", True), ("512MiB", False)])
def test_an_evaluation_whose_kept_head_passes_the_cap_computes_its_loss_in_chunks(budget, with_logits):
    """NOTE [The head in evaluation] on the allocator: an evaluation forward of 8,192 tokens of a 32k vocabulary in
    bf16, whose kept head (2.6 GB) passes the cap, computes its loss in chunks under it, equal to the uncapped model's
    within float32 rounding, with the model's logits where they fit (0.5 GB) and without where they do not."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                         vocab_size=32000, max_position_embeddings=8192, use_cache=False)
    torch.cuda.set_per_process_memory_fraction(1.0)  # the reference uncapped: an earlier test's cap stays on the process
    model = tf.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 8192), device="cuda")
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids)
    want_loss, want_logits = want.loss.item(), want.logits.cpu()
    del want
    gc.collect()
    torch.cuda.empty_cache()
    ctl = memfit.fit(model, budget=budget, method="dynamic", announce=False)
    switch, asked = ctl.head._switch, []
    inner = switch.on_evaluation
    switch.on_evaluation = lambda tokens: asked.append(inner(tokens)) or asked[-1]
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        got = model(input_ids=ids, labels=ids)
    assert asked[0][0] > 1 and asked[0][1] is with_logits, asked
    assert torch.cuda.max_memory_allocated() < parse_bytes(budget)
    # the logits the loss reads are the model's (float32 rounding alone); made a chunk at a time, bf16's too
    assert abs(got.loss.item() - want_loss) <= (1e-5 if with_logits else 1e-3) * abs(want_loss)
    assert torch.equal(got.logits.cpu(), want_logits) if with_logits else got.logits is None
    ctl.remove()


def test_an_evaluation_whose_mlps_would_not_fit_runs_them_in_chunks_under_the_cap():
    """NOTE [Blocks in evaluation] on the allocator: 16k tokens through MLPs of 8,192 features in bf16 (256 MiB a
    ``tokens x intermediate`` tensor) evaluate under a 1 GiB cap, the loss the uncapped model's within bf16 rounding."""
    import transformers as tf

    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=8192, vocab_size=1000, max_position_embeddings=16384, use_cache=False)
    model = tf.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16384), device="cuda")
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids).loss.item()
    gc.collect()
    torch.cuda.empty_cache()
    ctl = memfit.fit(model, budget="1GiB", method="dynamic", announce=False)
    assert all(b.evaluation is not None for b in ctl.blocks)
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        got = model(input_ids=ids, labels=ids).loss.item()
    assert torch.cuda.max_memory_allocated() < parse_bytes("1GiB")
    assert abs(got - want) <= 1e-2 * abs(want)
    ctl.remove()
