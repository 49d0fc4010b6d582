"""Peers run through `memfit train` with memfit only measuring."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch._functorch.config
from torch import nn

import copy
from types import SimpleNamespace

import transformers

import memfit
from _models import build_decoder, step_both_and_compare
from memfit.tools.bench import peers
from memfit.tools.bench.peers import PEER_FILE, PeerArguments, PeerUnavailableError, make_peer, plan_blocks
from memfit.engine.parts.blocks import find_blocks
from memfit.cli.train import run

FIXTURES = Path(__file__).parent / "fixtures" / "glue" / "MRPC"
TINY = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 37, "vocab_size": 30522}
MIB = 2**20


def _train(tmp_path, name, *flags):
    """2 steps of a tiny BERT on MRPC (CPU); returns the run's output folder."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / name
    run("text-classification", [
        "--config_name", str(config), "--task_name", "mrpc", "--train_file", str(FIXTURES / "train.tsv"),
        "--do_train", "--max_steps", "2", "--per_device_train_batch_size", "8", "--use_cpu", "--seed", "1",
        "--report_to", "none", "--save_strategy", "no", "--output_dir", str(out), "--memfit_method", "none", *flags,
    ])
    return out


def _peak(tmp_path, name, *flags):
    return json.loads((_train(tmp_path, name, *flags) / "memfit_summary.json").read_text())["max_peak_allocated_bytes"]


def _steps(out):
    return [json.loads(line) for line in (out / "memfit_steps.jsonl").read_text().splitlines()]


