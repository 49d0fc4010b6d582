"""benchmarks/run_suite.py: suites run on CPU and publish the canonical results folder."""

import gzip
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from memfit.engine.records import StepRecord, read_jsonl

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("run_suite", ROOT / "benchmarks" / "run_suite.py")
run_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_suite)


def _record(step: int, **changes) -> dict:
    record = StepRecord(step=step, shape=[4, 16], tokens=64, method="dynamic", plan=[0], n_checkpointed=1, n_blocks=2,
                        predicted_peak_bytes=1000, peak_allocated_bytes=900, peak_reserved_bytes=950,
                        budget_bytes=2000, accounting="logical", step_ms=1.5, recompute_ms_est=0.1)
    return {**record.to_dict(), **changes}


def test_compacted_step_records_keep_what_the_report_reads(tmp_path):
    src = tmp_path / "memfit_steps.jsonl"
    records = [_record(1, phase="warmup", step_ms=12.3456789, planner_us=41.23456),
               _record(2, saved_activation_bytes=123456789, static_bytes=98765, planned=True),
               _record(3, evicted_blocks=[1], oom_retries=1, oom_attempts=[{"stage": "backward"}], backstop_armed=True)]
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert run_suite.compact_steps(src, tmp_path / "a.jsonl.gz") == 3
    back = [StepRecord.from_dict(d) for d in read_jsonl(tmp_path / "a.jsonl.gz")]
    unread = {name: run_suite._step_defaults()[name] for name in run_suite.UNREAD_STEP_FIELDS}  # read as defaults
    expected = [StepRecord.from_dict({**r, **unread, **{k: round(r[k], n) for k, n in run_suite.STEP_DECIMALS.items()}})
                for r in records]
    assert back == expected
    assert "rank" not in next(iter(read_jsonl(tmp_path / "a.jsonl.gz")))  # a default left out
    assert back[1].static_bytes == 98765  # kept: benchmarks/model_replay.py predicts from it
    run_suite.compact_steps(src, tmp_path / "b.jsonl.gz")  # no time in the gzip header: the same bytes
    assert (tmp_path / "a.jsonl.gz").read_bytes() == (tmp_path / "b.jsonl.gz").read_bytes()


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H200", "nvidia-h200"), ("NVIDIA H100 80GB HBM3", "nvidia-h100"), ("NVIDIA H100 PCIe", "nvidia-h100-pcie"),
    ("NVIDIA A100-SXM4-80GB", "nvidia-a100-sxm4"), ("Tesla V100-SXM2-16GB", "tesla-v100-sxm2"),
])
def test_device_folder_names(name, slug):
    assert run_suite.device_slug(name) == slug


def test_every_suite_defines_its_calls(tmp_path):
    from suites import Call, Context, Suite

    names = run_suite.suite_names()
    assert {"engine", "tasks", "detection", "soak", "estimate", "ddp", "planner", "mrpc-minilm"} <= set(names)
    for name in names:
        module = run_suite.load(name)
        assert isinstance(module.SUITE, Suite) and module.SUITE.name == name
        for quick, cuda in ((False, True), (True, False)):
            suite = getattr(module, "QUICK", module.SUITE) if quick else module.SUITE
            calls = module.calls(suite, Context(raw=tmp_path / name, quick=quick, cuda=cuda))
            assert calls and all(isinstance(c, Call) and c.commands for c in calls), name
            assert len({c.name for c in calls}) == len(calls), name


def test_loop_bench_steady_time_takes_each_fixed_lengths_median():
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("loop_bench", ROOT / "benchmarks" / "loop_bench.py")
    loop_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop_bench)
    # steps alternate 8k and 16k tokens; two warm-up steps; one slow outlier per length
    times = [900.0, 900.0, 200.0, 250.0, 210.0, 400.0, 205.0, 260.0, 500.0, 255.0]
    alternating = loop_bench._steady(SimpleNamespace(steady_from=2, lengths="fixed:8192,16384"), times)
    assert alternating["steady_step_ms_by_length"] == {8192: 207.5, 16384: 257.5}
    assert alternating["steady_step_ms"] == 232.5
    drawn = loop_bench._steady(SimpleNamespace(steady_from=2, lengths="sft"), times)
    assert drawn == {"steady_step_ms": 252.5}  # the plain median of the 8 steady steps
    assert loop_bench._steady(SimpleNamespace(steady_from=20, lengths="sft"), times) == {"steady_step_ms": None}


