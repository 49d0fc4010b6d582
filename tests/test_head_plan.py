"""The LM head's options for the planner (NOTE [Head options]) and its place in the registry."""

import pytest
import torch

from memfit.engine.parts.head import head_saved_bytes
from _head_common import plan_with_head
from memfit.engine.plan.planner import InfeasiblePlanError
from memfit.engine.parts.treatments import BY_PART, TREATMENTS, ChunkedHead, HeadPart, KeepHead, head_options


def test_head_registers_its_own_treatments():
    assert dict(BY_PART["head"]) == {"keep": KeepHead, "chunked": ChunkedHead}
    assert "chunked" not in TREATMENTS  # a block is never given a head's treatment
    assert dict(BY_PART["block"]) == dict(TREATMENTS)


def test_head_options_bytes_from_the_formula_and_rising():
    tokens, vocab, hidden = 16, 5000, 32
    options = head_options(tokens, vocab, hidden, torch.bfloat16, extra_ms=2.0, per_chunk_ms=0.5)
    assert options[0] == ("keep", 1, 0, 0.0)
    kept = head_saved_bytes(tokens, vocab, hidden, torch.bfloat16, "keep")
    for name, n, saved, ms in options[1:]:
        chunked = head_saved_bytes(tokens, vocab, hidden, torch.bfloat16, "chunked", n)
        assert name == "chunked"
        assert saved == kept.saved_bytes + kept.transient_bytes - chunked.saved_bytes - chunked.transient_bytes
        assert ms == pytest.approx(2.0 + 0.5 * n)
    assert [o[1] for o in options[1:]] == sorted(o[1] for o in options[1:])
    assert [o[2] for o in options] == sorted(o[2] for o in options)
    assert options[-1][1] == tokens  # one token per chunk at most


def test_head_options_stop_where_a_doubling_saves_too_little():
    """NOTE [Head options]: at 16k tokens the counts stop well short of one token per chunk, at
    the first doubling that saves less than MIN_CHUNK_GAIN_SHARE of the kept head more."""
    from memfit.engine.parts.treatments.chunked_head import MIN_CHUNK_GAIN_SHARE

    tokens, vocab, hidden = 16384, 49152, 960
    options = head_options(tokens, vocab, hidden, torch.bfloat16, extra_ms=2.0, per_chunk_ms=0.5)
    kept = head_saved_bytes(tokens, vocab, hidden, torch.bfloat16, "keep")
    kept_peak = kept.saved_bytes + kept.transient_bytes
    most = options[-1][1]
    assert 8 <= most < tokens // 16, options
    further = head_saved_bytes(tokens, vocab, hidden, torch.bfloat16, "chunked", 2 * most)
    gain = kept_peak - further.saved_bytes - further.transient_bytes - options[-1][2]
    assert gain < MIN_CHUNK_GAIN_SHARE * kept_peak
    gains = [b[2] - a[2] for a, b in zip(options[1:], options[2:])]
    assert all(g >= MIN_CHUNK_GAIN_SHARE * kept_peak for g in gains), gains


def _plan(tokens: int, free_bytes: int):
    """A vocabulary-dominated decoder: 2 blocks that save little, its head priced by the formula;
    ``free_bytes`` is what the budget leaves for the head's peak and the blocks."""
    vocab, hidden = 5000, 32
    kept = head_saved_bytes(tokens, vocab, hidden, torch.float32, "keep")
    blocks = [[("recompute", tokens * hidden * 4, 1.0)]] * 2
    need = 2 * tokens * hidden * 8 + kept.saved_bytes + kept.transient_bytes - free_bytes
    return plan_with_head(blocks, head_options(tokens, vocab, hidden, torch.float32, 0.5, 0.05), need)


def test_short_batch_keeps_the_head_long_batch_chunks_it():
    free = 4 * 2**20
    assert _plan(32, free).option("head") == ("keep", 1)
    long = _plan(512, free)
    assert long.option("head")[0] == "chunked" and long.option("head")[1] > 1


def test_budget_below_the_smallest_chunked_head_names_the_head():
    with pytest.raises(InfeasiblePlanError, match="the head's treatments at most"):
        _plan(512, 2**10)


def _decoder(vocab: int = 4000):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=37, vocab_size=vocab, use_cache=False)
    return tf.LlamaForCausalLM(cfg).train()


