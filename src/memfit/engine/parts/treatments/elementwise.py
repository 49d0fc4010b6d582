"""``elementwise``: the block runs once, but what its norms and its gated MLP's activation product
save for backward is computed again there from their inputs, never a matmul.

# NOTE [Elementwise recompute]
Most of a decoder block's saved bytes are not matmul outputs but what the elementwise ops between
them keep: a gated MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: Llama, Qwen, Mistral,
Gemma; Phi-3 halves one ``gate_up_proj`` instead) saves the activation's input, its output, the up
projection and their product (four ``tokens x intermediate`` tensors, about two thirds of a
block), and an RMSNorm written in Python
saves a float32 copy of its input beside its normalised rows. ``recompute`` frees all of it and
pays the block's whole forward again; ``selective`` frees the same elementwise outputs but runs
the block's every op through a dispatch mode, twice. This treatment frees them by saved-tensor
hooks (``torch.autograd.graph.saved_tensors_hooks``, one pair a block forward), with no
checkpoint and no dispatch mode, so it adds a few elementwise kernels a block and little host
time:

* the activation's output and the product are saved as *recipes*: when backward unpacks them, they
  are computed again from ``gate`` and ``up`` (which the activation and the product save anyway),
  the activation once for both;
* what a norm saves, and its output wherever a projection saves it, is saved as slots of the norm's
  call: the first unpack runs the norm's forward again on its input (which the treatment keeps)
  under hooks that collect what it saves, in order, and each slot takes its own.

A tensor is matched by its storage (a projection saves a 2-d view of its 3-d input), and given back
with the saved view's size, strides and offset. Everything else a block saves goes to the hooks
that were in force (the step's counter), as it would without this treatment.

Gradients are ``keep``'s bit for bit: the ops computed again are the forward's own, on the same
inputs, under the same autocast state; nothing that draws random numbers is computed again (a LoRA
dropout inside ``down_proj`` saves its own output, which stays). Nothing is assumed of a norm or an
MLP beyond their class name and four attributes: the probe runs the block both ways, forward and
backward, on the same inputs and RNG state, and offers this treatment only where the outputs and
the gradients are equal bit for bit, so an MLP that computes something else (a scaling, a residual)
is never planned with it. Eager blocks only: a compiled block has ``selective`` under the
partitioner's budget.

The norms' inputs the treatment keeps are not seen by the step's saved-tensor hooks where no op
saves them: the treatment counts them itself, as ``selective`` counts its cache.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._pytree import tree_leaves

from memfit.engine.parts.treatments.base import RunOptions, Treatment

if TYPE_CHECKING:
    from memfit.engine.parts.accounting import SavedTensorCounter
    from memfit.engine.parts.treatments.base import Block, ProbeKit

__all__ = ["ELEMENTWISE", "Elementwise", "elementwise_parts", "runs_as_plain"]

logger = logging.getLogger("memfit")

ELEMENTWISE = "elementwise"

#: a gated MLP's attributes: its two projections apart (Llama, Qwen, Mistral, Gemma), or fused (Phi-3)
_GATED_MLP = ("gate_proj", "up_proj", "down_proj", "act_fn")
_FUSED_GATED_MLP = ("gate_up_proj", "down_proj", "activation_fn")


def _is_gated_mlp(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in _GATED_MLP) or all(hasattr(m, a) for a in _FUSED_GATED_MLP)


def elementwise_parts(module: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The block's norms (leaf modules whose class name ends in ``Norm``, not one keeping running statistics: run again,
    it would update them again, NOTE [Running statistics] in buffers.py) and gated MLPs (modules with ``gate_proj``,
    ``up_proj``, ``down_proj`` and ``act_fn``, or ``gate_up_proj``, ``down_proj`` and ``activation_fn``) that this
    treatment runs leaner."""
    norms, mlps = [], []
    for m in module.modules():
        if _is_gated_mlp(m):
            if "forward" not in vars(m):  # a forward wrapped on the instance (a hook library's) is not rewritten
                mlps.append(m)
        elif type(m).__name__.endswith("Norm") and not any(True for _ in m.children()) and not isinstance(m, _NormBase):
            norms.append(m)
    return norms, mlps