def test_loop_bench_pairs_each_line_with_the_repeats_uncapped_none_step_by_step():
    spec = importlib.util.spec_from_file_location("loop_bench", ROOT / "benchmarks" / "loop_bench.py")
    loop_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop_bench)
    refs = {}
    none = {"method": "none", "repeat": 0, "budget_bytes": None, "status": "ok", "step_ms": [9.0, 100.0, 200.0, 100.0]}
    compiled = {"method": "none+compile", "repeat": 0, "budget_bytes": None, "status": "ok",
                "step_ms": [9.0, 50.0, 100.0, 50.0]}
    for line in (none, compiled):
        loop_bench._paired_with_none(line, refs, steady_from=1)
    assert "step_ratio_vs_none" not in none and compiled["step_ratio_vs_none"] == 0.5  # none+compile over none
    # a long step slower by 25%, short ones by 10%: the median of the per-step ratios is 1.1
    capped = {"method": "dynamic", "repeat": 0, "budget_bytes": 5, "status": "ok", "step_ms": [1.0, 110.0, 250.0, 110.0]}
    loop_bench._paired_with_none(capped, refs, steady_from=1)
    assert capped["step_ratio_vs_none"] == 1.1 and capped["step_ratio_vs_none_compile"] == 2.2
    other = {"method": "dynamic", "repeat": 1, "budget_bytes": 5, "status": "ok", "step_ms": [1.0, 2.0, 3.0, 4.0]}
    cut = {"method": "full", "repeat": 0, "budget_bytes": 5, "status": "oom", "step_ms": [1.0, 2.0]}
    for line in (other, cut):  # another repeat's none, or steps that do not pair: no ratio
        loop_bench._paired_with_none(line, refs, steady_from=1)
        assert "step_ratio_vs_none" not in line


def test_loop_bench_reads_a_margin_share_after_a_memfit_method():
    spec = importlib.util.spec_from_file_location("loop_bench", ROOT / "benchmarks" / "loop_bench.py")
    loop_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop_bench)
    method, kwargs, treatments = loop_bench._memfit_config("dynamic+all@0.1")
    assert (method, kwargs, treatments) == ("dynamic", {"margin": 0.1}, ("recompute", "selective", "offload"))
    assert "margin" not in loop_bench.MEMFIT_METHODS["dynamic+all"][1]  # the table itself is left alone
    assert loop_bench._memfit_config("dynamic") == loop_bench.MEMFIT_METHODS["dynamic"]
    for bad in ("dynamic@0.5", "dynamic@x", "plain@0.1", "dynamic-plans@0.1"):
        assert loop_bench._memfit_config(bad) is None


def test_paired_steps_pairs_the_latest_runs_step_by_step(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("paired_steps", ROOT / "benchmarks" / "paired_steps.py")
    paired_steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paired_steps)

    def line(method, budget, times, **extra):
        return json.dumps({"method": method, "budget_bytes": budget, "repeat": 0, "steps": len(times),
                           "step_ms": times, "status": "ok", **extra})

    lines = [
        line("compile-0.5", 5, [9.0, 50.0, 50.0, 50.0]),  # an earlier call's, replaced below
        line("none", None, [9.0, 100.0, 200.0, 100.0]),
        line("dynamic", 5, [9.0, 90.0, 260.0, 95.0]),
        line("compile-0.5", 5, [9.0, 100.0, 200.0, 100.0]),
        line("dynamic", 5, [1.0, 1.0, 1.0, 1.0], lora=True),  # another setup
        line("none", None, [1.0, 1.0, 1.0, 1.0], model="other"),  # another model's, appended last
    ]
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    for against in ("compile-0.5", "none"):  # the latest capped peer, and the uncapped reference
        paired_steps.main([str(tmp_path), "--a", "dynamic", "--b", against, "--steady_from", "1"])
        # differences -10, +60, -5: median -5 ms; ratios 0.9, 1.3, 0.95: median 0.95
        out = capsys.readouterr().out
        assert "median difference -5.0 ms, median ratio 0.950" in out and out.count("median ratio") == 1
    paired_steps.main([str(tmp_path), "--a", "dynamic", "--b", "static"])
    assert "no run of dynamic pairs" in capsys.readouterr().out


