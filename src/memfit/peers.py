"""Peers: the best-known alternatives to memfit, run by ``memfit train`` for the comparison.

Each peer is applied to the model before the Trainer is built and runs with
``--memfit_method none`` under the same budget (cap), so memfit only measures:

* ``--hf_checkpoint_every_n_layers N``: Hugging Face's own activation checkpointing of every
  N-th layer (``activation_checkpointing_enable(every_n_layers=N)``, non-reentrant);
* ``--hf_checkpoint_offload``: with it, Hugging Face's offload of the checkpointed layers'
  inputs to pinned host memory;
* Accelerate's ``find_executable_batch_size`` is the Trainer's own ``--auto_find_batch_size``
  (it changes the batch size, so it is reported apart).

A peer the installed transformers lacks fails with one clear error; ``memfit bench`` records
it and goes on.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from torch import nn

__all__ = ["PeerArguments", "apply_peers"]


@dataclass
class PeerArguments:
    """Alternatives to memfit, for the benchmark's comparison (all off by default)."""

    hf_checkpoint_every_n_layers: int | None = field(
        default=None,
        metadata={"help": "Peer: Hugging Face activation checkpointing of every N-th layer (needs --memfit_method none)."},
    )
    hf_checkpoint_offload: bool = field(
        default=False,
        metadata={"help": "Peer: with --hf_checkpoint_every_n_layers, offload the checkpointed inputs to host memory."},
    )

    def __post_init__(self) -> None:
        if self.hf_checkpoint_offload and not self.hf_checkpoint_every_n_layers:
            raise ValueError("--hf_checkpoint_offload needs --hf_checkpoint_every_n_layers")
        if self.hf_checkpoint_every_n_layers is not None and self.hf_checkpoint_every_n_layers < 1:
            raise ValueError("--hf_checkpoint_every_n_layers must be at least 1")


def apply_peers(model: nn.Module, peers: PeerArguments, memfit_method: str) -> None:
    """Turn on the requested peer on ``model``.

    Raises:
        ValueError: a peer with a memfit method other than ``none`` (both would checkpoint).
        NotImplementedError: the installed transformers has no such option.
    """
    n = peers.hf_checkpoint_every_n_layers
    if n is None:
        return
    if memfit_method != "none":
        raise ValueError("--hf_checkpoint_every_n_layers is a peer of memfit: run it with --memfit_method none")
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None or "every_n_layers" not in inspect.signature(enable).parameters:
        raise NotImplementedError(
            "the installed transformers has no activation_checkpointing_enable(every_n_layers=...): "
            "peer hf-every-n is not available"
        )
    kwargs = {"offload": True} if peers.hf_checkpoint_offload else {}
    enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=n, **kwargs)
