"""One rank's share of a step sharded by FSDP2 over several ranks: ``memfit estimate --shards N``.

# NOTE [Sharded ranks in the estimate]
Under FSDP2's full shard (the Trainer's ``--fsdp "full_shard auto_wrap"`` with ``fsdp_version: 2``, or
``fully_shard`` on every block and then on the model) a rank keeps a ``1/N`` share of every parameter, of
its gradient and of its optimizer state (each parameter is cut along its first dimension; the padding to a
multiple of N is left out), and the optimizer step runs on those shares, its temporaries a ``1/N`` share
too. What a rank holds besides, and a single GPU does not, are the gathered (unsharded) parameters:

* the root's own parameters (what no block holds: the embeddings, the final norm, the LM head) stay
  gathered from the root's forward to the end of its backward: FSDP2 does not reshard the root after
  forward, since backward would gather it again at once. The Trainer's auto-wrap leaves the embeddings and
  the head in the root; a model whose embeddings and head are units of their own (``fully_shard`` on each)
  holds them only while they run, so this over-counts it by their bytes.
* in forward, three blocks' parameters: the block running, its all-gather's output, kept until the next
  block's copy-out so that the two overlap (``wait_for_unshard``), and the next block's all-gather in
  flight; in backward, two (the block running and the one prefetched) and, where the blocks train (full
  fine-tuning), the block's unsharded gradients and the reduce-scatter's input made from them. Counted
  as the most of the two phases, for the largest block, at every moment of forward and backward: an
  upper bound by a block or two at the moments that hold fewer.

Gathered parameters are in the compute dtype: the weights' own where they are bf16 or the step runs in
fp32, else the half precision the Trainer's FSDP2 gathers them in (Accelerate's mixed-precision policy),
which makes no autocast copy of its own (so none is counted). Gradients of a block are in the weights'
dtype. Some of these bytes live in the all-gather and reduce-scatter streams' pools, which a cap counts
as it counts the compute stream's: the per-rank cap holds them all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["per_rank", "gathered_bytes"]


def per_rank(n_bytes: int, shards: int) -> int:
    """One rank's share of ``n_bytes`` sharded over ``shards`` ranks (NOTE [Sharded ranks in the estimate]).

    Example:
        >>> per_rank(10, 4)
        3
    """
    return math.ceil(n_bytes / shards)


def gathered_bytes(block_params: Sequence[int], root_params: int, gather_width: int, grad_width: int) -> int:
    """The unsharded parameters (and, where blocks train, gradients) a rank holds at once beside its shares in
    forward and backward (NOTE [Sharded ranks in the estimate]).

    Args:
        block_params: each block's parameters (trained or not: every one is gathered).
        root_params: the parameters no block holds (the root's own).
        gather_width: bytes a gathered parameter takes.
        grad_width: bytes a block's gradient takes; 0 where the blocks' weights are frozen (LoRA, whose adapters'
            gradients are left out as they are on one GPU).

    Example:
        >>> gathered_bytes([100, 100], root_params=50, gather_width=2, grad_width=0)  # the root, three blocks
        700
        >>> gathered_bytes([100, 100], root_params=50, gather_width=2, grad_width=2)  # two blocks, two copies of grads
        900
    """
    block = max(block_params, default=0)
    forward = 3 * gather_width * block
    backward = 2 * gather_width * block + 2 * grad_width * block
    return gather_width * root_params + max(forward, backward)