@pytest.mark.slow
def test_quick_soak_publishes_the_canonical_folder(tmp_path):
    out, raw = tmp_path / "out", tmp_path / "raw"
    assert run_suite.main(["soak", "--quick", "--out", str(out), "--raw", str(raw)]) == 0
    lines = list(read_jsonl(out / "results.jsonl"))
    assert [(r["method"], r["status"]) for r in lines] == [("dynamic", "ok"), ("reactive", "ok")]
    assert all(r["max_peak_allocated_bytes"] <= r["budget_bytes"] for r in lines)
    for line in lines:
        assert line["steps_file"] == f"runs/cpu.{line['method']}.steps.jsonl.gz"
        with gzip.open(out / line["steps_file"], "rt") as fh:
            assert sum(1 for _ in fh) == line["steps"]
    report = (out / "report" / "report.md").read_text()
    assert "## adversarial" in report and report.count(".steps.jsonl.gz` |") == 2
    assert "| cpu |" in (out / "SOURCE.md").read_text()
    published = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert not [p for p in published if p.endswith(".log") or p.endswith(".jsonl") and p != "results.jsonl"]
    with pytest.raises(SystemExit, match="already ran"):
        run_suite.main(["soak", "--quick", "--out", str(out), "--raw", str(raw)])
    # Publishing the raw folder again gives the same files, byte for byte.
    before = {p: (out / p).read_bytes() for p in published if not p.startswith("report/") and p != "SOURCE.md"}
    assert run_suite.main(["soak", "--publish", str(raw), "--out", str(out)]) == 0
    assert before == {p: (out / p).read_bytes() for p in before}


def test_planner_bench_times_the_planner_on_each_model():
    spec = importlib.util.spec_from_file_location("planner_bench", ROOT / "benchmarks" / "planner_bench.py")
    planner_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planner_bench)
    for name, build in planner_bench.MODELS.items():
        out = planner_bench.bench(build, steps=20, repeats=1, learn_every=3)
        for method in ("dynamic", "static"):
            r = out[method]
            assert 0 < r["mean_checkpointed"] < r["n_blocks"], (name, method, r)  # the budget binds part of the stack
            assert r["cache_hit_us"]["median"] > 0 and r["new_bucket_us"]["median"] > 0, (name, method, r)
        assert out["dynamic"]["mean_checkpointed"] < out["static"]["mean_checkpointed"], name


def test_a_suite_whose_quick_path_needs_cuda_says_so_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(run_suite, "_machine", lambda suite: {"cuda": False, "gpus": 0, "slug": "cpu"})
    with pytest.raises(SystemExit, match=r"llm needs CUDA .*--quick too; on CPU, --quick checks .*detection") as err:
        run_suite.main(["llm", "--quick", "--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "out")])
    assert "llm" not in str(err.value).split("checks", 1)[1].split(", ")  # not offered as a CPU check
    assert not (tmp_path / "raw").exists() and not (tmp_path / "out").exists()  # nothing ran, nothing written


def test_loop_bench_head_peers_fix_the_chunked_head_or_say_why_they_skip():
    import torch
    import transformers as tf

    spec = importlib.util.spec_from_file_location("loop_bench", ROOT / "benchmarks" / "loop_bench.py")
    loop_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop_bench)
    assert set(loop_bench.HEAD_PEERS) <= set(loop_bench.PEERS)
    cfg = tf.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=37, vocab_size=500, use_cache=False)
    model = tf.LlamaForCausalLM(cfg).train()
    ids = torch.randint(3, 500, (2, 16))
    undo, note = loop_bench.fixed_head(model, *loop_bench.HEAD_PEERS["hf-every-1+chunked-8"])
    assert note is None and model(input_ids=ids, labels=ids).logits is None  # the chunked loss, no logits
    undo()
    assert model(input_ids=ids, labels=ids).logits is not None  # the model's own head again
    undo, note = loop_bench.fixed_head(model, *loop_bench.HEAD_PEERS["hf-every-1+liger"])
    assert undo is None and note.startswith("skipped: head implementation 'liger' is not usable here")  # CPU
    args = loop_bench._parse(["--model", "Qwen2.5-1.5B", "--budgets", "--budget_gb", "23.62", "--methods", "none",
                              "hf-every-1+liger", "--output_dir", "x"])
    assert args.budgets == [] and args.budget_gb == [23.62]


