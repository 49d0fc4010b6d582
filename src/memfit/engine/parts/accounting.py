"""Accounting: bytes saved for backward per block, static bytes, and allocator peaks.

Saved activations are counted with ``torch.autograd.graph.saved_tensors_hooks``: the pack
hook sees every tensor autograd keeps for backward, on CPU and GPU alike, with no device
synchronisation. Storages are de-duplicated (views of one storage count once, by storage
address) and parameters/buffers are not activations.

# NOTE [Who sees a checkpointed block's tensors]
Saved-tensor hooks nest and only the innermost pair is called. A checkpointed block runs
under ``torch.utils.checkpoint``'s own hooks, so our counter sees nothing from inside it;
what the block keeps is its inputs (held by the checkpoint for the recompute), which the
runtime counts explicitly with :meth:`SavedTensorCounter.count_inputs`. What an
un-checkpointed block would save is measured in warm-up by a *probe* (engine/parts/probe.py).

# NOTE [FSDP's unsharded parameters]
Under FSDP2 (``fully_shard``) a parameter is a DTensor holding this rank's shard: static
memory counts the shard (:func:`local`). During a module's forward, FSDP swaps in the
all-gathered (unsharded) parameters, and the module's ops save *them* for backward; FSDP
frees their storage after forward and gathers it again in backward, so they are not
activations. Their storages live as long as the model (FSDP resizes them, never replaces
them), so they are recognised by storage identity (``_cdata``), not by address: a freed
storage's address may be reused by an activation within the same forward. The runtime
learns them at each block's first forward (and the root's at the first block); a root
parameter first gathered later in the first step (the classifier's) is counted in that
step only, a few bytes too many in warm-up. ``memfit.fit`` must be called after
``fully_shard``, so that static memory is measured on the shards.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from memfit.engine.parts.optim_state import torch_optimizer_state_bytes
from memfit.engine.ranks import is_fsdp

__all__ = [
    "gathered_param_bytes",
    "SavedTensorCounter", "ProbeCounter", "GatheredParameters", "local", "tensor_bytes", "static_bytes_logical", "optimizer_state_bytes",
    "expected_optimizer_bytes",
]

OUTSIDE = -1  # block index for tensors saved outside any block (embeddings, head, loss)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (FSDP2 parameters), else ``t``."""
    # Duck-typed: importing torch.distributed.tensor to test isinstance costs seconds.
    return t.to_local() if hasattr(t, "to_local") else t


def gathered_param_bytes(module: nn.Module) -> int:
    """What FSDP2 gathers of ``module``'s parameters while it runs: their unsharded bytes where the rank holds them as
    DTensor shards, in the shards' dtype (NOTE [Warm-up on the floor], methods/dynamic.py); 0 where it holds them whole,
    where they are static bytes."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if hasattr(p, "to_local"))


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (this rank's shard of a DTensor)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = local(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the tensors in an optimizer's state (0 before its first step)."""
    if optimizer is None:
        return 0
    return tensor_bytes(t for state in optimizer.state.values() for t in tree_leaves(state) if isinstance(t, torch.Tensor))


def expected_optimizer_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """The state ``optimizer`` will hold after its first step, before it has allocated it
    (afterwards the state is measured); 0 for a class the optimizer-state table
    (engine/parts/optim_state.py) does not know. This rank's shards of sharded parameters.
    """
    if optimizer is None:
        return 0
    params = [local(p) for g in optimizer.param_groups for p in g["params"]]
    return torch_optimizer_state_bytes(optimizer, params) or 0


