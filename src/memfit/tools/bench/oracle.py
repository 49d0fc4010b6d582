"""The per-step oracle: the fewest first blocks that fit each shape, measured by a sweep.

``dynamic`` is judged against it: the same batches, the same budget, and per shape the
plan a person would pick after trying every one. It is measured, not predicted (NOTE
[Oracle sweep]), and runs through ``precomputed``, so it has no warm-up and no model.

    plans, rows = sweep(model, batches, step, budget="4GB", optimizer=opt)

``memfit train <task> --oracle`` sweeps the run's own batches before training
(:func:`prepare`); with ``--oracle_sweep_only`` it stops there, and with
``--oracle_plans_file`` it trains on an earlier sweep's plans. ``memfit bench --methods
oracle`` does both in two processes, so that the timed run starts as cold as the other
methods' (CUDA and its libraries not yet initialised).

# NOTE [Oracle sweep]
The batches are grouped by plan bucket (rows, tokens rounded up as ``dynamic`` rounds
them), and each bucket is tried with its longest batch, in increasing length per row
count: a plan of the first k blocks runs two training steps (forward, backward and the
optimizer's step, whose transient can be the step's peak) under the budget's hard cap on
CUDA, or its logical accounting on CPU, and is accepted when neither step ran out of
memory and the peak left the room ``dynamic`` plans into (the budget less its margin and
the allocator slack: NOTE [Room] in engine/plan/room.py) free. k starts at the previous
bucket's (a longer batch never needs fewer blocks) and grows by one. First-k plans are the
fewest blocks for a stack of alike blocks (BERT-like), which the NLP tasks are; for a mixed
stack (a Swin detector) they are an upper bound, not the oracle. A bucket that does not fit
with every block keeps every block (the run then fails as ``full`` would). The weights are
restored and the sweep's optimizer dropped after it, and the run's Trainer seeds the random
state again, so the timed run starts where the other methods' runs start.
"""

from __future__ import annotations

import copy
import gc
import itertools
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from memfit.engine.methods import Decision, Method, Precomputed, save_plans
from memfit.engine.plan.planner import Plan
from memfit.engine.shapes import bucket_key, shape_key

__all__ = ["Oracle", "sweep", "prepare"]

logger = logging.getLogger(__name__)

#: the sweep's rows, next to the plans file, for the report and a reader
ORACLE_FILE = "memfit_oracle.json"
ORACLE_PLANS_FILE = "memfit_oracle_plans.json"


class Oracle(Precomputed):
    """``precomputed`` plans from a sweep (:func:`sweep`), named ``oracle`` in the records."""

    name = "oracle"


class _FirstK(Method):
    """The first ``k`` blocks, whatever the shape: one trial of the sweep."""

    name = "first-k"

    def __init__(self, k: int):
        self.k = k

    def decide(self, planning, key: tuple[int, int], failed=None) -> Decision:
        return Decision(Plan(tuple(range(min(self.k, planning.n_blocks)))))


def _batch_key(batch: Any) -> tuple[int, int]:
    """(rows, tokens) of a batch from its first tensor: token ids ``(..., T)`` or images ``(N, C, H, W)``.

    Used only to group batches; the plans are keyed by what the first block sees.
    """
    if isinstance(batch, Mapping):
        tensors = [v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "labels"]
    else:
        tensors = [v for v in (batch if isinstance(batch, (list, tuple)) else [batch]) if isinstance(v, torch.Tensor)]
    if not tensors:
        raise ValueError("oracle sweep: a batch has no tensor to read its shape from")
    x = tensors[0]
    if x.is_floating_point() and x.dim() == 4:
        return shape_key(list(x.shape))
    return (math.prod(x.shape[:-1]), int(x.shape[-1]))