def _loop_bench():
    spec = importlib.util.spec_from_file_location("loop_bench", ROOT / "benchmarks" / "loop_bench.py")
    loop_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop_bench)
    return loop_bench


def test_loop_bench_head_part_of_a_name_and_the_flag_set_fits_head():
    loop_bench = _loop_bench()
    assert "head" not in loop_bench._memfit_config("dynamic")[1]  # fit's own default
    assert loop_bench._memfit_config("dynamic", "on")[1]["head"] is True
    assert loop_bench._memfit_config("dynamic+compile", "on")[1] == {"compile": True, "head": True}
    assert loop_bench._memfit_config("dynamic+head-off", "on")[1]["head"] is False  # the name wins
    assert loop_bench._memfit_config("dynamic+head-auto")[1]["head"] == "auto"
    method, kwargs, _ = loop_bench._memfit_config("full+head@0.1")
    assert method == "full" and kwargs == {"head": True, "margin": 0.1}
    assert loop_bench._memfit_config("plain+head") is None and loop_bench._memfit_config("dynamic+head-x") is None


def test_loop_bench_compares_memfit_with_the_fastest_fixed_policy_that_fits():
    loop_bench = _loop_bench()
    base = {"budget_bytes": 100, "repeat": 0, "oom_count": 0, "status": "ok"}
    lines = [
        {**base, "method": "dynamic", "step_ms": [9, 9, 4.0, 8.0, 6.0], "steady_step_ms": 6.0},
        {**base, "method": "hf-every-1+chunked-8", "step_ms": [9, 9, 5.0, 10.0, 10.0], "steady_step_ms": 10.0},
        {**base, "method": "hf-every-1+liger", "step_ms": [9, 9, 8.0, 8.0, 8.0], "steady_step_ms": 8.0},
        # faster, but did not fit: not a candidate
        {**base, "method": "hf-every-1", "step_ms": [1, 1], "steady_step_ms": 1.0, "status": "oom", "oom_count": 1},
        {**base, "method": "plain", "step_ms": [1, 1, 1, 1, 1], "steady_step_ms": 1.0},  # no policy
        {**base, "method": "full", "repeat": 1, "step_ms": [1, 1, 1], "steady_step_ms": 1.0},  # another repeat
        {**base, "method": "none", "budget_bytes": None, "step_ms": [1, 1, 1], "steady_step_ms": 1.0},
    ]
    loop_bench.add_vs_fixed(lines, steady_from=2)
    dynamic = lines[0]
    assert dynamic["fastest_fixed"] == "hf-every-1+liger" and dynamic["fixed_fitting"] == 2
    assert dynamic["step_ratio_vs_fastest_fixed"] == 0.75  # median of 4/8, 8/8, 6/8
    assert dynamic["sum_ratio_vs_fastest_fixed"] == 0.75
    assert all("fixed_fitting" not in x for x in lines[1:5] + lines[6:])  # peers and uncapped lines
    assert lines[5]["fixed_fitting"] == 0 and "fastest_fixed" not in lines[5]  # nothing fixed fits there


