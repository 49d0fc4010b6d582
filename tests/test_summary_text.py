"""What memfit prints at the start and end of a run, from plain values and step records."""

from __future__ import annotations

import pytest

from memfit.engine.budget import Budget
from memfit.engine.records import StepRecord
from memfit.engine.summary_text import end_summary, over_budget_words, parameters_words, size_in_given_unit, start_line, verdict


def _record(step: int, peak: int, budget: int | None, plan: list[int], phase: str = "steady", **extra) -> StepRecord:
    return StepRecord(
        step=step, shape=[4, 100], tokens=400, method="dynamic", plan=plan, n_checkpointed=len(plan), n_blocks=4,
        predicted_peak_bytes=None, peak_allocated_bytes=peak, peak_reserved_bytes=peak, budget_bytes=budget,
        accounting="logical", step_ms=100.0, recompute_ms_est=10.0 * len(plan), phase=phase, **extra,
    )


def test_start_line_states_method_budget_accounting_and_blocks():
    line = start_line("dynamic", Budget.parse("500MB"), "cuda", ["SwinLayer"] * 2 + ["DetrEncoderLayer"])
    assert line == (
        "memfit: method dynamic, budget 500MB (500000000 bytes), cuda accounting (allocator peaks, budget enforced "
        "as a hard cap), 3 blocks (2 SwinLayer, 1 DetrEncoderLayer)"
    )


def test_start_line_without_budget_says_nothing_is_capped():
    line = start_line("dynamic", None, "logical", ["BertLayer"] * 6)
    assert "no budget: nothing is capped" in line and "6 blocks (BertLayer)" in line


def test_end_summary_counts():
    budget = 1000
    records = [
        _record(1, 600, budget, [0, 1, 2, 3], phase="warmup"),
        _record(2, 900, budget, [0, 1], oom_retries=1),
        _record(3, 1100, budget, []),  # over the budget
        _record(4, 800, budget, [0, 1, 2, 3]),
    ]
    text = end_summary(records, Budget.parse("1000"))
    lines = text.splitlines()
    assert len(lines) == 4 and all(line.startswith("memfit: ") for line in lines)
    assert lines[0] == "memfit: 4 micro-steps (forward + backward; 1 warm-up), method dynamic, budget 1000 bytes"
    assert lines[1] == "memfit: peak 1100 B = 110% of the budget (logical accounting), 1 micro-step over budget, 1 OOM replay"
    # blocks over the 3 steady micro-steps: (2 + 0 + 4) / 3 = 2.0 of 4; recompute 10 ms a block: 60 of 300 ms
    assert lines[2] == (
        "memfit: 2.0 of 4 blocks recomputed per micro-step on average (50%) over 3 steady micro-steps, recompute "
        "about 20% of their time (estimated); 1 warm-up micro-step recomputed every block; the 4 micro-steps took 0.4 s"
    )
    assert lines[3].startswith("memfit: verdict: 1 of 4 micro-steps went over the budget; most of it is the activations")


def test_end_summary_averages_over_steady_micro_steps_and_says_what_warm_up_did():
    """7 warm-up micro-steps that recompute all 4 blocks beside 89 steady ones that recompute 1:
    the average is 1.0 (25%), not the 1.2 (30%) that counting warm-up gave, and warm-up is said apart."""
    records = [_record(i, 600, 1000, [0, 1, 2, 3], phase="warmup") for i in range(1, 8)]
    records += [_record(i, 600, 1000, [0]) for i in range(8, 97)]
    line = end_summary(records).splitlines()[2]
    assert line.startswith("memfit: 1.0 of 4 blocks recomputed per micro-step on average (25%) over 89 steady micro-steps, "
                           "recompute about 10% of their time (estimated); 7 warm-up micro-steps recomputed every block;")
    # a warm-up that did not recompute every block says what it did; a run of warm-up only has no average
    partial = [_record(1, 600, 1000, [0, 1, 2, 3], phase="warmup"), _record(2, 600, 1000, [0, 1], phase="warmup",
                                                                            treatments={"elementwise": [0, 1]})]
    assert end_summary(partial).splitlines()[2] == (
        "memfit: no steady micro-step; 2 warm-up micro-steps: 3.0 of 4 blocks treated per micro-step on average "
        "(75%: recompute 2.0, elementwise 1.0); the 2 micro-steps took 0.2 s")


def test_end_summary_says_what_share_of_the_steady_steps_memfits_decisions_took():
    """The planner's time (``planner_us``, measured around the method's decision) over the steady micro-steps' time, said
    beside the treatments' estimate; warm-up's decisions are left out, and a run whose decisions were not timed says
    nothing of them."""
    import dataclasses

    records = [dataclasses.replace(_record(1, 600, 1000, [0], phase="warmup"), planner_us=90_000.0)]
    records += [dataclasses.replace(_record(i, 600, 1000, [0]), planner_us=us) for i, us in ((2, 400.0), (3, 200.0))]
    line = end_summary(records).splitlines()[2]  # (0.4 + 0.2) ms of 2 x 100 ms
    assert "recompute about 10% of their time (estimated), deciding 0.3% (measured); 1 warm-up" in line, line
    untimed = [_record(1, 600, 1000, [0], phase="warmup"), _record(2, 600, 1000, [0])]
    assert "deciding" not in end_summary(untimed)


