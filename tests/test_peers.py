"""Peers run through `memfit train` with memfit only measuring."""

import json
from pathlib import Path

import pytest

from memfit.peers import PeerArguments
from memfit.train import run

FIXTURES = Path(__file__).parent / "fixtures" / "glue" / "MRPC"
TINY = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 37, "vocab_size": 30522}


def _peak(tmp_path, name, *flags):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / name
    run("text-classification", [
        "--config_name", str(config), "--task_name", "mrpc", "--train_file", str(FIXTURES / "train.tsv"),
        "--do_train", "--max_steps", "2", "--per_device_train_batch_size", "8", "--use_cpu", "--seed", "1",
        "--report_to", "none", "--save_strategy", "no", "--output_dir", str(out), "--memfit_method", "none", *flags,
    ])
    return json.loads((out / "memfit_summary.json").read_text())["max_peak_allocated_bytes"]


def test_hf_every_layer_peer_saves_memory(tmp_path):
    # HF's own checkpoint holds the layers' tensors out of memfit's counter: a lower count.
    assert _peak(tmp_path, "peer", "--hf_checkpoint_every_n_layers", "1") < _peak(tmp_path, "none")


@pytest.mark.parametrize(
    "flags, message",
    [({"hf_checkpoint_offload": True}, "needs --hf_checkpoint_every_n_layers"), ({"hf_checkpoint_every_n_layers": 0}, "at least 1")],
)
def test_peer_argument_errors(flags, message):
    with pytest.raises(ValueError, match=message):
        PeerArguments(**flags)


def test_peer_needs_method_none(tmp_path):
    with pytest.raises(ValueError, match="--memfit_method none"):
        _peak(tmp_path, "both", "--hf_checkpoint_every_n_layers", "2", "--memfit_method", "dynamic")