def test_hf_every_layer_peer_saves_memory(tmp_path):
    # HF's own checkpoint holds the layers' tensors out of memfit's counter: a lower count.
    assert _peak(tmp_path, "peer", "--hf_checkpoint_every_n_layers", "1") < _peak(tmp_path, "none")


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"hf_checkpoint_offload": True}, "needs --hf_checkpoint_every_n_layers"),
        ({"hf_checkpoint_every_n_layers": 0}, "at least 1"),
        ({"compile_activation_memory_budget": 0.0}, "0 < F <= 1"),
        ({"compile_activation_memory_budget": 1.5}, "0 < F <= 1"),
        ({"ckptplan_saving_fraction": 0.0}, "0 < F <= 1"),
        ({"compile_backend": "inductor"}, "needs --compile_activation_memory_budget"),
        ({"compile_activation_memory_budget": 0.5, "ckptplan_saving_fraction": 0.5}, "one peer at a time"),
        ({"offload_activations": True, "memfit_off": True}, "--offload_activations and --memfit_off"),
    ],
)
def test_peer_argument_errors(flags, message):
    with pytest.raises(ValueError, match=message):
        PeerArguments(**flags)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--hf_checkpoint_every_n_layers", "2", "--memfit_method", "dynamic"], "--memfit_method none"),
        (["--compile_activation_memory_budget", "0.5", "--memfit_method", "full"], "--memfit_method none"),
        (["--compile_activation_memory_budget", "0.5", "--torch_compile"], "drop --torch_compile"),
        (["--memfit_off", "--memfit_method", "dynamic"], "--memfit_method none"),
        (["--offload_activations", "--memfit_method", "static"], "--memfit_method none"),
    ],
)
def test_peer_run_errors(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        _train(tmp_path, "bad", *flags)


# ---------------------------------------------------------------------------- torch.compile


@pytest.mark.slow
def test_compile_peer_compiles_and_its_knob_applies(tmp_path):
    # aot_eager_decomp_partition runs inductor's min-cut partitioner (the one the knob steers)
    # without generating C++: seconds instead of a minute of gcc on CPU.
    before = torch._functorch.config.activation_memory_budget
    backend = ("--compile_backend", "aot_eager_decomp_partition")
    default = _train(tmp_path, "f1", "--compile_activation_memory_budget", "1", *backend)
    assert torch._functorch.config.activation_memory_budget == before  # restored after the run
    low = _train(tmp_path, "f005", "--compile_activation_memory_budget", "0.05", *backend)
    assert torch._functorch.config.activation_memory_budget == before
    # memfit counts what the compiled blocks save (NOTE [Compile inside the block wrappers]):
    # the knob, set while they compiled, made them save less at every step.
    saved = [(a["shape"], a["saved_activation_bytes"], b["saved_activation_bytes"]) for a, b in zip(_steps(default), _steps(low))]
    assert len(saved) == 2 and all(low_bytes < 0.7 * bytes_1 for _, bytes_1, low_bytes in saved), saved
    record = json.loads((low / PEER_FILE).read_text())
    m = record["metrics"]
    assert record["peer"] == "compile" and m["compile_activation_memory_budget"] == 0.05
    assert m["compile_frames"] >= 1 and m["compile_frames"] == 1 + m["compile_recompiles"]  # one block class
    assert m["compile_s"] > 0 and "recompiles" in record["note"]


# ---------------------------------------------------------------------------- ckptplan


def _profile(ckptplan, name, order, module, activation_bytes, recompute_ms):
    """A ckptplan BlockProfile as its CUDA profiler would make it, with given measurements."""
    return ckptplan.BlockProfile(
        block_id=name, order=order, device="cpu", dtype=str(next(module.parameters()).dtype),
        input_shape_signature="in", output_shape_signature="out",
        param_count=sum(p.numel() for p in module.parameters()),
        trainable_param_count=sum(p.numel() for p in module.parameters()),
        timing_only=False, activation_bytes_estimate=activation_bytes, activation_bytes_method="isolated_forward_delta",
        forward_time_ms_mean=recompute_ms, forward_time_ms_std=0.0, recompute_time_upper_bound_ms_mean=recompute_ms,
        recompute_time_upper_bound_ms_std=0.0, recompute_time_source="measured_full_recompute_early_stop_disabled",
        num_warmup=0, num_trials=1, is_stochastic=None, is_stateful=False, stochastic_submodules=(),
        stateful_submodules=(), eligible_for_checkpoint=True, exclusion_reason=None, warnings=(),
        pytorch_version=torch.__version__, profiler_version="test",
    )


@pytest.mark.parametrize(
    "fraction, expected",
    [
        (0.5, (2,)),  # the 4 MiB block alone saves half of 7 MiB, at the least recompute
        (0.7, (0, 2)),  # plus the cheaper of the 1 MiB blocks 0 and 1
        (1.0, (0, 1, 2, 3)),
    ],
)
def test_ckptplan_plan_becomes_memfit_blocks(fraction, expected):
    ckptplan = pytest.importorskip("ckptplan")
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    named = list(model.named_children())
    sizes, costs = [1 * MIB, 1 * MIB, 4 * MIB, 1 * MIB], [1.0, 2.0, 1.0, 5.0]
    profiles = [_profile(ckptplan, n, i, m, s, c) for i, ((n, m), s, c) in enumerate(zip(named, sizes, costs))]
    plan = ckptplan.plan_checkpoints(
        profiles, ckptplan.declare_blocks(model, named), target_kind="activation_saving_fraction",
        target_value=fraction, planner="dynamic_programming",
    )
    assert plan_blocks(plan, [n for n, _ in named]) == expected
    with pytest.raises(ValueError, match="not memfit's"):
        plan_blocks(plan, ["1", "0", "2", "3"])


def test_ckptplan_peer_runs_its_plan_through_memfit(tmp_path, monkeypatch):
    ckptplan = pytest.importorskip("ckptplan")
    seen = {}

    def fake_profiles(ckptplan, model, named, inputs, device):
        # CPU stand-in for ckptplan's CUDA profiler: layer 1 is the cheaper to recompute.
        seen["first_input"] = tuple(inputs[0][0][0].shape)
        return tuple(_profile(ckptplan, n, i, m, MIB, [2.0, 1.0][i]) for i, (n, m) in enumerate(named))

    monkeypatch.setattr(peers, "_profile_blocks", fake_profiles)
    out = _train(tmp_path, "ckptplan", "--ckptplan_saving_fraction", "0.5")
    steps = _steps(out)
    assert [(s["method"], s["plan"]) for s in steps] == [("ckptplan", [1]), ("ckptplan", [1])]
    record = json.loads((out / PEER_FILE).read_text())["metrics"]
    assert record["ckptplan_plan"] == [1] and record["ckptplan_n_blocks"] == 2
    # planned at the largest batch: 8 of the longest examples, at least as long as any step
    assert record["ckptplan_shape"] == list(seen["first_input"])
    assert record["ckptplan_shape"][0] == 8 and all(s["shape"][1] <= record["ckptplan_shape"][1] for s in steps)


def test_ckptplan_peer_needs_cuda(tmp_path):
    pytest.importorskip("ckptplan")
    with pytest.raises(PeerUnavailableError, match="needs CUDA"):
        _train(tmp_path, "cpu", "--ckptplan_saving_fraction", "0.5")


def test_ckptplan_peer_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ckptplan", None)  # import fails as if not installed
    with pytest.raises(PeerUnavailableError, match="pip install ckptplan"):
        make_peer(PeerArguments(ckptplan_saving_fraction=0.5), "none")


def test_largest_batch_leaves_the_examples_whole():
    """Multiple choice's collator pops "labels" from the examples it gets; the ckptplan peer
    collates the largest examples before training, and the Trainer collates them again (H200,
    2026-11-22: KeyError 'labels' at the first step)."""
    dataset = [{"input_ids": [1] * n, "labels": 0} for n in (3, 9, 5)]

    def popping(features):
        return {"labels": [f.pop("labels") for f in features], "lengths": [len(f["input_ids"]) for f in features]}

    assert peers._largest_batch(dataset, popping, 2)["lengths"] == [9, 5]
    assert all("labels" in example for example in dataset)


# ---------------------------------------------------------------------------- Hugging Face's checkpointing


def _real_enable():
    """Hugging Face's own implementation, ``(model, checkpoint_kwargs, every_n_layers, offload)``:
    5.2x's private one, or 5.17's public one (read it before patching that name)."""
    private = getattr(transformers.PreTrainedModel, "_activation_checkpointing_enable", None)
    return private or transformers.PreTrainedModel.gradient_checkpointing_enable


def _hf_peer_on_tiny_llama(n, offload=False):
    """HfEveryN applied to a 3-layer Llama; returns which layers Hugging Face now checkpoints."""
    model, _ = build_decoder("llama")
    peers.HfEveryN(n, offload).prepare(SimpleNamespace(model=model), None)
    return [m.gradient_checkpointing for _, m in find_blocks(model)]


def test_hf_peer_calls_activation_checkpointing_enable(monkeypatch):
    calls = []
    real = _real_enable()

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        calls.append(dict(activation_checkpointing_kwargs=activation_checkpointing_kwargs, every_n_layers=every_n_layers, offload=offload))
        real(self, activation_checkpointing_kwargs, every_n_layers, offload)

    monkeypatch.setattr(transformers.PreTrainedModel, "activation_checkpointing_enable", activation_checkpointing_enable, raising=False)
    assert _hf_peer_on_tiny_llama(2) == [True, False, True]
    assert calls == [{"activation_checkpointing_kwargs": {"use_reentrant": False}, "every_n_layers": 2, "offload": False}]


def test_hf_peer_calls_the_5_17_gradient_checkpointing_enable(monkeypatch):
    """transformers 5.17 (the GPU machine's) has only gradient_checkpointing_enable(every_n_layers, offload)."""
    calls = []
    real = _real_enable()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, every_n_layers: int = 1, offload: bool = False):
        calls.append(dict(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs, every_n_layers=every_n_layers, offload=offload))
        real(self, gradient_checkpointing_kwargs, every_n_layers, offload)

    monkeypatch.delattr(transformers.PreTrainedModel, "activation_checkpointing_enable", raising=False)
    monkeypatch.setattr(transformers.PreTrainedModel, "gradient_checkpointing_enable", gradient_checkpointing_enable)
    assert _hf_peer_on_tiny_llama(2, offload=True) == [True, False, True]
    assert calls == [{"gradient_checkpointing_kwargs": {"use_reentrant": False}, "every_n_layers": 2, "offload": True}]


