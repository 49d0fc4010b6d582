"""``elementwise``: the block runs once, but its gated MLP's activation product and its norms keep
only their inputs; backward runs those few elementwise ops again.

# NOTE [Elementwise recompute]
Most of a decoder block's saved bytes are not matmul outputs but what the elementwise ops between
them keep: a gated MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: Llama, Qwen, Mistral,
Gemma) saves the activation's input, its output, the up projection and their product (four
``tokens x intermediate`` tensors, about two thirds of a block), and an RMSNorm written in Python
saves a float32 copy of its input beside its normalised rows. ``recompute`` frees all of it and
pays the block's whole forward again; ``selective`` frees the same elementwise outputs but runs
the block's every op through a dispatch mode, twice. This treatment works at module level: each
norm (a leaf module whose class name ends in ``Norm``) runs under ``torch.utils.checkpoint`` and
keeps its input; each gated MLP computes its two projections as the model does and runs
``down_proj(act_fn(gate) * up)`` under a selective checkpoint that keeps the matmul outputs
(:func:`~memfit.engine.treatments.selective.keep_matmul_and_attention`), so backward runs the
activation and the product again, never a matmul. It keeps ``gate`` and ``up`` (and the
projection's output) where the block kept four tensors, about a third of a block less, for a few
elementwise kernels a block (priced by its probe, like every treatment).

Gradients are ``keep``'s bit for bit: the ops that run again are the forward's own, on the same
inputs, with the RNG state restored (a LoRA dropout inside ``down_proj`` draws the same mask).
Nothing is assumed of an MLP beyond its four attributes: the probe runs the block both ways on the
same inputs and RNG state and offers this treatment only where the outputs are equal bit for bit,
so an MLP that computes something else (a scaling, a residual) is never planned with it. Eager
blocks only: a compiled block has ``selective`` under the partitioner's budget.

The tensors the checkpoints keep are not seen by the step's saved-tensor hooks (each checkpoint
packs its own): the treatment counts them itself, as ``selective`` counts its cache.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from memfit.engine.treatments.base import RunOptions, Treatment
from memfit.engine.treatments.selective import keep_matmul_and_attention, selective_cache_tensors

if TYPE_CHECKING:
    from memfit.engine.accounting import SavedTensorCounter
    from memfit.engine.blocks import Block
    from memfit.engine.probe import ProbeKit

__all__ = ["ELEMENTWISE", "Elementwise", "elementwise_parts"]

logger = logging.getLogger("memfit")

ELEMENTWISE = "elementwise"

_GATED_MLP = ("gate_proj", "up_proj", "down_proj", "act_fn")


def elementwise_parts(module: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The block's norms (leaf modules whose class name ends in ``Norm``) and gated MLPs (modules
    with ``gate_proj``, ``up_proj``, ``down_proj`` and ``act_fn``) that this treatment runs leaner."""
    norms, mlps = [], []
    for m in module.modules():
        if all(hasattr(m, a) for a in _GATED_MLP):
            if "forward" not in vars(m):  # a forward wrapped on the instance (a hook library's) is not rewritten
                mlps.append(m)
        elif type(m).__name__.endswith("Norm") and not any(True for _ in m.children()):
            norms.append(m)
    return norms, mlps