def sweep(
    model: nn.Module,
    batches: Iterable[Any],
    step: Callable[[Any], None],
    budget: int | str,
    optimizer: torch.optim.Optimizer | None = None,
    margin: float | None = None,
    bucket_tokens: int = 8,
    blocks: Any = None,
) -> tuple[dict[tuple[int, int], tuple[int, ...]], list[dict[str, Any]]]:
    """Per bucket of ``batches``, the fewest first blocks whose measured steps fit ``budget``.

    Args:
        model: the model, on its device.
        batches: the run's batches (each bucket is tried with its longest one).
        step: one training step on a batch: forward, backward, the optimizer's step and
            ``zero_grad`` (it changes the weights: restore them after, as :func:`prepare` does).
        budget: bytes or a size string, as for :func:`memfit.fit`.
        optimizer: counted in the static need, as for :func:`memfit.fit`.
        margin: as for :func:`memfit.fit` (its default when None).
        bucket_tokens: as for :func:`memfit.fit`.
        blocks: as for :func:`memfit.fit`.

    Returns:
        ``(plans, rows)``: plans keyed by the first block's shape key, for
        ``precomputed``/:class:`Oracle`; and one row per bucket (``key``, ``k``, ``fits``,
        ``peak_allocated_bytes``, ``room_bytes``, ``trials``, ``n_blocks``).

    Example:
        >>> plans, rows = sweep(model, batches, step, "4GB", optimizer=opt)  # doctest: +SKIP
    """
    from memfit.engine.run.controller import fit

    longest: dict[tuple[int, int], tuple[int, Any]] = {}
    for batch in batches:  # only each bucket's longest is kept (images add up)
        rows_, tokens = _batch_key(batch)
        bucket = bucket_key((rows_, tokens), bucket_tokens)
        if bucket not in longest or tokens > longest[bucket][0]:
            longest[bucket] = (tokens, batch)
    plans: dict[tuple[int, int], tuple[int, ...]] = {}
    rows: list[dict[str, Any]] = []
    for _, group in itertools.groupby(sorted(longest), key=lambda b: b[0]):
        k = 0
        for bucket in group:
            batch = longest[bucket][1]
            trials = 0
            while True:
                trials += 1
                ctl = fit(model, budget, _FirstK(k), optimizer=optimizer, margin=margin, bucket_tokens=bucket_tokens, blocks=blocks)
                n_blocks, room = len(ctl.blocks), ctl.planning.room_bytes
                channels_first = ctl.blocks[0].channels_first  # keyed as the run keys its steps (NOTE [What the key cannot see])
                failed = False
                try:
                    for _ in range(2):
                        step(batch)
                except torch.OutOfMemoryError:
                    failed = True
                records = ctl.records
                ctl.remove()
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
                if failed and torch.cuda.is_available():
                    gc.collect()
                    torch.cuda.empty_cache()
                peak = max((r.peak_allocated_bytes for r in records), default=0)
                fits = not failed and peak <= room
                if fits or k >= n_blocks:
                    break
                k += 1
            key = shape_key(records[0].shape, channels_first) if records else bucket
            plans[key] = tuple(range(k))
            rows.append({
                "key": list(key), "bucket": list(bucket), "k": k, "fits": fits,
                "peak_allocated_bytes": int(peak), "room_bytes": int(room), "trials": trials, "n_blocks": n_blocks,
            })
            logger.info("oracle sweep: %s k=%d fits=%s peak %.3f GB (room %.3f GB, %d trials)",
                        key, k, fits, peak / 1e9, room / 1e9, trials)
    return plans, rows


def prepare(bundle: Any, args: Any) -> Oracle:
    """Sweep the run's own batches (its data, collator, optimizer and budget); return the plans.

    A throwaway ``transformers.Trainer`` on the same arguments gives the batches (as many as
    the run takes) and the optimizer, and runs the steps; the weights are put back after,
    and the optimizer is dropped (the run makes its own). Writes
    ``memfit_oracle.json`` (the sweep's rows) and ``memfit_oracle_plans.json`` to
    ``args.output_dir``.

    Args:
        bundle: the task's :class:`~memfit.tasks.TaskBundle`.
        args: the run's :class:`memfit.integrations.hf.TrainingArguments` (``--memory_threshold`` set).

    Raises:
        ValueError: without a budget (the oracle is the fewest blocks that fit one).
    """
    import transformers

    budget = args.memfit_budget_bytes
    if budget is None:
        raise ValueError("--oracle needs a budget: set --memory_threshold GB (or --memory_budget)")
    probe_args = copy.copy(args)
    probe_args.report_to = []
    trainer = transformers.Trainer(
        model=bundle.model, args=probe_args, train_dataset=bundle.train_dataset, data_collator=bundle.data_collator,
        processing_class=bundle.tokenizer,
    )
    model = trainer.model
    weights = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}
    loader = trainer.get_train_dataloader()
    # the batches the run will take: max_steps x accumulation, or its epochs
    wanted = args.max_steps * args.gradient_accumulation_steps if args.max_steps > 0 else None
    if len(loader) == 0:
        raise ValueError("oracle sweep: the training data makes no batch (fewer examples than one batch?)")
    epochs = math.ceil(wanted / len(loader)) if wanted else max(1, math.ceil(args.num_train_epochs))
    batches = itertools.islice(itertools.chain.from_iterable(itertools.repeat(loader, epochs)), wanted)
    optimizer = trainer.create_optimizer()

    device = next(model.parameters()).device

    def step(batch: Any) -> None:
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with trainer.accelerator.autocast():  # the run's model is wrapped in it (bf16/fp16)
            loss = trainer.compute_loss(model, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        plans, rows = sweep(
            model, batches, step, budget, optimizer=optimizer, margin=getattr(args, "memfit_margin", None),
        )
    finally:
        optimizer.state.clear()  # its state is freed now; the run makes its own optimizer
        trainer.optimizer = None
        with torch.no_grad():
            for name, t in model.state_dict().items():
                t.copy_(weights[name])
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, ORACLE_PLANS_FILE)
    save_plans(path, rows[0]["n_blocks"] if rows else 0, {key: Plan(blocks) for key, blocks in plans.items()})
    with open(os.path.join(args.output_dir, ORACLE_FILE), "w", encoding="utf-8") as fh:
        json.dump({"budget_bytes": budget, "rows": rows}, fh, indent=1)
    return Oracle(path)