def test_end_summary_says_what_share_of_the_steady_steps_the_all_gathers_held_up():
    """NOTE [The collective wait]: under FSDP over several ranks each record holds its step's wait on the all-gathers,
    said as a share of the steady micro-steps' time; a run that did not read it (None) says nothing of it."""
    import dataclasses

    records = [dataclasses.replace(_record(1, 600, 1000, [0], phase="warmup"), collective_wait_ms=80.0)]
    records += [dataclasses.replace(_record(i, 600, 1000, [0]), collective_wait_ms=ms) for i, ms in ((2, 6.0), (3, 0.0))]
    line = end_summary(records).splitlines()[2]  # (6 + 0) ms of 2 x 100 ms
    assert "of their time (estimated), waiting on all-gathers 3.0% (measured); 1 warm-up" in line, line
    assert "all-gathers" not in end_summary([_record(1, 600, 1000, [0], phase="warmup"), _record(2, 600, 1000, [0])])


def test_end_summary_names_micro_steps_and_the_optimizer_steps_where_known():
    """Records are micro-steps: 96 of them in 12 optimizer steps (accumulation 8) say both; without a
    count of optimizer steps only micro-steps are named; a merged summary says over how many ranks."""
    records = [_record(i, 600, 1000, [0], phase="warmup" if i <= 7 else "steady") for i in range(1, 97)]
    assert end_summary(records, optimizer_steps=12).splitlines()[0] == (
        "memfit: 12 optimizer steps, 96 micro-steps (forward + backward; 7 warm-up), method dynamic, "
        "budget 1000 bytes")
    assert end_summary(records).splitlines()[0].startswith("memfit: 96 micro-steps (forward + backward; 7 warm-up)")
    assert "step" not in end_summary(records, optimizer_steps=12).replace("micro-step", "").replace("optimizer step", "")
    two_ranks = records + [_record(i, 600, 1000, [0], rank=1) for i in range(1, 97)]
    assert end_summary(two_ranks, optimizer_steps=12).startswith("memfit: 12 optimizer steps, 192 micro-steps over 2 ranks")


def test_end_summary_names_each_treatment_where_a_plan_gave_another_than_recompute():
    """A block under ``elementwise`` is not recomputed: the summary counts treated blocks and each
    treatment's blocks per step."""
    budget = 1000
    records = [
        _record(1, 600, budget, [0, 1, 2], treatments={"recompute": [0, 1, 2]}),
        _record(2, 900, budget, [0, 1, 2, 3], treatments={"recompute": [0], "elementwise": [1, 2, 3], "head": "chunked:4"}),
    ]
    line = end_summary(records).splitlines()[2]
    # (3 + 4) / 2 steps = 3.5 of 4; recompute (3 + 1) / 2 = 2.0, elementwise 3 / 2 = 1.5 (registry order)
    assert line == (
        "memfit: 3.5 of 4 blocks treated per micro-step on average (88%: recompute 2.0, elementwise 1.5) over 2 "
        "steady micro-steps, treatments about 35% of their time (estimated); the 2 micro-steps took 0.2 s"
    )


def test_end_summary_names_treatments_the_registry_does_not_know():
    """A treatment class a run was given (not registered) is named beside the registered ones, after
    them; an unregistered head treatment is named on the head's line, not counted as chunked."""
    records = [
        _record(1, 600, None, [0, 1, 2, 3], treatments={"my_offload": [0], "elementwise": [1, 2], "recompute": [3],
                                                        "head": "my_head:2"}),
        _record(2, 600, None, [0, 1], treatments={"elementwise": [0, 1], "head": "chunked:4"}, implementations={"head": "pure"}),
        _record(3, 600, None, [], treatments={"head": "keep"}),
    ]
    lines = end_summary(records).splitlines()
    assert "(50%: recompute 0.3, elementwise 1.3, my_offload 0.3)" in lines[2]
    assert lines[3] == "memfit: LM head kept on 1 micro-step, chunked on 1 (pure), my_head on 1"


def test_the_summary_says_sizes_in_the_family_of_the_budget_typed():
    """NOTE [A budget as typed] in budget.py: a budget typed in MB reads MB back, with its name to raise."""
    budget = Budget.parse("500MB", "--memory_budget")
    records = [_record(1, 600 * 10**6, budget.bytes, [], static_bytes=10**8)]
    lines = end_summary(records, budget).splitlines()
    assert lines[0].endswith("budget 500MB (500000000 bytes)")
    assert lines[1].startswith("memfit: peak 600.0 MB = 120% of the budget")
    assert lines[-1].endswith("most of it is the activations, 500.0 MB: lower --per_device_train_batch_size or "
                              "--max_seq_length, or raise --memory_budget")
    assert end_summary(records, Budget.parse("500MB")).endswith(", or raise budget=")  # memfit.fit's argument


