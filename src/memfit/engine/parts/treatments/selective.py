"""``selective``: inputs and matmul/attention outputs kept, the cheap rest recomputed in backward.

# NOTE [Selective policy]
``selective`` keeps the outputs of the ops that cost most to recompute per byte they hold:
matrix products and fused attention kernels (their FLOPs per output element grow with the
inner dimension); every other op (norms, activations, elementwise, rotary embeddings, dropout)
is recomputed in backward from those. This is the policy torch's selective checkpointing
documents and torchtitan's op-level policy uses, and it applies to any transformer block, so it
is the default for blocks of unknown families. One exception keeps gradients exact: an op that
draws random numbers (fused attention with dropout draws its mask from the device's generator)
is recomputed, never kept. A kept op is not run again in backward, so it would not advance the
generator there, and every later dropout of the recompute would draw another mask than the
forward's. What it keeps and costs is measured per block
(engine/parts/probe.py), and the planner picks it only where it is cheaper per byte freed than the
other treatments. The kept bytes are the block's inputs plus the selective cache (every output
of a saved op), which no saved-tensor hook sees: the treatment counts the cache itself.

"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memfit.engine.parts.buffers import restoring_rerun
from memfit.engine.parts.treatments.base import RunOptions, Treatment
from memfit.engine.parts.random_ops import dropout_p, runs_random

if TYPE_CHECKING:
    from torch import nn

    from memfit.engine.parts.accounting import SavedTensorCounter
    from memfit.engine.parts.treatments.base import Block, ProbeKit

__all__ = ["SELECTIVE", "Selective", "CompiledSelective", "keep_matmul_and_attention", "selective_cache_tensors"]

SELECTIVE = "selective"


@functools.cache
def _saved_ops() -> frozenset:
    """The aten ops whose outputs ``selective`` keeps (NOTE [Selective policy]); those this
    torch build lacks are left out."""
    names = (
        "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward", "_efficient_attention_forward",
    )
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))




def keep_matmul_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy (NOTE [Selective policy]): keep matmul and attention outputs, except
    an attention that draws a dropout mask (it must run again to keep the random stream)."""
    if op not in _saved_ops() or dropout_p(op, args, kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def selective_cache_tensors(caching_mode: Any) -> list[torch.Tensor]:
    """The tensors a selective checkpoint's caching mode holds (its ``storage``, whatever its
    layout in this torch version: dicts and lists of wrappers whose ``val`` is the output)."""
    out: list[torch.Tensor] = []
    stack = [getattr(caching_mode, "storage", {})]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "val"):
            stack.append(item.val)
    return out


class _Contexts:
    """``context_fn`` for one selective checkpoint, keeping its caching mode to read the cache."""

    def __init__(self, policy: Callable[..., CheckpointPolicy]):
        self.policy = policy
        self.caching: Any = None

    def __call__(self) -> tuple[Any, Any]:
        caching, cached = create_selective_checkpoint_contexts(self.policy)
        self.caching = caching
        return caching, cached



class Selective(Treatment):
    """Selective checkpoint: inputs and matmul/attention outputs kept, the rest recomputed.

    Args:
        counter: the run's counter, told the cache's storages when the step counts.
        policy: the selective policy (default :func:`keep_matmul_and_attention`).
    """

    name = SELECTIVE
    help = "keep matmul and attention outputs, recompute the rest"
    holds_inputs = True
    reruns_part = True
    order = 10

    @classmethod
    def by_default(cls, modules: Sequence[nn.Module], compile_options: dict[str, Any] | None) -> bool:
        """Offered where inductor compiles the blocks (the body compiled again under the activation
        budget: :class:`CompiledSelective`); an eager run offers it where it names it."""
        return compile_options is not None and compile_options.get("backend", "inductor") == "inductor"

    @classmethod
    def for_run(cls, options: RunOptions) -> Treatment:
        return CompiledSelective() if options.compiled else cls(options.counter)

    @classmethod
    def probe(cls, block: "Block", kit: "ProbeKit") -> tuple[int, float | None] | None:
        """Its inputs plus the selective cache, and its price: the recompute under the cache (the
        unsaved ops only) plus what the forward under the caching mode costs beyond a plain
        forward (the modes dispatch every op through Python, which small ops feel). A compiled
        block: :func:`_probe_compiled` (None for one that draws random numbers: it would keep
        what ``keep`` keeps)."""
        if block.compiled:
            if block.draws_random is None:
                plain_args, plain_kwargs = kit.fresh()
                block.draws_random = runs_random(block.eager_body, *plain_args, **plain_kwargs)
            return None if block.draws_random else _probe_compiled(block, kit)

        def timed(context: Any) -> float:
            def run() -> None:
                with kit.shield(), context:
                    block.body(*probe_args, **probe_kwargs)

            return kit.elapsed_ms(run)

        probe_args, probe_kwargs = kit.fresh()
        plain_ms, forward_ms, recompute_ms = [], [], []
        for r in range(kit.timed_runs):  # NOTE [Cold runs of a block] (probe.py)
            plain_ms.append(timed(contextlib.nullcontext()))
            caching, cached = create_selective_checkpoint_contexts(keep_matmul_and_attention)
            forward_ms.append(timed(caching))
            if r == 0:
                nbytes = kit.distinct_bytes(kit.inputs() + selective_cache_tensors(caching))
            recompute_ms.append(timed(cached))
            del caching, cached
        return nbytes, max(0.0, min(forward_ms) - min(plain_ms)) + min(recompute_ms)

    def __init__(self, counter: "SavedTensorCounter | None" = None, policy: Callable[..., CheckpointPolicy] = keep_matmul_and_attention):
        self.counter = counter
        self.policy = policy

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        contexts = _Contexts(self.policy)
        out = checkpoint(
            block.run_body, *args, use_reentrant=False, preserve_rng_state=True, context_fn=restoring_rerun(block, contexts),
            **kwargs
        )
        if self.counter is not None and self.counter.active and contexts.caching is not None:
            for t in selective_cache_tensors(contexts.caching):
                self.counter.count_tensor(block.index, t)
        return out


class CompiledSelective(Treatment):
    """``selective`` on a compiled block: its body compiled under the activation memory budget,
    whose graph saves (through the hooks) only what its partitioner keeps (NOTE [Compiled
    blocks] in blocks.py)."""

    name = SELECTIVE
    holds_inputs = False
    reruns_part = True
    order = 10

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        return block.run_lean(*args, **kwargs)



def _probe_compiled(block: "Block", kit: "ProbeKit") -> tuple[int, float]:
    """A compiled block's ``selective`` (NOTE [Compiled blocks], blocks.py): what its budgeted
    compilation saves, and its forward and backward time beyond the plain compilation's (the
    partitioner's recompute runs inside the backward graph), each the fastest of the timed
    runs, interleaved (NOTE [Cold runs of a block], probe.py: the first may compile). Gradients
    are returned, not accumulated, and the inputs' and parameters' both asked, as the step's
    backward asks them."""
    lean = kit.counter_of_run()
    lean_ms, plain_ms = [], []
    for r in range(kit.timed_runs):
        lean_ms.append(kit.forward_backward_ms(block.lean_body, lean.hooks() if r == 0 else kit.shield()))
        plain_ms.append(kit.plain_run_ms(r))
    return lean.bytes, max(0.0, min(lean_ms) - min(plain_ms))
