"""`memfit bench` on CPU: the matrix runs, failures are recorded and the matrix goes on."""

import importlib.util
import json
from pathlib import Path

import pytest

from memfit.tools.bench import matrix as bench
from memfit.engine.records import read_jsonl


def _tiny_config(tmp_path):
    """A 2-layer BERT config file (random weights), fast on CPU."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({
        "model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 37, "vocab_size": 30522, "max_position_embeddings": 512,
    }))
    return config


def test_parse_budgets():
    assert bench.parse_budgets(["3:8:1"]) == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert bench.parse_budgets(["6", "0.5"]) == [6.0, 0.5]


@pytest.mark.slow
def test_matrix_records_every_configuration(tmp_path):
    config = _tiny_config(tmp_path)
    out = tmp_path / "bench"
    # 0.0001 GB = 100 kB: below the weights, so that configuration must fail cleanly.
    code = bench.main([
        "--tasks", "text-classification", "--methods", "none", "dynamic", "oracle", "--uncapped_none_only",
        "--budgets", "0.05", "0.0001", "--steps", "2", "--gpu_warmup_s", "0", "--output_dir", str(out),
        "--", "--config_name", str(config), "--use_cpu",
    ])
    assert code == 0
    rows = list(read_jsonl(out / "results.jsonl"))
    assert [(r["method"], r["budget_bytes"], r["status"]) for r in rows] == [
        ("none", None, "ok"), ("dynamic", 50_000_000, "ok"), ("oracle", 50_000_000, "ok"),
        ("dynamic", 100_000, "oom"), ("oracle", 100_000, "oom"),
    ]
    oracle = list(read_jsonl(out / rows[2]["steps_file"]))
    assert len(oracle) == 2 and all(s["method"] == "oracle" and s["phase"] != "warmup" for s in oracle)
    ok = rows[1]
    assert ok["max_peak_allocated_bytes"] <= ok["budget_bytes"] and ok["steps"] == 2 and ok["total_s"] > 0
    assert ok["wall_s"] > ok["total_s"] and rows[2]["wall_s"] > rows[2]["total_s"]  # the oracle's: sweep + run
    assert all(r["wall_s"] > 0 for r in rows[3:])  # failed configurations are timed too
    assert all("needs" in r["note"] or "budget" in r["note"] for r in rows[3:])
    steps = list(read_jsonl(out / ok["steps_file"]))
    assert len(steps) == 2 and all(s["method"] == "dynamic" for s in steps)


@pytest.mark.slow
def test_prime_runs_the_first_task_untimed_outside_the_results(tmp_path, monkeypatch):
    # On CUDA only (NOTE [First process]); the run itself goes wherever the flags say (CPU here).
    monkeypatch.setattr(bench, "_cuda_available", lambda: True)
    config = _tiny_config(tmp_path)
    flags = ["--tasks", "text-classification", "--methods", "dynamic", "--budgets", "0.05", "--steps", "2",
             "--gpu_warmup_s", "0", "--", "--config_name", str(config), "--use_cpu"]
    bench.main(["--output_dir", str(tmp_path / "primed"), *flags])
    rows = list(read_jsonl(tmp_path / "primed" / "results.jsonl"))
    assert [r["method"] for r in rows] == ["dynamic"]
    prime = list(read_jsonl(tmp_path / "primed" / "prime" / "text-classification-none-uncapped-r0" / "memfit_steps.jsonl"))
    assert len(prime) == 2 and {s["method"] for s in prime} == {"none"}
    bench.main(["--output_dir", str(tmp_path / "unprimed"), "--no-prime", *flags])
    assert not (tmp_path / "unprimed" / "prime").exists()
    assert [r["method"] for r in read_jsonl(tmp_path / "unprimed" / "results.jsonl")] == ["dynamic"]


@pytest.mark.slow
def test_savers_with_eval_metric_and_report(tmp_path):
    from memfit.tools.report import build_report

    config = _tiny_config(tmp_path)
    fixtures = __import__("pathlib").Path(__file__).parent / "fixtures" / "glue" / "MRPC"
    out = tmp_path / "savers"
    bench.main([
        "--tasks", "text-classification", "--savers", "none", "accumulation", "adafactor", "dynamic+all",
        "--budgets", "0.05", "--steps", "2", "--batch_size", "8", "--do_eval", "--gpu_warmup_s", "0",
        "--output_dir", str(out), "--", "--config_name", str(config), "--use_cpu", "--task_name", "mrpc",
        "--train_file", str(fixtures / "train.tsv"), "--validation_file", str(fixtures / "dev.tsv"),
    ])
    rows = list(read_jsonl(out / "results.jsonl"))
    assert [(r["method"], r["status"]) for r in rows] == [
        ("none", "ok"), ("accumulation", "ok"), ("adafactor", "ok"), ("dynamic+all", "ok"),
    ]
    assert all(r["eval_metric"] == "accuracy" and 0 <= r["eval_value"] <= 1 for r in rows)
    assert rows[3]["budget_bytes"] == 50_000_000 and rows[0]["budget_bytes"] is None
    # accumulation: 4 micro-steps of 2 per optimizer step
    steps = list(read_jsonl(out / rows[1]["steps_file"]))
    assert len(steps) == 8 and all(s["shape"][0] == 2 for s in steps)
    report = build_report(out, tmp_path / "report").read_text()
    assert "Memory savers" in report and "dynamic+all" in report


def test_peer_names_give_their_train_flags():
    from transformers import HfArgumentParser

    from memfit.tools.bench.peers import PeerArguments

    assert bench.peer_flags("hf-every-2") == bench.PEERS["hf-every-2"]
    assert bench.peer_flags("dynamic") is None and bench.peer_flags("other-0.5") is None
    parser = HfArgumentParser((PeerArguments,))
    for name, field, value in (("compile-0.25", "compile_activation_memory_budget", 0.25),
                               ("ckptplan-1", "ckptplan_saving_fraction", 1.0)):
        flags = bench.peer_flags(name)
        assert flags[:2] == ("--memfit_method", "none")
        (parsed,) = parser.parse_args_into_dataclasses(args=list(flags[2:]))
        assert getattr(parsed, field) == value
    for bad in ("compile-0", "compile-1.5", "ckptplan-x"):
        with pytest.raises(ValueError, match="0 < F <= 1"):
            bench.peer_flags(bad)
    with pytest.raises(SystemExit):
        bench._parse_args(["--methods", "compile-2", "--output_dir", "x"])


@pytest.mark.slow
def test_peers_in_the_matrix(tmp_path):
    config = _tiny_config(tmp_path)
    out = tmp_path / "bench"
    common = ["--tasks", "text-classification", "--budgets", "0.05", "--steps", "1", "--batch_size", "4",
              "--synthetic", "8", "--gpu_warmup_s", "0", "--output_dir", str(out)]
    bench.main([*common, "--methods", "compile-1", "--", "--config_name", str(config), "--use_cpu",
                "--compile_backend", "aot_eager_decomp_partition"])
    if importlib.util.find_spec("ckptplan"):  # installed, it still needs CUDA: skipped with the reason
        bench.main([*common, "--methods", "ckptplan-0.5", "--", "--config_name", str(config), "--use_cpu"])
    rows = list(read_jsonl(out / "results.jsonl"))
    assert rows[0]["method"] == "compile-1" and rows[0]["status"] == "ok", rows[0].get("note")
    assert rows[0]["peer_metrics"]["compile_frames"] >= 1 and "torch.compile" in rows[0]["note"]
    if len(rows) > 1:
        assert rows[1]["status"] == "skipped" and "needs CUDA" in rows[1]["note"]


@pytest.mark.slow
def test_causal_lm_with_the_plain_and_offload_peers(tmp_path):
    """The LLM suite's task runs in the matrix; `plain` (no memfit) is timed without step records,
    `offload` is skipped on CPU with the reason."""
    out = tmp_path / "bench"
    bench.main([
        "--tasks", "causal-lm", "--methods", "plain", "offload", "--budgets", "0.5", "--steps", "2", "--batch_size", "2",
        "--gpu_warmup_s", "0", "--output_dir", str(out), "--", "--use_cpu", "--max_seq_length", "64",
    ])
    rows = list(read_jsonl(out / "results.jsonl"))
    assert [(r["method"], r["status"]) for r in rows] == [("plain", "ok"), ("offload", "skipped")]
    plain, offload = rows
    assert plain["model"] == "llama-tiny (config, random weights)" and plain["batch_size"] == 2
    assert plain["total_s"] > 0 and plain["steps_file"] is None and plain["oom_count"] == 0
    assert plain["max_peak_allocated_bytes"] is None  # CPU: no allocator peak, and no memfit to count one
    assert "needs CUDA" in offload["note"]


def _loop_bench():
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "loop_bench.py"
    spec = importlib.util.spec_from_file_location("loop_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_steps_that_compiled_are_left_out_of_the_steady_time_and_every_paired_ratio():
    """loop_bench's NOTE [Steps that compiled]: a step in which either side made a graph is not
    compared, and a run's own such steps are not in its steady time."""
    loop_bench = _loop_bench()
    memfit_times = [500.0, 10.0, 10.0, 10.0, 10.0]
    peer_times = [500.0, 20.0, 20.0, 8000.0, 8000.0]  # the peer recompiled at steps 3 and 4
    memfit_line = {"method": "dynamic", "budget_bytes": 1, "repeat": 0, "step_ms": memfit_times, "compiled_steps": [0]}
    peer = {"method": "hf-every-1", "budget_bytes": 1, "repeat": 0, "step_ms": peer_times, "compiled_steps": [0, 3, 4],
            "status": "ok", "oom_count": 0, "steady_step_ms": 20.0}
    (out, _) = loop_bench.add_vs_fixed([memfit_line, peer], steady_from=1)
    assert out["fastest_fixed"] == "hf-every-1"
    assert out["step_ratio_vs_fastest_fixed"] == 0.5 and out["sum_ratio_vs_fastest_fixed"] == 0.5
    del peer["compiled_steps"]  # as lines from before the field: every step compared
    (out, _) = loop_bench.add_vs_fixed([memfit_line, peer], steady_from=1)
    assert out["step_ratio_vs_fastest_fixed"] < 0.5

    class Args:
        steady_from, lengths = 1, "sft"

    assert loop_bench._steady(Args, peer_times, [3, 4]) == {"steady_step_ms": 20.0}
    assert loop_bench._steady(Args, peer_times) == {"steady_step_ms": 4010.0}


