"""The blocks' frozen weights as a part: on the host between their uses, where a batch needs the room.

# NOTE [Weights on the host]
Past every block re-run on the host with its MLP tiled, what is left on the device is mostly
static: an 8B model's frozen bf16 weights are 15 GiB of a 16 GiB floor at 16k tokens, and no
treatment of activations touches them. A LoRA run's frozen weights never change, so a block needs
them only while it runs: ``weights`` is the part (``HostWeights``) whose option ``host:<c>`` keeps
the frozen weights of the lowest ``c`` blocks in pinned host memory and brings each block's back
just before it runs, in forward and in backward, the way FSDP2 brings back a shard (the storage
freed with ``resize_(0)`` and filled again in place, so every reference autograd saved reads the
weights again; the copy goes through a byte view of the storage, so the parameter's version is
untouched and the gradients are those of the weights kept, bit for bit).

* A block's weights come back one block ahead (``DEPTH``): in forward, as the block below starts;
  in backward, as the block above reaches its backward (a hook on the block's outputs'
  gradients, as FSDP2's pre-backward hook). They leave at the end of the block's forward and once
  the block below has its output's gradient (its backward is done). The topmost streamed block
  keeps them from its forward to its backward, the bottom one from its backward to its next
  forward. So at most ``WINDOW`` blocks' weights are on the device at once: what an option saves
  is its blocks' bytes less ``WINDOW`` times the largest of them, at every moment of the step.
* The copy back goes on a side stream after the compute stream's work so far, into memory taken
  on the compute stream (as offload's fetch: NOTE [Prefetch depth], treatments/offload.py); the
  compute stream waits for it where the block runs.
* The price of a block is the copy time its compute does not hide, in forward and in backward
  (``LinkPrice``'s form, NOTE [Offload price], probe.py, with the copy back both ways), plus a
  fixed cost. A block's compute grows with tokens as its copy does not: the copy hides under the
  forward from about the tokens at which a block's forward reaches its weights' bytes over the link
  (the device's FLOP rate over the link's bandwidth, whatever the model's width), so long batches
  stream for next to nothing and short ones keep their weights. The search tries a few counts
  beside keeping them all (NOTE [The weights' room], plan/search.py).
* The host copy is made once, when a plan first streams the block (pinned, from the run's pool,
  within the host budget: NOTE [Host budget], offload.py; the weights take at most
  ``WEIGHTS_HOST_SHARE`` of it, the rest is the stashes', so the options stream no more blocks
  than fit that share), and made again only where a
  parameter's version moved (a user's in-place change). Pinning is not priced: it is paid once a
  run (docs/devlog.md has what it cost).
* A forward without autograd (evaluation, generation) brings back the weights a block left on the
  host one block ahead and sends them back after the block: they pass through, at most ``WINDOW``
  blocks' at once, so a model whose weights are over the cap evaluates under it. Any other forward
  brings a block's weights back to stay, as does ``remove()``; a ``state_dict`` reads them on the
  host; a plan that keeps a block's weights brings them back at the step's first block
  (NOTE [Bringing the weights back]).

# NOTE [Bringing the weights back]
A step that keeps the weights of blocks the step before streamed brings them all back. Done at the
step's start, the compute stream waiting for each copy, it cost 100-150 ms on 2-4k-token steps of an
8B LoRA after a streaming one (15 GiB at 55 GB/s), which no price counted: those steps ran 1.06-1.25x
the static recipe's that kept its weights on the device throughout (docs/devlog.md, session 49). Now
every copy is issued at the step's first block on the side stream, bottom block first, and each block
waits only for its own where it runs, so the blocks below compute while the copies above go on. What
stays exposed is priced (:meth:`HostWeights.back_ms`: the copies in that order beside the blocks'
forward times, as the plan's other prices read them) and added to the option that brings them back,
``keep`` or a count below the last step's; the search weighs it like every other price, so a short
step after a streaming one keeps streaming where that is cheaper. The price depends on where the
weights are, so the plans are cached per that (``HostWeights.last``, the last plan's option).

Only plain frozen parameters are streamed: not a trained one (its gradient and optimizer step
need it), nor one a block shares (with another block or the model outside the blocks), nor a
tensor subclass (an FSDP2 shard, a quantised weight), nor a compiled block's.

# NOTE [A model larger than its card]
With its frozen weights on the host a LoRA run needs far less device memory than its model's
weights (an 8B model at 16k tokens trains in 6 GiB, its bf16 weights 15 GiB), but a model must be
on its device before ``fit`` sends them there: a card smaller than the weights could not take it.
So ``fit(model, device=...)`` takes a model on the CPU and moves it itself (:func:`place`): every
tensor but the blocks' frozen weights that the part streams (those whose pinned copies fit its
share of the host budget), which go straight from the CPU into pinned host memory as the part
starts, their parameters on empty storages of the device that the weights fill as a plan brings
them back (``HostWeights(device=...)``). The run then starts as one whose weights left the
device at ``fit``; a plan that keeps them brings them to the device where they fit. A failed
setup moves the model back to the CPU; ``remove()`` leaves it on the device (the weights the cap
cannot hold stay on the host, as for any run).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from memfit.engine.budget import format_bytes
from memfit.engine.parts.kind import STATIC, Option, PartKind
from memfit.engine.parts.probe import BACKWARD_PER_FORWARD
from memfit.engine.parts.treatments.offload import _bytes_view, size_class

logger = logging.getLogger("memfit")

__all__ = ["HostWeights", "NO_WEIGHTS", "WEIGHTS_HOST_SHARE", "WEIGHTS", "HOST", "DEPTH", "WINDOW", "frozen_storages", "streamable_saving",
           "place", "weights_words"]

WEIGHTS, HOST = "weights", "host"
#: blocks of weights fetched ahead of the one running (NOTE [Weights on the host])
DEPTH = 1
#: the most blocks whose weights are on the device at once
WINDOW = DEPTH + 1
#: a streamed block's fixed price (hooks, events, launches), ms
FIXED_MS = 0.05
#: the share of the run's host budget the weights' pinned copies may take (the rest is the stashes': NOTE [Host budget])
WEIGHTS_HOST_SHARE = 0.5
#: a block's price where no link was measured (a CPU run asked for the part): streamed only where nothing else fits
UNPRICED_MS = 1e9
#: the shares of the stack the search tries (NOTE [The weights' room], plan/search.py)
SHARES = (0.125, 0.25, 0.5, 0.75, 1.0)


def frozen_storages(modules: Sequence[nn.Module], model: nn.Module) -> list[list[tuple[torch.UntypedStorage, list[nn.Parameter]]]]:
    """Per module, the storages only its frozen plain parameters use, each with those parameters
    (NOTE [Weights on the host]): none a trained parameter, a buffer, another module or the model
    outside ``modules`` uses too."""
    users: dict[int, set[int]] = {}
    for i, module in enumerate(modules):
        for t in (*module.parameters(), *module.buffers()):
            users.setdefault(t.untyped_storage().data_ptr(), set()).add(i)
    inside = {id(t) for module in modules for t in (*module.parameters(), *module.buffers())}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in inside:
            users.setdefault(t.untyped_storage().data_ptr(), set()).add(-1)
    out = []
    for i, module in enumerate(modules):
        found: dict[int, tuple[torch.UntypedStorage, list[nn.Parameter]]] = {}
        refused: set[int] = set()
        for p in module.parameters():
            storage = p.untyped_storage()
            ptr = storage.data_ptr()
            plain = type(p) is nn.Parameter and type(p.data) is torch.Tensor and p.device.type in ("cuda", "cpu")
            if not plain or p.requires_grad or users.get(ptr) != {i} or not storage.nbytes() or not storage.resizable():
                refused.add(ptr)
                continue
            found.setdefault(ptr, (storage, []))[1].append(p)
        out.append([entry for ptr, entry in found.items() if ptr not in refused])
    return out


def streamable_saving(modules: Sequence[nn.Module], model: nn.Module, host_bytes: int | None = None) -> int:
    """The most the blocks' frozen weights on the host save at every moment (the blocks' whose pinned copies fit
    ``host_bytes``, less ``WINDOW`` of the largest): what the check of the static need takes off the parameters before a
    step has run."""
    found = frozen_storages(modules, model)
    return _saving([sum(s.nbytes() for s, _ in f) for f in found][: _fitting(found, host_bytes)], WINDOW)


def place(model: nn.Module, modules: Sequence[nn.Module] | None, device: torch.device, host_bytes: int | None = None) -> Callable[[], None]:
    """Move ``model`` (on the CPU) to ``device`` but for the frozen weights of ``modules`` that the weights part streams
    (the lowest blocks' whose pinned copies fit ``host_bytes``; None: every one; ``modules`` None: none stay), which a
    ``HostWeights(device=device)`` then takes from the CPU (NOTE [A model larger than its card]). Returns what moves
    the model back to the CPU."""
    stay: set[int] = set()
    if modules:
        found = frozen_storages(modules, model)
        stay = {s.data_ptr() for storages in found[: _fitting(found, host_bytes)] for s, _ in storages}

    def to(t: torch.Tensor) -> torch.Tensor:
        return t if t.device.type == "cpu" and t.untyped_storage().data_ptr() in stay else t.to(device)

    model._apply(to)  # as ``Module.to`` does: parameters (their objects kept), buffers and gradients
    return lambda: model._apply(lambda t: t.cpu())


def _saving(sizes: Sequence[int], window: int) -> int:
    """What streaming blocks of ``sizes`` bytes saves at every moment: their bytes less ``window`` of the largest (none for
    ``WINDOW`` blocks or fewer: they would all be on the device at once)."""
    return max(0, sum(sizes) - window * max(sizes)) if len(sizes) > WINDOW else 0


def _fitting(found: Sequence[Sequence[tuple[torch.UntypedStorage, Any]]], host_bytes: int | None) -> int:
    """How many blocks from the bottom have their storages' pinned copies (power-of-two buffers: NOTE [Pinned pool],
    treatments/offload.py) within ``host_bytes`` (None: all)."""
    if host_bytes is None:
        return len(found)
    pinned = 0
    for i, storages in enumerate(found):
        pinned += sum(size_class(s.nbytes(), pinned=True) for s, _ in storages)
        if pinned > host_bytes:
            return i
    return len(found)


def _on_host(h: "_Held", p: nn.Parameter) -> torch.Tensor:
    """``p`` as a CPU tensor on its storage's host copy (same layout)."""
    return torch.empty(0, dtype=p.dtype).set_(h.host.untyped_storage(), p.storage_offset(), p.size(), p.stride())


