"""The LM head in step records, run summaries and plans files (issue 39): each step says the head's
treatment and chunk count (NOTE [The head in a record]); plans files save and load a plan's head,
and files written before the head existed still load (NOTE [Plans files])."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import memfit
from memfit.engine.methods import load_plans, save_plans
from memfit.engine.plan.planner import Plan
from memfit.engine.records import StepRecord, parse_part_label, part_steps, summarize, treated_blocks

tf = pytest.importorskip("transformers")


def _record(step: int, tokens: int, treatments: dict, plan=()) -> StepRecord:
    return StepRecord(step, [4, tokens // 4], tokens, "dynamic", list(plan), len(plan), 4, None, 100, 100, None,
                      "logical", 1.0, 0.0, treatments=treatments)


def test_head_label_reads_as_treatment_and_chunk_count():
    assert parse_part_label("keep", "head") == ("keep", 1)
    assert parse_part_label("chunked:16", "head") == ("chunked", 16)
    for bad in ("", "chunked:", "chunked:0", "chunked:x", ":4"):
        with pytest.raises(ValueError, match="neither 'keep' nor"):
            parse_part_label(bad, "head")


def test_a_record_says_the_heads_treatment_apart_from_its_blocks():
    rec = _record(1, 400, {"recompute": [0, 1], "head": "chunked:8"}, plan=(0, 1))
    assert rec.parts == {"head": ("chunked", 8)}
    assert rec.block_treatments == {"recompute": [0, 1]}
    again = StepRecord.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert again.parts == {"head": ("chunked", 8)} and again.treatments == rec.treatments
    assert _record(2, 40, {"head": "keep"}).parts == {"head": ("keep", 1)}
    assert _record(2, 40, {"head": "keep"}).block_treatments == {}
    # no planned head (head=False, or records of before): no head; schema 1 recomputed its plan
    old = _record(3, 40, {}, plan=(2,))
    assert old.parts == {} and old.block_treatments == {"recompute": [2]}


def test_summary_counts_steps_per_head_label_and_no_head_block():
    records = [
        _record(1, 40, {"head": "keep"}),
        _record(2, 400, {"recompute": [0], "head": "chunked:16"}, plan=(0,)),
        _record(3, 800, {"recompute": [0, 1], "head": "chunked:4"}, plan=(0, 1)),
        _record(4, 400, {"recompute": [0], "head": "chunked:16"}, plan=(0,)),
    ]
    summary = summarize(records)
    assert summary.part_steps == {"head": {"keep": 1, "chunked:4": 1, "chunked:16": 2}}  # fewest chunks first
    assert list(summary.part_steps["head"]) == ["keep", "chunked:4", "chunked:16"]
    assert summary.treated_blocks == treated_blocks(records) == {"recompute": 4}
    assert summarize([_record(1, 40, {})]).part_steps == {} == part_steps([])


def test_plans_file_saves_and_loads_a_plans_head(tmp_path):
    plans = {
        (4, 8): Plan(()).with_option("head", ("keep", 1)),
        (4, 64): Plan((0, 1), kinds=("selective", "recompute")).with_option("head", ("chunked", 16)),
        (4, 32): Plan((1,)),  # a plan that did not place the head
    }
    path = tmp_path / "plans.json"
    save_plans(path, 2, plans, fingerprint="abc")
    rows = {tuple(r["key"]): r for r in json.loads(path.read_text())["plans"]}
    assert rows[(4, 64)]["head"] == "chunked:16" and rows[(4, 8)]["head"] == "keep" and "head" not in rows[(4, 32)]
    loaded, n_blocks, fingerprint = load_plans(str(path))
    assert loaded == plans and n_blocks == 2 and fingerprint == "abc"


@pytest.mark.parametrize("schema, row", [
    (1, {"key": [4, 16], "blocks": [0]}),
    (2, {"key": [4, 16], "blocks": [0, 1], "treatments": ["selective", "recompute"]}),
])
def test_plans_files_of_before_the_head_still_load_without_a_head(tmp_path, schema, row):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema_version": schema, "n_blocks": 2, "plans": [row]}))
    plans, _, _ = load_plans(str(path))
    assert plans[(4, 16)].option("head") is None and plans[(4, 16)].blocks == tuple(row["blocks"])


def test_a_bad_head_label_in_a_plans_file_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"n_blocks": 2, "plans": [{"key": [4, 16], "blocks": [], "head": "chunked:0"}]}))
    with pytest.raises(ValueError, match=r"plans file .*bad.json is malformed .*head label 'chunked:0'"):
        load_plans(str(path))


def _llama(vocab: int = 4000):
    config = tf.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=37, vocab_size=vocab, use_cache=False)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).train()


def _steps(model, ctl, lengths, rows=2):
    generator = torch.Generator().manual_seed(1)
    for length in lengths:
        ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=generator)
        ctl.run_step(lambda: model(input_ids=ids, labels=ids).loss.backward())
        model.zero_grad(set_to_none=True)
    return list(ctl.records)


def test_precomputed_runs_a_files_head_where_the_head_is_planned_and_drops_it_where_not(tmp_path):
    base = _llama()
    path = tmp_path / "plans.json"
    save_plans(path, 2, {(2, 8): Plan(()).with_option("head", ("keep", 1)), (2, 32): Plan((0,)).with_option("head", ("chunked", 4))})
    model = copy.deepcopy(base)
    ctl = memfit.fit(model, budget=None, method="precomputed", path=path, head=True, announce=False)
    records = _steps(model, ctl, [8, 32])
    assert [r.parts.get("head") for r in records] == [("keep", 1), ("chunked", 4)]
    assert ctl.head.part.switch.chunked_forwards == 1
    # the chunked step says which implementation ran it, and the summary says the head's mix
    assert [r.implementations.get("head") for r in records] == [None, ctl.head.part.switch.implementation]
    assert StepRecord.from_dict(records[1].to_dict()).implementations.get("head") == ctl.head.part.switch.implementation
    from memfit.engine.summary_text import end_summary

    assert f"memfit: LM head kept on 1 micro-step, chunked on 1 ({ctl.head.part.switch.implementation})" in end_summary(records)
    ctl.remove()
    model = copy.deepcopy(base)
    ctl = memfit.fit(model, budget=None, method="precomputed", path=path, announce=False)
    records = _steps(model, ctl, [8, 32])
    ctl.remove()
    assert [r.parts.get("head") for r in records] == [None, None] and records[1].block_treatments == {"recompute": [0]}


def test_a_dynamic_runs_plans_file_keeps_each_shapes_head(tmp_path):
    """A dynamic run that chunks its long batches' head (the budget of tests/test_head_fit.py) writes
    each shape's head into its plans file; precomputed from that file runs the same heads."""
    base = _llama(vocab=8000)
    lengths = [16, 64, 8, 32, 64, 16, 48, 64, 8, 64]
    model = copy.deepcopy(base)
    ctl = memfit.fit(model, budget=12_000_000, method="dynamic", head=True, announce=False)
    ran = {tuple(r.shape): r.parts.get("head") for r in _steps(model, ctl, lengths, rows=4) if r.phase == "steady"}
    ctl.save_plans(str(tmp_path / "plans.json"))
    ctl.remove()
    plans, _, _ = load_plans(str(tmp_path / "plans.json"))
    assert {p.option("head")[0] for p in plans.values()} == {"keep", "chunked"}, plans
    assert all(plans[key].option("head") == head for key, head in ran.items() if key in plans)
    model = copy.deepcopy(base)
    ctl = memfit.fit(model, budget=None, method="precomputed", path=tmp_path / "plans.json", head=True, announce=False)
    again = {tuple(r.shape): r.parts.get("head") for r in _steps(model, ctl, lengths, rows=4)}
    ctl.remove()
    assert all(again[key] == plans[key].option("head") for key in plans if key in again)


def test_a_parts_implementation_loads_from_a_record_of_either_version():
    """A part's implementation is ``implementations[<kind>]``; an earlier version wrote the LM head's as
    ``head_implementation``, read into the same place; the summary names it either way."""
    from memfit.engine.summary_text import end_summary

    line = StepRecord(1, [2, 8], 16, "dynamic", [], 0, 2, None, 0, 0, None, "logical", 1.0, 0.0,
                      treatments={"head": "chunked:4"}, implementations={"head": "liger"}).to_dict()
    assert "head_implementation" not in line and StepRecord.from_dict(line).implementations == {"head": "liger"}
    old = {k: v for k, v in line.items() if k != "implementations"} | {"head_implementation": "liger"}
    assert StepRecord.from_dict(old).implementations == {"head": "liger"}
    assert StepRecord.from_dict({**old, "head_implementation": None}).implementations == {}
    for data in (line, old):
        assert "memfit: LM head chunked on 1 micro-step (liger)" in end_summary([StepRecord.from_dict(data)])

