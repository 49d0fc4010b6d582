"""Meters: how a step's memory is read, behind one interface.

* :class:`CudaMeter`: the caching allocator's counters (``memory_allocated``,
  ``max_memory_allocated``, reset per step); the budget is a hard cap on the allocator;
* :class:`LogicalMeter` (CPU, or any device without an allocator to read): parameters +
  gradients + optimizer state + saved activations, counted from the tensors.

# NOTE [No sync in steady state]
A steady-state step reads only host-side values: the caching allocator's counters, read and
reset without synchronising the device. Only warm-up probes synchronise (to time a block), and
the last record when it is closed on request.

# NOTE [Cheap allocator reads]
``torch.cuda.memory_allocated`` and its kin build and flatten the allocator's whole statistics
dict per call (about 140 µs each); the nested dict they start from costs about 20 µs, and one
read gives the current and peak bytes together. A meter that reads at every block entry and
exit (``reactive``'s windows: four reads per block) pays that per block, so the meter reads the
nested dict once per reading, through :func:`_allocator`.

# NOTE [Expandable segments under a cap]
Without expandable segments the caching allocator keeps fixed segments, and near a hard cap their
free fragments cannot serve a large block: a 1B model at 12 GiB ran out of memory in its optimizer
step (one 502 MiB temporary, 11.2 GiB allocated, 12 reserved), which memfit cannot replay, and at 22
GiB a backward OOM's replay was refused with the failed attempt's 12 GiB still held (docs/devlog.md,
session 39); the same runs with the segments expandable ran clean. ``memfit train`` sets them before
CUDA starts; a program that calls ``memfit.fit`` has started CUDA already, so under a cap the meter
turns them on in the allocator's settings (new segments expand; those already made stay; the process
keeps the setting after ``remove()``), and says so,
unless ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) names ``expandable_segments``: the
user's choice stands (and `backend:cudaMallocAsync`, which has no such segments). It then empties the
allocator's cache: the fixed segments cached until then (a model's setup, FSDP2's sharding, an earlier
run of the same process) would otherwise serve the run's next allocations, fragments and all. A
sharded 8B LoRA whose process had run eight configurations without them ran out of memory in a backward
with 5.3 GiB reserved but not allocated (docs/devlog.md, session 40). What is still in use stays in fixed
segments: under FSDP2 a rank's shards. A sharded 3B at half of ``none``'s peak ran 682 ms a step with the
segments turned on here against 626-660 with them set at launch, so on several ranks the line says to set
them before launching.
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_leaves

from memfit.engine.parts.accounting import local, optimizer_state_bytes
from memfit.engine.budget import add_allocator_settings, apply_cuda_cap
from memfit.engine.plan.learner import Peaks
from memfit.engine.ranks import world_size
from memfit.engine.run.step import Stage, StepState

__all__ = ["Meter", "CudaMeter", "LogicalMeter", "make_meter", "stream_pools"]


class Meter:
    """How a run reads memory; one per run.

    Attributes:
        kind: ``"cuda"`` or ``"logical"`` (the records' ``accounting``).
        optimizer: the optimizer whose state is static memory (set by the runtime).
        expected_optimizer_bytes: the state it will hold after its first step.
    """

    kind: ClassVar[str] = ""
    #: every step counts its saved tensors (they are what this meter reads)
    counts_always: ClassVar[bool] = False

    def __init__(self, device: torch.device, parameter_bytes: int):
        self.device = device
        self.parameter_bytes = parameter_bytes
        self.optimizer: torch.optim.Optimizer | None = None
        self.expected_optimizer_bytes = 0

    def apply_cap(self, budget_bytes: int) -> str | None:
        """Make the budget a hard cap, where the device has one; what the run should say of it, if anything."""
        return None

    def static_now(self) -> int:
        """Bytes that no plan changes, as they will be at this step's peak.

        # NOTE [Static at the step's peak]
        A step's static bytes are the weights, every gradient and the optimizer's state, those not
        made yet included: gradients after ``zero_grad``, and before the optimizer's first step its
        whole state (``expected_optimizer_bytes``), which that step makes. Every reader (the
        planner's room, the head's and the optimizer step's checks) takes them as they are; the
        learner alone takes the state still to come back off (``StepState.state_to_come``) to read
        what the step's forward and backward held. Added again by a reader, a 1.24B model's AdamW
        state was counted twice at its first step (13.9 GiB of static bytes for 9.2) and a cap it fits
        was refused.
        """
        raise NotImplementedError

    def start_step(self, step: StepState) -> None:
        """A training step starts."""

    def block_run(self, step: StepState | None) -> None:
        """A block's body is about to run (in forward, or recomputed in backward)."""

    def parts_done(self, step: StepState | None) -> None:
        """The top block's output gradient arrived: the LM head's backward is done (NOTE [The parts' moment],
        engine/plan/model.py)."""

    def watch_parts(self, step: StepState, output: Any) -> None:
        """Call :meth:`parts_done` when the gradient of ``output`` (the top block's, in a training forward) arrives."""
        def done(grad: torch.Tensor) -> None:  # a hook that returns nothing leaves the gradient as it is
            self.parts_done(step)

        out = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if out is not None:
            out.register_hook(done)

    def window_start(self, step: StepState) -> int | None:
        """Open a window over one block's forward; returns the bytes allocated at its start (None:
        this meter cannot read a window)."""
        return None

    def window_peak(self, step: StepState) -> int | None:
        """The highest allocation since :meth:`window_start` (None: cannot be read)."""
        return None

    def aside(self, step: StepState | None) -> contextlib.AbstractContextManager:
        """What runs inside is not the step's: its peak stays out of ``step``'s readings (NOTE [Work
        aside from the step])."""
        return contextlib.nullcontext()

    def optimizer_step(self, step: StepState | None) -> None:
        """The optimizer's step is about to run."""
        if step is not None and step.stage is Stage.BACKWARD:
            step.stage = Stage.OPTIMIZER

    def in_use(self, step: StepState, held: Callable[[], int]) -> int:
        """Bytes in use now; ``held`` gives the counted bytes beyond static (logical accounting)."""
        raise NotImplementedError

    def peaks(self, step: StepState) -> Peaks:
        """What the finished ``step`` peaked at."""
        raise NotImplementedError

    def oom_readings(self, step: StepState | None) -> dict[str, int | None]:
        """Memory at an OOM, for the failed attempt's description (engine/run/replay.py)."""
        return {}

    def settle(self) -> None:
        """Wait for the device, before a step is closed on request."""

    def release(self) -> int | None:
        """After an OOM's clean-up: return cached memory to the device; the static bytes now (None: not read),
        which the failed attempt's own should equal (NOTE [What a failed attempt leaves], replay.py)."""
        return None

    def run_stats(self) -> dict[str, int]:
        """Allocator statistics for the run summary."""
        return {}


def _stats(device: torch.device) -> dict[str, Any] | None:
    """The allocator's statistics in one read, or None on a torch without the raw reader."""
    reader = getattr(torch._C, "_cuda_memoryStats", None)
    return None if reader is None else reader(device.index or 0)


def _allocator(device: torch.device, stats: dict[str, Any] | None = None) -> tuple[int, int, int, int]:
    """The allocator's (allocated now, allocated peak, reserved now, reserved peak) bytes on
    ``device``, in one read (NOTE [Cheap allocator reads]), or from ``stats`` already read."""
    stats = stats or _stats(device)
    if stats is None:  # a torch without the raw reader: the public API, four reads
        return (torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device),
                torch.cuda.memory_reserved(device), torch.cuda.max_memory_reserved(device))
    allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
    return allocated["current"], allocated["peak"], reserved["current"], reserved["peak"]


def stream_pools(device: torch.device) -> dict[str, tuple[int, int]]:
    """Per stream of ``device`` (the current one named ``"current"``), the caching allocator's reserved and allocated
    bytes now, from its snapshot (NOTE [Other streams' pools], room.py)."""
    current, index = torch.cuda.current_stream(device).cuda_stream, device.index or 0
    pools: dict[str, tuple[int, int]] = {}
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device", index) == index:
            name = "current" if segment.get("stream", current) == current else str(segment["stream"])
            total, allocated = pools.get(name, (0, 0))
            pools[name] = (total + int(segment["total_size"]), allocated + int(segment["allocated_size"]))
    return pools


def expandable_segments_on() -> bool:
    """Turn the CUDA allocator's expandable segments on, unless the user's allocator settings name them (NOTE
    [Expandable segments under a cap]); whether this call turned them on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return add_allocator_settings("expandable_segments:True", unless=("expandable_segments", "cudaMallocAsync"))


def _other_pools_free(device: torch.device) -> int:
    """The bytes the caching allocator holds free in the pools of streams other than the current one on ``device``."""
    return sum(total - allocated for name, (total, allocated) in stream_pools(device).items() if name != "current")


class CudaMeter(Meter):
    """The CUDA caching allocator's counters (NOTE [No sync in steady state])."""

    kind = "cuda"

    def __init__(self, device: torch.device, grad_params: list[torch.nn.Parameter], parameter_bytes: int):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device, parameter_bytes)
        #: each trainable parameter with the bytes of its gradient on this rank (read every step)
        self._grad_bytes = [(p, local(p).numel() * p.element_size()) for p in grad_params]
        #: the allocator's retry count when the last step was read (NOTE [Room], room.py)
        self._retries: int | None = None
        #: other streams' pools were read at a step's end (NOTE [Other streams' pools], room.py)
        self._pools_read = False

    def apply_cap(self, budget_bytes: int) -> str | None:
        # Cycles no longer referenced (an earlier model and its optimizer) hold device memory until the collector's
        # next full pass: gone before the cap, they count neither against it nor in the static part read next.
        gc.collect()
        apply_cuda_cap(budget_bytes, self.device)
        if expandable_segments_on():
            torch.cuda.empty_cache()  # the fixed segments cached so far go: what the run allocates next expands
            sharded = world_size() > 1
            return ("memfit: the CUDA allocator's segments made expandable, so the cap is not lost to fragmentation "
                    + ("(the segments this rank made before, its shards among them, stay fixed: set "
                       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before launching, as memfit train does)" if sharded else
                       "(set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False before CUDA starts to keep them fixed)"))
        return None

    def static_now(self) -> int:
        """What is allocated now, plus gradients not yet created (``.grad is None`` after
        ``zero_grad``) and optimizer state not yet created (before its first step): both
        appear during the step whatever the plan."""
        missing = sum(nbytes for p, nbytes in self._grad_bytes if p.grad is None)
        if self.optimizer is not None and not self.optimizer.state:
            missing += self.expected_optimizer_bytes
        return _allocator(self.device)[0] + missing

    def start_step(self, step: StepState) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def _read(self, step: StepState | None, stats: dict[str, Any] | None = None) -> tuple[int, int, int, int]:
        """(allocated, peak since the step's last reading with windows folded in (NOTE [Block
        windows]), reserved, reserved peak), in one read of the allocator (or from ``stats``)."""
        allocated, peak, reserved, reserved_peak = _allocator(self.device, stats)
        return allocated, peak if step is None else max(peak, step.window_carry), reserved, reserved_peak

    def block_run(self, step: StepState | None) -> None:
        """At a step's first recompute, read its backward's start peak apart (NOTE [Reading
        the backward's start], learner.py); every other run of a block body passes through."""
        if step is None or step.stage is not Stage.BACKWARD or step.start_peak is not None:
            return
        _, step.start_peak, _, step.start_reserved = self._read(step)
        step.window_carry = 0
        torch.cuda.reset_peak_memory_stats(self.device)

    def parts_done(self, step: StepState | None) -> None:
        """Read the peak so far apart, the LM head's backward's moment (NOTE [The parts' moment], engine/plan/model.py):
        once a step, before its first recompute."""
        if step is None or step.stage is not Stage.BACKWARD or step.parts_peak is not None or step.start_peak is not None:
            return
        _, step.parts_peak, _, _ = self._read(step)
        step.window_carry = 0
        torch.cuda.reset_peak_memory_stats(self.device)

    def window_start(self, step: StepState) -> int:
        """# NOTE [Block windows]
        The allocator keeps one peak; reading a block's own peak resets it. So the peak so far
        is carried in the step (``window_carry``) and every later reading of the step's peak
        takes the larger of the two.
        """
        allocated, step.window_carry, _, _ = self._read(step)
        torch.cuda.reset_peak_memory_stats(self.device)
        return allocated

    def window_peak(self, step: StepState) -> int:
        return _allocator(self.device)[1]

    @contextlib.contextmanager
    def aside(self, step: StepState | None) -> Iterator[None]:
        """# NOTE [Work aside from the step]
        Warm-up's head probe (NOTE [A probe at the steps' size], chunked_head.py) runs inside a step's
        forward and holds a kept head of up to 8,192 tokens for a moment: taken as the step's, its
        bytes were learnt as the step's transient (on the llm suite's Qwen cell at 60 GB, 6-12 GB on
        every warm-up step), and every later shape was predicted that much too high. So are the
        blocks' warm-up probes (NOTE [Probe], probe.py): a kept block's forward on a cut, beside
        treated ones, holds more than a step on the floor does at its peak, and read as the step's it
        raised every warm-up reading of a long shape, the floor predicted over what it holds (docs/devlog.md).
        So the peak so far is carried in the step, as a block window's is (NOTE [Block windows]), and
        the counter is reset after the work: the step's peak is the larger of the two, without the work's.
        """
        if step is None:
            yield
            return
        _, step.window_carry, _, _ = self._read(step)
        try:
            yield
        finally:
            torch.cuda.reset_peak_memory_stats(self.device)

    def optimizer_step(self, step: StepState | None) -> None:
        """Read the backward's peak apart from the optimizer step's (NOTE [Three peaks], model.py)."""
        if step is not None and step.stage is Stage.BACKWARD:
            step.rest_peak = self._read(step)[1]
            step.window_carry = 0
            torch.cuda.reset_peak_memory_stats(self.device)
        super().optimizer_step(step)

    def in_use(self, step: StepState, held: Callable[[], int]) -> int:
        return _allocator(self.device)[0]

    def peaks(self, step: StepState) -> Peaks:
        stats = _stats(self.device)
        _, rest, _, reserved_peak = self._read(step, stats)  # since the last reset
        reserved = max(reserved_peak, step.start_reserved or 0)
        optimizer = None
        if step.rest_peak is not None:  # since the optimizer's pre-hook reset the counter, `rest` is its step's
            optimizer, rest = rest, step.rest_peak
        peak = max(rest if step.start_peak is None else max(rest, step.start_peak), step.parts_peak or 0)
        # the allocator's retries since the last step was read: its optimizer step's are this one's
        retries_now = int((stats if stats is not None else torch.cuda.memory_stats(self.device)).get("num_alloc_retries", 0))
        retries = 0 if self._retries is None else retries_now - self._retries
        self._retries = retries_now
        pools = None
        if retries or not self._pools_read:  # the run's first step, and a step that retried: a read walks every block
            pools, self._pools_read = _other_pools_free(self.device), True
        return Peaks(peak=peak, reserved=reserved, rest=rest, start=step.start_peak, parts=step.parts_peak, optimizer=optimizer,
                     alloc_retries=retries, pool_bytes=pools)

    def oom_readings(self, step: StepState | None) -> dict[str, int | None]:
        # the larger of the head's moment and the backward's start, each read apart, and what came since
        start = max(step.start_peak or 0, step.parts_peak or 0) if step is not None and step.rest_peak is None else 0
        allocated, peak, reserved, _ = self._read(step)
        peak = max(peak, start)
        backward = None
        if step is not None and step.rest_peak is not None:
            backward = max(step.rest_peak, step.start_peak or 0, step.parts_peak or 0)
        return {
            "allocated_bytes": allocated, "peak_allocated_bytes": peak,
            "reserved_bytes": reserved, "unusable_reserved_bytes": max(0, reserved - peak),
            "backward_peak_bytes": backward,
        }

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)

    def release(self) -> int:
        torch.cuda.empty_cache()
        return self.static_now()

    def run_stats(self) -> dict[str, int]:
        # Allocations the caching allocator could only serve after releasing its cache (a
        # device sync and unmapping each time): the cost of running close to a hard cap.
        stats = torch.cuda.memory_stats(self.device)
        return {
            "cuda_alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "cuda_device_allocs": int(stats.get("num_device_alloc", 0)),
        }


