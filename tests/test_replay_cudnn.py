"""NOTE [cuDNN attention after an OOM] (engine/run/replay.py): an OOM leaves cuDNN's attention on; a
micro-step that fails in cuDNN turns it off for the rest of the process, says so once, and is
replayed with the same plan; a second failure, one that does not name cuDNN, or one on CPU is
raised. No GPU here: CUDA's state is mocked."""

from __future__ import annotations

import logging

import pytest
import torch

from memfit.engine.run.replay import Replayer, cudnn_attention_failed

CUDNN_FAILURE = "Expected mha_graph.execute(...).is_good() to be true, but got false."


@pytest.fixture
def cudnn_sdp():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr("memfit.engine.run.replay.rng_state", lambda: {"cpu": torch.get_rng_state()})


def _replayer() -> tuple[Replayer, list[str], list[int]]:
    param = torch.nn.Parameter(torch.ones(2))
    noted: list[str] = []
    dropped: list[int] = []
    replayer = Replayer(torch.nn.Linear(2, 2), [param], [], None, noted.append, lambda: dropped.append(1), lambda: None)
    return replayer, noted, dropped


def _fails_first(*errors: Exception):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return len(calls)
    return fn


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_an_oom_on_cuda_leaves_cudnn_attention_on_and_the_step_is_replayed(cudnn_sdp, on_cuda, caplog):
    replayer, noted, dropped = _replayer()
    with caplog.at_level(logging.WARNING, logger="memfit"):
        assert replayer.run(_fails_first(_oom(), _oom())) == 3
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert len(noted) == 2 and not dropped
    assert not [m for m in caplog.messages if "cuDNN" in m]


def test_a_cudnn_failure_turns_its_attention_off_once_and_replays_with_the_same_plan(cudnn_sdp, on_cuda, caplog):
    replayer, noted, dropped = _replayer()
    with caplog.at_level(logging.WARNING, logger="memfit"):
        assert replayer.run(_fails_first(_oom(), RuntimeError(CUDNN_FAILURE))) == 3
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert len(noted) == 1, "the cuDNN failure is no OOM: no safer plan"
    assert dropped == [1], "the failed attempt's step is dropped unrecorded"
    said = [m for m in caplog.messages if "cuDNN" in m]
    assert len(said) == 1, caplog.messages


def test_a_second_cudnn_failure_is_raised(cudnn_sdp, on_cuda):
    replayer, _, _ = _replayer()
    with pytest.raises(RuntimeError, match="mha_graph"):
        replayer.run(_fails_first(RuntimeError(CUDNN_FAILURE), RuntimeError(CUDNN_FAILURE)))
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_other_errors_and_cpu_runs_are_raised_and_leave_cudnn_attention_as_it_is(cudnn_sdp, monkeypatch, on_cuda):
    replayer, _, _ = _replayer()
    with pytest.raises(RuntimeError, match="shape mismatch"):
        replayer.run(_fails_first(RuntimeError("shape mismatch")))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="mha_graph"):
        replayer.run(_fails_first(RuntimeError(CUDNN_FAILURE)))
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_what_counts_as_a_cudnn_failure():
    assert cudnn_attention_failed(RuntimeError(CUDNN_FAILURE))
    assert cudnn_attention_failed(RuntimeError("cuDNN Frontend error: [cudnn_frontend] Error: No execution plans support the graph."))
    assert not cudnn_attention_failed(_oom())
    assert not cudnn_attention_failed(RuntimeError("CUDA error: an illegal memory access was encountered"))