@pytest.mark.slow
def test_head_calls_run_end_to_end_on_cpu_with_a_tiny_model(tmp_path):
    """The head job's two commands, as the suite builds them, on a 2-layer model on CPU: arguments parse,
    every configuration writes its line (the liger peer skips on CPU), the head is planned and recorded,
    and <call>.vs_fixed.md is written."""
    from suites import Context
    from suites import llm

    raw = tmp_path / "raw"
    ctx = Context(raw=raw, quick=True, cuda=False)
    for call in llm.head_calls(llm.QUICK, ctx, tiny=True):
        for command in call.commands:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
            assert done.returncode == 0, done.stderr[-2000:]
    qwen = [json.loads(x) for x in (raw / "head-qwen15" / "results.jsonl").read_text().splitlines()]
    assert {(x["method"], x["status"]) for x in qwen} >= {
        ("dynamic", "ok"), ("full", "ok"), ("hf-every-1+chunked-8", "ok"), ("hf-every-1+liger", "skipped")}
    # a tiny budget under the CPU's for-loop AdamW bound is a budget error line; the others ran
    dynamic = [x for x in qwen if x["method"] == "dynamic" and x["status"] == "ok"]
    assert dynamic and all(x["head_steps"] and x["fixed_fitting"] >= 1 and "step_ratio_vs_fastest_fixed" in x for x in dynamic)
    assert all(x["head"]["implementation"] in ("pure", "pure_grad_in_forward") for x in dynamic)  # the probe's choice, said
    assert "| dynamic |" in (raw / "head-qwen15" / "head-qwen15.vs_fixed.md").read_text()
    smollm = [json.loads(x) for x in (raw / "head-smollm" / "results.jsonl").read_text().splitlines()]
    assert {x["method"] for x in smollm} == {"none", "dynamic+head-auto", "dynamic+head-off"}
    assert all(not x.get("head_steps") and "head" not in x for x in smollm if x["method"] == "dynamic+head-off")
    # published side by side: both calls' tables, the lines, the report
    assert run_suite.main(["llm", "--publish", str(raw), "--out", str(tmp_path / "published")]) == 0
    published = {p.name for p in (tmp_path / "published").iterdir()}
    assert {"head-qwen15.vs_fixed.md", "head-smollm.vs_fixed.md", "results.jsonl", "report"} <= published


def test_head_job_line_is_the_suites_head_calls_and_parses():
    """The one line the GPU session runs is the suite's head calls, each under its timeout, each parsed
    by loop_bench without an unknown method; their timeouts fit the job's 520 s."""
    import shlex

    from suites import llm

    loop_bench = _loop_bench()
    line = llm.head_job("/out/head")
    parts = [shlex.split(part) for part in line.split(" ; ")]
    assert [p[:3] for p in parts] == [["timeout", "130", "python3"], ["timeout", "375", "python3"]]
    assert sum(float(p[1]) for p in parts) <= 520
    for words, folder in zip(parts, ("head-smollm", "head-qwen15")):
        assert words[3] == "benchmarks/loop_bench.py"
        args = loop_bench._parse(words[4:])
        assert args.output_dir == f"/out/head/{folder}" and args.no_cudnn_sdpa
        assert all(m == "none" or loop_bench._memfit_config(m) or m in loop_bench.PEERS for m in args.methods + args.last)
        assert args.time_limit_s + args.config_time_limit_s + 15 <= float(words[1])
    qwen = loop_bench._parse(parts[1][4:])
    assert qwen.head == "on" and qwen.budget_gb == [23.62, 42.73] and qwen.repeats >= 3


def test_loop_bench_pairs_head_auto_with_head_off_step_by_step():
    loop_bench = _loop_bench()
    base = {"budget_bytes": 100, "repeat": 0, "status": "ok"}
    lines = [
        {**base, "method": "dynamic+head-auto", "step_ms": [9, 9, 10.0, 11.0, 10.0]},
        {**base, "method": "dynamic+head-off", "step_ms": [1, 1, 10.0, 10.0, 10.0]},
        {**base, "method": "dynamic+head-auto", "repeat": 1, "step_ms": [1, 1, 1, 1, 1]},  # no twin in repeat 1
    ]
    loop_bench.add_vs_head_off(lines, steady_from=2)
    assert lines[0]["step_ratio_vs_head_off"] == 1.0  # median of 1.0, 1.1, 1.0
    assert "step_ratio_vs_head_off" not in lines[1] and "step_ratio_vs_head_off" not in lines[2]