def test_head_part_plans_and_sets_the_switch_per_batch():
    from memfit.engine.parts.head import attach_head

    model = _decoder()
    part = HeadPart(attach_head(model), extra_ms=1.0, per_chunk_ms=0.01)
    blocks = [[("recompute", 10_000, 5.0)]] * 2
    # short batch, budget not binding: keep; the model's own loss
    ids = torch.randint(3, 4000, (2, 8))
    plan = plan_with_head(blocks, part.options(ids.numel()), 0)
    part.apply(plan.option("head"))
    assert plan.option("head") == ("keep", 1) and part.switch.treatment == "keep"
    reference = model(input_ids=ids, labels=ids).loss
    # long batch, the head's float32 logits are most of the need: chunked, fewest chunks that fit
    ids = torch.randint(3, 4000, (4, 64))
    options = part.options(ids.numel())
    need = options[2][2]  # what the second-fewest chunk count saves
    plan = plan_with_head(blocks, options, need)
    assert plan.option("head") == options[2][:2] and plan.blocks == ()
    part.apply(plan.option("head"))
    assert (part.switch.treatment, part.switch.n_chunks) == plan.option("head")
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None and part.switch.chunked_forwards == 1
    part.switch.set("keep")
    torch.testing.assert_close(out.loss, model(input_ids=ids, labels=ids).loss)
    assert reference.isfinite()


def test_a_fused_kernel_is_offered_at_its_own_chunk_count_only():
    """NOTE [Head bytes]: Liger/CCE chunk the tokens themselves, so the planner gets one chunked option,
    at fused_chunks(), priced by what each kernel keeps whatever chunk count it is asked for."""
    from memfit.engine.parts.head import fused_chunks, head_saved_bytes

    tokens, vocab, hidden = 4096, 151936, 1536
    for implementation in ("liger", "cce"):
        options = head_options(tokens, vocab, hidden, torch.bfloat16, 0.0, 0.0, implementation=implementation)
        n = fused_chunks(tokens, vocab, hidden)
        assert [o[:2] for o in options] == [("keep", 1), ("chunked", n)] and n == 99
        fused = head_saved_bytes(tokens, vocab, hidden, torch.bfloat16, "chunked", 7, implementation=implementation)
        assert fused == head_saved_bytes(tokens, vocab, hidden, torch.bfloat16, "chunked", n, implementation=implementation)


