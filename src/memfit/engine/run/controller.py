"""The controller: wires a model's hooks to the method, the meter, the learner and the records.

``memfit.fit`` builds a :class:`Controller`, which hooks the model and needs no change to the
training loop:

* a forward pre-hook on the root module starts a step (and closes the previous one: its
  record is written then, when the peak of its backward and optimizer step is known);
* the first block to run asks the method for the plan and applies it (NOTE [Plan is fixed
  before forward]); the method's protection may change how kept blocks run (protection.py);
* saved tensors are counted per block while the root forward runs (accounting.py);
* in warm-up every block is probed (engine/parts/probe.py), and the probes are learnt at the
  forward's end (learner.py);
* an optimizer step pre-hook and every block run let the meter read the step's peaks apart
  (engine/run/meter.py);
* a closed step is turned into what it teaches (learner.py), which the method learns, and
  into a :class:`~memfit.engine.records.StepRecord`.

# NOTE [Counting what teaches]
The counter's pack hook runs for every tensor autograd saves. Logical accounting reads its
counts as the step's memory, so every step counts there; on CUDA the allocator gives the
peaks, and the counts only teach the model what each block saves. So a step counts only
when its method asks (``Decision.count``: NOTE [Which steps count] in methods/dynamic.py) or
the backstop is armed (it learns what the stored blocks saved); the counter starts with the
forward and stops at the first block otherwise, and the step runs as plain PyTorch plus the
blocks' treatments.

# NOTE [Setup is all or nothing]
Whatever setup changes on the model (wrapped blocks, hooks, the head's switch, a compiled loss) is
recorded where :meth:`Controller._unhook` finds it as soon as it is made, and the cap is set
last: any error before the first step leaves the model as it was, and a later ``fit`` on it works.

# NOTE [Plan is fixed before forward]
The shape key is read from the first block's input, so it works for any model input (tokens,
pixels, kwargs). Every block's treatment is set at that moment, before any block has run, and
does not change until the next step: forward and backward see one plan.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from memfit.engine.plan import learner
from memfit.engine.parts.accounting import OUTSIDE, GatheredParameters, SavedTensorCounter, expected_optimizer_bytes, local, optimizer_state_bytes, static_bytes_logical
from memfit.engine.parts.optimizer_step import OptimizerStepPart, choose_step
from memfit.engine.parts.guard_sides import GuardSides
from memfit.engine.parts.blocks import SELECTIVE_BUDGET, Block, compile_clock, compile_loss, find_blocks, fingerprint, unwrap_blocks, wrap_blocks
from memfit.engine.budget import OPTIMIZER_TRANSIENT, Budget, check_static_need, parse_bytes
from memfit.engine.methods import Method, make_method, save_plans
from memfit.engine.plan.planner import Plan
from memfit.engine.plan.planning import Planning
from memfit.engine.plan.room import Room
from memfit.engine.ranks import sharded_over_ranks
from memfit.engine.records import JsonlWriter, StepRecord, summarize
from memfit.engine.parts import probe
from memfit.engine.run.collectives import CollectiveWait
from memfit.engine.run.collector import Pauses, freezes
from memfit.engine.run.meter import Meter, make_meter
from memfit.engine.run.replay import Replayer, after_oom
from memfit.engine.run.step import Stage, StepState
from memfit.engine.shapes import first_tensor, shape_key
from memfit.engine.parts.store import ReactiveStore
from memfit.engine.summary_text import end_summary, start_line
from memfit.engine.parts.treatments import (
    RECOMPUTE, SELECTIVE, TREATMENTS, Treatment, make_treatments, resolve, run_treatment_names,
)
from memfit.engine.parts.host_weights import WEIGHTS_HOST_SHARE, WINDOW, HostWeights, place, streamable_saving, weights_words
from memfit.engine.parts.kind import PartKind, RunParts
from memfit.engine.parts.treatments.chunked_head import RunHead, room_free_bytes
from memfit.engine.parts.treatments.tiled_mlp import tiled_evaluation
from memfit.engine.parts.treatments.offload import _HostPool, default_host_budget_bytes

__all__ = ["fit", "Controller", "check_static_need_of", "refuse_deepspeed", "DEEPSPEED_INSTEAD", "weights_saved_of"]

logger = logging.getLogger("memfit")


def _room(method: Method, model: nn.Module, budget: Budget | None, accounting: str, margin: float | None) -> Room:
    """The run's room (room.py): where an OOM is fatal (sharded), and whether the margin may shrink
    (not for a method with one plan for every shape, ``static``: NOTE [The margin follows the misses])."""
    return Room.for_run(budget, accounting, margin, oom_fatal=sharded_over_ranks(model),
                        margin_shrinks=getattr(method, "plans_rows", True))


def _group_ids(blocks: list[Block]) -> list[int]:
    """Blocks of the same class and parameter count share a group (and a model)."""
    ids: dict[tuple[type, int], int] = {}
    out = []
    for b in blocks:
        sig = (type(b.module), sum(p.numel() for p in b.module.parameters()))
        out.append(ids.setdefault(sig, len(ids)))
    return out


def check_static_need_of(
    model: nn.Module, budget: Budget | None, state_bytes: int | None, state_name: str = "optimizer state",
    transient_bytes: int | None | Callable[[int | None], int | None] = None, weights_saved: int = 0,
) -> dict[str, int]:
    """The static need: parameters and gradients (this rank's shards under FSDP),
    ``state_bytes`` of optimizer state (left out when None: not known yet) and
    ``transient_bytes`` of the optimizer step's temporaries (NOTE [Optimizer step transient] in
    optim_state.py; left out when None or 0), counted. A callable ``transient_bytes`` is handed the
    bytes the budget leaves above the rest (None without a budget) and treats the step to fit them
    (NOTE [The optimizer step's treatments], parts/optimizer_step.py).

    The one check of the static need before training: the controller's for an optimizer it is
    given, the Trainer's for the one ``--optim`` will make (NOTE [Expected optimizer state] in
    optim_state.py), which names it ``state_name``. ``weights_saved``: what the blocks' frozen weights on the host
    save at every moment at most (NOTE [Weights on the host], parts/host_weights.py), off the parameters.

    Raises:
        BudgetTooSmallError: when they exceed ``budget`` (its message quotes the budget as the user gave it).
    """
    parts = static_bytes_logical(model, None)
    parts.pop("optimizer state")
    if state_bytes is not None:
        parts[state_name] = state_bytes
    if callable(transient_bytes):
        transient_bytes = transient_bytes(None if budget is None else budget.bytes - sum(parts.values()))
    if transient_bytes:
        parts[OPTIMIZER_TRANSIENT] = transient_bytes
    if budget is not None:
        shown = {**parts, "less frozen weights on the host": -weights_saved} if weights_saved else parts
        check_static_need(budget, sum(shown.values()), shown)
    return parts


def _state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """``optimizer``'s state as it is, or as it will be after its first step if larger."""
    return max(expected_optimizer_bytes(optimizer), optimizer_state_bytes(optimizer))


def _fit_step(optimizer: torch.optim.Optimizer | None) -> Callable[[int | None], int | None]:
    """What ``optimizer.step()`` will allocate on top of its state (this rank's shards; None: not
    predicted) given the bytes left free, as its part will run it (parts/optimizer_step.py)."""
    return lambda free_bytes: choose_step(_inner_optimizer(optimizer), free_bytes, local)


def _run_options(
    treatments: Sequence[str] | None, compile: bool | dict[str, Any], modules: Sequence[nn.Module] = (),
) -> tuple[tuple[str, ...], dict[str, Any] | None]:
    """The run's treatment names (NOTE [Recompute always at hand], treatments/__init__.py) and the
    ``torch.compile`` arguments of the blocks' bodies, or None (NOTE [Compiled blocks], blocks.py).

    ``treatments=None`` gives the default: ``recompute`` and what each registered treatment offers
    these blocks (``modules``) compiled so (:meth:`Treatment.by_default`): ``selective`` where
    inductor compiles them (the budgeted compilation, priced per block like any treatment: NOTE
    [Compiled blocks]), ``elementwise`` for eager blocks with a gated MLP.

    Raises:
        ValueError: an ``activation_memory_budget`` outside [0, 1), a ``recompile_limit``
            that is not a whole number from 1, a ``loss`` that is not a bool; ``selective`` with a backend other than inductor (NOTE [Compiled blocks]).
    """
    options = None if compile is False or compile is None else {} if compile is True else dict(compile)
    if treatments is None:
        treatments = tuple(n for n, t in TREATMENTS.items() if t.by_default(modules, options))
    if options is None:
        return run_treatment_names(treatments), None
    inductor = options.get("backend", "inductor") == "inductor"
    names = run_treatment_names(treatments)
    budget = options.get("activation_memory_budget", SELECTIVE_BUDGET)
    if not isinstance(budget, (int, float)) or not 0 <= budget < 1:
        raise ValueError(
            f"compile's activation_memory_budget {budget!r} is the share of a compiled block's activations "
            "'selective' keeps: give a number from 0 up to, not including, 1"
        )
    limit = options.get("recompile_limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(
            f"compile's recompile_limit {limit!r} is how many variants of a block's body Dynamo compiles before it "
            "runs them eagerly: give a whole number from 1, or leave it out"
        )
    if not isinstance(options.get("loss", True), bool):
        raise ValueError(
            f"compile's loss {options['loss']!r} says whether the model's loss function is compiled: give True or False"
        )
    for name, treatment in resolve(names).items():
        if treatment.eager_only:
            logger.warning("memfit: '%s' treats eager blocks only; with the blocks compiled it is never planned", name)
    if SELECTIVE in names and not inductor:
        raise ValueError(
            f"'selective' on compiled blocks needs the inductor backend (it keeps random ops from being recomputed), "
            f"not {options['backend']!r}: leave out compile's backend, or 'selective' from the treatments"
        )
    return names, options


def _inner_optimizer(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (or ``optimizer`` itself)."""
    while optimizer is not None and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _optimizer_hooks(optimizer: torch.optim.Optimizer | None, before: Callable[..., Any], after: Callable[..., Any]) -> list:
    """``before`` and ``after`` hooked around ``optimizer``'s steps (none where it has no step hooks): their handles."""
    if optimizer is None or not hasattr(optimizer, "register_step_pre_hook"):
        return []
    return [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]


def _kinds(blocks: Sequence[Block]) -> list[str]:
    return [type(b.module).__name__ for b in blocks]


def _kinds_compiled(blocks: Sequence[Block]) -> tuple[list[str], None, str | None]:
    """The start line's blocks, no parameters, and ``""`` for compiled blocks (no flag asked: ``fit``)."""
    return _kinds(blocks), None, "" if blocks[0].compiled else None


def _say(text: str | None, rank: int) -> None:
    if rank == 0 and text:
        print(text, file=sys.stderr, flush=True)


def _make_treatments(
    names: Sequence[str], counter: SavedTensorCounter, planning: Planning, device: torch.device, compiled: bool,
    host_budget_bytes: int | None = None,
) -> dict[str, Treatment]:
    """The run's treatments; with one that moves tensors to the host (``offload``, ``host_checkpoint``),
    the host link is measured now, before training holds memory, and priced for the planner
    (engine/parts/probe.py), and their pinned pool is bounded by the host budget (NOTE [Host budget], offload.py)."""
    if not any(cls.moves_out for cls in resolve(names).values()):
        return make_treatments(tuple(names), counter, compiled)
    planning.price_offload(probe.measure_link(device))
    return make_treatments(
        tuple(names), counter, compiled, excluded_ptrs=counter.excluded_ptrs, depth_for=planning.offload_depth,
        max_host_bytes=host_budget_bytes if host_budget_bytes is not None else default_host_budget_bytes(),
    )


def _check_static(model: nn.Module, budget: Budget | None, optimizer: torch.optim.Optimizer | None, weights_saved: int) -> dict[str, int]:
    """:func:`check_static_need_of` for ``optimizer`` as made or as it will be, the weights on the host at their most."""
    return check_static_need_of(model, budget, _state_bytes(optimizer), transient_bytes=_fit_step(optimizer), weights_saved=weights_saved)


def _weights_saved(offered: bool | str, names: Sequence[Any], compiled: bool, device: torch.device,
                   named: Sequence[tuple[str, nn.Module]], model: nn.Module, host_budget_bytes: int | None) -> int:
    """The most the blocks' frozen weights on the host save where the run plans them as a part (NOTE [Weights on the
    host], parts/host_weights.py), else 0: ``"auto"`` on CUDA where it offers a treatment that moves tensors to the host
    (the link is measured) and its blocks run eagerly; True where they run eagerly; False never. Their pinned copies
    take at most ``WEIGHTS_HOST_SHARE`` of the host budget (``host_budget_bytes``; None: the default's)."""
    if offered not in (True, False, "auto"):
        raise ValueError(f"host_weights={offered!r}: give True, False or 'auto'")
    if offered is True and compiled:
        raise ValueError("host_weights=True: compiled blocks keep their weights on the device; give compile=False or host_weights='auto'")
    moves = device.type == "cuda" and any(cls.moves_out for cls in resolve(names).values())
    offers = not compiled and (offered is True or (offered == "auto" and moves))
    return streamable_saving([m for _, m in named], model, _weights_host_bytes(host_budget_bytes)) if offers else 0


def _weights_host_bytes(host_budget_bytes: int | None) -> int:
    """The pinned host memory the weights' copies may take: their share of the host budget (None: the default's)."""
    return int(WEIGHTS_HOST_SHARE * (default_host_budget_bytes() if host_budget_bytes is None else host_budget_bytes))


def _weights_when_placed(host_weights: bool | str, compiled: bool) -> bool | str:
    """``host_weights`` of a run whose model ``fit`` places from the CPU (NOTE [A model larger than its card]): on, its
    streamed weights being on the host, unless turned off or the blocks are compiled (then the whole model moves)."""
    return True if host_weights is not False and not compiled else host_weights


def weights_saved_of(model: nn.Module, treatments: Sequence[Any] | None, compile: bool | dict[str, Any] = False,
                     host_weights: bool | str = "auto", blocks: Sequence[nn.Module] | str | None = None,
                     host_budget: int | str | None = None, device: torch.device | None = None) -> int:
    """What ``fit(model, treatments=..., compile=..., host_weights=..., device=...)``'s weights part saves at most (0 where
    it plans none): the static check's share of the weights that may wait on the host (NOTE [Weights on the host])."""
    named = find_blocks(model, blocks)
    names, compile_options = _run_options(treatments, compile, [m for _, m in named])
    if device is not None and _device_of(model).type == "cpu" and torch.device(device).type != "cpu":  # as fit places it
        host_weights = _weights_when_placed(host_weights, compile_options is not None)
    device = _device_of(model) if device is None else torch.device(device)
    host = None if host_budget is None else parse_bytes(host_budget, argument="host_budget=")
    return _weights_saved(host_weights, names, compile_options is not None, device, named, model, host)


def _host_weights(ctl: "Controller", static_bytes: int) -> HostWeights | None:
    """The run's weights part (NOTE [Weights on the host], parts/host_weights.py), its host copies in the run's pinned pool
    (or one of its own), its storages never counted as activations, its undo among the controller's; None where no option
    saves a byte. Where ``static_bytes`` (weights, gradients, optimizer state) are over the budget, no plan keeps every
    block's weights: they leave the device now, before the cap is set."""
    pool = next((t.pool for t in ctl.treatments.values() if getattr(t, "pool", None) is not None), None)
    pool = pool or _HostPool(ctl._host_budget_bytes or default_host_budget_bytes())
    if pool.pin is None:
        pool.pin = ctl.device.type == "cuda"
    weights = HostWeights([b.module for b in ctl.blocks], ctl.model, pool.take, getattr(ctl.planning.offload_ms, "h2d", None),
                          ctl._counter.excluded_ptrs, window=WINDOW if ctl.meter.kind != "logical" else 0,
                          host_bytes=int(WEIGHTS_HOST_SHARE * pool.max_bytes), device=ctl.device)
    if not weights.streamable:
        weights.remove()
        return None
    ctl._undo.append(weights.remove)
    ctl._counter.exclude_parameters(p for b in weights.blocks for h in b.held for p in h.params)
    if ctl.budget is not None and static_bytes > ctl.budget.bytes:
        weights.leave()
    return weights


def _device_of(model: nn.Module) -> torch.device:
    """The run's device: its parameters' (the first not on the CPU: a model ``fit`` placed keeps the blocks' streamed
    weights there until they arrive, NOTE [A model larger than its card]), the CPU where all are."""
    return next((p.device for p in model.parameters() if p.device.type != "cpu"), torch.device("cpu"))


def _weights_left(step: StepState, weights: HostWeights | None, meter: Meter) -> None:
    """A step was decided and its streamed weights left: its static bytes are less them, and its peaks are read from now
    (NOTE [A part kind's moment], parts/kind.py)."""
    if weights is not None:
        step.static_bytes -= weights.streamed_bytes()
        meter.start_step(step)


def _statics(meter: Meter, weights: HostWeights | None) -> tuple[int, int]:
    """The static bytes now with every frozen weight on the device (what plans are made from), and less the closing step's
    streamed weights (what that step is read in: NOTE [A part kind's moment], parts/kind.py)."""
    now = meter.static_now()
    if weights is None:
        return now, now
    every = now + (weights.off_bytes() if meter.kind != "logical" else 0)  # a logical meter counts them all
    return every, every - weights.streamed_bytes()


class Controller:
    """Plans, applies and records the treatment of every block for one model; made by :func:`fit`.

    Attributes:
        blocks: the wrapped blocks, in order; method: the :class:`~memfit.engine.methods.Method`.
        planning: model, planner and cache; meter: how memory is read (:attr:`accounting` names it).
        replay: the :class:`~memfit.engine.run.replay.Replayer` each micro-step runs through (:meth:`run_step`).
    """

    def __init__(
        self, model: nn.Module, budget: Budget | None, method: Method, optimizer: torch.optim.Optimizer | None = None,
        blocks: Sequence[nn.Module] | str | None = None, log: str | None = None, margin: float | None = None,
        bucket_tokens: int = 8, cap: bool = True, treatments: Sequence[str] | None = None, announce: bool = False,
        compile: bool | dict[str, Any] = False, head: bool | str = "auto", head_logits: str = "drop",
        host_budget_bytes: int | None = None, parts: Sequence[Any] = (), host_weights: bool | str = "auto",
    ):
        self.model, self.method = model, method  # the budget: the planning's room holds it (NOTE [A budget as typed])
        self.blocks: list[Block] = []
        self._undo: list[Callable[[], None]] = []  # each change to the model's undo, as it is made (NOTE [Setup is all or nothing])
        self._optimizer_handles: list = []
        try:  # NOTE [Setup is all or nothing]
            named = find_blocks(model, blocks)
            treatments, compile_options = _run_options(treatments, compile, [m for _, m in named])
            self.device = _device_of(model)
            self._host_budget_bytes, self._weights_saved = host_budget_bytes, _weights_saved(
                host_weights, treatments, compile_options is not None, self.device, named, model, host_budget_bytes)
            static_parts = _check_static(model, budget, optimizer, self._weights_saved)
            self.grad_params = [p for p in model.parameters() if p.requires_grad]
            self.meter: Meter = make_meter(self.device, self.grad_params, static_parts["parameters"] + static_parts["gradients"])
            self._fingerprint = fingerprint(named)
            method.bind(len(named), self._fingerprint)
            self.sides = GuardSides()  # compiled callables' guard sides, compiled in warm-up (NOTE [Guard sides in warm-up])
            self.blocks = wrap_blocks(named, allow_hf_checkpointing=method.measures_only, compile=compile_options, sides=self.sides)
            self._undo.append(lambda: unwrap_blocks(self.blocks))
            self.planning = Planning(
                len(self.blocks), _group_ids(self.blocks), budget, 0, bucket_tokens, treatments=treatments,
                room=_room(method, model, budget, self.meter.kind, margin),
            )
            # Parameters and buffers are never activations (under FSDP: this rank's shards).
            self._counter = SavedTensorCounter(len(self.blocks), exclude=list(model.parameters()) + list(model.buffers()))
            self._undo.append(self._counter.stop)
            self.treatments = _make_treatments(treatments, self._counter, self.planning, self.device, self.blocks[0].compiled, host_budget_bytes)
            self._block_done = [t.block_done for t in self.treatments.values() if type(t).block_done is not Treatment.block_done]
            self._weights = _host_weights(self, sum(static_parts.values())) if self._weights_saved else None
            self.head = RunHead(model, self.planning, self.meter.kind != "logical", head, head_logits, method.learns and budget is not None, lambda: self.meter.aside(self._step))
            self._undo.append(self.head.remove)  # before anything else can raise: the head's hooks are on
            self.parts = RunParts(self.head, [*parts, *filter(None, [self._weights])], self.planning)  # parts/kind.py
            self.protection = method.make_protection(lambda: ReactiveStore(self._counter.excluded_ptrs), self.planning, self.meter, self._counter)
            self._gathered, self._waits = GatheredParameters(model, self._counter), CollectiveWait(model, self.device)
            self.pauses = Pauses(freeze=freezes(not method.measures_only, self.meter.kind))  # NOTE [The collector's pauses]
            self._undo += [self._waits.remove, self.pauses.remove]  # NOTE [The collective wait], collectives.py
            self.rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
            self.announce, self._steps_recorded = announce, 0  # announce: a start line now and a summary at remove()
            self._records, self._step = [], None  # the step records; the running micro-step's StepState
            self.replay = Replayer(model, self.grad_params, self.blocks, self.treatments[RECOMPUTE], self.note_oom,
                                   self.drop_step, self.meter.release, parts=lambda: tuple(self.planning.parts.values()),
                                   step_key=lambda: None if self._step is None else self._step.key)
            self._undo += [h.remove for h in (*compile_loss(model, compile_options, self.sides), model.register_forward_pre_hook(
                self._on_forward_start, with_kwargs=True), model.register_forward_hook(self._on_forward_end, always_call=True))]
            for b in self.blocks:  # NOTE [Blocks in evaluation]: a forward without autograd tiles MLPs that would not fit
                b.listener, b.before_run, b.evaluation = self, lambda _: self.meter.block_run(self._step), _evaluation(self.planning, self.meter.kind)
            self.set_optimizer(optimizer, check=False)  # sets self.optimizer
            self._writer = JsonlWriter(log) if log else None
            self._undo += [self._writer.close] if self._writer is not None else []
            capped = self.meter.apply_cap(budget.bytes) if budget is not None and cap else None
            if announce:
                _say(start_line(method.name, budget, self.meter.kind, *_kinds_compiled(self.blocks)) + self.head.start_words() + weights_words(self.parts.kinds), self.rank)
            _say(capped, self.rank)  # what the cap changed, if anything
        except BaseException:
            self._unhook()
            raise

    # ----------------------------------------------------------------- optimizer
    def set_optimizer(self, optimizer: torch.optim.Optimizer | None, check: bool = True) -> None:
        """Count ``optimizer``'s state from now on (for an optimizer made after ``fit``). Raises:
        BudgetTooSmallError: when weights + gradients + its state exceed the budget."""
        if check:
            _check_static(self.model, self.budget, optimizer, self._weights_saved)
        for h in self._optimizer_handles:
            h.remove()
        self.optimizer = self.meter.optimizer = optimizer
        self.replay.closed_by_optimizer = optimizer is not None
        optimizer = _inner_optimizer(optimizer)
        self.meter.expected_optimizer_bytes = expected_optimizer_bytes(optimizer)  # by the inner one's class
        self.planning.remove_part(OptimizerStepPart.name)
        if optimizer is not None:  # its step, a part held at its own moment (NOTE [The optimizer step's treatments])
            self.planning.add_part(step := OptimizerStepPart(optimizer, local))
            self._undo.append(lambda: step.apply(None))  # as made again at remove()
        self._optimizer_handles = _optimizer_hooks(optimizer, lambda *_: self.meter.optimizer_step(self._step), self.replay.close_window)

    @property
    def optimizer_steps(self) -> int | None:
        """Optimizer steps taken while hooked; None without an optimizer to hook."""
        return self.replay.windows_closed if self.replay.closed_by_optimizer else None

    @property
    def budget(self) -> Budget | None:
        """The budget as typed (NOTE [A budget as typed]): the room's, its one copy (room.py)."""
        return self.planning.budget

    @property
    def accounting(self) -> str:
        """``"cuda"`` (allocator peaks) or ``"logical"`` (counted tensors)."""
        return self.meter.kind

    # ----------------------------------------------------------------- hooks
    def _on_forward_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        training = module.training and torch.is_grad_enabled()
        # read once: the closing step's lasting growth and this step's static bytes
        static_now, closing = _statics(self.meter, self._weights) if training else (None, None)
        self._finish_step(closing)
        if not training:
            return
        self._gathered.check_first_forward()
        self.planning.begin_step(static_now)
        self._step = step = StepState(
            t0=time.perf_counter(), static_bytes=static_now, replay=self.replay.replaying, replayable=self.replay.replayable,
            state_to_come=self.meter.expected_optimizer_bytes if self.optimizer is not None and not self.optimizer.state else 0,
            compile_start=compile_clock() if self.blocks[0].compiled else None,
        )
        self.meter.start_step(step)
        for treatment in self.treatments.values():
            treatment.start_step()
        self.protection.start_step(step)
        self._counter.start()

    def _on_forward_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        step = self._step
        # the counter's hooks come off autograd's stack even when the forward raised (always called)
        self._counter.stop()
        self.sides.close()
        if (output is None and sys.exc_info()[1] is not None) or step is None:
            return  # the forward raised: nothing to record
        counter = self._counter
        by_block = list(counter.by_block) if step.counted else [0] * len(self.blocks)
        if step.decision is not None:
            by_block = self.protection.forward_end(step, by_block)
        step.end_forward(counter.outside_bytes if step.counted else 0, by_block)
        if step.probes:
            probes, step.probes = step.probes, {}
            self.planning.apply(learner.learn_probes(self.planning, step.key, probes, step.treated_probes))

    def exit(self, block: Block, output: Any = None) -> None:
        """Block listener: saved tensors go to no block until the next; the top block's output is watched (NOTE [The parts' moment])."""
        self._counter.current = OUTSIDE
        if self._step is not None and self._step.stage is Stage.FORWARD:
            self.protection.exit(self._step, block)
            for done in self._block_done:  # NOTE [Spread stashes], plan/model.py: every block's output
                done(block, output)
            if self.planning.model.parts_apart and block is self.blocks[-1]:
                self.meter.watch_parts(self._step, output)

    def enter(self, block: Block, args: tuple, kwargs: dict) -> None:
        """Block listener: fix the plan at the first block; attribute saved tensors; probe."""
        step = self._step
        if step is None or step.stage is not Stage.FORWARD:
            return
        self._gathered.enter(block.index, block.module)
        if step.decision is None:
            self._decide(step, args, kwargs)
        self._counter.current = step.enter(block, args, kwargs)  # NOTE [A block runs once a step]
        self.protection.enter(step, block, args, kwargs)
        if block.treatment.holds_inputs and step.counted:
            self._counter.count_inputs(block.index, args, kwargs)
        if step.decision.warmup:
            probe.probe_warmup(step, block, args, kwargs, self._counter, self.device, self.planning, self.meter.aside, self.blocks)

    def _decide(self, step: StepState, args: tuple, kwargs: dict) -> None:
        x = first_tensor(args, kwargs)
        step.shape = list(x.shape) if x is not None else []
        step.key = shape_key(step.shape, self.blocks[0].channels_first)
        self.planning.note_block_input(x, self.blocks)
        misses, oom = self.planning.cache.misses, self.replay.oom
        failed = oom.failed_plan if oom.attempts and not self.replay.replaying else None
        t0 = time.perf_counter()
        decision = self.parts.decide(self.method.decide(self.planning, step.key, failed), step.key)
        step.planner_us, step.planned, step.decision = (time.perf_counter() - t0) * 1e6, self.planning.cache.misses > misses, decision
        _weights_left(step, self._weights, self.meter)
        for b, kind in zip(self.blocks, decision.plan.treatments(len(self.blocks))):
            b.treatment = self.treatments[kind]
        self.protection.arm(step, self.blocks, step.key, decision.plan, decision.warmup)
        step.counted = decision.count or decision.warmup or step.armed or self.meter.counts_always
        if decision.warmup or not self._records:  # NOTE [Guard sides in warm-up]
            self.sides.open()
        if not step.counted:  # NOTE [Counting what teaches]
            self._counter.stop()

    # ----------------------------------------------------------------- records
    def _finish_step(self, static_now: int | None = None) -> None:
        """Close the pending step: read its peaks, learn, write its record (``static_now``: the meter's static bytes
        if the caller has them: a step start reads them anyway)."""
        step, self._step = self._step, None
        if step is None:
            return
        self._counter.stop()
        if step.decision is None or step.stage is Stage.FORWARD:
            return  # the forward ran no block (or failed): nothing to record
        now, treated_ms = time.perf_counter(), self.planning.recompute_ms(step.key, step.decision.plan) + step.evicted_ms
        peaks = self.meter.peaks(step)
        outcome = learner.step_outcome(
            peaks, key=step.key, plan=step.decision.plan, warmup=step.decision.warmup,
            outside=step.saved_outside, by_block=step.saved_by_block, static=step.static_bytes,
            state_to_come=step.state_to_come, block_keys=step.block_keys,
            static_now=_statics(self.meter, self._weights)[1] if static_now is None else static_now,
            evicted=step.evicted, backstop_input=step.backstop_input, counted=step.counted, net_ms=(now - step.t0) * 1e3 - treated_ms,
            timed_key=self.replay.take_agreed_key(),  # NOTE [A retry beside no clean step of its bucket]
        )
        predicted = self.method.learn(self.planning, outcome)
        self.protection.after_step(step, outcome)
        if step.replay:
            return  # a replayed micro-step was recorded when it first ran
        self._steps_recorded += 1
        record = step.to_record(
            outcome, peaks.reserved, predicted, number=self._steps_recorded, method=self.method.name,
            n_blocks=len(self.blocks), budget_bytes=self.planning.budget_bytes, accounting=self.meter.kind, recompute_ms=treated_ms,
            oom_retries=len(self.replay.oom.attempts), oom_attempts=self.replay.oom.attempts, rank=self.rank, now=now,
            collective_wait_ms=self._waits.take(step.t0 if self.replay.oom.attempts else 0.0),  # NOTE [The collective wait]
            gc_ms=self.pauses.take(steady=not step.decision.warmup))  # NOTE [The collector's pauses], collector.py
        self.replay.oom.clear()
        self.parts.record(record, step.decision.plan)
        self._records.append(record)
        if self._writer is not None:
            self._writer.write(record)

    # ----------------------------------------------------------------- public
    @property
    def records(self) -> list[StepRecord]:
        """Step records so far (the last step's record is closed on access)."""
        if self._step is not None and self._step.stage is not Stage.FORWARD:
            self.meter.settle()
            self._finish_step()
        return self._records

    def summary(self):
        """:class:`~memfit.engine.records.RunSummary` of the records so far."""
        return summarize(self.records, self.optimizer_steps)

    def note_oom(self, error: BaseException | str | None = None) -> None:
        """After an OOM inside a step, before :attr:`replay` replays it: drop the failed step and keep more room
        free (:func:`~memfit.engine.run.replay.after_oom`); the replay's record lists the attempt. ``error``: the error
        or its message (a message keeps the failed step's frames, and their tensors, out of reach). Raises:
        BudgetTooSmallError: when no safer plan exists."""
        step, self._step = self._step, None
        self._counter.stop()
        attempt = self.replay.oom.add(step, self.meter, self.planning, self.protection, error)
        self.protection.note_oom(step, attempt)
        after_oom(self.method, self.planning, step, attempt, len(self.blocks), self.replay.oom.attempts[:-1])

    def drop_step(self) -> None:
        """Drop the pending step unrecorded: another rank's OOM replays it (NOTE [Replay under FSDP])."""
        self._step = None
        self._counter.stop()

    def run_step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one micro-step ``fn(*args, **kwargs)`` (its forward and backward) and return its result; on an OOM,
        replay it with the same RNG state and a safer plan, so that the gradients are those of a run without the OOM,
        accumulation windows included (NOTE [Replay in a plain loop] in engine/run/replay.py). Raises:
        BudgetTooSmallError: when no safer plan exists.

        Example:
            >>> for batch in loader:  # doctest: +SKIP
            ...     ctl.run_step(lambda: model(**batch).loss.backward())
            ...     opt.step(); opt.zero_grad(set_to_none=True)
        """
        return self.replay.run(fn, args, kwargs, raise_what=f"{self.budget.name if self.budget else 'budget='} or margin=")

    def plans(self) -> dict[tuple[int, int], Plan]:
        """Plans decided so far, per shape bucket."""
        return {k: p for (k, _), p in self.planning.cache.items()}

    def save_plans(self, path: str) -> None:
        """Write the plans of this run as JSON for the ``precomputed`` method."""
        save_plans(path, len(self.blocks), self.plans(), fingerprint=self._fingerprint)

    def state_dict(self) -> dict[str, Any]:
        """Memory model and margin, for resuming without a new warm-up."""
        return {**self.planning.state_dict(), "step": self._steps_recorded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.planning.load_state_dict(state)
        self._steps_recorded = int(state.get("step", 0))
        self.method.resume()

    def remove(self) -> None:
        """Close the last record, unhook and unwrap: the model is exactly as before ``fit``."""
        if self._undo and self.records and self.announce:
            _say(end_summary(self.records, self.budget, self.optimizer_steps), self.rank)
        self._unhook()

    def _unhook(self) -> None:
        """Undo every change this controller made to the model, last first (NOTE [Setup is all or nothing])."""
        undo, self._undo, self._optimizer_handles = [h.remove for h in self._optimizer_handles] + self._undo, [], []
        for step in reversed(undo):
            step()

    def __enter__(self) -> "Controller":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _evaluation(planning: Planning, accounting: str) -> Callable[[Block, tuple, dict], Any] | None:
    """A block's forward without autograd on CUDA under a budget (NOTE [Blocks in evaluation]); None elsewhere. One a block:
    each keeps its block's MLPs."""
    return tiled_evaluation(room_free_bytes(planning) if accounting == "cuda" and planning.budget_bytes is not None else None)


def fit(
    model: nn.Module,
    budget: int | str | Budget | None,
    method: str | Method = "dynamic",
    optimizer: torch.optim.Optimizer | None = None,
    blocks: Sequence[nn.Module] | str | None = None,
    log: str | None = None,
    margin: float | None = None,
    bucket_tokens: int = 8,
    cap: bool = True,
    treatments: Sequence[str] | None = None,
    announce: bool = True,
    compile: bool | dict[str, Any] = False,
    head: bool | str = "auto",
    head_logits: str = "drop",
    host_budget: int | str | None = None,
    parts: Sequence[PartKind] = (),
    host_weights: bool | str = "auto",
    device: str | torch.device | None = None,
    **method_kwargs: Any,
) -> Controller:
    """Train ``model`` inside ``budget`` by treating just enough blocks per batch.

    Args:
        model: the model, already on its device (or on the CPU, with ``device``).
        budget: bytes (int) or a size string, its unit written as in the table (NOTE [A budget as typed]
            in budget.py): ``"6GiB"`` = 6·2**30, ``"6GB"`` = 6·10**9 (``"6gb"`` is refused, naming both);
            ``None`` runs the method with no budget (records only). Messages quote it as given and
            name it ``budget=``; a :class:`~memfit.engine.budget.Budget` keeps its own name
            (the Trainer's ``--memory_budget``).
        method: ``none | full | dynamic | static | precomputed | reactive`` (or a Method
            instance).
        optimizer: its state is counted in the static need (measured from its tensors on
            CPU, by the allocator on CUDA); its steps close the windows of :meth:`Controller.run_step`.
        blocks: modules or a name regex, for models memfit cannot analyse.
        log: path of a JSONL file receiving one :class:`StepRecord` per step.
        margin: fraction of the budget kept free as a safety margin (default 3% on CUDA,
            0.1% with logical accounting, which is exact but for the fit's rounding). On
            CUDA the allocator's slack is kept free on top of it: ``min(256 MiB, budget / 16)``
            at first, more after an OOM that shows more (NOTE [Room] in room.py).
        bucket_tokens: plans are shared by shapes whose token counts round up to the same
            multiple of this (1 = a plan per exact shape).
        cap: on CUDA, enforce the budget with ``set_per_process_memory_fraction``.
        treatments: what the planner may give a block besides ``keep``: ``recompute``,
            ``selective``, ``offload``, ``elementwise``, ``host_checkpoint`` (treatments/); it picks per
            batch and block the cheapest mix that fits (NOTE [Treatments never lose] in search.py).
            ``recompute`` is always included (warm-up, ``full`` and replays use it). Default:
            ``recompute``; ``elementwise`` for eager blocks with a gated MLP; ``selective`` where
            ``compile`` uses inductor; ``host_checkpoint`` for blocks on a CUDA device.
        announce: print one line on stderr now (method, budget, accounting, blocks) and a short
            summary when :meth:`Controller.remove` is called.
        compile: compile each block's body with ``torch.compile`` inside memfit's wrapper
            (``True``, or a dict of its keyword arguments), the treatments around it (NOTE
            [Compiled blocks] in blocks.py); there ``selective`` runs a second compilation
            under the option ``activation_memory_budget`` (default 0.5), and the model's loss
            function (transformers' ``loss_function``) is compiled too unless the option
            ``loss`` is False.
        head: plan the LM head of a causal LM beside the blocks (NOTE [The head in the plan] in
            planner.py): per batch ``keep`` or ``chunked`` logits and loss (treatments/chunked_head.py),
            recorded under ``treatments["head"]``. ``"auto"``: wherever memfit recognises the
            head, the method is ``dynamic`` or ``static`` and a budget is given, for forwards that pass
            ``labels`` (a forward without them leaves the head to the caller from then on); elsewhere
            the model keeps its head and the start line says why (NOTE [The head by default]); the
            default. ``True``: plan it whatever the method, or raise ValueError where memfit cannot.
            ``False``: never. A chunked head's loss and gradients equal the model's within float32 rounding
            (not bitwise: the additions are reordered); the blocks stay bitwise.
        head_logits: what a training forward with ``labels`` returns as ``outputs.logits`` in a step
            whose head is chunked: ``"drop"`` (default: None, the ``tokens x vocab`` logits are never
            made) or ``"detached"`` (computed without grad in the model's dtype, for metrics; costs
            ``tokens x vocab`` bytes). Where the head is kept, and in eval or no-grad forwards, the
            logits are the model's own.
        host_budget: the pinned host memory the treatments that move tensors to the host
            (``offload``, ``host_checkpoint``) may hold, bytes or a size string like ``budget``;
            default: half of what the host has available at the start, shared among its ranks
            (NOTE [Host budget] in treatments/offload.py).
        parts: part kinds beside the blocks the planner treats per batch too
            (:class:`~memfit.engine.parts.kind.PartKind`, ``memfit.PartKind``: NOTE [A part kind's
            options]): one option of each per plan, recorded under ``treatments[part.name]``.
        host_weights: plan the blocks' frozen weights (LoRA's base weights) as a part that may wait on the host
            between their uses where a batch needs the room (NOTE [Weights on the host], parts/host_weights.py):
            ``"auto"`` (default) on CUDA where the run offers a treatment that moves tensors to the host and its blocks
            run eagerly; ``True`` wherever they run eagerly; ``False`` never.
        device: where a ``model`` on the CPU trains: memfit moves it there but for the blocks' frozen weights that
            the weights part streams, which go straight to pinned host memory (the part is then on unless
            ``host_weights=False``): a model larger than its card (NOTE [A model larger than its card],
            parts/host_weights.py). A failed setup moves it back; None: the model's own device.
        **method_kwargs: passed to the method (``path=`` for ``precomputed``,
            ``max_shape=`` for ``static``, ``warmup_steps=`` for ``dynamic``...).

    Returns:
        The :class:`Controller`; ``ctl.records[-1]`` is the last step's record,
        ``ctl.run_step(fn)`` runs a micro-step with OOM replay, and ``ctl.remove()`` restores
        the model.

    Raises:
        BudgetTooSmallError: when weights + gradients + optimizer state exceed the budget.
        UnknownMethodError: for an unknown method name.
        NoBlocksError: listing candidates, when no checkpointable block is found.
        PlansMismatchError: ``precomputed`` plans made for another model.

    Example:
        >>> import torch, memfit
        >>> from torch import nn
        >>> model = nn.Sequential(nn.ModuleList([nn.Linear(8, 8) for _ in range(4)]))
        >>> ctl = memfit.fit(model, budget="1GiB", method="full", blocks=r"0\\.\\d+")
        >>> len(ctl.blocks)
        4
        >>> ctl.remove()
    """
    budget = None if budget is None else Budget.parse(budget, "budget=")
    host_budget_bytes = None if host_budget is None else parse_bytes(host_budget, argument="host_budget=")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1):
        raise ValueError(f"margin={margin!r}: give a share of the budget in [0, 1), e.g. 0.05, or None for the default")
    if isinstance(bucket_tokens, bool) or not isinstance(bucket_tokens, int) or bucket_tokens < 1:
        raise ValueError(f"bucket_tokens={bucket_tokens!r}: give a whole number of tokens from 1 (1 = a plan per exact shape)")
    refuse_deepspeed(model)
    method_obj = make_method(method, **method_kwargs)
    placed, host_weights = _placed(model, device, blocks, host_weights, compile, host_budget_bytes)
    try:
        return Controller(model, budget, method_obj, optimizer, blocks, log, margin, bucket_tokens, cap, treatments, announce,
                          compile, head=head, head_logits=head_logits, host_budget_bytes=host_budget_bytes, parts=parts,
                          host_weights=host_weights)
    except BaseException:
        placed()  # NOTE [Setup is all or nothing]: the model back on the CPU
        raise


def _placed(model: nn.Module, device: str | torch.device | None, blocks: Sequence[nn.Module] | str | None,
            host_weights: bool | str, compile: bool | dict[str, Any], host_budget_bytes: int | None) -> tuple[Callable[[], None], bool | str]:
    """``model`` on ``device`` where ``fit`` was given one and the model is on the CPU, the blocks' streamed weights on the
    host (NOTE [A model larger than its card], parts/host_weights.py): what moves it back, and the ``host_weights`` the
    run then has (on: the weights wait on the host)."""
    try:
        target, now = None if device is None else torch.device(device), _device_of(model)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}: give a torch device, such as 'cuda' or 'cuda:1'") from None
    if target is None or target.type == "cpu" or (now.type == target.type and target.index in (None, now.index)):
        return (lambda: None), host_weights
    if now.type != "cpu":
        raise ValueError(f"device={device!r}: the model is on {now}; give a model on the CPU, or no device")
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    host_weights = _weights_when_placed(host_weights, compile is not False and compile is not None)
    modules = [m for _, m in find_blocks(model, blocks)] if host_weights is True else None
    return place(model, modules, target, _weights_host_bytes(host_budget_bytes)), host_weights