def test_loop_bench_fields_give_per_length_band_peaks_retries_bias_and_compile_time():
    """Issue 40's room-compile call: per band of lengths, the steady steps' peak and reserved peak
    over the cap, retries, the median prediction error over the cap; the compile time and the
    graphs compiled after the first step."""
    import importlib.util
    from types import SimpleNamespace

    from memfit.engine.records import StepRecord

    spec = importlib.util.spec_from_file_location("loop_bench", ROOT / "benchmarks" / "loop_bench.py")
    loop_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop_bench)

    def record(step, length, peak, predicted, phase="steady", **extra):
        return StepRecord(step=step, shape=[8, length], tokens=8 * length, method="dynamic", plan=[0], n_checkpointed=1,
                          n_blocks=4, predicted_peak_bytes=predicted, peak_allocated_bytes=peak,
                          peak_reserved_bytes=peak + 50, budget_bytes=1000, accounting="cuda", step_ms=1.0,
                          recompute_ms_est=0.0, phase=phase, **extra)

    records = [record(1, 300, 500, 900, phase="warmup", compile_ms=4000.0, compiled_graphs=3),
               record(2, 100, 600, 610), record(3, 200, 700, 690, alloc_retries=2),
               record(4, 2000, 950, 990), record(5, 1990, 900, 990, compile_ms=500.0, compiled_graphs=1)]
    fields = loop_bench._memfit_fields(SimpleNamespace(steps=5), records)
    assert fields["compile_s"] == 4.5 and fields["steady_compiled_graphs"] == 1
    assert fields["by_length"] == {
        "256": {"steps": 2, "peak_over_cap": 0.7, "reserved_over_cap": 0.75, "alloc_retries": 2,
                "bias_over_cap": 0.0, "treated_per_step": 1},
        "2048": {"steps": 2, "peak_over_cap": 0.95, "reserved_over_cap": 1.0, "alloc_retries": 0,
                 "bias_over_cap": 0.065, "treated_per_step": 1},
    }
    from suites import Context

    llm = run_suite.load("llm")
    (call,) = [c for c in llm.calls(llm.SUITE, Context(raw=ROOT / "runs" / "x", quick=False, cuda=True)) if c.name == "room-compile"]
    command = " ".join(call.commands[0])
    assert "--methods none dynamic dynamic+compile hf-every-1" in command and "--repeats 3" in command
    assert "--budgets 0.5" in command and "--time_limit_s 180" in command


def test_loop_bench_compile_peer_takes_a_fixed_head_part():
    loop_bench = _loop_bench()
    assert loop_bench._compile_budget("compile-0.5") == 0.5 and loop_bench._compile_head("compile-0.5") is None
    assert loop_bench._compile_budget("compile-0.5+chunked-8") == 0.5
    assert loop_bench._compile_head("compile-0.5+chunked-8") == "+chunked-8"
    assert loop_bench._compile_head("compile-1+liger") == "+liger" and loop_bench._compile_budget("compile-1+liger") == 1.0
    assert loop_bench._compile_budget("compile-0.5+head") is None and loop_bench._compile_budget("compile-2+liger") is None
    assert loop_bench._is_fixed("compile-0.5+liger")  # a fixed policy memfit is compared with


def test_llm_suite_has_the_compiled_head_call_and_long_context_at_32k():
    """The calls behind nvidia-h100/llm-head's compiled rows and llm-room's 16k/32k and compiled
    cells: each parsed by loop_bench without an unknown method, within a device command's 10 minutes."""
    from suites import Context

    loop_bench = _loop_bench()
    llm = run_suite.load("llm")
    calls = {c.name: c for c in llm.calls(llm.SUITE, Context(raw=ROOT / "runs" / "x", quick=False, cuda=True))}
    head, long32, sides = calls["head-compile"], calls["room-long32"], calls["compile-sides"]
    auto = [calls["head-auto-qwen15"], calls["head-auto-llama1b"]]
    floor, anatomy = calls["head-floor-llama1b"], calls["head-anatomy-llama1b"]
    for call in (head, long32, sides, *auto, calls["head-kernels-llama1b"], floor, anatomy):
        words = [str(w) for w in call.commands[0]]
        args = loop_bench._parse(words[words.index(next(w for w in words if w.endswith("loop_bench.py"))) + 1:])
        assert all(loop_bench._memfit_config(m) or m in loop_bench.PEERS or loop_bench._compile_budget(m)
                   or m == "none" for m in args.methods), args.methods
        assert call.timeout_s <= 600
    assert "compile-0.1+chunked-8" in head.commands[0] and "dynamic+sel+compile" in head.commands[0]
    assert "fixed:16384,32768" in long32.commands[0] and "hf-offload" in long32.commands[0]
    assert "dynamic+sel+compile" in sides.commands[0] and "none" in sides.commands[0]
    assert "plain" in floor.commands[0] and "dynamic+auto+only-cce" in floor.commands[0]
    assert "--gpu_busy" in anatomy.commands[0] and "plain" in anatomy.commands[0]
    for call, model in zip(auto, ("Qwen2.5-1.5B", "Llama-3.2-1B")):
        words = [str(w) for w in call.commands[0]]
        assert words[words.index("--model") + 1] == model and "dynamic+auto" in words and "hf-every-1+liger" in words