def test_each_fused_kernel_is_priced_by_what_it_keeps():
    """NOTE [Head bytes]: Liger keeps the rows' and the weight's gradients in the weight's dtype and one
    power-of-two chunk of logits at a time; Cut Cross-Entropy the rows, a float32 log-sum-exp and int64
    targets and indices, no weight gradient in forward (priced as pure_grad_in_forward's float32 one, its
    saving came out vocab x hidden x 4 short of what its steps saved, on the GPU)."""
    from memfit.engine.parts.head import head_saved_bytes

    vocab, hidden, dtype = 151936, 1536, torch.bfloat16
    for tokens in (1000, 16384):
        liger = head_saved_bytes(tokens, vocab, hidden, dtype, "chunked", implementation="liger")
        rows = 1 << (-(-tokens // 99) - 1).bit_length()  # Liger's chunk: tokens / ceil(vocab / hidden), to a power of 2
        assert rows >= -(-tokens // 99) and liger.saved_bytes == (tokens + vocab) * hidden * 2
        assert liger.transient_bytes == rows * vocab * 2 + tokens * 8
        frozen = head_saved_bytes(tokens, vocab, hidden, dtype, "chunked", implementation="liger", weight_trains=False)
        assert liger.saved_bytes - frozen.saved_bytes == vocab * hidden * 2  # a frozen lm_head (LoRA): no weight gradient
        cce = head_saved_bytes(tokens, vocab, hidden, dtype, "chunked", implementation="cce")
        assert cce == head_saved_bytes(tokens, vocab, hidden, dtype, "chunked", implementation="cce", weight_trains=False)
        assert cce.saved_bytes == tokens * (hidden * 2 + 8 + 4 + 8) and cce.transient_bytes == tokens * hidden * 2
        grad_in_forward = head_saved_bytes(tokens, vocab, hidden, dtype, "chunked", 99, implementation="pure_grad_in_forward")
        assert grad_in_forward.saved_bytes - cce.saved_bytes == vocab * hidden * 4 - tokens * (8 + 4 + 8)
    part_options = head_options(16384, vocab, hidden, dtype, 0.0, 0.0, implementation="liger", weight_trains=False)
    assert part_options[1][2] - head_options(16384, vocab, hidden, dtype, 0.0, 0.0, implementation="liger")[1][2] == vocab * hidden * 2


def test_a_steps_head_saving_holds_for_a_count_the_options_no_longer_offer():
    """NOTE [A step's head as it ran]: a warm-up step planned before the probe changed the options
    (a fused kernel's own count, or pure's) still saves the kept head's bytes less its chunked ones."""
    from memfit.engine.parts.head import attach_head

    model = _decoder()
    part = HeadPart(attach_head(model), extra_ms=1.0, per_chunk_ms=0.01)
    tokens = 4 * 64
    offered = {n: saved for name, n, saved, _ in part.options(tokens) if name == "chunked"}
    assert offered and 3 not in offered
    spec = part.switch.spec
    kept = head_saved_bytes(tokens, spec.vocab_size, spec.weight.shape[-1], spec.weight.dtype, "keep")
    three = head_saved_bytes(tokens, spec.vocab_size, spec.weight.shape[-1], spec.weight.dtype, "chunked", 3)
    saving = part.saved_bytes(tokens, ("chunked", 3))
    assert saving == kept.saved_bytes + kept.transient_bytes - three.saved_bytes - three.transient_bytes > 0
    assert min(offered.values()) < saving < max(offered.values())  # between its neighbours' counts
    n = min(offered)
    assert part.saved_bytes(tokens, ("chunked", n)) == offered[n]  # an offered count: the option's bytes
    assert part.saved_bytes(tokens, ("keep", 1)) == 0 and part.saved_bytes(tokens, None) == 0


def test_a_kept_heads_bytes_follow_whether_the_outputs_are_held():
    """NOTE [Outputs held through the backward]: held (or not yet known), the kept head prices its
    logits too; dropped, every chunk count saves the logits' bytes less."""
    from memfit.engine.parts.head import attach_head

    model = _decoder()
    part = HeadPart(attach_head(model), extra_ms=1.0, per_chunk_ms=0.01)
    tokens = 4 * 64
    held = {n: saved for name, n, saved, _ in part.options(tokens) if name == "chunked"}
    kept_held, three_held = part.head_bytes(tokens)[0], part.saved_bytes(tokens, ("chunked", 3))
    part.switch.outputs_held = False
    dropped = {n: saved for name, n, saved, _ in part.options(tokens) if name == "chunked"}
    logits = tokens * part.switch.spec.vocab_size * part.switch.spec.weight.element_size()
    assert kept_held - part.head_bytes(tokens)[0] == logits
    common = set(held) & set(dropped)
    assert common and all(held[n] - dropped[n] == logits for n in common)
    assert three_held - part.saved_bytes(tokens, ("chunked", 3)) == logits  # a count not offered: by formula too


def test_a_kept_head_that_made_the_allocator_retry_is_not_kept_at_as_many_tokens_or_more():
    """NOTE [A kept head's retries]: once a steady step kept the head and the allocator retried, the head's options at
    its tokens and more are the chunked ones, so where keeping it with blocks treated made the cheaper plan, chunking
    it now does, also where nothing is needed; smaller batches may keep it, a smaller retry lowers the bound, and a
    chunked step's retry, a warm-up's or a step without one teaches nothing."""
    from types import SimpleNamespace

    from memfit.engine.plan.planner import Plan
    from memfit.engine.plan.planning import Planning
    from memfit.engine.plan.room import Room
    from memfit.engine.parts.treatments.chunked_head import RunHead

    planning = Planning(2, [0, 0], 10**9, 0, 8, room=Room(10**9, slack_bytes=0))
    run = RunHead(_decoder(), planning, transient=True, mode=True, logits="drop", plans=True)
    part = run.part
    part.extra_ms, part.per_chunk_ms = 3.0, 0.0  # chunking costs 3 ms over keeping, a block's recompute 2 ms
    blocks = [[("recompute", 10_000, 2.0)]] * 2
    tokens = 4 * 64

    def head(tokens, need=10_000):
        return plan_with_head(blocks, part.options(tokens), need).option("head")

    def step(tokens, option, retries=1, phase="steady"):
        record = SimpleNamespace(treatments={}, implementations={}, alloc_retries=retries, phase=phase, tokens=tokens)
        run.record(record, Plan(()).with_option("head", option))

    assert head(tokens) == ("keep", 1) and head(tokens // 2) == ("keep", 1)
    priced = part.priced
    step(tokens, ("chunked", 4))
    step(tokens, ("keep", 1), phase="warmup")
    step(tokens, ("keep", 1), retries=0)
    assert part.kept_retries.tokens is None and part.priced == priced and head(tokens) == ("keep", 1)
    step(tokens, ("keep", 1))
    assert part.kept_retries.tokens == tokens and part.priced == priced + 1  # the cached plans are stale
    assert all(name == "chunked" for name, *_ in part.options(tokens))
    assert head(tokens) == ("chunked", 1) and head(2 * tokens) == ("chunked", 1) and head(tokens, need=0) == ("chunked", 1)
    assert head(tokens // 2) == ("keep", 1) and part.untreated(tokens)[0] == "chunked"
    step(2 * tokens, ("keep", 1))  # more tokens: the bound stands
    assert part.kept_retries.tokens == tokens and part.priced == priced + 1
    step(tokens // 2, ("keep", 1))
    assert part.kept_retries.tokens == tokens // 2 and head(tokens // 2) == ("chunked", 1)
    run.remove()