class Elementwise(Treatment):
    """The block's gated MLP activation product and norms recomputed in backward (NOTE [Elementwise recompute]).

    Args:
        counter: the run's counter, told what the checkpoints keep when the step counts.
    """

    name = ELEMENTWISE
    help = "recompute the gated MLP's activation product and the norms in backward (module level)"
    # its re-runs are modules inside the block's backward, not the body: the partial transient learns
    # their returns (NOTE [Treated peaks], model.py), so it declares neither ``reruns`` nor ``reruns_part``
    order = 20
    eager_only = True

    @classmethod
    def for_run(cls, options: RunOptions) -> Treatment:
        return cls(options.counter)

    def __init__(self, counter: "SavedTensorCounter | None" = None):
        self.counter = counter
        #: per block, its norms and gated MLPs, found once (not at every forward)
        self._parts: dict[int, tuple[list[nn.Module], list[nn.Module]]] = {}

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        held: list[torch.Tensor] = []
        parts = self._parts.get(block.index)
        if parts is None:
            parts = self._parts[block.index] = elementwise_parts(block.module)
        with _leaner(block.module, held, parts):
            out = block.run_body(*args, **kwargs)
        if self.counter is not None and self.counter.active:
            for t in held:
                self.counter.count_tensor(block.index, t)
        return out

    @classmethod
    def probe(cls, block: "Block", kit: "ProbeKit") -> tuple[int, float | None] | None:
        """What the block keeps under it (the hooks' count and what the checkpoints hold) and its
        price: forward and backward beyond the plain block's, each the fastest of the timed runs,
        interleaved. None for a compiled block, one with nothing to treat, or one whose output is
        not the plain block's bit for bit."""
        norms, mlps = elementwise_parts(block.module)
        if block.compiled or not (norms or mlps):
            return None
        devices = [kit.device] if kit.device.type == "cuda" else []

        def forward(lean: bool, hooks: Any, held: list[torch.Tensor]) -> tuple[Any, tuple, dict]:
            probe_args, probe_kwargs = kit.fresh()
            with hooks, (_leaner(block.module, held) if lean else contextlib.nullcontext()):
                return block._body(*probe_args, **probe_kwargs), probe_args, probe_kwargs

        with torch.random.fork_rng(devices=devices):
            state = torch.random.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]
            plain, *_ = forward(False, kit.shield(), [])
            torch.random.set_rng_state(state[0])
            for d, s in zip(devices, state[1]):
                torch.cuda.set_rng_state(s, d)
            counter, held = kit.counter_of_run(), []
            try:
                lean, *_ = forward(True, counter.hooks(), held)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # a norm or MLP that does not run under a checkpoint: never offered
                logger.info("memfit: block %s does not run with its norms and MLP checkpointed (%s); 'elementwise' "
                            "is not offered for it", block.index, str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
                return None
            equal = _equal(plain, lean)
            for t in held:
                counter.count(t)
        del plain, lean
        if not equal:
            logger.info("memfit: block %s's MLP or norms compute more than their modules' plain ops; "
                        "'elementwise' is not offered for it", block.index)
            return None

        lean_ms, plain_ms = [], []
        for _ in range(kit.timed_runs):  # NOTE [Cold runs of a block] (probe.py)
            lean_ms.append(kit.forward_backward_ms(block._body, kit.shield(), _leaner(block.module, [])))
            plain_ms.append(kit.forward_backward_ms(block._body, kit.shield()))
        return counter.bytes, max(0.0, min(lean_ms) - min(plain_ms))


def _equal(a: Any, b: Any) -> bool:
    left = [t for t in tree_leaves(a) if isinstance(t, torch.Tensor)]
    right = [t for t in tree_leaves(b) if isinstance(t, torch.Tensor)]
    return len(left) == len(right) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(left, right))


@contextlib.contextmanager
def _leaner(
    module: nn.Module, held: list[torch.Tensor], parts: tuple[list[nn.Module], list[nn.Module]] | None = None,
) -> Iterator[None]:
    """Run ``module``'s norms and gated MLPs (``parts``, default :func:`elementwise_parts`) as NOTE
    [Elementwise recompute] says while the block's forward runs, appending what their checkpoints
    keep to ``held``."""
    norms, mlps = elementwise_parts(module) if parts is None else parts
    patched = [(m, functools.partial(_norm_forward, m.forward, held)) for m in norms]
    patched += [(m, functools.partial(_mlp_forward, m, held)) for m in mlps]
    before = [vars(m).get("forward") for m, _ in patched]  # a norm's forward wrapped on the instance stays
    for m, forward in patched:
        m.forward = forward  # the instance's attribute, read by Module.__call__, put back below
    try:
        yield
    finally:
        for (m, _), was in zip(patched, before):
            if was is None:
                del m.forward
            else:
                m.forward = was


def _norm_forward(forward: Any, held: list[torch.Tensor], x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    held.append(x)
    return checkpoint(forward, x, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _mlp_forward(mlp: nn.Module, held: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    gate = mlp.gate_proj(x)
    up = mlp.up_proj(x)
    held += [gate, up]
    caching, cached = create_selective_checkpoint_contexts(keep_matmul_and_attention)
    contexts = _Once(caching, cached)
    out = checkpoint(_tail, mlp, gate, up, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)
    held += selective_cache_tensors(caching)
    return out


def _tail(mlp: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(mlp.act_fn(gate) * up)


class _Once:
    """``context_fn`` handing one checkpoint its selective contexts (their cache is read after it)."""

    def __init__(self, caching: Any, cached: Any):
        self.contexts = (caching, cached)

    def __call__(self) -> tuple[Any, Any]:
        return self.contexts