class LogicalMeter(Meter):
    """Parameters + gradients + optimizer state + saved activations, counted from the tensors."""

    kind = "logical"
    counts_always = True

    def static_now(self) -> int:
        to_come = self.expected_optimizer_bytes if self.optimizer is not None and not self.optimizer.state else 0
        return self.parameter_bytes + optimizer_state_bytes(self.optimizer) + to_come

    def in_use(self, step: StepState, held: Callable[[], int]) -> int:
        in_use = step.static_bytes + held()
        step.saved_peak = max(step.saved_peak, in_use - step.static_bytes)
        return in_use

    def peaks(self, step: StepState) -> Peaks:
        held = step.kept_now if step.kept_now is not None else step.saved_bytes
        peak = step.static_bytes + max(held, step.saved_peak)
        return Peaks(peak=peak, reserved=peak, rest=peak, exact=True)


def make_meter(device: torch.device, grad_params: list[torch.nn.Parameter], parameter_bytes: int) -> Meter:
    """The allocator's meter on CUDA, logical counting elsewhere.

    Args:
        device: where the model's parameters are.
        grad_params: the parameters that get gradients (the CUDA meter counts those not yet created).
        parameter_bytes: parameters + gradients, counted (what logical accounting calls static).
    """
    if device.type == "cuda":
        return CudaMeter(device, grad_params, parameter_bytes)
    return LogicalMeter(device, parameter_bytes)
