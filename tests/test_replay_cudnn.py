"""NOTE [cuDNN attention after an OOM] (engine/replay.py): after an OOM on CUDA the replayer turns
cuDNN's SDPA backend off for the rest of the process, says so once, and replays; on CPU (or with it
already off) it changes nothing. No GPU here: CUDA's state is mocked."""

from __future__ import annotations

import logging

import pytest
import torch

from memfit.engine.replay import Replayer


@pytest.fixture
def cudnn_sdp():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def _replayer() -> tuple[Replayer, list[str]]:
    param = torch.nn.Parameter(torch.ones(2))
    noted: list[str] = []
    return Replayer(torch.nn.Linear(2, 2), [param], [], None, noted.append, lambda: None, lambda: None), noted


def _fails_first(times: int):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= times:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return len(calls)
    return fn


def test_an_oom_on_cuda_turns_cudnn_attention_off_once_and_the_step_is_replayed(cudnn_sdp, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr("memfit.engine.replay.rng_state", lambda: {"cpu": torch.get_rng_state()})
    replayer, noted = _replayer()
    with caplog.at_level(logging.WARNING, logger="memfit"):
        assert replayer.run(_fails_first(2)) == 3
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert len(noted) == 2
    said = [m for m in caplog.messages if "cuDNN" in m]
    assert len(said) == 1, caplog.messages


def test_an_oom_without_cuda_leaves_cudnn_attention_as_it_is(cudnn_sdp, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    replayer, _ = _replayer()
    with caplog.at_level(logging.WARNING, logger="memfit"):
        assert replayer.run(_fails_first(1)) == 2
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert not [m for m in caplog.messages if "cuDNN" in m]