def test_loop_bench_runs_the_compile_peer_and_undoes_it(tmp_path, monkeypatch):
    """A ``compile-F`` configuration end to end on CPU (Dynamo with AOT's eager backend: no C
    compiler): it trains, its undo restores the blocks, and its line carries the peer's note (the
    undo once called ``__exit__`` on the run's list of compiled steps, which had taken its name)."""
    import memfit.tools.bench.peers as peers

    class AotEager(peers.TorchCompile):
        def __init__(self, budget, backend="inductor"):
            super().__init__(budget, backend="aot_eager")

    monkeypatch.setattr(peers, "TorchCompile", AotEager)
    loop_bench = _loop_bench()
    out = tmp_path / "out"
    assert loop_bench.main(["--model", "llama-tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "uniform:8:24",
                            "--batch", "2", "--steps", "3", "--steady_from", "1", "--budgets", "--budget_gb", "1",
                            "--repeats", "1", "--methods", "compile-0.5", "--output_dir", str(out)]) == 0
    (line,) = [json.loads(text) for text in (out / "results.jsonl").read_text().splitlines()]
    assert line["status"] == "ok" and len(line["step_ms"]) == 3
    assert line["note"].startswith("torch.compile (aot_eager, activation_memory_budget 0.5)")


def test_model_replay_predicts_each_step_with_its_blocks_treatments(tmp_path, capsys):
    """benchmarks/model_replay.py on a CPU run of loop_bench: a step record's blocks are replayed under
    the treatment the record names (it once replayed every treated block as recomputed), each row's
    prediction the run's last model's for that plan. The run's line says what the head's probe read."""
    from memfit.engine.plan.model import MemoryModel
    from memfit.engine.plan.planner import Plan

    loop_bench = _loop_bench()
    out = tmp_path / "out"
    assert loop_bench.main(["--model", "llama-tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "uniform:64:160",
                            "--batch", "2", "--steps", "5", "--steady_from", "3", "--budgets", "--budget_gb", "0.061",
                            "--repeats", "1", "--head", "on", "--methods", "dynamic", "--output_dir", str(out)]) == 0
    (line,) = [json.loads(text) for text in (out / "results.jsonl").read_text().splitlines()]
    probed = line["head"]["probed"]  # what warm-up's probe read of each implementation, for the records
    assert line["head"]["implementation"] in probed and probed["pure"]["tokens"] > 0 and line["head"]["failed"] == []
    assert probed["pure"]["keep_ms"] > 0 and probed["pure"]["chunked_ms"] > 0
    (steps,) = (out / "steps").glob("*-r0.jsonl.gz")
    model_file = steps.with_name(steps.name.replace(".jsonl.gz", ".model.json.gz"))
    records = [json.loads(line) for line in gzip.open(steps, "rt")]
    steady = next(r for r in records if r["phase"] == "steady")
    mixes = ({"recompute": [0, 1, 2, 3]}, {"elementwise": [0, 1], "recompute": [2, 3]}, {"elementwise": [1, 3]})
    rewritten = tmp_path / "steps.jsonl.gz"
    with gzip.open(rewritten, "wt") as fh:
        for step, mix in enumerate(mixes, start=10):
            fh.write(json.dumps({**steady, "step": step, "treatments": {**mix, "head": "keep"}}) + "\n")
        # a step replayed after an OOM: its first try's plan (treatments as a list beside its blocks) and reading
        attempt = {"plan": [0, 1], "treatments": ["elementwise", "recompute"], "peak_allocated_bytes": steady["peak_allocated_bytes"]}
        fh.write(json.dumps({**steady, "step": 13, "treatments": {"head": "keep"}, "oom_attempts": [attempt]}) + "\n")
    mixes += ({"elementwise": [0], "recompute": [1]},)
    spec = importlib.util.spec_from_file_location("model_replay", ROOT / "benchmarks" / "model_replay.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    assert replay.main([str(rewritten), str(model_file), "--model", "llama-tiny"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| 1")]
    assert [row[2].strip() for row in rows] == ["4 recompute", "2 elementwise, 2 recompute", "2 elementwise",
                                                "1 elementwise, 1 recompute"]
    model = MemoryModel.from_dict(json.load(gzip.open(model_file, "rt"))["model"])
    key = tuple(steady["shape"][:2])
    for row, mix in zip(rows, mixes):
        kind = {i: name for name, blocks in mix.items() for i in blocks}
        plan = Plan(tuple(sorted(kind)), kinds=tuple(kind[i] for i in sorted(kind))).with_option("head", ("keep", 1))
        assert float(row[5]) == round((steady["static_bytes"] + model.step_bytes(key, plan)) / 1e9, 2)
    assert rows[2][4].strip() == "-"  # no block re-runs its body whole


