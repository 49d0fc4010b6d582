"""The floor of a shape: the smallest cap memfit's treatments reach, said before it is hit (``memfit estimate --floor``).

# NOTE [The floor]
The floor of a shape (micro-batch x sequence length) is the estimate of its step with every block on the
engine's floor treatment (``floor_treatment``, treatments/__init__.py): ``host_checkpoint_tiled`` where the
engine tiles the model's MLP, else ``host_checkpoint`` (NOTE [Checkpoints on the host in the estimate] and NOTE
[The tiled MLP in the estimate], anatomy.py: no block input on the device, and the MLP's intermediates one chunk
at a time), and the LM head chunked in the most chunks the planner offers (:func:`most_head_chunks`): the
static memory (weights, gradients, optimizer state, library workspaces) and one block's recompute and
backward at a time, with the head's rows and one chunk's logits; at the optimizer step, the step run per tensor
where the optimizer has such a step (torch's AdamW: one tensor's temporaries, not foreach's). No plan of memfit's treatments keeps
less on the device (the others keep a block's input, or its saved tensors, or fetch a whole block's saved
tensors back, or make its MLP's intermediates for every token at once): a budget under it cannot train that
shape, whatever the method, and the pinned host memory it holds (every block's input) must fit the host budget
(``--memfit_host_budget``). Whether the MLP tiles depends on the setup as well as the model (peft's LoRA
dropout inside the MLP rules it out): the estimate's note says which was counted. Whether it fits is judged
against the budget less ``--margin``, as ``--advise`` judges (NOTE [Advice keeps a margin], advise.py).
It is an estimate, with the assumptions of the count (NOTE [What the meta count runs], anatomy.py: the
estimate's note says them for the model) and its own (:data:`FLOOR_ASSUMES`), both said under every floor
table.

The floor grows with the tokens (nothing in it shrinks with them), so the longest length a budget admits
is found by doubling from the shortest and then halving the last step (:meth:`Floors.longest`), each
length counted once (:class:`Floors` keeps them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from memfit.engine.budget import Budget, format_bytes
from memfit.engine.parts.host_weights import WEIGHTS_HOST_SHARE, WINDOW
from memfit.engine.parts.optimizer_step import PER_TENSOR
from memfit.tools.estimate.advise import NothingFitsError
from memfit.tools.estimate.anatomy import (
    MemoryEstimate,
    ModelProfile,
    TrainingSetup,
    estimate,
    most_head_chunks,
    table_unit,
)

__all__ = ["FLOOR_ASSUMES", "FloorTooHighError", "Floors", "floor_estimate", "floor_lengths", "format_floor",
           "floor_words", "floor_too_high", "plan_words", "weights_on_host"]

#: the shortest length of the floor table (a shorter one is searched only where it does not fit)
SHORTEST = 1024
#: what a floor assumes besides the count's assumptions (the estimate's note), said under every floor table
FLOOR_ASSUMES = (
    "the floor assumes the LM head chunked by memfit's own implementation (a fused kernel, where installed, may hold "
    "less), host_checkpoint's prefetch depth 1 (a slow host link deepens it: a block input more each), and nothing "
    "for the allocator's fragmentation but the margin; memfit's last-resort replay runs this plan with the head at "
    "the count a plan without a head runs (fewer chunks)"
)


class FloorTooHighError(NothingFitsError):
    """Even the floor of the shape asked does not fit the budget (or its pinned bytes the host budget)."""


def floor_estimate(profile: ModelProfile, setup: TrainingSetup, seq_length: int, host_budget_bytes: int | None = None,
                   **inputs) -> MemoryEstimate:
    """The estimate of ``setup``'s step at its floor (NOTE [The floor]): every block on ``host_checkpoint_tiled``
    (``host_checkpoint`` where the engine tiles no MLP), the head chunked in the most chunks the planner offers at
    these tokens.

    Example:
        >>> floor_estimate(profile, TrainingSetup("bf16", weights="bf16", micro_batch_size=1), 65536).total_bytes  # doctest: +SKIP
    """
    chunks = most_head_chunks(profile, setup.micro_batch_size * seq_length, setup.precision, setup.weights)
    at = dataclasses.replace(setup, checkpoint="host", head="chunked" if chunks else "keep", head_chunks=chunks,
                             optimizer_step=PER_TENSOR)
    return weights_on_host(estimate(profile, at, seq_length=seq_length, **inputs), profile, host_budget_bytes)


def weights_on_host(est: MemoryEstimate, profile: ModelProfile, host_budget_bytes: int | None = None) -> MemoryEstimate:
    """``est`` with the blocks' frozen weights on the host, as memfit's floor runs them under LoRA (NOTE [Weights on the
    host], parts/host_weights.py): on the device only ``WINDOW`` blocks' at once; in pinned host memory every block's,
    or those from the bottom whose weights fit ``WEIGHTS_HOST_SHARE`` of ``host_budget_bytes`` where one is given.

    # NOTE [Weights on the host in the floor]
    Under LoRA every weight of a block is frozen, so the floor plan holds them on the host too: the device keeps the
    weights outside the blocks (embeddings, LM head), the adapters and the two blocks' weights on their way, and the
    host budget holds the blocks' (their power-of-two pinned buffers are not counted: up to an eighth more), as many
    from the bottom as fit the weights' share of it (the runtime's rule); the others stay on the device. Full
    fine-tuning trains every block weight, which stays.
    """
    blocks = list(profile.block_params or ())
    per_param = 2 if est.setup.weights == "bf16" else 4
    if host_budget_bytes is not None:
        room = WEIGHTS_HOST_SHARE * host_budget_bytes
        blocks = blocks[: next((i for i in range(len(blocks)) if per_param * sum(blocks[: i + 1]) > room), len(blocks))]
    if not est.setup.lora_r or len(blocks) <= WINDOW:
        return est
    sizes = [per_param * n for n in blocks]
    moved = sum(sizes) - WINDOW * max(sizes)
    note = (f"the blocks' frozen weights wait in pinned host memory between their uses (memfit's weights part): "
            f"{format_bytes(moved)} off the device, {format_bytes(sum(sizes))} pinned")
    return dataclasses.replace(est, weights_bytes=est.weights_bytes - moved, host_bytes=est.host_bytes + sum(sizes),
                               notes=(*est.notes, note))


def floor_lengths(longest: int) -> list[int]:
    """The lengths of the floor table: powers of two from :data:`SHORTEST` up to ``longest``, and ``longest``.

    Example:
        >>> floor_lengths(5000)
        [1024, 2048, 4096, 5000]
    """
    lengths = [SHORTEST]
    while lengths[-1] * 2 <= longest:
        lengths.append(lengths[-1] * 2)
    return sorted({*(n for n in lengths if n <= longest), longest})


class Floors:
    """The floors of one setup at every length asked, each counted once (a count on the meta device takes seconds).

    Args:
        profile: the model.
        setup: the setup whose floor is asked (precision, weights, LoRA, optimizer, micro-batch).
        usable_bytes: the budget less the margin, or None without a budget.
        host_budget_bytes: pinned host memory allowed (``--memfit_host_budget``), or None when not given.
        **inputs: ``attention`` and the like, as for :func:`~memfit.tools.estimate.anatomy.estimate`.
    """

    def __init__(self, profile: ModelProfile, setup: TrainingSetup, usable_bytes: int | None = None,
                 host_budget_bytes: int | None = None, **inputs):
        self.profile, self.setup, self.inputs = profile, setup, inputs
        self.usable_bytes, self.host_budget_bytes = usable_bytes, host_budget_bytes
        self._known: dict[tuple[int, int], MemoryEstimate] = {}

    def at(self, seq_length: int, micro_batch_size: int | None = None) -> MemoryEstimate:
        """The floor at ``seq_length`` tokens a row and ``micro_batch_size`` rows (the setup's by default)."""
        micro = micro_batch_size or self.setup.micro_batch_size
        if (micro, seq_length) not in self._known:
            setup = dataclasses.replace(self.setup, micro_batch_size=micro, accumulation_steps=1)
            self._known[micro, seq_length] = floor_estimate(self.profile, setup, seq_length, self.host_budget_bytes, **self.inputs)
        return self._known[micro, seq_length]

    def admits(self, est: MemoryEstimate) -> bool:
        """Whether ``est`` fits the usable budget and its pinned bytes the host budget (where given)."""
        host_ok = self.host_budget_bytes is None or est.host_bytes <= self.host_budget_bytes
        return host_ok and (self.usable_bytes is None or est.total_bytes <= self.usable_bytes)

    def longest(self, limit: int, micro_batch_size: int | None = None) -> int | None:
        """The longest length up to ``limit`` whose floor is admitted at ``micro_batch_size`` rows (NOTE [The
        floor]): from :data:`SHORTEST`, doubling while it fits (or halving until it does), then bisecting the
        last doubling to an eighth of it; None where not even one token a row is admitted."""
        def fits(n: int) -> bool:
            return self.admits(self.at(n, micro_batch_size))

        low = min(SHORTEST, limit)
        if fits(low):
            while low < limit and fits(min(2 * low, limit)):
                low = min(2 * low, limit)
        else:
            low = next((n for n in (low >> k for k in range(1, low.bit_length())) if fits(n)), 0)
        if low in (0, limit):
            return low or None
        over, step = min(2 * low, limit), max(1, low // 8)
        while over - low > step:
            mid = low + max(step, (over - low) // 2 // step * step)
            low, over = (mid, over) if fits(mid) else (low, mid)
        return low


def floor_words(est: MemoryEstimate, size: Callable[[int], str] = format_bytes) -> str:
    """A floor and what it is made of at its peak moment, in ``size``'s units: ``"22.97 GiB: weights 15.11 GiB
    + ..."`` (NOTE [Phases of a step], anatomy.py: the gradients are whole only in the optimizer step)."""
    if est.backward_peak_bytes >= est.step_peak_bytes:
        parts = [("weights", est.weights_bytes), ("optimizer state", est.optimizer_state_bytes),
                 ("workspaces", est.workspace_bytes), ("forward and backward", est.backward_bytes),
                 ("gathered by FSDP2", est.gathered_bytes)]
        tail = f" (at its peak, one block's recompute and backward: {size(est.recompute_bytes)}"
        if est.lm_head is not None:
            tail += f"; at its own moment, the LM head chunked in {est.lm_head.n_chunks}: {size(est.lm_head.bytes('chunked'))}"
        tail += ")"
    else:
        parts = [("weights", est.weights_bytes), ("gradients", est.gradients_bytes), ("optimizer state", est.optimizer_state_bytes),
                 ("workspaces", est.workspace_bytes), ("optimizer step temporaries", est.optimizer_step_bytes)]
        tail = " (the optimizer step's peak)"
    return f"{size(est.total_bytes)}: " + " + ".join(f"{name} {size(b)}" for name, b in parts if b) + tail


def format_floor(floors: Floors, lengths: Sequence[int], budget: Budget | None, longest: tuple[int, int] | None,
                 margin: float) -> str:
    """The floor table per length (NOTE [The floor]) and, with a budget, the longest length it admits.

    Args:
        floors: the setup's floors.
        lengths: the table's lengths (:func:`floor_lengths`; the longest admitted is added).
        budget: the budget as the user gave it, or None.
        longest: (length, micro-batch) of the longest admitted, or None where nothing is (or no budget).
        margin: the share of the budget kept free.

    Returns:
        Multi-line text: the table, the longest line, the assumptions.
    """
    unit = table_unit(budget)
    size = budget.size if budget is not None else format_bytes
    micro = floors.setup.micro_batch_size
    rows = sorted({*((n, micro) for n in lengths), *([longest] if longest else [])})
    last = floors.at(*rows[-1])  # the headline and the notes speak of the longest row's shape (its MLP chunks)
    lines = [
        f"floor per sequence length: the smallest cap memfit's treatments reach ({plan_words(last)}), "
        f"{floors.setup.precision}, {floors.setup.weights} weights{_lora_words(floors.setup)}, {floors.setup.optimizer}",
        "",
        f"| seq_length | micro-batch | tokens | floor {unit[0]} | one block {unit[0]} | LM head {unit[0]} | pinned host {unit[0]} |"
        + (" fits |" if budget is not None else ""),
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" --- |" if budget is not None else ""),
    ]
    for length, rows_at in rows:
        est = floors.at(length, rows_at)
        head = est.lm_head.bytes("chunked") if est.lm_head is not None else 0
        cells = [f"{length:,}", str(rows_at), f"{rows_at * length:,}", _in(est.total_bytes, unit), _in(est.recompute_bytes, unit),
                 _in(head, unit) + (f" ({est.lm_head.n_chunks} chunks)" if est.lm_head is not None else ""), _in(est.host_bytes, unit)]
        if budget is not None:
            cells.append("yes" if floors.admits(est) else "no")
        lines.append("| " + " | ".join(cells) + " |")
    if budget is not None:
        within = f"{budget} less {100 * margin:g}%" + _host_words(floors, size)
        if longest is None:
            lines += ["", f"nothing fits {within} at the floor, not even one token a row"]
        else:
            est = floors.at(*longest)
            lines += ["", f"longest that fits {within}: {longest[0]:,} tokens a row at micro-batch {longest[1]} (floor "
                          f"{floor_words(est, size)}; pinned host memory {size(est.host_bytes)})"]
    lines += [""] + [f"note: {n}" for n in (*last.notes, FLOOR_ASSUMES)]
    return "\n".join(lines)


def plan_words(est: MemoryEstimate) -> str:
    """The floor's plan in words: ``"every block on host_checkpoint_tiled, its input in pinned host memory and its MLP
    in 15 chunks of tokens; the LM head chunked the most"``, or why the MLP is not tiled (NOTE [The floor])."""
    tiling = est.mlp_tiling
    if tiling is not None and tiling.tiled_blocks:
        mlp = f" and its MLP in {tiling.chunks} chunk{'s' * (tiling.chunks > 1)} of tokens"
    else:
        mlp = f", its MLP not tiled (memfit does not tile {tiling.why_not})" if tiling is not None else ""
    return f"every block on {est.block_treatment}, its input in pinned host memory{mlp}; the LM head chunked the most"


def _lora_words(setup: TrainingSetup) -> str:
    return f", LoRA r {setup.lora_r} (dropout {setup.lora_dropout:g})" if setup.lora_r else ""


def _host_words(floors: Floors, size: Callable[[int], str]) -> str:
    return "" if floors.host_budget_bytes is None else f" with {size(floors.host_budget_bytes)} of pinned host memory"


def _in(n: int, unit: tuple[str, int]) -> str:
    return f"{n / unit[1]:.2f}"


def floor_too_high(floors: Floors, seq_length: int, budget: Budget, margin: float, limit: int,
                   lora_setup: TrainingSetup | None = None, host_budget_name: str = "--memfit_host_budget") -> str | None:
    """Why even the floor of the shape asked does not fit, and what to change (NOTE [The floor]); None where it fits.

    Args:
        floors: the setup's floors (its micro-batch is the shape's).
        seq_length: the shape's length.
        budget: the budget as the user gave it.
        margin: the share of the budget kept free.
        limit: the longest length to look for one that fits (the model's positions).
        lora_setup: the same setup with LoRA, to name where it would fit; None under LoRA already.
        host_budget_name: the flag of the host budget.

    Returns:
        One message naming the shape, its floor and the flags to change, or None.
    """
    est = floors.at(seq_length)
    if floors.admits(est):
        return None
    size, micro = budget.size, floors.setup.micro_batch_size
    gpu_short = floors.usable_bytes is not None and est.total_bytes > floors.usable_bytes
    host_short = floors.host_budget_bytes is not None and est.host_bytes > floors.host_budget_bytes
    said = [f"the floor of {floors.profile.name} at micro-batch {micro} x {seq_length:,} tokens is {floor_words(est, size)}"]
    if gpu_short:
        said.append(f", above the budget of {budget} less {100 * margin:g}% ({size(floors.usable_bytes)})")
    if host_short:
        dtype = "bf16" if floors.setup.weights == "bf16" else "fp32"
        said.append(f"; its pinned host memory, {size(est.host_bytes)} ({est.n_blocks} blocks x {size(est.host_bytes // est.n_blocks)}: "
                    f"each block's input, {micro * seq_length:,} tokens x {floors.profile.config.hidden_size:,} hidden in "
                    f"{dtype}, in a power-of-two pinned buffer), is above {host_budget_name} {size(floors.host_budget_bytes)}")
    if not host_short:
        bound = _HOST_DEFAULT if floors.host_budget_bytes is None else f"{size(floors.host_budget_bytes)} given"
        said.append(f"; it pins {size(est.host_bytes)} of host memory ({host_budget_name}: {bound})")
    said.append(f". Even every block on {est.block_treatment} and the LM head chunked the most do not fit; change one of:")
    changes = []
    longest = floors.longest(min(seq_length, limit))
    if longest:
        changes.append(f"a shorter sequence: --max_seq_length {longest} fits (--seq_length here)")
    if micro > 1 and floors.admits(floors.at(seq_length, 1)):
        changes.append(f"a smaller micro-batch: one row at a time fits (--per_device_train_batch_size 1 "
                       f"--gradient_accumulation_steps {floors.setup.batch_size}; here --gradient_accumulation_steps "
                       f"{floors.setup.batch_size})")
    if lora_setup is not None:
        with_lora = Floors(floors.profile, lora_setup, floors.usable_bytes, floors.host_budget_bytes, **floors.inputs)
        at = with_lora.at(seq_length)
        changes.append(f"LoRA: --use_peft (--lora_r {lora_setup.lora_r} here), its floor {size(at.total_bytes)}"
                       + ("" if with_lora.admits(at) else ", not enough alone"))
    if floors.setup.lora_r and floors.setup.lora_dropout and est.mlp_tiling and est.mlp_tiling.dropout_inside:
        # NOTE [The tiled MLP in the estimate]: without peft's dropout the MLP may tile
        without = Floors(floors.profile, dataclasses.replace(floors.setup, lora_dropout=0.0), floors.usable_bytes,
                         floors.host_budget_bytes, **floors.inputs)
        at = without.at(seq_length)
        if at.mlp_tiling and at.mlp_tiling.tiled_blocks:
            changes.append(f"no LoRA dropout, so that memfit tiles the MLP: --lora_dropout 0 (here too), its floor "
                           f"{size(at.total_bytes)}" + ("" if without.admits(at) else ", not enough alone"))
    if gpu_short and est.static_bytes + est.workspace_bytes > floors.usable_bytes:
        lighter = [] if floors.setup.weights == "bf16" else ["bf16 weights (--torch_dtype bfloat16; --weights bf16 here)"]
        changes.append("a smaller static part (weights, gradients, optimizer state: "
                       f"{size(est.static_bytes)}): " + ", ".join([*lighter, "Adafactor or 8-bit AdamW (--optim; --optimizer here)"]))
    if host_short:
        changes.append(f"more host memory: {host_budget_name} of at least {size(est.host_bytes)}")
    if gpu_short:
        changes.append(f"a budget of at least {size(_needed(est.total_bytes, margin))} ({budget.name})")
    return "".join(said) + " " + "; or ".join(changes) + "."


#: what the host budget is when ``--memfit_host_budget`` is not given (NOTE [Host budget], offload.py)
_HOST_DEFAULT = "half the host's available memory by default"


def _needed(n_bytes: int, margin: float) -> int:
    """The budget whose share ``1 - margin`` holds ``n_bytes``."""
    return math.ceil(n_bytes / (1 - margin))