class Elementwise(Treatment):
    """The block's norms and gated MLP activation product computed again in backward (NOTE [Elementwise recompute]).

    Args:
        counter: the run's counter, told what the treatment keeps when the step counts.
    """

    name = ELEMENTWISE
    help = "recompute the gated MLP's activation product and the norms in backward (saved-tensor hooks)"
    # what it computes again are modules inside the block's backward, not the body: the partial
    # transient learns their returns (NOTE [Treated peaks], model.py), so it declares neither
    # ``reruns`` nor ``reruns_part``
    order = 20
    eager_only = True

    @classmethod
    def for_run(cls, options: RunOptions) -> Treatment:
        return cls(options.counter)

    @classmethod
    def by_default(cls, modules: Sequence[nn.Module], compile_options: dict[str, Any] | None) -> bool:
        """Offered to eager blocks with a gated MLP (decoder LLMs), where it frees about half a block for
        a few elementwise kernels; a block with norms only frees little (the planner would rarely take it)."""
        return compile_options is None and any(elementwise_parts(m)[1] for m in modules)

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
        """What the block keeps under it (the hooks' count and the norms' inputs) and its price:
        forward and backward beyond the plain block's, each the fastest of the timed runs,
        interleaved. None for a compiled block, one with nothing to treat, or one whose outputs or
        gradients are not the plain block's bit for bit."""
        parts = elementwise_parts(block.module)
        if block.compiled or not (parts[0] or parts[1]):
            return None
        counter, held = kit.counter_of_run(), []
        try:
            equal = runs_as_plain(block, kit, lambda: _leaner(block.module, held, parts), counter.hooks())
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # a norm or MLP whose forward does not run again as it ran: never offered
            logger.debug("memfit: block %s does not run with its norms and MLP computed again in backward (%s); "
                        "'elementwise' is not offered for it", block.index,
                        str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
            return None
        for t in held:
            counter.count(t)
        if not equal:
            logger.debug("memfit: block %s's MLP or norms compute more than their modules' plain ops; "
                        "'elementwise' is not offered for it", block.index)
            return None

        lean_ms, plain_ms = [], []
        for run in range(kit.runs_after_check()):  # its check ran it cold: NOTE [Cold runs of a block] (probe.py)
            lean_ms.append(kit.forward_backward_ms(block.body, kit.shield(), _leaner(block.module, [], parts)))
            plain_ms.append(kit.plain_run_ms(run))
        return counter.bytes, max(0.0, min(lean_ms) - min(plain_ms))


def runs_as_plain(block: "Block", kit: "ProbeKit", context: Callable[[], Any], hooks: Any, plain_hooks: Any = None,
                  cotangent: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> bool:
    """Whether ``block`` run under ``context()`` (its saved tensors to ``hooks``) gives the plain block's outputs and
    gradients (of its inputs and trainable parameters) bit for bit, each run from one RNG state; where the plain
    block's own backward is not bit for bit twice (an attention kernel that accumulates with atomics), its forward
    outputs decide, and the block remembers it (``Block.repeats_gradients``): its later checks do not run the plain
    block a third time to find it again. ``plain_hooks`` take the plain run's saved tensors (default: the kit's shield); ``cotangent(t, i)``
    gives the gradient of the ``i``-th output ``t`` (default: ones)."""
    devices = [kit.device] if kit.device.type == "cuda" else []

    def forward_backward(treated: bool, run_hooks: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.random.set_rng_state(state[0])
        for d, s in zip(devices, state[1]):
            torch.cuda.set_rng_state(s, d)
        probe_args, probe_kwargs = kit.fresh()
        with run_hooks, (context() if treated else contextlib.nullcontext()):
            out = block.body(*probe_args, **probe_kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        inputs = [t for t in tree_leaves((probe_args, probe_kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        inputs += [p for p in block.module.parameters() if p.requires_grad]
        grown = [t for t in outs if t.requires_grad]
        seeds = [cotangent(t, i) if cotangent is not None else torch.ones_like(t) for i, t in enumerate(grown)]
        grads = torch.autograd.grad(grown, inputs, seeds, allow_unused=True) if grown and inputs else ()
        return [t.detach() for t in outs], [g for g in grads if g is not None]

    with torch.random.fork_rng(devices=devices):
        state = torch.random.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]
        plain = forward_backward(False, plain_hooks if plain_hooks is not None else kit.shield())
        treated = forward_backward(True, hooks)
        if not _same(plain[0], treated[0]):
            return False
        if _same(plain[1], treated[1]) or not block.repeats_gradients:  # not repeatable: found once, not run again
            return True
        if _same(plain[1], forward_backward(False, kit.shield())[1]):
            return False
        block.repeats_gradients = False
        return True


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


@contextlib.contextmanager
def swapped_forwards(pairs: Sequence[tuple[nn.Module, Callable[..., Any]]]) -> Iterator[None]:
    """Each module's ``forward`` the one paired with it while the context is open (the instance's attribute, read by
    ``Module.__call__``), and after it what the instance had (a forward wrapped on it by a hook library stays), where
    nothing replaced ours meanwhile: the one owner of the swaps the treatments make inside a block."""
    before = [vars(m).get("forward") for m, _ in pairs]
    for m, forward in pairs:
        m.forward = forward
    try:
        yield
    finally:
        for (m, forward), was in zip(pairs, before):
            if vars(m).get("forward") is forward:
                if was is None:
                    del m.forward
                else:
                    m.forward = was


@contextlib.contextmanager
def _leaner(
    module: nn.Module, held: list[torch.Tensor], parts: tuple[list[nn.Module], list[nn.Module]] | None = None,
) -> Iterator[None]:
    """Run ``module``'s norms and gated MLPs (``parts``, default :func:`elementwise_parts`) as NOTE
    [Elementwise recompute] says while the block's forward runs, appending the norms' inputs it
    keeps to ``held``."""
    norms, mlps = elementwise_parts(module) if parts is None else parts
    recipes = _Recipes(held)
    patched = [(m, _NormForward(m.forward, recipes)) for m in norms]
    patched += [(m, _MlpForward(m, recipes)) for m in mlps]
    with swapped_forwards(patched), torch.autograd.graph.saved_tensors_hooks(recipes.pack, recipes.unpack):
        yield


def _top_hooks() -> tuple[Callable, Callable] | None:
    """The saved-tensor hooks in force (the innermost pair), or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _Slot:
    """A saved tensor that backward gets by computing it again: ``record.value(key)`` in the
    saved view's geometry."""

    __slots__ = ("record", "key", "size", "stride", "offset")

    def __init__(self, record: Any, key: Any, t: torch.Tensor, base_offset: int):
        self.record, self.key = record, key
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset() - base_offset

    def get(self) -> torch.Tensor:
        base = self.record.value(self.key)
        if base.size() == self.size and base.stride() == self.stride and self.offset == 0:
            return base
        return base.as_strided(self.size, self.stride, base.storage_offset() + self.offset)


class _Recipes:
    """One block forward's saved-tensor hooks: a tensor registered as computable again is packed as a
    :class:`_Slot`; everything else goes to the hooks in force (or is kept, counted in ``held``)."""

    def __init__(self, held: list[torch.Tensor]):
        self.held = held
        outer = _top_hooks()
        self.outer_pack, self.outer_unpack = outer if outer is not None else (None, None)
        #: by storage: the registered tensor (weakly: a storage freed and taken by another tensor is no
        #: longer its), the record that computes it again, its key, and its offset, dtype and version
        #: (a tensor changed in place since is not what the record computes)
        self.by_storage: dict[int, tuple[weakref.ref, Any, Any, int, torch.dtype, int]] = {}
        #: the norm whose forward is running: what it saves becomes its slots
        self.collecting: "_NormRecord | None" = None

    def register(self, t: torch.Tensor, record: Any, key: Any) -> None:
        self.by_storage[_storage(t)] = (weakref.ref(t), record, key, t.storage_offset(), t.dtype, t._version)

    def pack(self, t: torch.Tensor) -> Any:
        norm = self.collecting
        if norm is not None:
            index = norm.packs
            norm.packs += 1
            if _storage(t) != norm.input_storage and not isinstance(t, nn.Parameter):
                norm.slots += 1
                return _Slot(norm, index, t, 0)
        else:
            entry = self.by_storage.get(_storage(t))
            if entry is not None and entry[4] == t.dtype and entry[5] == t._version and entry[0]() is not None:
                entry[1].slots += 1
                return _Slot(entry[1], entry[2], t, entry[3])
        if self.outer_pack is not None:
            return self.outer_pack(t)
        self.held.append(t)
        return t.detach()  # NOTE [Pack a detached tensor] (accounting.py)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Slot):
            return packed.get()
        return self.outer_unpack(packed) if self.outer_unpack is not None else packed


class _Record:
    """What computes one call's tensors again; ``slots`` counts what backward will ask of it, and
    its computed tensors are dropped once every slot has had its own."""

    def __init__(self, autocast: tuple[str, bool, torch.dtype]):
        self.autocast = autocast
        self.slots = 0
        self._cache: dict[Any, torch.Tensor] | None = None
        self._left = 0

    def value(self, key: Any) -> torch.Tensor:
        if self._cache is None:
            device_type, enabled, dtype = self.autocast
            if _autocast_state(device_type) == self.autocast:  # as in forward (backward runs outside autocast)
                self._cache = self.compute()
            else:
                with torch.autocast(device_type, dtype=dtype, enabled=enabled):
                    self._cache = self.compute()
            self._left = self.slots
        out = self._cache[key]
        self._left -= 1
        if self._left <= 0:
            self._cache = None
        return out

    def compute(self) -> dict[Any, torch.Tensor]:
        raise NotImplementedError


class _MlpRecord(_Record):
    """The activation's output and the product, from ``gate`` and ``up``."""

    def __init__(self, act_fn: Callable, gate: torch.Tensor, up: torch.Tensor):
        super().__init__(_autocast_state(gate.device.type))
        self.act_fn, self.gate, self.up = act_fn, gate.detach(), up.detach()
        self.versions = (gate._version, up._version)

    def compute(self) -> dict[Any, torch.Tensor]:
        if (self.gate._version, self.up._version) != self.versions:
            raise RuntimeError("a gated MLP's projection was changed in place after the forward")
        with torch.no_grad():
            act = self.act_fn(self.gate)
            return {"act": act, "product": act * self.up}


class _MlpForward:
    """A gated MLP's forward as the model's, its activation's output and product registered."""

    def __init__(self, mlp: nn.Module, recipes: _Recipes):
        self.mlp, self.recipes = mlp, recipes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: one projection, halved
            gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
            act_fn = mlp.activation_fn
        else:
            gate, up, act_fn = mlp.gate_proj(x), mlp.up_proj(x), mlp.act_fn
        record = _MlpRecord(act_fn, gate, up)
        act = act_fn(gate)
        if (gate._version, up._version) != record.versions:  # an activation in place is not computed again
            return mlp.down_proj(act * up)
        self.recipes.register(act, record, "act")  # before the product saves it
        product = act * up
        self.recipes.register(product, record, "product")
        return mlp.down_proj(product)


class _NormRecord(_Record):
    """What one norm call saved and its output, from its input: its forward run again under hooks
    that collect what it saves, in order."""

    def __init__(self, forward: Callable, x: torch.Tensor, args: tuple, kwargs: dict):
        super().__init__(_autocast_state(x.device.type))
        self.forward, self.x, self.args, self.kwargs = forward, x.detach(), args, kwargs
        self.requires_grad, self.version = x.requires_grad, x._version
        #: the input's storage: what the call saves of it stays as it is (the record keeps it anyway)
        self.input_storage = _storage(x)
        #: how many tensors the call saved (its output's key)
        self.packs = 0

    def compute(self) -> dict[Any, torch.Tensor]:
        if self.x._version != self.version:
            raise RuntimeError("a norm's input was changed in place after the forward")
        saved: list[torch.Tensor] = []
        x = self.x.detach().requires_grad_(self.requires_grad)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.detach()), lambda _: None):
            out = self.forward(x, *self.args, **self.kwargs)
        if len(saved) != self.packs:
            raise RuntimeError(f"a norm saved {len(saved)} tensors when run again in backward, {self.packs} in forward")
        return {**dict(enumerate(saved)), "output": out.detach()}


class _NormForward:
    """A norm's forward as the model's, what it saves taken as slots and its output registered."""

    def __init__(self, forward: Callable, recipes: _Recipes):
        self.forward, self.recipes = forward, recipes

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        recipes = self.recipes
        if recipes.collecting is not None or not isinstance(x, torch.Tensor):
            return self.forward(x, *args, **kwargs)
        record = _NormRecord(self.forward, x, args, kwargs)
        recipes.collecting = record
        try:
            out = self.forward(x, *args, **kwargs)
        finally:
            recipes.collecting = None
        recipes.held.append(x)
        if isinstance(out, torch.Tensor) and _storage(out) != record.input_storage:
            recipes.register(out, record, "output")
        return out