def test_loop_bench_only_part_runs_the_chunked_head_by_one_implementation(tmp_path):
    """``+only-X`` (a memfit name's last part): the head's other implementations are never probed nor run,
    so two runs of one call time the same plans' head by two kernels; an unknown X is not a method."""
    loop_bench = _loop_bench()
    assert loop_bench._memfit_config("dynamic+auto+only-liger") == loop_bench._memfit_config("dynamic+auto")
    assert loop_bench._only_head("dynamic+auto+only-liger@0.1") == "liger"
    assert loop_bench._memfit_config("dynamic+only-x") is None and loop_bench._only_head("dynamic") is None
    out = tmp_path / "out"
    assert loop_bench.main(["--model", "llama-tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "uniform:64:160",
                            "--batch", "2", "--steps", "4", "--steady_from", "2", "--budgets", "--budget_gb", "0.061",
                            "--repeats", "1", "--head", "on", "--methods", "dynamic+only-pure", "--output_dir", str(out)]) == 0
    (line,) = [json.loads(text) for text in (out / "results.jsonl").read_text().splitlines()]
    assert line["status"] == "ok" and line["head"]["implementation"] == "pure" and set(line["head"]["probed"]) == {"pure"}
    assert set(line["head"]["failed"]) == {"pure_grad_in_forward", "liger", "cce"}


def test_decide_replay_decides_each_steady_step_on_the_model_that_planned_it(tmp_path, capsys):
    """benchmarks/decide_replay.py on an H200 run's files: every steady step is decided again on the model
    after the step before (its curves taught as the run taught them), timed, and its plan written; a plan
    that needs only what the files hold comes out as the run recorded it, and ``--same_as`` fails where a
    plan differs from an earlier replay's."""
    spec = importlib.util.spec_from_file_location("decide_replay", ROOT / "benchmarks" / "decide_replay.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    run = ROOT / "tests" / "fixtures" / "h200_llm_optimizer" / "optimizer-llama1b.s32-5.dynamic+auto-12.35GB-r0"
    files = [f"{run}.steps.jsonl.gz", f"{run}.models.jsonl.gz", "--repeats", "2", "--sweep", "2"]
    out = tmp_path / "plans.json"
    assert replay.main([*files, "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    stepped = [p for p in written["plans"] if "recorded" in p]
    assert [p["step"] for p in stepped] == list(range(4, 31)) and len(written["times_us"]) == 2 * 27
    assert len(written["plans"]) == 27 * 3 and all(t > 0 for t in written["times_us"])
    # the first steady step, planned with room the run had learnt in warm-up: as it ran (later steps differ: the
    # stashes back now count only past the blocks above them that backward has freed, NOTE [Spread stashes])
    assert next(p for p in stepped if p["step"] == 4)["same_as_record"]
    assert "27 steady steps x 2" in capsys.readouterr().out
    assert replay.main([*files, "--same_as", str(out)]) == 0
    assert "0 differ" in capsys.readouterr().out
    written["plans"][3]["plan"] = {"recompute": list(range(16))}
    out.write_text(json.dumps(written))
    assert replay.main([*files, "--same_as", str(out)]) == 1
