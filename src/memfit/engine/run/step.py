"""The state of one training step, from its forward's start to the next step's start."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from typing import TYPE_CHECKING, Any

from memfit.engine.methods import Decision
from memfit.engine.records import StepRecord
from memfit.engine.shapes import input_key

if TYPE_CHECKING:
    from memfit.engine.parts.blocks import Block
    from memfit.engine.plan.learner import StepOutcome

__all__ = ["Stage", "StepState"]


class Stage(enum.Enum):
    """Where a step is: each stage starts at a hook (engine/run/controller.py)."""

    #: from the root module's forward pre-hook to its forward hook
    FORWARD = "forward"
    #: from the forward's end to the optimizer's step (or the next step's start)
    BACKWARD = "backward"
    #: from the optimizer's step pre-hook to the next step's start
    OPTIMIZER = "optimizer"


@dataclass
class StepState:
    """One training step's state; made at its forward's start, read when it is closed.

    Attributes:
        t0: ``time.perf_counter()`` at the step's start.
        static_bytes: bytes no plan changes, as they will be at this step's peak.
        state_to_come: optimizer state counted in ``static_bytes`` that only its first step creates.
        replay: an earlier micro-step of an accumulation window, rerun after an OOM (no record).
        replayable: a caller replays the step if it runs out of memory (the Trainer, ``run_step``).
        stage: where the step is.
        decision: the method's decision, made at the first block's entry (None before).
        shape, key: the first block's input shape, and its shape key.
        planner_us: time the method took to decide.
        planned: the plan was made this step (not read from the cache).
        counted: the step counts its saved tensors (NOTE [Counting what teaches], engine/run/controller.py).
        probed_groups, probes: warm-up probes: groups timed so far; per block (bytes, ms or None).
        treated_probes: per timed block, ``{treatment: (bytes, ms or None)}`` (engine/parts/probe.py).
        saved_outside, saved_by_block: what the forward saved outside the blocks and per block.
        saved_peak: the largest logical bytes in use (beyond static) seen at a room check.
        kept_now: under an armed backstop, logical bytes held at the forward's end.
        armed: the backstop ran the kept blocks under the store.
        upcoming: per block, the backstop's (bytes still to come, bytes before) predictions.
        evicted, evicted_ms: blocks evicted this step, and their recompute time.
        backstop_input: per block, what the stores kept only as block inputs.
        parts_peak: allocator peak when the top block's output gradient arrived: the LM head's backward done (CUDA,
            where the model reads that moment apart: NOTE [The parts' moment], engine/plan/model.py).
        start_peak, start_reserved: allocator peaks at the backward's first recompute (CUDA).
        rest_peak: allocator peak read at the optimizer's step (CUDA).
        window_carry: the step's allocator peak before the last block window reset it (NOTE
            [Block windows], engine/run/meter.py).
        compile_start: with compiled blocks, :func:`~memfit.engine.parts.blocks.compile_clock` at the step's start.
    """

    t0: float
    static_bytes: int
    state_to_come: int = 0
    replay: bool = False
    replayable: bool = False
    stage: Stage = Stage.FORWARD
    decision: Decision | None = None
    shape: list[int] = field(default_factory=list)
    key: tuple[int, int] = (1, 1)
    planner_us: float = 0.0
    planned: bool = False
    counted: bool = True
    probed_groups: set[int] = field(default_factory=set)
    #: the blocks whose training forward started in this step (NOTE [A block runs once a step])
    entered: set[int] = field(default_factory=set)
    probes: dict[int, tuple[int, float | None]] = field(default_factory=dict)
    treated_probes: dict[int, dict[str, tuple[int, float | None]]] = field(default_factory=dict)
    #: the sequence length this step's probes run at, where it is shorter than the step's (NOTE [Probing on a cut],
    #: probe.py); None: not decided yet; 0: the whole input
    probe_length: int | None = None
    saved_outside: int = 0
    saved_by_block: list[int] = field(default_factory=list)
    saved_peak: int = 0
    kept_now: int | None = None
    armed: bool = False
    upcoming: list[tuple[float, float]] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    evicted_ms: float = 0.0
    backstop_input: list[int] = field(default_factory=list)
    parts_peak: int | None = None
    start_peak: int | None = None
    start_reserved: int | None = None
    rest_peak: int | None = None
    window_carry: int = 0
    compile_start: tuple[float, int] | None = None
    #: each block's own (N, T) this step (NOTE [What the key cannot see], shapes.py)
    block_keys: dict[int, tuple[int, int]] = field(default_factory=dict)

    def enter(self, block: "Block", args: tuple = (), kwargs: dict | None = None) -> int:
        """``block`` starts its training forward on ``args``/``kwargs``: its index (its own key kept in ``block_keys``).

        # NOTE [A block runs once a step]
        Everything memfit learns and plans is per block and step: what a block saved, its treatment, its probe. A
        module called twice in one forward (shared weights: ALBERT runs its one layer group once per layer) would
        be counted, treated and probed as one block running once, and the learner's groups break on it. So a
        second start of a block's forward in one step is refused with what to change.
        """
        if block.index in self.entered:
            from memfit.engine.parts.blocks import NoBlocksError

            raise NoBlocksError(
                f"block {block.index} ({block.name}) ran twice in one forward: its module is called more than once "
                "(shared weights, as ALBERT's layer group, run once per layer), and memfit plans each block once a "
                "step: pass blocks= modules that each run once a forward (the model's own layers, if it has them)")
        self.entered.add(block.index)
        own = input_key(args, kwargs or {}, block.channels_first)
        if own is not None:
            self.block_keys[block.index] = own  # NOTE [What the key cannot see] (shapes.py)
        return block.index

    def end_forward(self, outside: int, by_block: list[int]) -> None:
        """The forward ended having saved ``outside`` bytes outside the blocks and ``by_block`` in them."""
        self.saved_outside, self.saved_by_block = outside, by_block
        self.stage = Stage.BACKWARD

    @property
    def saved_bytes(self) -> int:
        """Bytes the forward saved in all."""
        return self.saved_outside + sum(self.saved_by_block)

    def to_record(
        self, outcome: "StepOutcome", reserved: int, predicted: int | None, *, number: int, method: str, n_blocks: int,
        budget_bytes: int | None, accounting: str, recompute_ms: float, oom_retries: int,
        oom_attempts: list[dict[str, Any]], rank: int, now: float, collective_wait_ms: float | None = None, gc_ms: float = 0.0,
    ) -> StepRecord:
        """The finished step's record (``number``: its step number; ``now``: when it was closed; ``collective_wait_ms``:
        NOTE [The collective wait], collectives.py)."""
        plan = self.decision.plan
        backstop_input = sum(self.backstop_input)  # NOTE [Backstop], protection.py
        compile_s, graphs = (0.0, 0)
        if self.compile_start is not None:
            from memfit.engine.parts.blocks import compile_clock

            now_s, now_graphs = compile_clock()
            compile_s, graphs = now_s - self.compile_start[0], now_graphs - self.compile_start[1]
        return StepRecord(
            step=number, shape=self.shape, tokens=self.key[0] * self.key[1], method=method,
            plan=list(plan.blocks), n_checkpointed=len(plan.blocks), n_blocks=n_blocks,
            predicted_peak_bytes=predicted, peak_allocated_bytes=int(outcome.peak), peak_reserved_bytes=int(reserved),
            budget_bytes=budget_bytes, accounting=accounting, step_ms=(now - self.t0) * 1e3,
            recompute_ms_est=recompute_ms, oom_retries=oom_retries,
            phase="warmup" if self.decision.warmup else "steady",
            saved_activation_bytes=int(self.saved_bytes + backstop_input), static_bytes=int(self.static_bytes),
            planner_us=self.planner_us, planned=self.planned, evicted_blocks=self.evicted, backstop_armed=self.armed,
            backstop_input_bytes=backstop_input, oom_attempts=oom_attempts, rank=rank,
            treatments=plan.by_treatment(), counted=self.counted, alloc_retries=outcome.alloc_retries,
            stream_pool_bytes=outcome.pool_bytes, parts_peak_bytes=self.parts_peak, compile_ms=compile_s * 1e3, compiled_graphs=graphs,
            collective_wait_ms=collective_wait_ms, gc_ms=gc_ms,
        )