def test_saved_inventory_lists_a_layers_saved_tensors_once_each(capsys):
    """benchmarks/saved_inventory.py: one layer of a bundled config, its saved activations by node,
    parameters left out, each storage counted once; an unknown config is exit code 2."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "saved_inventory.py"
    spec = importlib.util.spec_from_file_location("saved_inventory", path)
    inventory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inventory)
    assert inventory.main(["--model", "llama-tiny", "--batch", "2", "--length", "8", "--dtype", "float32"]) == 0
    report = json.loads(capsys.readouterr().out)
    nodes = {row["node"] for row in report["saved"]}
    assert "SiluBackward0" in nodes and any(n.startswith("MmBackward") for n in nodes)
    assert all(row["shape"][:2] != [176, 64] for row in report["saved"])  # no weight (64 x 176 / 176 x 64)
    assert report["bytes"] == sum(row["bytes"] for row in report["saved"] if not row["shared"]) > 0
    gate = next(row for row in report["saved"] if row["node"] == "SiluBackward0")
    assert gate["shape"] == [2, 8, 176] and gate["bytes"] == 2 * 8 * 176 * 4  # the gate projection, float32
    assert inventory.main(["--model", "no-such-model"]) == 2


def test_step_floor_pairs_two_caps_and_keeps_the_untreated_steps_for_the_floor(tmp_path, capsys):
    """benchmarks/step_floor.py: the roomy run's untreated steps over the fixed policy's give the floor,
    the tight run's steps the ratio, their difference what the treatments cost; no pair is exit code 2."""
    import gzip

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "step_floor.py"
    spec = importlib.util.spec_from_file_location("step_floor", path)
    step_floor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_floor)
    (tmp_path / "steps").mkdir()
    with gzip.open(tmp_path / "steps" / "roomy.jsonl.gz", "wt") as fh:  # steps 0 and 2 treat a block
        for i in range(4):
            fh.write(json.dumps({"step": i + 1, "treatments": {"recompute": [0]} if i % 2 == 0 else {"head": "chunked:4"}}) + "\n")
    lines = [
        {"method": "dynamic", "budget_bytes": 10e9, "repeat": 0, "step_ms": [90.0, 80.0, 90.0, 80.0], "steps_file": "steps/tight.jsonl.gz"},
        {"method": "dynamic", "budget_bytes": 20e9, "repeat": 0, "step_ms": [80.0, 70.0, 80.0, 75.0], "steps_file": "steps/roomy.jsonl.gz"},
        {"method": "hf", "budget_bytes": 10e9, "repeat": 0, "step_ms": [100.0] * 4},
        {"method": "hf", "budget_bytes": 20e9, "repeat": 0, "step_ms": [1.0] * 4},  # not the one compared
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (row,) = step_floor.floor_rows(tmp_path, "dynamic", "hf", 10, 20, steady_from=0)
    assert row["untreated_steps"] == 2 and row["steps"] == 4
    assert row["floor"] == pytest.approx(0.725) and row["tight"] == pytest.approx(0.85)
    assert row["treatments"] == pytest.approx(0.1)  # the median of 0.1, 0.1, 0.1 and 0.05
    assert step_floor.main([str(tmp_path), "--method", "dynamic", "--fixed", "hf", "--tight", "10", "--roomy", "20",
                            "--steady_from", "0"]) == 0
    assert "| 0 | 2 of 4 | 0.725 | 0.850 | 0.100 |" in capsys.readouterr().out
    assert step_floor.main([str(tmp_path), "--fixed", "none", "--tight", "10", "--roomy", "20"]) == 2
    (tmp_path / "steps" / "roomy.jsonl.gz").unlink()
    assert step_floor.main([str(tmp_path), "--method", "dynamic", "--fixed", "hf", "--tight", "10", "--roomy", "20"]) == 2


def test_gpu_busy_splits_each_steps_span_into_kernels_and_the_gap_before_the_next_step():
    """benchmarks/gpu_busy.py: a step's span runs to the next step's first kernel, so the host's gap after
    its last kernel is its idle time; overlapping kernels count once; kernels outside any step are left
    out; its doctests hold."""
    import doctest

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_busy.py"
    spec = importlib.util.spec_from_file_location("gpu_busy", path)
    gpu_busy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_busy)
    assert doctest.testmod(gpu_busy).failed == 0
    ev = [
        {"cat": "kernel", "name": "before", "ts": -5000, "dur": 1000},  # before the first step: left out
        {"cat": "gpu_user_annotation", "name": "loop_step_7", "ts": 0, "dur": 3000},
        {"cat": "user_annotation", "name": "loop_step_7", "ts": -100, "dur": 2500},
        {"cat": "kernel", "name": "a", "ts": 0, "dur": 2000},
        {"cat": "kernel", "name": "b", "ts": 1000, "dur": 2000},  # overlaps a (another stream)
        {"cat": "gpu_memcpy", "name": "copy", "ts": 3500, "dur": 500},  # the next batch's copy, in 7's gap
        {"cat": "gpu_user_annotation", "name": "loop_step_8", "ts": 10000, "dur": 1000},
        {"cat": "kernel", "name": "a", "ts": 10000, "dur": 1000},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99999},  # host ops are not the GPU's
    ]
    s = gpu_busy.summarise(ev)
    assert s["steps"] == [7, 8] and s["span_ms"] == [10.0, 1.0] and s["busy_ms"] == [3.5, 1.0]
    assert s["host_ms"] == [2.5, 0.0]
    assert s["kernels"][0] == ["a", 1.5, 1.0]
    assert "note" in gpu_busy.summarise([{"cat": "kernel", "name": "a", "ts": 0, "dur": 1}])
    timeline = gpu_busy.GpuBusy(enabled=False)  # a CPU run: nothing profiled, nothing added to the line
    with timeline, timeline.step(0):
        pass
    assert timeline.fields() == {}