def static_bytes_logical(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Parameters, gradients (as they will exist in backward) and optimizer state, counted.

    Gradients are counted for every parameter that requires grad, whether or not ``.grad``
    exists yet, because backward will create them while activations are still alive.
    """
    params = list(model.parameters())
    return {
        "parameters": tensor_bytes(params),
        "gradients": sum(local(p).numel() * p.element_size() for p in params if p.requires_grad),
        "optimizer state": optimizer_state_bytes(optimizer),
    }


class SavedTensorCounter:
    """Counts saved-for-backward bytes per block during one forward.

    Use :meth:`start` / :meth:`stop` around a forward (the runtime does it from forward
    hooks on the root module) and set :attr:`current` to the running block's index.

    Args:
        n_blocks: number of blocks.
        exclude: tensors whose storages are never activations (parameters, buffers).

    Attributes:
        excluded_ptrs: addresses of those storages (a set the owner may update in place).
    """

    def __init__(self, n_blocks: int, exclude: Iterable[torch.Tensor] = ()):
        self.n_blocks = n_blocks
        self.excluded_ptrs = {local(t).untyped_storage().data_ptr() for t in exclude}
        #: storages (by identity) of parameters that exist only during forward and backward:
        #: FSDP2's unsharded parameters (NOTE [FSDP's unsharded parameters]).
        self.parameter_storages: set[int] = set()
        self._ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        self.reset()

    def reset(self) -> None:
        self.current = OUTSIDE
        self.by_block = [0] * self.n_blocks
        self.outside_bytes = 0
        #: per storage counted this forward (by address), the block it is counted in (OUTSIDE: outside
        #: the blocks, or shared by several: NOTE [Storages saved by several blocks]) and its bytes
        self._seen: dict[int, tuple[int, int]] = {}

    @property
    def total_bytes(self) -> int:
        return self.outside_bytes + sum(self.by_block)

    @property
    def counted_ptrs(self) -> Collection[int]:
        """Addresses of the storages counted this forward (read-only use)."""
        return self._seen.keys()

    def exclude_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """Never count the storages of ``params`` (FSDP2's unsharded parameters) as activations."""
        self.parameter_storages.update(local(p).untyped_storage()._cdata for p in params)

    def _add(self, t: torch.Tensor, index: int) -> None:
        """# NOTE [Storages saved by several blocks]
        A storage is counted once, in the block that saves it. One that a second block (or the
        code outside the blocks) saves too, such as the attention mask and the rotary tables every
        layer receives, is no block's own: no plan frees it by treating one block. So it moves to
        the outside bytes. Left in its first block, the block curves (each treatment's largest
        block) carried it into every block's bytes: on a padded batch of 8 x 2,048 tokens a 33 MB
        mask for each recomputed block, 0.5 GB too much at 15 of 32 (docs/devlog.md).
        """
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded_ptrs or storage._cdata in self.parameter_storages:
            return
        seen = self._seen.get(key)
        if seen is None:
            nbytes = storage.nbytes()
            self._seen[key] = (index, nbytes)
            if index == OUTSIDE:
                self.outside_bytes += nbytes
            else:
                self.by_block[index] += nbytes
            return
        owner, nbytes = seen
        if owner != OUTSIDE and owner != index:
            self._seen[key] = (OUTSIDE, nbytes)
            self.by_block[owner] -= nbytes
            self.outside_bytes += nbytes

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._add(t, self.current)
        # NOTE [Pack a detached tensor]: keeping `t` itself, when it is an output of the
        # op saving it, makes a cycle through its grad_fn that no gc can break; a graph
        # that never runs backward (a forward that hit an OOM, the probe) would leak.
        # Detaching is lossless: autograd re-attaches the grad_fn on unpack.
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def count_tensor(self, index: int, t: torch.Tensor) -> None:
        """Count ``t``'s storage for block ``index`` (once, as a saved tensor is): what a
        treatment keeps where the hooks cannot see it (engine/parts/treatments/)."""
        self._add(t, index)

    def count_inputs(self, index: int, args: tuple, kwargs: dict[str, Any]) -> None:
        """Count the tensors a checkpointed block keeps for its recompute (its inputs)."""
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._add(t, index)

    def start(self) -> None:
        if self._ctx is not None:
            return
        self.reset()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()

    def stop(self) -> None:
        if self._ctx is None:
            return
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(None, None, None)
        self.current = OUTSIDE

    @property
    def active(self) -> bool:
        return self._ctx is not None


class GatheredParameters:
    """FSDP's unsharded parameters, excluded from the counter as they are first gathered.

    NOTE [FSDP's unsharded parameters]: at a block's first forward FSDP has just gathered its
    (and, at the first block, the root's) parameters, whose storages are then known.

    Args:
        model: the model, sharded with ``fully_shard`` or not.
        counter: the run's counter.
    """

    def __init__(self, model: nn.Module, counter: SavedTensorCounter):
        self.model = model
        self.counter = counter
        self.sharded = is_fsdp(model)
        self._seen: set[int] = set()
        self._checked = False

    def check_first_forward(self) -> None:
        """At the first training forward: refuse a model sharded after ``memfit.fit``.

        Raises:
            RuntimeError: naming the fix.
        """
        if self._checked:
            return
        self._checked = True
        if not self.sharded and is_fsdp(self.model):
            raise RuntimeError(
                "the model was sharded with FSDP after memfit.fit: call memfit.fit after fully_shard, so "
                "memfit counts this rank's shards (NOTE [FSDP's unsharded parameters] in memfit/engine/parts/accounting.py)"
            )

    def enter(self, index: int, module: nn.Module) -> None:
        """Block ``index`` starts its forward: at its first, exclude its gathered parameters."""
        if not self.sharded or index in self._seen:
            return
        self.counter.exclude_parameters(module.parameters())
        if not self._seen:
            self.counter.exclude_parameters(self.model.parameters())
        self._seen.add(index)


class ProbeCounter:
    """Counts the bytes one isolated block forward saves (the un-checkpointed cost).

    Args:
        exclude_ptrs: storages that are not activations (parameters, buffers), by address.
        parameter_storages: same, by storage identity (:attr:`SavedTensorCounter.parameter_storages`).
    """

    def __init__(self, exclude_ptrs: set[int], parameter_storages: set[int] = frozenset()):
        self._exclude = exclude_ptrs
        self._parameter_storages = parameter_storages
        self._seen: set[int] = set()
        self.bytes = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._exclude and key not in self._seen and storage._cdata not in self._parameter_storages:
            self._seen.add(key)
            self.bytes += storage.nbytes()
        return t.detach()  # NOTE [Pack a detached tensor]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, SavedTensorCounter._unpack)

    def count(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage (once): what a treatment keeps where the hooks cannot see it."""
        self._pack(t)