def test_hf_peer_without_every_n_layers_is_unavailable(monkeypatch):
    monkeypatch.delattr(transformers.PreTrainedModel, "activation_checkpointing_enable", raising=False)
    # transformers before 5.17: gradient_checkpointing_enable(gradient_checkpointing_kwargs=None) only
    monkeypatch.setattr(transformers.PreTrainedModel, "gradient_checkpointing_enable", lambda self, gradient_checkpointing_kwargs=None: None)
    with pytest.raises(PeerUnavailableError, match=r"neither activation_checkpointing_enable\(every_n_layers=...\)"):
        _hf_peer_on_tiny_llama(1)


# ---------------------------------------------------------------------------- TRL's activation offloading


class _FakeOffloading(torch.autograd.graph.saved_tensors_hooks):
    """Stands in for TRL's OffloadActivations on CPU: counts what it would offload, keeps it."""

    def __init__(self):
        self.packed = 0
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t):
        self.packed += 1
        return t


def test_offload_peer_offloads_the_decoder_inside_memfits_counter(monkeypatch):
    """NOTE [Offloading inside memfit's counter]: the offloading hooks are the innermost over the
    decoder layers (memfit's counter sees only the head's tensors), closed before memfit's, and
    training forwards only; gradients are unchanged."""
    made = []
    monkeypatch.setattr(peers, "_offloading_factory", lambda: lambda model, warn_if_no_head: made.append(_FakeOffloading()) or made[-1])
    torch.manual_seed(0)
    model, make_batch = build_decoder("llama")
    reference = copy.deepcopy(model)
    peer = make_peer(PeerArguments(offload_activations=True), "none")
    with peer:
        peer.prepare(SimpleNamespace(model=model), SimpleNamespace(device=torch.device("cuda")))  # device checked only
        measured, plain = memfit.fit(model, None, "none"), memfit.fit(reference, None, "none")
        for step, length in enumerate((12, 20)):
            step_both_and_compare(model, reference, make_batch(2, length), step, f"step {step}")
        with torch.no_grad():
            model(**make_batch(2, 8))  # evaluation is not offloaded
    (offloading,) = made
    assert offloading.packed > 0 and peer.steps == 2
    with_peer, without = measured.records[-1].saved_activation_bytes, plain.records[-1].saved_activation_bytes
    assert 0 < with_peer < without / 3, (with_peer, without)
    packed = offloading.packed
    x = torch.ones(3, requires_grad=True)
    (x * x).sum().backward()  # no hook of the peer is left active
    model(**make_batch(2, 8)).loss.backward()  # the peer's hooks were removed on exit
    assert offloading.packed == packed and peer.record()["metrics"] == {"offload_steps": 2}


def test_offload_peer_needs_cuda_and_trl(monkeypatch):
    model, _ = build_decoder("llama")
    bundle = SimpleNamespace(model=model)
    with pytest.raises(PeerUnavailableError, match="peer offload needs CUDA"):
        peers.OffloadActivations().prepare(bundle, SimpleNamespace(device=torch.device("cpu")))
    monkeypatch.setitem(sys.modules, "trl.models.activation_offloading", None)  # import fails as if not installed
    with pytest.raises(PeerUnavailableError, match=r"pip install 'memfit\[llm\]'"):
        peers.OffloadActivations().prepare(bundle, SimpleNamespace(device=torch.device("cuda")))


# ---------------------------------------------------------------------------- plain Trainer


def test_plain_peer_trains_without_memfit(tmp_path):
    out = _train(tmp_path, "plain", "--memfit_off", "--memory_threshold", "1")
    assert (out / "train_results.json").exists()
    assert not (out / "memfit_steps.jsonl").exists() and not (out / "memfit_summary.json").exists()
    record = json.loads((out / PEER_FILE).read_text())
    assert record["peer"] == "plain" and "no memfit" in record["note"]
    assert record["metrics"] == {}  # CPU: no CUDA allocator to read