class _Held:
    """One streamed storage: its device storage, bytes, host copy and its parameters' versions at the copy."""

    __slots__ = ("storage", "nbytes", "params", "host", "versions")

    def __init__(self, storage: torch.UntypedStorage, params: list[nn.Parameter]):
        self.storage, self.nbytes, self.params = storage, storage.nbytes(), params
        self.host: torch.Tensor | None = None
        self.versions: tuple[int, ...] = ()


class _BlockWeights:
    __slots__ = ("index", "held", "nbytes", "on_device", "ready")

    def __init__(self, index: int, held: list[_Held]):
        self.index, self.held = index, held
        self.nbytes = sum(h.nbytes for h in held)
        self.on_device = True
        self.ready: torch.cuda.Event | None = None  # the copy back on the side stream


class HostWeights(PartKind):
    """The blocks' frozen weights (NOTE [Weights on the host]); ``options``: keep them, or ``host:<c>`` for the lowest
    ``c`` blocks.

    Args:
        modules: the blocks' modules, in order.
        model: the model (what the blocks share with it is never streamed).
        take: ``take(nbytes)``, a host buffer of at least ``nbytes`` (the run's pinned pool's, within the host budget).
        h2d_bytes_per_ms: the host link's bandwidth back to the device (None: not measured, each block priced as if its
            compute hid nothing).
        excluded: the run's set of storage addresses that are never activations (the counter's ``excluded_ptrs``): a
            streamed storage's new address is put in it, its old one taken out.
        host_bytes: the pinned host memory the weights may take (None: no bound); the options stream no more blocks
            than fit it.
        window: the blocks whose weights a saving counts on the device at once: ``WINDOW`` where the meter reads the
            allocator; 0 where it counts tensors (a logical meter, which counts a step's static bytes less the streamed
            blocks' and never sees the ones coming back).
        device: the run's device: a block whose weights are elsewhere (left on the CPU by :func:`place`) starts with
            them on the host (NOTE [A model larger than its card]); None: where they are.
    """

    name = WEIGHTS
    title = "block weights"
    param_words = "blocks"
    floor_words = ("the blocks' frozen weights on the host", "a larger host budget (--memfit_host_budget)")
    moment = STATIC

    def __init__(self, modules: Sequence[nn.Module], model: nn.Module, take: Callable[[int], torch.Tensor],
                 h2d_bytes_per_ms: float | None = None, excluded: set[int] | None = None, window: int = WINDOW,
                 host_bytes: int | None = None, device: torch.device | None = None):
        found = frozen_storages(modules, model)
        self.blocks = [_BlockWeights(i, [_Held(s, ps) for s, ps in storages]) for i, storages in enumerate(found)]
        self.take, self.h2d, self.excluded = take, h2d_bytes_per_ms, excluded if excluded is not None else set()
        self.streamed: frozenset[int] = frozenset()
        #: blocks a forward without autograd brought back from the host: they go back after it (NOTE [Weights on the host])
        self._passing: set[int] = set()
        #: the option of the last plan that named one: what a plan made without the part runs (:meth:`untreated`), and
        #: where the weights are between steps, which the plans are cached per (NOTE [Bringing the weights back])
        self.last: tuple[str, int] = ("keep", 1)
        self._side: torch.cuda.Stream | None = None
        n, most = len(self.blocks), _fitting(found, host_bytes)
        counts = sorted({c for share in SHARES if most >= (c := min(n, max(1, round(share * n)))) > WINDOW})
        #: what each option's count of blocks saves at every moment (the part's one table: options, prices, peaks)
        self._saved = {c: _saving([b.nbytes for b in self.blocks[:c]], window) for c in counts}
        self._counts = [c for c in counts if self._saved[c] > 0]
        self._handles = [h for i, module in enumerate(modules) for h in (
            module.register_forward_pre_hook(self._before(i)), module.register_forward_hook(self._after(i)),
            module.register_state_dict_post_hook(self._state(i, module)))]
        arrived = [b for b in self.blocks if device is not None and b.held and b.held[0].storage.device != device]
        for b in arrived:
            self._arrive(b, device)
        if arrived:  # as if they had left at ``fit``: a plan made without the part streams them (:meth:`untreated`)
            self.last = (HOST, arrived[-1].index + 1)

    @property
    def streamable(self) -> bool:
        """Whether any option saves bytes."""
        return bool(self._counts)

    @property
    def most_saved(self) -> int:
        """What the option that saves most saves: the static bytes no plan goes below are the rest."""
        return self._saved[self._counts[-1]] if self._counts else 0

    def saved_bytes(self, tokens: int, option: tuple[str, int] | None) -> int:
        """What ``option`` saves at every moment, whatever the tokens (0 for ``keep``, None or a count not offered)."""
        return self._saved.get(int(option[1]), 0) if option is not None and option[0] == HOST else 0

    def saved_by(self, plan: Any) -> int:
        """What ``plan``'s option of the weights saves at every moment (0 where it names none)."""
        return self.saved_bytes(0, plan.option(self.name))

    def streamed_bytes(self) -> int:
        """The bytes of the blocks the step streams (its static bytes lack them: NOTE [A part kind's moment])."""
        return sum(self.blocks[i].nbytes for i in self.streamed)

    def off_bytes(self) -> int:
        """The bytes of frozen weights on the host now (what the device would hold with every block's back)."""
        return sum(b.nbytes for b in self.blocks if not b.on_device)

    def options(self, tokens: int) -> Sequence[Option]:
        return (("keep", 1, 0, 0.0), *((HOST, c, self._saved[c], 0.0) for c in self._counts))

    def untreated(self, tokens: int) -> tuple[str, int]:
        """What a plan made without the part runs (warm-up's, a replay's, ``none``'s, ``full``'s): the weights where the
        last plan that placed them left them, so a replay after an out-of-memory step never brings back what that step
        streamed (every block's weights on the host where they left at ``fit``)."""
        return self.last

    def priced(self, forward_ms: Sequence[float]) -> list[Option]:
        """The options that stream, each priced at the blocks' forward times ``forward_ms`` (NOTE [Weights on the host])."""
        prices = [self._block_ms(b.nbytes, f) for b, f in zip(self.blocks, forward_ms)]
        return [(HOST, c, self._saved[c], sum(prices[:c])) for c in self._counts]

    def back_ms(self, count: int, forward_ms: Sequence[float]) -> float:
        """What bringing back, at the step's start, the weights above the lowest ``count`` blocks that are on the host now
        costs the step: the copies in the blocks' order against the blocks' forward times ``forward_ms``, each block
        waiting for its own (NOTE [Bringing the weights back])."""
        if not self.h2d:
            return 0.0
        copied = computed = 0.0
        for b, forward in zip(self.blocks, forward_ms):
            if b.index >= count and not b.on_device and b.nbytes:
                copied += b.nbytes / self.h2d
                computed = max(computed, copied)
            computed += forward
        return max(0.0, computed - sum(forward_ms[: len(self.blocks)]))

    def _block_ms(self, nbytes: int, forward_ms: float) -> float:
        if not nbytes:
            return 0.0
        if not self.h2d:
            return UNPRICED_MS
        copy = nbytes / self.h2d
        return max(0.0, copy - forward_ms) + max(0.0, copy - BACKWARD_PER_FORWARD * forward_ms) + FIXED_MS

    # ------------------------------------------------------------------ the step
    def apply(self, option: tuple[str, int] | None) -> None:
        """The coming step streams the lowest ``c`` blocks of ``option`` (``host:<c>``; none for any other), decided
        at the first block's start: a block that keeps its weights has them back now, a streamed one above the first
        block leaves now, and the second block's copy starts (NOTE [Weights on the host])."""
        count = int(option[1]) if option is not None and option[0] == HOST else 0
        self.last, self._passing = ((HOST, count) if count else ("keep", 1)), set()
        self.streamed = frozenset(i for i in range(count) if self.blocks[i].nbytes)
        for b in self.blocks:
            if b.index not in self.streamed:
                self._fetch(b)  # waited for where the block runs (NOTE [Bringing the weights back])
            elif b.index > 0:
                self._free(b)
        if 1 in self.streamed:
            self._fetch(self.blocks[1])

    def _before(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            if not torch.is_grad_enabled():  # NOTE [Weights on the host]: a forward without autograd passes through
                for b in self.blocks[i : i + 1 + DEPTH]:
                    if not b.on_device and b.nbytes:
                        self._passing.add(b.index)
                        self._fetch(b)
            self._ensure(self.blocks[i])
            if i + 1 in self.streamed and module.training and torch.is_grad_enabled():
                self._fetch(self.blocks[i + 1])
        return hook

    def _after(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if i in self._passing and not torch.is_grad_enabled():
                self._passing.discard(i)
                self._free(self.blocks[i])
                return
            if not (self.streamed and module.training and torch.is_grad_enabled()):
                return
            if i in self.streamed and i != max(self.streamed):
                self._free(self.blocks[i])
            outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(outputs, lambda _: self._backward_at(i), mode="any")
        return hook

    def _state(self, i: int, module: nn.Module) -> Callable[..., None]:
        """A state dict reads a block's weights on the host where they are (CPU tensors on its host copy): saving a
        checkpoint brings nothing back onto the device."""
        names = {id(p): name for name, p in module.named_parameters()}

        def hook(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
            if self.blocks[i].on_device:
                return
            for h in self.blocks[i].held:
                for p in h.params:
                    if (key := prefix + names[id(p)]) in state:
                        state[key] = _on_host(h, p)
        return hook

    def _backward_at(self, i: int) -> None:
        """Backward reached block ``i`` (its output's gradient is in): block ``i + 1``'s backward is done."""
        if i + 1 in self.streamed:
            self._free(self.blocks[i + 1])
        if i in self.streamed:
            self._ensure(self.blocks[i])
        if i - 1 in self.streamed:
            self._fetch(self.blocks[i - 1])

    # ------------------------------------------------------------------ moving a block's weights
    def _free(self, b: _BlockWeights) -> None:
        if not b.on_device:
            return
        if b.ready is not None:  # fetched and never waited for: the copy must land before the memory is reused
            torch.cuda.current_stream(b.held[0].storage.device).wait_event(b.ready)
            b.ready = None
        for h in b.held:
            versions = tuple(p._version for p in h.params)
            device = h.storage.device
            if h.host is None or versions != h.versions:
                if h.host is None:
                    h.host = self.take(h.nbytes)
                h.host[: h.nbytes].copy_(_bytes_view(h.storage, device))  # once, blocking (NOTE [Weights on the host])
                h.versions = versions
            self.excluded.discard(h.storage.data_ptr())
            h.storage.resize_(0)
        b.on_device = False

    def _arrive(self, b: _BlockWeights, device: torch.device) -> None:
        """Block ``b``'s weights, on the CPU, to their host copies; its parameters on empty storages of ``device``, which
        a fetch fills (NOTE [A model larger than its card])."""
        for h in b.held:
            h.host = self.take(h.nbytes)
            h.host[: h.nbytes].copy_(_bytes_view(h.storage, h.storage.device))
            h.storage = torch.UntypedStorage(0, device=device)
            for p in h.params:  # ``set_`` grows the storage to the view: one storage's bytes at a time, freed below
                p.data = torch.empty(0, dtype=p.dtype, device=device).set_(h.storage, p.storage_offset(), p.size(), p.stride())
            h.storage.resize_(0)
            h.versions = tuple(p._version for p in h.params)
        b.on_device = False

    def _fetch(self, b: _BlockWeights) -> None:
        """Block ``b``'s weights back, on the side stream where there is one (waited for where it runs)."""
        if b.on_device:
            return
        device = b.held[0].storage.device
        for h in b.held:
            h.storage.resize_(h.nbytes)  # in the compute stream's memory
            self.excluded.add(h.storage.data_ptr())
        if device.type == "cuda":
            if self._side is None:
                self._side = torch.cuda.Stream(device)
            self._side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._side):
                for h in b.held:
                    _bytes_view(h.storage, device).copy_(h.host[: h.nbytes], non_blocking=True)
                b.ready = self._side.record_event()
        else:
            for h in b.held:
                _bytes_view(h.storage, device).copy_(h.host[: h.nbytes])
        b.on_device = True

    def _ensure(self, b: _BlockWeights) -> None:
        """Block ``b``'s weights on the device, ready for the compute stream."""
        self._fetch(b)
        if b.ready is not None:
            torch.cuda.current_stream(b.held[0].storage.device).wait_event(b.ready)
            b.ready = None

    def leave(self) -> None:
        """Every block's weights to the host now (the static bytes are over the budget: no plan keeps them all)."""
        for b in self.blocks:
            if b.nbytes:
                self._free(b)
        self.last = (HOST, len(self.blocks))
        if any(b.nbytes and b.held[0].storage.device.type == "cuda" for b in self.blocks):
            torch.cuda.empty_cache()  # no cached block of theirs serves the run past its cap

    def remove(self) -> None:
        """Every block's weights back, the hooks off (the model as before ``fit``). Where the device's cap cannot hold
        them, the rest stay in host memory as CPU tensors (a forward then fails on the devices, a state dict reads
        them), and the run says so."""
        self.streamed = frozenset()
        left = 0
        for b in self.blocks:
            try:
                self._ensure(b) if not left else None
            except torch.OutOfMemoryError:
                for h in b.held:
                    h.storage.resize_(0)  # what the failed copy back took
                b.on_device = False
            if not b.on_device:
                left += b.nbytes
                for h in b.held:
                    for p in h.params:
                        p.data = _on_host(h, p)
        if left:
            logger.warning("memfit: %.2f GiB of frozen block weights stay in host memory after remove(): the device's cap "
                           "cannot hold them; move the model back (model.to(device)) once it can", left / 2**30)
        for handle in self._handles:
            handle.remove()
        self._handles = []


def weights_words(kinds: Sequence[Any]) -> str:
    """What a start line adds of the weights part among the run's part ``kinds``: ``", <words>"`` where its weights start
    on the host (over the budget, or placed there: NOTE [A model larger than its card]), else nothing."""
    off = sum(k.off_bytes() for k in kinds if isinstance(k, HostWeights))
    return f", {format_bytes(off)} of the blocks' frozen weights start in pinned host memory (plans bring them back where a batch leaves room)" if off else ""


class _NoWeights:
    """A run's weights part where it plans none: it saves nothing at any moment."""

    name, streamable, most_saved = WEIGHTS, False, 0

    def saved_by(self, plan: Any) -> int:
        return 0


#: the weights part of a run that plans none (Planning's default)
NO_WEIGHTS = _NoWeights()