#: what a user shards with instead of DeepSpeed (NOTE [DeepSpeed is refused])
DEEPSPEED_INSTEAD = "shard with FSDP2 instead (the Trainer's --fsdp, or torch's fully_shard before memfit.fit)"


def refuse_deepspeed(model: nn.Module) -> None:
    """Raise where ``model`` runs under DeepSpeed (its engine, or ZeRO-3's partitioned parameters).

    # NOTE [DeepSpeed is refused]
    memfit counts, replays and treats a step on the assumption that a block's parameters are whole during its
    forward and that an OOM leaves every rank able to run the step again; DeepSpeed's engine owns the backward, the
    gradient partitions and the parameter gathers (ZeRO-3), none of which memfit has been tested against. Rather
    than train with plans it cannot vouch for, it refuses, once, naming FSDP2, under which the same treatments,
    per-rank caps and replays are tested.

    Raises:
        ValueError: naming what to use instead.
    """
    engine = "DeepSpeedEngine" in {c.__name__ for c in type(model).__mro__}
    partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    if engine or partitioned:
        raise ValueError(f"memfit.fit: the model runs under DeepSpeed ({'its engine' if engine else 'ZeRO-3 partitioned parameters'}), "
                         f"which memfit does not support; {DEEPSPEED_INSTEAD}")