def test_end_summary_without_budget_and_without_steps():
    text = end_summary([_record(1, 2**20, None, [])])
    assert "no budget: nothing is capped" in text and "peak 1.0 MiB (logical accounting), not capped" in text
    assert end_summary([]) == "memfit: no training step ran"


@pytest.mark.parametrize(
    "n, text",
    [
        (500 * 10**6, "500 MB"),
        (8 * 10**9, "8 GB"),
        (6 * 2**30, "6 GiB"),
        (512 * 2**20, "512 MiB"),
        (26 * 10**6, "26 MB"),
        (1500 * 10**6, "1500 MB"),
        (123456789, "117.7 MiB"),
    ],
)
def test_a_budget_in_the_unit_it_was_given(n, text):
    assert size_in_given_unit(n) == text


# (what, records' static and peak, budget) -> the verdict's words (NOTE [What to change when a step cannot fit])
VERDICTS = [
    ("no budget", 0, 500, None, "no budget was given"),
    ("kept", 100, 900, 1000, "every micro-step kept to the budget"),
    ("static dominates", 900, 1100, 1000, "1 of 1 micro-steps went over the budget; most of it is the static part (weights, "
     "gradients, optimizer state), 900 B: train LoRA adapters (--use_peft), store bf16 weights"),
    ("activations dominate", 100, 5000, 1000, "most of it is the activations, 4900 B: lower "
     "--per_device_train_batch_size or --max_seq_length, or raise the budget"),  # records do not say who gave it
]


@pytest.mark.parametrize("what, static, peak, budget, words", VERDICTS, ids=[v[0] for v in VERDICTS])
def test_summary_ends_with_one_verdict(what, static, peak, budget, words):
    record = _record(1, peak, budget, [0, 1, 2, 3], static_bytes=static)
    last = end_summary([record]).splitlines()[-1]
    assert last == verdict([record]) and last.startswith("memfit: verdict: ") and words in last


def test_over_budget_words_name_the_largest_part_and_its_flag():
    assert "the static part" in over_budget_words({"static": 3, "outside": 2, "blocks": 1})
    outside = over_budget_words({"static": 1, "outside": 3, "blocks": 2})
    # no part beside the blocks: an LM head kept, or a model with none, whose layers no block holds may be the most
    assert "layers no block holds" in outside and "memfit.fit's blocks=" in outside and "--memfit_head auto" in outside


def test_a_part_kind_that_cannot_fit_is_named_by_its_own_words():
    """NOTE [What to change when a step cannot fit]: a part kind beside the blocks says what it is and what to change
    (``floor_words``), and the rest outside the blocks is named besides it by its title; one that says nothing is
    named by its kind (records name a part by its kind alone)."""
    import memfit

    class Squeezer(memfit.PartKind):
        name = "squeezer_of_the_summary_test"
        title = "the final norm's squeezer"
        floor_words = ("the squeezer's copies, squeezed", "lower --squeeze")

    assert over_budget_words({"static": 1, Squeezer.name: 9, "outside-not-parts": 2, "blocks": 3}) == (
        "most of it is the squeezer's copies, squeezed, 9 B: lower --squeeze, or raise the budget")
    assert over_budget_words({"static": 1, Squeezer.name: 2, "outside-not-parts": 9, "blocks": 3}).startswith(
        "most of it is what runs outside the blocks besides the final norm's squeezer (the embeddings")
    assert over_budget_words({"static": 1, "untitled": 9, "blocks": 3}).startswith("most of it is the part untitled beside")

    class StandIn(memfit.PartKind):  # a test's stand-in under the head's name, no title of its own: the head's words stay
        name = "head"

    from memfit.engine.parts.kind import part_title

    assert part_title("head") == "LM head" and "in its most chunks" in over_budget_words({"static": 1, "head": 9})


def test_parameters_words():
    assert parameters_words(10, 1000) == "trainable 10 of 1,000 parameters (1.00%)"
    assert parameters_words(10, 1000, ["q_proj"], 1).endswith("adapters on q_proj (1 module)")


def test_compiled_blocks_are_named_at_the_start_and_their_compile_time_at_the_end():
    line = start_line("dynamic", None, "cuda", ["LlamaDecoderLayer"] * 2, compiled="--torch_compile")
    assert line.endswith("compiled blocks (--torch_compile: each block's body and the loss compiled inside memfit's treatments)")
    assert "compiled" not in start_line("dynamic", None, "cuda", ["LlamaDecoderLayer"] * 2)
    records = [_record(1, 10, None, [], compile_ms=5000.0, compiled_graphs=3), _record(2, 10, None, []),
               _record(3, 10, None, [], compile_ms=1500.0, compiled_graphs=1)]
    assert "memfit: compiling took 6.5 s, 1 graph compiled after warm-up" in end_summary(records)
    assert "compiling" not in end_summary(records[1:2])
