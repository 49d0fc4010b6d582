"""The per-step controller: shape key -> plan -> forward/backward -> step record -> refit.

``memfit.fit`` builds a :class:`Controller`, which hooks the model and needs no change to
the training loop:

* a forward pre-hook on the root module starts a step (and closes the previous one: its
  record is written then, when the peak of its backward and optimizer step is known);
* the first block to run fixes the plan (NOTE [Plan is fixed before forward]);
* saved tensors are counted per block while the root forward runs (accounting.py);
* in warm-up, every block is *probed*: its body runs once more on detached inputs under a
  forked RNG, to measure what it would save un-checkpointed, and the first of each group of
  identical blocks is timed (NOTE [Probe], NOTE [Blocks alike only in name]);
* under a method that evicts (``reactive``), blocks run under the reactive store and room
  is made at each block entry and at the forward's end (NOTE [Reactive room]).

# NOTE [Plan is fixed before forward]
The shape key is read from the first block's input, so it works for any model input
(tokens, pixels, kwargs). All block switches are set at that moment, before any block has
run, and do not change until the next step: forward and backward see one plan.

# NOTE [Probe]
Under ``full`` the blocks' saved tensors are held by the checkpoint and invisible to our
hooks (NOTE [Who sees a checkpointed block's tensors]). The probe re-runs a block on
detached copies of its inputs, counts what it saves, and drops the result: it costs one
block's activations for a moment, as ``full``'s own recompute does in backward, so warm-up
is safe under any budget ``full`` fits. The RNG is forked so dropout masks of the real
forward are those of a run without the probe (gradients stay exact).

# NOTE [First run of a block]
The probe's time is the block's recompute cost, which decides *which* blocks a mixed stack
checkpoints. A block's first run pays once for what later runs reuse: in a process, loading
its kernels (CUDA loads modules lazily); at a new size, what the libraries and the allocator
set up for the new shapes (the likely causes; not traced). On
the H200 Swin-B detector (batch 16, 2026-11-23) the first step's probe took 599 ms for a
stage-1 layer whose later probes took 11-12 ms. With the first run of each group in a
process run apart (untimed), probes at new sizes still took 40-72 ms for encoder layers and
42-113 ms for decoder layers, where a repeated size took 1.5 ms and an isolated run 1-2 ms
(benchmarks/recompute_bench.py). A curve keeps each size's largest sample, so such a probe
prices its size's blocks 20-50 times their worth, and the plans follow the noise: two
``static`` processes with the same data chose different plans at the same step; the one
that left a stage-1 layer held ran over its prediction into an OOM (replayed), and the
margin that grew after it kept 19 of 36 blocks checkpointed where the other kept 11. So
every probe runs the block twice with autograd, the second run reusing what the first set
up, and the price is the faster run. The first run's saved tensors are the ones counted,
the second's go to a counter of their own (the step's counter is outside: it must see
neither), and each run's are freed before the next: the probe's peak stays one block's
activations.

# NOTE [Blocks alike only in name]
Blocks of one class and parameter count share a group, one memory and cost model
(``_group_ids``), but such blocks need not save the same bytes. Swin's shifted-window
layers add the shift mask to the relative-position bias, a (windows x heads x 49 x 49)
tensor where the unshifted layers pass a (heads x 49 x 49) bias; on CUDA the attention
kernel keeps it for backward. On the H200 Swin-B detector (batch 16, 84,672 patches) a
held shifted stage-1 layer was counted at 7.59 GB, the unshifted one the group was probed
on at 6.99 GB (a bf16 mask of that shape is 0.53 GB); each held shifted stage-3 and
stage-4 layer was under-predicted alike. At 35.49 GB both ``dynamic`` processes of the
thirteenth run (2026-11-23) ran out of memory in step 6's forward, with a plan that held
the shifted layer 1 under a checkpointed layer 0 (predicted 33.87 GB, 35.16 GB allocated
when it failed), as ``static`` had in the twelfth. The CPU's attention saves no mask, so
the CPU counts both alike. So warm-up probes every block (the first of each group twice,
timed, the others once, for their bytes: about one more forward per warm-up step), and a
group whose members saved more than ``GROUP_SPLIT_SHARE`` apart is split, before its
samples are added: each kind of member gets its own group (a copy of the group's curves
from earlier steps, where its members were measured alike) with its first member's bytes,
and the group's timed price, as blocks of one class and size cost about the same.

# NOTE [Reactive room]
Eviction can only act between blocks, so at each block entry the bytes in use (the
allocator's on CUDA; static + counted saved tensors, logically) plus the margin plus the
largest block seen this step must fit the budget, else already-run blocks are evicted. At
the forward's end the same check (with nothing to come) makes room for backward. The
logical peak is the largest count seen at these checks *before* evicting, so the margin must
cover what runs between two checks outside any block (the head and loss after the last
block): logical accounting keeps only 0.1% by default, too little for `reactive` (give it 5%).

# NOTE [Backstop]
``dynamic`` (``backstop=True``, the default) runs the blocks its plan leaves un-checkpointed
under the reactive store too. While the plan is right that costs a pack hook per saved
tensor and an RNG-state copy per block, and it keeps each such block's inputs until
backward for a recompute (blocks save them anyway, except an attention mask that no block
saves, which then lives on until backward). On short, host-bound steps that is not free:
2.7 ms of a 20 ms median step in the H200 soak (bert-base, batch 16), 13%. So the backstop
is *armed* only for a step that needs it: one longer (in tokens) than any step so far, where
the model extrapolates, or one whose activations, 50% above their prediction, would cross
the backstop's threshold below, unless the same plan already ran a shape of its bucket at
least as long and stayed under that threshold (the same blocks on the same shape hold the
same bytes; a Swin-S detector's plans fill the budget to 90%, so the 50% rule armed nearly
every step, and the store's hooks made the H200's `dynamic` steps slower than `static`'s
with more blocks checkpointed: 248 against 193 ms at one size, fourth run, 2026-11-22).
Other steps run their blocks plainly. Room is made only
when the bytes in use plus the largest block *still to run* under the store (predicted,
times the largest excess of the blocks run so far this step over their prediction) would
leave less than a third of the margin free; the plan keeps the whole margin free. Not the
largest block of the stack: a Swin detector's stage-1 layer saves twice a stage-2 layer, 4
times a stage-3 layer and 13-23 times a detector layer, and reserving it at every entry
made the third H200 detection run (2026-11-22) evict in 26 of 56 steady Swin-S steps (34
of 56 on Swin-T), at the detector's layers, with every peak under the planned room and
0.5-0.9 GB under the cap. Then the DTR policy evicts already-run blocks, which are
recomputed in backward; the step's record lists them. Such a step teaches the model the
bytes its blocks saved (as counted before evicting: an under-prediction, so it refits) but
not its transient, which the evictions lowered.
An armed step holds more than the same plan run plainly: its stores keep each block's inputs,
and those that no saved tensor holds (a bf16 stage input that LayerNorm saves as its fp32 cast,
a mask every block takes) would be freed. On the H200 Swin-T detector (batch 16, 84,672
patches, thirteenth run, 2026-11-23) an armed step peaked 0.76-0.88 GB above the same plan
unarmed. Learnt, those bytes lifted the block curves (which keep each size's largest sample)
and grew the margin, so `dynamic` over-predicted its unarmed steps by 0.8-2.0 GB where
`static` erred by 0.02-0.19 GB (a CPU stack whose blocks keep an unsaved input: the margin
grew from 0.1% to 29% of the budget, and plans of 2 and 4 blocks became 6). So an armed step
teaches what its plan holds run plainly: its blocks' saved tensors without the stores' inputs,
and its peaks less those inputs (all of them at the backward's start; from the first
recompute on, those of the stores below it, the others being gone); the record's
``backstop_input_bytes`` says how much that was. An armed step is then predicted short by
them, which the backstop's room covers (it evicts if they do not fit); and it counts as the
proof that its plan fits unarmed (the rule above) if its plan would: by its peak less the
inputs or, had it evicted, by the model's prediction, learnt from what its blocks saved.
On the H200 (fourteenth run, 2026-11-23) those inputs were 0.04-1.75 GB a step and explained
the armed steps' extra to within 30-70 MB (222 armed steps against the same plan and size
unarmed); `dynamic`'s unarmed over-prediction fell to a median 0.10-0.31 GB in 17 of 19 runs
(0.44 and 0.68 in the others), and with no step above its prediction by more than 0.14 GB
every margin stayed at its initial 3%.

# NOTE [A replay checkpoints more]
An OOM grows the margin or the slack and clears the plans, so the replay is planned with
less room; but a model that predicts far too little for the shape plans the same blocks
again, and again: an H200 Swin-B detector (batch 16) ran a 66k-patch batch with no block
checkpointed and no room to spare in all 8 replays, while the margin grew to 14 GiB (its
blocks' bytes were a quadratic extrapolated below its samples: NOTE [Sizes outside the
samples], model.py). So a replay whose plan checkpoints nothing the failed attempt did not
runs every block checkpointed instead; if that is still too much, the budget is too small
(``note_oom`` says so).

# NOTE [Blocks held below a recompute]
While backward recomputes a checkpointed block, every un-checkpointed block below it still
holds its activations (NOTE [Three peaks], model.py). The planner's cheapest set can leave
such blocks: on a Swin detector it checkpointed Swin layers 2-7 and left the two largest,
0 and 1, under them, and the recompute peak went over the budget. A plan that fails that
check is mended, not replaced by every block: the cheaper of the plan with every block
under its topmost one added, and the shortest run of first blocks that saves enough (both
hold nothing below a recompute). Before this, 26 of 56 steady steps of an H200 Swin-T run
checkpointed all 24 blocks.

# NOTE [Reading the backward's start]
A partial plan's backward has two peaks (NOTE [Three peaks], model.py): its start, which the
partial transient describes, and the recompute of its topmost checkpointed block, which the
model bounds from ``full``'s transient and the blocks held below. The allocator keeps one
peak per step, so a partial step taught the partial transient whenever the model predicted
its start to be the larger, and when that prediction was wrong the recompute's bytes were
learnt as transient. On the H200 Swin-T detector (batch 16, 17.78 GB, 2026-11-23) a plan
that left blocks 10-18 held under its decoder layers 19-21 peaked at a recompute, and taught
the partial transient +1.49 GB; against -0.18 GB at every other partial step, that one
sample lifted the partial curve's envelope, and the 94k-patch batches were predicted
2.5-2.9 GB above their peaks for the remaining 45 steps: 8 blocks checkpointed where
``static``'s 7 peaked at 14.5 GB, 9 at 85k patches. So the step's first recompute reads the
allocator's peak so far (the start's: the forward, the loss and the backward of the blocks
above) and resets it; the partial transient learns from that reading alone, and the step's
peak is the larger of the two readings. Host-side counters only, as the optimizer's hook
reads them.

# NOTE [Allocator slack]
The memory model predicts *allocated* bytes; the CUDA cap limits *reserved* ones. Between the
two lies memory the caching allocator holds but cannot hand out: the free tails of partly used
pages (20 MiB in the large pool with expandable segments), which no release returns. The
fourth H200 engine run (bert-base, batch 32, 4 GB) ran out of memory asking for 72 MiB with
3.77 GB allocated, under its 3.88 GB of room: 154 MiB of the 3.93 GB reserved was such slack,
more than the 120 MB margin. So the room a plan must fit is ``budget - margin - slack``: the
margin covers prediction error, the slack the allocator. With a 160 MiB slack the next
run's dynamic had no OOM, but its soak's ``reactive`` (batch 16, 5 GB, evicting and
recomputing in backward) failed once with 263 MiB unusable. On CUDA the slack starts at
``min(256 MiB, budget / 16)`` (what those runs saw) and an OOM raises it to 1.25 × the reserved
bytes that were not allocated when it failed, when that is more; the margin then grows only
when the slack did not (the failure was the prediction's). Logical accounting has no
allocator: its slack is 0. The backstop and ``reactive`` keep the slack free too.

# NOTE [Planning a row]
In a training process a new bucket's plan cost about 100-150 µs on the H200 host (the same
call takes 10 µs in a loop there: caches are cold between steps), and a bert-base run at
lengths 32..512 meets about 60 buckets, plus every bucket again after each change of the
memory model: 80-110 µs per step on average. For a stack of one group (BERT-like: every
block alike) the plan of a shape is the shortest prefix of blocks that fits, so a miss
plans the whole row at once: every length of the shape's batch size, one token apart (NOTE
[Plan for the longest shape seen]), up to the longest shape seen, with numpy over the row,
doing the per-key planner's float operations in its order (so the plans are the same, bit
for bit: tested against it); each length's plan is built
from the row's arrays when first asked. Shapes that no plan fits are left to the per-key
path, which warns. Mixed stacks (Swin detectors) and ``static`` plan per key. A row costs
0.4-0.5 ms in the H200 process (a key alone about 0.15 ms), so it pays only if the model
behind it lasts: in the first steady steps the model learns almost every step (10 of the
17 rows of the 6 GB run were planned in steps 4-14, each used once). A miss plans a row
once the cache has served more than three requests since its last clear, or the model
before it did (a settled model's later changes are corrections that last too; waiting
three plans there would cost them on top of the row). The row's curves are evaluated in
one numpy pass (``curve_values``): a dozen numpy calls per curve were most of its cost.

# NOTE [Plan for the longest shape seen]
A plan serves every shape of its bucket (tokens rounded up to ``bucket_tokens``) up to the
length it was made for: the longest the run has met in that bucket, not the bucket's upper
edge, a length no batch may have. In the H200 multiple-choice runs of 2026-11-22 (bert-base
fp32, 64 rows of 33-41 tokens, 3 GB) every 41-token batch was planned and predicted for 48
tokens, 17% more activations and a partial transient extrapolated 7 tokens past its
samples: 7 blocks, predicted 2.70 GB, measured 2.19 GB, where 3 blocks measured 2.69 GB
against 2.72 GB of room (the oracle plans each bucket by its longest batch, and took 3).
Nothing learned from that over-prediction: each curve was right at 41 tokens, where a step
is compared. A longer shape of the bucket is planned anew when it comes (and, if it is the
longest yet, runs with the backstop armed). Where a row of plans (NOTE [Planning a row])
gives every length from the shape to the bucket's edge the same plan (most buckets: only
those where the plan grows by a block differ), that plan serves the whole bucket and no
longer shape of it replans; each longer shape in a bucket was a miss before, 124 planned
steps of 197 at 4 GB in the H200 engine run (67 with plans at the edge; 106 since), and
52.7 µs per step on average against 43.9 (45.7 since). Plans are not monotone in length
everywhere (where the partial transient's range begins, a shorter shape can need a block
more), so the row's lengths are checked one by one, not the edge's plan alone.

# NOTE [No sync in steady state]
A steady-state step reads only host-side values: ``memory_allocated``,
``max_memory_allocated`` and ``reset_peak_memory_stats`` query the caching allocator's
counters without synchronising the device. ``step_ms`` is the wall time between step
starts. Only warm-up probes synchronise (to time a block).
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from memfit.accounting import OUTSIDE, ProbeCounter, SavedTensorCounter, local, optimizer_state_bytes, static_bytes_logical
from memfit.blocks import Block, find_blocks, unwrap_blocks, without_cache, wrap_blocks
from memfit.budget import BudgetTooSmallError, apply_cuda_cap, check_static_need, format_bytes, parse_bytes
from memfit.distributed import is_fsdp
from memfit.methods import Decision, Dynamic, Method, make_method, save_plans
from memfit.model import MemoryModel, bucket_key, shape_key
from memfit.planner import InfeasiblePlanError, Plan, PlanCache, plan_blocks
from memfit.reactive import ReactiveStore
from memfit.records import JsonlWriter, StepRecord, summarize

__all__ = ["fit", "Controller", "Planning"]

logger = logging.getLogger("memfit")

#: Rows are planned only once the plan cache, or the one before its last clear, has served
#: more than this many requests: before, the model changes every step or two (NOTE [Planning a row]).
ROW_AFTER_STEADY_ASKS = 3

#: The backstop is armed for a step unless its activations could exceed the prediction by
#: this share and still leave the backstop's reserve free (NOTE [Backstop]).
BACKSTOP_ARM_SHARE = 0.5

#: Blocks of one group whose probes saved more than this share apart are split (NOTE [Blocks alike only in name]).
GROUP_SPLIT_SHARE = 0.01

#: The allocator's slack kept free on CUDA before any OOM has measured it (NOTE [Allocator slack]).
ALLOCATOR_SLACK_BYTES = 256 * 2**20

# Expected optimizer state per parameter byte, used before the optimizer's first step has
# allocated its state (afterwards the state is measured).
_STATE_PER_PARAM_BYTE = {"Adam": 2.0, "AdamW": 2.0, "NAdam": 2.0, "RAdam": 2.0, "Adamax": 2.0, "SGD": 1.0, "RMSprop": 1.0, "Adagrad": 1.0}


def _expected_optimizer_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    per_byte = _STATE_PER_PARAM_BYTE.get(type(optimizer).__name__, 0.0)
    if type(optimizer).__name__ == "SGD" and not any(g.get("momentum", 0) for g in optimizer.param_groups):
        per_byte = 0.0
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        per_byte += 1.0
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return int(per_byte * sum(local(p).numel() * p.element_size() for p in params))


class Planning:
    """Memory model + planner + plan cache for one run (what methods see).

    Args:
        n_blocks: number of blocks.
        groups: group id of each block (identical blocks share a model).
        budget_bytes: the budget, or ``None`` for no budget.
        margin_bytes: initial safety margin kept free below the budget (prediction error).
        bucket_tokens: token granularity of plan buckets.
        slack_bytes: the allocator's reserved-but-unusable bytes, also kept free (NOTE
            [Allocator slack]).
    """

    def __init__(
        self, n_blocks: int, groups: Sequence[int], budget_bytes: int | None, margin_bytes: int, bucket_tokens: int,
        slack_bytes: int = 0,
    ):
        self.n_blocks = n_blocks
        self.all_blocks = tuple(range(n_blocks))
        self.model = MemoryModel(groups, bucket_tokens)
        self.budget_bytes = budget_bytes
        self.margin_bytes = margin_bytes
        self.slack_bytes = slack_bytes
        self.bucket_tokens = bucket_tokens
        self.cache = PlanCache()
        self.static_bytes = 0
        self.infeasible_keys: set[tuple[int, int]] = set()
        #: per plan bucket, the most tokens per row seen in it (NOTE [Plan for the longest shape seen])
        self.longest_in_bucket: dict[tuple[int, int], int] = {}

    def plan_key(self, key: tuple[int, int]) -> tuple[int, int]:
        """The shape ``key``'s plan is made and predicted for: the longest seen in its bucket
        (``key`` itself if none longer was) (NOTE [Plan for the longest shape seen])."""
        return (key[0], max(key[1], self.longest_in_bucket.get(bucket_key(key, self.bucket_tokens), 0)))

    def predict_peak(self, key: tuple[int, int], blocks: Sequence[int]) -> int:
        """Predicted step peak: static + the largest of the step's three peaks (NOTE [Three peaks])."""
        return int(self.static_bytes + self.model.step_bytes(self.plan_key(key), blocks))

    @property
    def room_bytes(self) -> int:
        """What a plan's predicted peak must fit: the budget less the margin and the slack."""
        return self.budget_bytes - self.margin_bytes - self.slack_bytes

    def _static_bucket(self) -> int:
        # Static bytes differ between micro-steps (gradients present or not); plans are
        # cached per (shape bucket, static bucket) so both stay cached.
        unit = max(1, (self.budget_bytes or 1) // 64)
        return self.static_bytes // unit

    def plan_for(self, key: tuple[int, int], whole_row: bool = True) -> tuple[int, ...]:
        """The cheapest plan whose predicted peak fits the room (cached).

        ``whole_row``: on a miss, plan the shape's whole row when the stack allows
        (NOTE [Planning a row]); ``static`` asks for one shape only.
        """
        if self.budget_bytes is None:
            return ()
        k, edge = self.plan_key(key), bucket_key(key, self.bucket_tokens)
        self.longest_in_bucket[edge] = k[1]
        static_bucket = self._static_bucket()
        # a plan made for the bucket's edge serves every shape of it
        cache_key = (edge, static_bucket) if self.cache.peek((edge, static_bucket)) is not None else (k, static_bucket)
        plan = self.cache.get(cache_key)
        if plan is None:
            settled = self.cache.settled(ROW_AFTER_STEADY_ASKS)
            from_row = self._plan_from_row(k, static_bucket) if whole_row and settled else None
            plan = from_row or self._plan(k)
            if from_row is not None and k != edge and self._row_constant(k, edge, static_bucket):
                self.cache.put((edge, static_bucket), plan)  # no longer shape of the bucket will replan
            self.cache.put(cache_key, plan)
        return plan.blocks

    def _row_constant(self, k: tuple[int, int], edge: tuple[int, int], static_bucket: int) -> bool:
        """Whether the row plans every length from ``k`` to ``edge`` alike (NOTE [Plan for the longest shape seen])."""
        row = self.cache.rows.get((k[0], static_bucket))
        if row is None or row["longest"] < edge[1]:
            return False
        span = slice(k[1] - 1, edge[1])
        return all(len(set(row[name][span])) == 1 for name in ("count", "every_fits", "prefix_fits"))

    def _plan_from_row(self, k: tuple[int, int], static_bucket: int) -> Plan | None:
        """``k``'s plan read from its row's arrays, planned first if needed (NOTE [Planning a row]).

        ``None`` (plan ``k`` alone) for a stack of several groups or a shape that no plan fits
        (the per-key path warns then).
        """
        row = self.cache.rows.get((k[0], static_bucket))
        if row is None or row["longest"] < k[1]:
            row = self._plan_row(k)
            if row is None:
                return None
            self.cache.rows[(k[0], static_bucket)] = row
        i = k[1] - 1
        c, m = row["count"][i], self.n_blocks
        if c == 0:
            return Plan(())
        if c < 0 or not row["every_fits"][i]:
            return None  # over the budget with every block
        if c == m or row["prefix_fits"][i]:
            # what the chosen blocks cost, summed one block at a time as plan_blocks sums them
            cost = float(sum(itertools.repeat(row["cost_ms"][i], c)))
            return Plan(self.all_blocks if c == m else tuple(range(c)), cost, row["saved_bytes"][i])
        return Plan(self.all_blocks)  # the mend's candidates are this very prefix (NOTE [Blocks held below a recompute])

    def _plan_row(self, k: tuple[int, int]) -> dict[str, Any] | None:
        """Every length of ``k``'s row, up to the longest shape seen, as lists (one group only)."""
        n, b = k[0], self.bucket_tokens
        longest = max(k[1], bucket_key(self.model.max_key, b)[1] if self.model.max_key else 0)
        # a few buckets past the longest shape seen: a row costs about the same at any
        # length, and a step just past it would otherwise replan the whole row
        longest = -(-longest // (8 * b)) * (8 * b)
        ts = np.arange(1, longest + 1, dtype=np.int64)  # per token: plan keys are lengths seen
        row = self.model.row(n, ts)
        if row is None:
            return None
        m, room, static = self.n_blocks, self.room_bytes, float(self.static_bytes)
        outside, full, kept = row["outside"], row["full"], row["kept"]
        saving = np.floor(np.maximum(0.0, full - kept)).astype(np.int64)
        # the same float operations, in the same order, as the per-key methods (bit-equal)
        need = np.trunc(static + ((outside + (0.0 * kept + m * full)) + row["transient"])).astype(np.int64) - room
        every = np.maximum((outside + (m * kept + 0.0 * full)) + row["transient_full"], self.model.optimizer_bytes)
        with np.errstate(divide="ignore", invalid="ignore"):
            count = np.where(need > 0, np.ceil(need / np.maximum(saving, 1)), 0).astype(np.int64)
        count = np.where(m * saving < need, -1, np.minimum(count, m))  # -1: no plan saves enough
        clipped = np.maximum(count, 0)
        start = (outside + (clipped * kept + (m - clipped) * full)) + row["transient"]
        recompute = (outside + (m * kept + 0.0 * full)) + row["transient_full"]
        peak = np.maximum(np.maximum(start, recompute), self.model.optimizer_bytes)
        return {
            "longest": longest, "count": count.tolist(), "every_fits": (np.trunc(static + every) <= room).tolist(),
            "prefix_fits": (np.trunc(static + peak) <= room).tolist(),
            "cost_ms": np.maximum(row["cost_ms"], 1e-6).tolist(),  # one block's
            "saved_bytes": (clipped * saving).tolist(),
        }

    def _plan(self, k: tuple[int, int]) -> Plan:
        # Checkpointing lowers the start-of-backward peak only; the plan is then checked
        # against the other two (NOTE [Three peaks]), and mended if one is over
        # (NOTE [Blocks held below a recompute]).
        room = self.room_bytes
        need = int(self.static_bytes + self.model.backward_start_bytes(k, ())) - room
        try:
            costs, savings = self.model.costs(k), self.model.savings(k)
            plan = plan_blocks(costs, savings, need)
            if not plan.blocks or self.predict_peak(k, plan.blocks) <= room:
                return plan
            if self.predict_peak(k, self.all_blocks) > room:
                raise InfeasiblePlanError("the recompute or optimizer-step peak is over the budget")
            below = tuple(range(max(plan.blocks) + 1))  # the plan and every block under it
            covered = itertools.accumulate(savings)
            prefix = tuple(range(next(i for i, total in enumerate(covered, 1) if total >= need)))
            mended = [p for p in {below, prefix} if self.predict_peak(k, p) <= room]
            if not mended:
                return Plan(self.all_blocks)
            best = min(mended, key=lambda p: (sum(costs[i] for i in p), p))
            return Plan(best, float(sum(costs[i] for i in best)), int(sum(savings[i] for i in best)))
        except InfeasiblePlanError:
            if k not in self.infeasible_keys:
                self.infeasible_keys.add(k)
                logger.warning(
                    "memfit: shape %s is predicted to need %s even with every block checkpointed, "
                    "over the budget of %s; running it with every block checkpointed",
                    k, format_bytes(self.predict_peak(k, self.all_blocks) + self.budget_bytes - room), format_bytes(self.budget_bytes),
                )
            return Plan(self.all_blocks)

    def would_plan_less(self, key: tuple[int, int], blocks: Sequence[int], over_bytes: int) -> bool:
        """Whether a prediction ``over_bytes`` lower would have given a cheaper plan than ``blocks``.

        An over-predicted step costs time only if it made the plan checkpoint more: one that
        checkpointed nothing, or whose cheaper alternative still needs the same blocks (the
        over-prediction was smaller than what one block saves), cost nothing.
        """
        if not blocks or self.budget_bytes is None:
            return False
        k = self.plan_key(key)
        need = int(self.static_bytes + self.model.backward_start_bytes(k, ())) - self.room_bytes - over_bytes
        if need <= 0:
            return True
        costs = self.model.costs(k)
        try:
            cheaper = plan_blocks(costs, self.model.savings(k), need)
        except InfeasiblePlanError:
            return False
        return cheaper.cost_ms < 0.999 * sum(costs[i] for i in blocks)

    def raise_margin(self, extra_bytes: int) -> None:
        self.margin_bytes += max(0, int(extra_bytes))
        self.cache.clear()

    def learn_slack(self, unusable_bytes: int) -> bool:
        """Keep 1.25 × ``unusable_bytes`` free for the allocator if that is more than now.

        Returns whether the slack grew (NOTE [Allocator slack]).
        """
        wanted = int(1.25 * unusable_bytes)
        if wanted <= self.slack_bytes:
            return False
        self.slack_bytes = wanted
        self.cache.clear()
        return True

    def recompute_ms(self, key: tuple[int, int], blocks: Sequence[int]) -> float:
        if not self.model.ready:
            return 0.0
        k = self.plan_key(key)
        return float(sum(self.model.block_cost_ms(i, k) for i in blocks))


def describe_attempt(attempt: dict[str, Any], n_blocks: int) -> str:
    """One line on a failed attempt (``Controller._describe_oom``): where, what ran, memory then."""
    plan = attempt.get("plan")
    ran = "no plan yet" if plan is None else f"{len(plan)} of {n_blocks} blocks checkpointed"
    memory = ", ".join(
        f"{name} {format_bytes(attempt[key])}"
        for name, key in (("allocated", "allocated_bytes"), ("peak", "peak_allocated_bytes"), ("reserved", "reserved_bytes"))
        if attempt.get(key) is not None
    )
    return f"out of memory in {attempt['stage']} at shape {attempt.get('shape')} ({ran}{'; ' + memory if memory else ''})"


def _group_ids(blocks: list[Block]) -> list[int]:
    """Blocks of the same class and parameter count share a group (and a model)."""
    ids: dict[tuple[type, int], int] = {}
    out = []
    for b in blocks:
        sig = (type(b.module), sum(p.numel() for p in b.module.parameters()))
        out.append(ids.setdefault(sig, len(ids)))
    return out


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t
    return None


class Controller:
    """Plans, switches and records checkpointing for one model; made by :func:`fit`.

    Attributes:
        blocks: the wrapped blocks, in order.
        method: the :class:`~memfit.methods.Method`.
        planning: model, planner and cache.
        accounting: ``"cuda"`` (allocator peaks) or ``"logical"`` (counted tensors).
    """

    def __init__(
        self,
        model: nn.Module,
        budget_bytes: int | None,
        method: Method,
        optimizer: torch.optim.Optimizer | None = None,
        blocks: Sequence[nn.Module] | str | None = None,
        log: str | None = None,
        margin: float | None = None,
        bucket_tokens: int = 8,
        cap: bool = True,
    ):
        self.model = model
        self.method = method
        self.optimizer = optimizer
        self.budget_bytes = budget_bytes
        named = find_blocks(model, blocks)
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.accounting = "cuda" if self.device.type == "cuda" else "logical"

        static_parts = self._check_static_need(optimizer)
        if budget_bytes is not None and self.accounting == "cuda" and cap:
            apply_cuda_cap(budget_bytes, self.device)

        self.blocks = wrap_blocks(named, allow_hf_checkpointing=method.name == "none")
        if margin is None:
            # Logical accounting is exact up to the least-squares fit's rounding (bytes).
            margin = 0.03 if self.accounting == "cuda" else 0.001
        slack = min(ALLOCATOR_SLACK_BYTES, (budget_bytes or 0) // 16) if self.accounting == "cuda" else 0
        self.planning = Planning(
            len(self.blocks), _group_ids(self.blocks), budget_bytes, int(margin * (budget_bytes or 0)), bucket_tokens,
            slack_bytes=slack,
        )
        # Parameters and buffers are never activations (under FSDP: this rank's shards).
        tensors = list(model.parameters()) + list(model.buffers())
        self._counter = SavedTensorCounter(len(self.blocks), exclude=tensors)
        self._exclude_ptrs = self._counter.excluded_ptrs
        self._param_bytes = static_parts["parameters"] + static_parts["gradients"]
        self._grad_params = [p for p in model.parameters() if p.requires_grad]
        self._expected_opt_bytes = _expected_optimizer_bytes(optimizer)
        self._fsdp = is_fsdp(model)
        self._fsdp_blocks_seen: set[int] = set()
        self._first_forward = True
        self.rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
        self._writer = JsonlWriter(log) if log else None
        self._records: list[StepRecord] = []
        self._pending: dict[str, Any] | None = None
        self._step = 0
        self._oom_retries = 0
        self._oom_attempts: list[dict[str, Any]] = []
        #: largest static bytes of a step that ran an optimizer step (_learn_optimizer_step)
        self._max_static = 0
        #: per plan bucket, the last steady step's (tokens, plan, peak above static): a step
        #: that repeats it needs no backstop (NOTE [Backstop])
        self._held: dict[tuple[int, int], tuple[int, tuple[int, ...], int]] = {}
        self.replaying = False
        self._reactive = ReactiveStore(self._exclude_ptrs) if method.evicts or method.backstop else None
        self._handles = [
            model.register_forward_pre_hook(self._on_forward_start, with_kwargs=True),
            model.register_forward_hook(self._on_forward_end, always_call=True),
        ]
        for b in self.blocks:
            b.listener = self
            if method.uses_model:
                b.before_run = self._before_block_run
            if method.evicts:
                b.runner = self._reactive.run
        self._optimizer_handles: list = []
        self._hook_optimizer(optimizer)

    def _check_static_need(self, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        parts = static_bytes_logical(self.model, None)
        parts["optimizer state"] = max(_expected_optimizer_bytes(optimizer), optimizer_state_bytes(optimizer))
        if self.budget_bytes is not None:
            check_static_need(self.budget_bytes, sum(parts.values()), parts)
        return parts

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s state from now on (for an optimizer made after ``fit``).

        Raises:
            BudgetTooSmallError: when weights + gradients + its state exceed the budget.
        """
        self._check_static_need(optimizer)
        self.optimizer = optimizer
        self._expected_opt_bytes = _expected_optimizer_bytes(optimizer)
        self._hook_optimizer(optimizer)

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Read the backward's and the optimizer step's peaks apart (NOTE [Three peaks], model.py).

        Host-side allocator counters only: no device synchronisation.
        """
        for h in self._optimizer_handles:
            h.remove()
        self._optimizer_handles = []
        while optimizer is not None and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            optimizer = optimizer.optimizer  # accelerate's AcceleratedOptimizer wraps the torch one
        if optimizer is None or self.accounting != "cuda" or not hasattr(optimizer, "register_step_pre_hook"):
            return

        def before_step(*_: Any) -> None:
            pending = self._pending
            if pending is not None and "saved" in pending:
                # the backward's start was read apart at its first recompute, if it had one
                pending["rest_peak"] = torch.cuda.max_memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)

        self._optimizer_handles = [optimizer.register_step_pre_hook(before_step)]

    # ----------------------------------------------------------------- hooks
    def _before_block_run(self, block: Block) -> None:
        """At a step's first recompute, read its backward's start peak apart (NOTE [Reading
        the backward's start]); every other run of a block body passes through."""
        pending = self._pending
        if pending is None or self.accounting != "cuda" or "saved" not in pending or "start_peak" in pending:
            return
        pending["start_peak"] = torch.cuda.max_memory_allocated(self.device)
        pending["start_reserved"] = torch.cuda.max_memory_reserved(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def _static_now(self) -> int:
        """Bytes that no plan changes, as they will be at this step's peak.

        On CUDA: what is allocated now, plus gradients not yet created (``.grad is None``
        after ``zero_grad``) and optimizer state not yet created (before its first step):
        both appear during the step whatever the plan. Logically: parameters + gradients
        + optimizer state, counted.
        """
        if self.accounting == "cuda":
            missing = sum(local(p).numel() * p.element_size() for p in self._grad_params if p.grad is None)
            if self.optimizer is not None and not self.optimizer.state:
                missing += self._expected_opt_bytes
            return torch.cuda.memory_allocated(self.device) + missing
        return self._param_bytes + optimizer_state_bytes(self.optimizer)

    def _on_forward_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        training = module.training and torch.is_grad_enabled()
        # read once: the closing step's lasting growth and this step's static bytes
        static_now = self._static_now() if training else None
        self._finish_step(static_now)
        if not training:
            return
        if self._first_forward:
            self._first_forward = False
            if not self._fsdp and is_fsdp(self.model):
                raise RuntimeError(
                    "the model was sharded with FSDP after memfit.fit: call memfit.fit after fully_shard, so "
                    "memfit counts this rank's shards (NOTE [FSDP's unsharded parameters] in memfit/accounting.py)"
                )
        if self.accounting == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.planning.static_bytes = static_now
        self._pending = {
            "t0": time.perf_counter(),
            "decision": None,
            "probed": set(),
            "probes": {},  # block index -> (saved bytes, time or None): warm-up's probes
            "static": self.planning.static_bytes,
            # optimizer state counted in `static` that only its first step will create
            "state_to_come": self._expected_opt_bytes if self.optimizer is not None and not self.optimizer.state else 0,
            "replay": self.replaying,
            "saved_peak": 0,
            "evicted": [],
            "evicted_ms": 0.0,
        }
        if self._reactive is not None:
            self._reactive.start_step()
        self._counter.start()

    def _on_forward_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        pending = self._pending
        if output is None and sys.exc_info()[1] is not None:
            return  # the forward raised (an always-called hook runs then too): nothing was saved
        if pending is not None:
            self._counter.stop()
            by_block = list(self._counter.by_block)
            if self._reactive is not None and pending["decision"] is not None:
                self._make_room(pending, 0)
                pending.update(evicted=list(self._reactive.evicted_blocks), evicted_ms=self._reactive.evicted_ms)
                # the counter sees nothing inside the store's blocks: their tensors are the store's
                if self.method.evicts:
                    by_block = self._reactive.kept_by_block(len(self.blocks))
                else:  # backstop: what the blocks saved, before any eviction (NOTE [Backstop])
                    n = len(self.blocks)
                    in_store = self._reactive.kept_by_block(n, before_eviction=True, inputs=False)
                    by_block = [a + b for a, b in zip(by_block, in_store)]
                    counted = self._counter.counted_ptrs
                    pending["kept_now"] = self._counter.total_bytes + self._reactive.kept_bytes_beyond(counted)
                    pending["backstop_input"] = self._reactive.input_only_by_block(n, counted)  # what arming added
            pending["saved"] = (self._counter.outside_bytes, by_block)
            if pending.get("probes"):
                self._learn_probes(pending)

    def _make_room(self, pending: dict[str, Any], upcoming_bytes: int, inputs: Any = ()) -> None:
        """Evict already-run blocks if in-use + margin + ``upcoming_bytes`` crosses the budget.

        ``inputs`` are the next block's: they stay alive whatever is evicted (NOTE [Reactive room]).
        """
        if self.accounting == "cuda":
            in_use = torch.cuda.memory_allocated(self.device)
        else:
            in_use = pending["static"] + self._counter.total_bytes + self._reactive.kept_bytes_beyond(self._counter.counted_ptrs)
            pending["saved_peak"] = max(pending["saved_peak"], in_use - pending["static"])
        if self.budget_bytes is None:
            return
        need_bytes = in_use + self._reserve_bytes() + upcoming_bytes - self.budget_bytes
        if need_bytes > 0:
            self._reactive.evict(need_bytes, [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)])

    def exit(self, block: Block) -> None:
        """Block listener: tensors saved after a block belong to no block until the next."""
        self._counter.current = OUTSIDE

    def enter(self, block: Block, args: tuple, kwargs: dict) -> None:
        """Block listener: fix the plan at the first block; attribute saved tensors; probe."""
        pending = self._pending
        if pending is None or not self._counter.active:
            return
        if self._fsdp and block.index not in self._fsdp_blocks_seen:
            # NOTE [FSDP's unsharded parameters]: FSDP has just gathered this block's (and,
            # at the first block, the root's) parameters; their storages are now known.
            self._counter.exclude_parameters(block.module.parameters())
            if not self._fsdp_blocks_seen:
                self._counter.exclude_parameters(self.model.parameters())
            self._fsdp_blocks_seen.add(block.index)
        if pending["decision"] is None:
            self._decide(pending, args, kwargs)
        self._counter.current = block.index
        if self.method.evicts:
            self._make_room(pending, self._reactive.largest_block_bytes, (args, kwargs))
        elif block.runner is not None:  # the backstop: only un-checkpointed blocks add much
            ahead, behind = pending["upcoming"][block.index]
            seen = self._reactive.largest_block_bytes
            excess = seen / behind if behind > 0 and seen > behind else 1.0
            self._make_room(pending, int(ahead * excess), (args, kwargs))
        if block.enabled:
            self._counter.count_inputs(block.index, args, kwargs)
        if pending["decision"].warmup:
            # every block is measured, each group's first also timed (NOTE [Blocks alike only in name])
            group = self.planning.model.groups[block.index]
            timed = group not in pending["probed"]
            pending["probed"].add(group)
            pending["probes"][block.index] = self._probe(block, args, kwargs, timed)

    def _decide(self, pending: dict[str, Any], args: tuple, kwargs: dict) -> None:
        x = _first_tensor(args, kwargs)
        shape = list(x.shape) if x is not None else []
        key = shape_key(shape)
        misses = self.planning.cache.misses
        t0 = time.perf_counter()
        decision = self.method.decide(self.planning, key)
        planner_us = (time.perf_counter() - t0) * 1e6
        if self._oom_attempts and not self.replaying and self.method.uses_model and not decision.warmup:
            failed = self._oom_attempts[-1].get("plan")
            if failed is not None and set(decision.blocks) <= set(failed):
                decision = Decision(self.planning.all_blocks)  # NOTE [A replay checkpoints more]
        planned = self.planning.cache.misses > misses
        enabled = set(decision.blocks)
        for b in self.blocks:
            b.enabled = b.index in enabled
        upcoming: list[tuple[float, float]] = []
        armed = False
        if self.method.backstop and not decision.warmup:
            armed = self._backstop_armed(key, decision.blocks)
            for b in self.blocks:
                b.runner = None if b.enabled or not armed else self._reactive.run
            if armed:
                upcoming = self._backstop_upcoming(bucket_key(key, self.planning.bucket_tokens))
        elif self.method.backstop:
            for b in self.blocks:
                b.runner = None
        pending.update(
            decision=decision, shape=shape, key=key, planner_us=planner_us, planned=planned, upcoming=upcoming,
            armed=armed,
        )

    def _backstop_upcoming(self, k: tuple[int, int]) -> list[tuple[float, float]]:
        """Per block: the largest predicted bytes of the store's blocks from it on, and of those before it.

        What the backstop keeps room for at a block's entry (NOTE [Backstop]): blocks run in
        index order, and only the store's (un-checkpointed) blocks add their activations.
        """
        model = self.planning.model
        per_group = {g: m.full_bytes(k) for g, m in model.group_models.items()}
        pred = [per_group[model.groups[b.index]] if b.runner is not None else 0.0 for b in self.blocks]
        ahead = list(itertools.accumulate(reversed(pred), max))[::-1]
        behind = [0.0, *itertools.accumulate(pred, max)][:-1]
        return list(zip(ahead, behind))

    def _backstop_armed(self, key: tuple[int, int], blocks: Sequence[int]) -> bool:
        """Whether this step's un-checkpointed blocks run under the store (NOTE [Backstop])."""
        planning = self.planning
        if planning.budget_bytes is None:
            return False
        seen = planning.model.max_key
        if seen is None or key[0] * key[1] > seen[0] * seen[1]:
            return True  # longer than any step so far: the model extrapolates
        threshold = planning.budget_bytes - self._reserve_bytes()  # where the backstop makes room
        held = self._held.get(bucket_key(key, planning.bucket_tokens))
        if held is not None:
            tokens, plan, above_static = held
            if plan == tuple(blocks) and key[0] * key[1] <= tokens and planning.static_bytes + above_static <= threshold:
                return False  # this plan ran this long a shape before and stayed under the threshold
        predicted = planning.predict_peak(key, blocks)
        return predicted + BACKSTOP_ARM_SHARE * max(0, predicted - planning.static_bytes) > threshold

    def _reserve_bytes(self) -> int:
        """What making room keeps free: the margin (a third of it for the backstop, whose plan
        keeps all of it: NOTE [Backstop]) and the allocator's slack (NOTE [Allocator slack])."""
        margin = self.planning.margin_bytes if self.method.evicts else self.planning.margin_bytes // 3
        return margin + self.planning.slack_bytes

    def _probe(self, block: Block, args: tuple, kwargs: dict, timed: bool = True) -> tuple[int, float | None]:
        """What ``block`` saves un-checkpointed, and its forward time if ``timed`` (NOTE [Probe]).

        Untimed, the block runs once (its bytes are all that is asked: NOTE [Blocks alike
        only in name]) and the time is ``None``.
        """
        detached = tree_map(
            lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t, (args, kwargs)
        )
        probe = ProbeCounter(self._exclude_ptrs, self._counter.parameter_storages)
        cuda = self.device.type == "cuda" and timed
        devices = [self.device] if self.device.type == "cuda" else []
        times_ms = []
        counters = (probe, ProbeCounter(self._exclude_ptrs, self._counter.parameter_storages)) if timed else (probe,)
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            # NOTE [First run of a block]: the faster run is the price. The second run's saved
            # tensors go to a counter of their own, not to the step's (which is outside).
            for counter in counters:
                probe_args, probe_kwargs = without_cache(block.module, *detached)
                if cuda:
                    torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                with counter.hooks():
                    out = block._body(*probe_args, **probe_kwargs)
                if cuda:
                    torch.cuda.synchronize(self.device)
                times_ms.append((time.perf_counter() - t0) * 1e3)
                del out, probe_args, probe_kwargs
        return probe.bytes, (min(times_ms) if timed else None)

    def _learn_probes(self, pending: dict[str, Any]) -> None:
        """Split groups whose members saved different bytes, then give each group its first
        member's probe (NOTE [Blocks alike only in name])."""
        (probes, pending["probes"]), key = (pending["probes"], {}), pending["key"]
        model = self.planning.model
        before, groups = list(model.groups), list(model.groups)
        next_id = max(groups) + 1
        timed_ms: dict[int, float] = {}  # per group before the split: its first member's time
        kinds: dict[int, list[tuple[int, int]]] = {}  # per group before the split: (bytes, new id)
        for i in sorted(probes):
            nbytes, ms = probes[i]
            g = model.groups[i]
            if ms is not None:
                timed_ms[g] = ms
            same = kinds.setdefault(g, [])
            match = next((gid for ref, gid in same if abs(nbytes - ref) <= GROUP_SPLIT_SHARE * max(nbytes, ref)), None)
            if match is None:  # a new kind: the group's first keeps its id, a later one gets a new id
                if same:
                    match, next_id = next_id, next_id + 1
                else:
                    match = g
                same.append((nbytes, match))
            groups[i] = match
        if groups != model.groups:
            changed = sorted({g for g in groups if groups.count(g) != before.count(g)})
            logger.info(
                "memfit: blocks of one class and size saved different bytes at shape key %s; planned apart now: %s",
                key, "; ".join(str([i for i, x in enumerate(groups) if x == g]) for g in changed),
            )
            model.split(groups)
            self.planning.cache.clear()
        seen: set[int] = set()
        for i in sorted(probes):
            g = model.groups[i]
            if g in seen:
                continue
            seen.add(g)
            nbytes, ms = probes[i]
            model.group_models[g].full_bytes.add(key, nbytes)
            model.group_models[g].cost_ms.add(key, ms if ms is not None else timed_ms[before[i]])

    # ----------------------------------------------------------------- records
    def _finish_step(self, static_now: int | None = None) -> None:
        """Close the pending step: read its peaks, learn, write its record.

        ``static_now``: :meth:`_static_now` if the caller has it (a step start reads it anyway).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self._counter.stop()
        if pending["decision"] is None or "saved" not in pending:
            return  # the forward ran no block (or failed): nothing to record
        now = time.perf_counter()
        optimizer_peak = None
        start_peak = pending.get("start_peak")  # NOTE [Reading the backward's start]
        start_transient = None
        if self.accounting == "cuda":
            rest = torch.cuda.max_memory_allocated(self.device)  # since the last reset
            reserved = max(torch.cuda.max_memory_reserved(self.device), pending.get("start_reserved", 0))
            if "rest_peak" in pending:
                # since the optimizer's pre-hook reset the counter, `rest` is its step's
                optimizer_peak, rest = rest, pending["rest_peak"]
            peak = rest if start_peak is None else max(rest, start_peak)
        outside, by_block = pending["saved"]
        saved = outside + sum(by_block)
        static = pending["static"]
        decision = pending["decision"]
        if self.accounting == "logical":
            peak = reserved = rest = static + max(pending.get("kept_now", saved), pending["saved_peak"])
        plain_peak, plain_start = self._plain_peaks(pending, peak, start_peak, rest)
        if self.accounting == "logical":
            transient = 0
        elif optimizer_peak is not None:
            # The backward's peak, read apart: the optimizer state that its first step
            # creates did not exist yet (counting it made the first step's transient 0.88 GB
            # low on an H200, bert-base AdamW).
            # Allocations of this step that stay (the first step's cuBLAS workspace: 35.5 MB
            # on an H200) are static from the next step on; counted here as transient, one
            # sample left the full-regime curve 34-56 MB high for the rest of a run.
            static_now = self._static_now() if static_now is None else static_now
            grown = max(0, static_now - static)
            base = static - pending["state_to_come"] + grown + saved
            transient = plain_peak - base
            start_transient = None if plain_start is None else plain_start - base
            self._learn_optimizer_step(optimizer_peak - static, static)
            peak, plain_peak = max(peak, optimizer_peak), max(plain_peak, optimizer_peak)
        else:
            # One peak for the whole step, which can include the optimizer's first step and
            # the state it creates: the transient is what the peak holds beyond the larger.
            base = max(static, self._static_now() if static_now is None else static_now) + saved
            transient = plain_peak - base
            start_transient = None if plain_start is None else plain_start - base
        key = pending["key"]
        model = self.planning.model
        predicted = self.planning.predict_peak(key, decision.blocks) if model.ready else None
        miss = None if predicted is None else plain_peak - predicted
        self._learn(key, decision, outside, by_block, transient, pending["evicted"], miss, start_transient)
        if self.method.backstop and not decision.warmup:
            bucket, tokens = bucket_key(key, self.planning.bucket_tokens), key[0] * key[1]
            held = self._held.get(bucket)
            same = held is not None and held[1] == tuple(decision.blocks)
            # what the plan holds unarmed (NOTE [Backstop]); a step that evicted held less than
            # its plan: the model, which has just learnt what its blocks saved, says how much
            above = int(plain_peak - static)
            if pending["evicted"]:
                above = max(above, int(self.planning.predict_peak(key, decision.blocks) - self.planning.static_bytes))
            self._held[bucket] = (
                max(tokens, held[0]) if same else tokens, tuple(decision.blocks), max(above, held[2]) if same else above,
            )
        if predicted is not None and self.method.uses_model and not decision.warmup:
            # Warm-up runs every block checkpointed whatever is predicted, from a model of
            # one or two samples: its misses say nothing of steady plans. (Counting them
            # raised an H200 run's margin from 0.18 to 0.65 GB for good: one block more
            # than the oracle in half the steps.)
            if miss > 0 and 1.25 * miss > self.planning.margin_bytes:
                # A step above its prediction: the margin grows to cover the largest miss
                # seen (plus a quarter), and the plans are redone with it.
                self.planning.raise_margin(int(1.25 * miss) - self.planning.margin_bytes)
        if pending["replay"]:
            return  # a replayed micro-step was recorded when it first ran
        self._step += 1
        backstop_input = sum(pending.get("backstop_input", ()))  # NOTE [Backstop]
        record = StepRecord(
            step=self._step,
            shape=pending["shape"],
            tokens=key[0] * key[1],
            method=self.method.name,
            plan=list(decision.blocks),
            n_checkpointed=len(decision.blocks),
            n_blocks=len(self.blocks),
            predicted_peak_bytes=predicted,
            peak_allocated_bytes=int(peak),
            peak_reserved_bytes=int(reserved),
            budget_bytes=self.budget_bytes,
            accounting=self.accounting,
            step_ms=(now - pending["t0"]) * 1e3,
            recompute_ms_est=self.planning.recompute_ms(key, decision.blocks) + pending["evicted_ms"],
            oom_retries=self._oom_retries,
            phase="warmup" if decision.warmup else "steady",
            saved_activation_bytes=int(saved + backstop_input),
            static_bytes=int(static),
            planner_us=pending["planner_us"],
            planned=pending["planned"],
            evicted_blocks=pending["evicted"],
            backstop_armed=pending["armed"],
            backstop_input_bytes=backstop_input,
            oom_attempts=self._oom_attempts,
            rank=self.rank,
        )
        self._oom_retries = 0
        self._oom_attempts = []
        self._records.append(record)
        if self._writer is not None:
            self._writer.write(record)

    def _plain_peaks(self, pending: dict[str, Any], peak: int, start_peak: int | None, rest: int) -> tuple[int, int | None]:
        """The step's peak and backward-start peak as its plan holds them run plainly, which is
        what the model learns: an armed step's less what its stores kept only as block inputs
        (NOTE [Backstop]). ``rest``: the peak from the first recompute on, when it was read apart.
        """
        inputs = pending.get("backstop_input", ())
        total = sum(inputs)
        if not total:
            return peak, start_peak
        if start_peak is None:  # no recompute (or logical): the peak is the backward's start, every store alive
            return peak - total, None
        # from the first recompute on (the topmost recomputed block), the stores above it are gone
        top = max([*pending["decision"].blocks, *pending["evicted"]], default=len(inputs))
        return max(start_peak - total, rest - sum(inputs[:top])), start_peak - total

    def _learn_optimizer_step(self, above_static: int, static: int) -> None:
        """Learn the optimizer step's peak above the step's static bytes (its batch included).

        Plans read it only through ``static + max(activations, optimizer) <= room``: while
        the largest static seen plus it stays within the room, no plan can change, and the
        cached plans stay (NOTE [Planning a row]: each clear cost a replan of every shape).
        """
        model = self.planning.model
        self._max_static = max(self._max_static, static)
        if above_static > model.optimizer_bytes:
            model.optimizer_bytes = float(above_static)
            if self.planning.budget_bytes is None or self._max_static + above_static > self.planning.room_bytes:
                self.planning.cache.clear()

    def _learn(
        self, key, decision, outside: int, by_block: list[int], transient: int,
        pending_evicted: Sequence[int] = (), miss: int | None = None, start_transient: int | None = None,
    ) -> None:
        """Feed a finished step's measurements to the memory model.

        Warm-up steps always add samples. A steady step (``miss``: observed minus predicted
        peak) changes the model only when its peak was under-predicted by more than a
        quarter of the margin (safety; or the backstop evicted) or over-predicted a new
        shape by more than 1% of the budget so that the right prediction would have given
        a cheaper plan (speed: it checkpointed for nothing; an over-predicted step that
        checkpointed nothing taught the 2026-11-22 H200 run nothing but cost a replan of
        every shape, 36 times in 200 steps at 6 GB); then each
        curve that erred the same way by more than 0.5% learns the step's value. The partial
        transient regime also learns its first 8 shapes, and any shape beyond the range it has
        seen (NOTE [Two transient regimes], model.py); it learns from the backward's start
        (``start_transient``) where the step read it (NOTE [Reading the backward's start]),
        else only when the model predicts the start to dominate. Every other steady step leaves
        the model and the plan cache untouched, so plans stay cached: smaller errors are the
        margin's to absorb, and each change of the model clears every cached plan (an H200
        run that learned every 0.5% under-prediction replanned two steps in three).
        """
        model = self.planning.model
        planned = set(decision.blocks)
        curves: list[tuple] = [(model.outside, outside)]
        for group_id, group in model.group_models.items():
            members = [i for i, g in enumerate(model.groups) if g == group_id]
            kept = [by_block[i] for i in members if i in planned]
            full = [by_block[i] for i in members if i not in planned]
            if kept:
                curves.append((group.kept_bytes, max(kept)))
            if full:
                curves.append((group.full_bytes, max(full)))
        transient_curve = None
        every_block = len(planned) == len(self.blocks)
        learns_transient = not (self.method.backstop and pending_evicted)
        if self.accounting == "cuda" and learns_transient:
            if every_block:
                transient_curve = model.transient_full
            elif start_transient is not None:  # NOTE [Reading the backward's start]
                transient_curve, transient = model.transient_partial, start_transient
            elif self._backward_start_dominates(key, decision.blocks):
                transient_curve = model.transient_partial
            if transient_curve is not None:
                curves.append((transient_curve, transient))
        changed = False
        step_under = bool(pending_evicted) or (miss is not None and miss > self.planning.margin_bytes / 4)
        # The plan came from the method's planning key (static: the largest shape's); a step
        # at another shape, over-predicted, says nothing of that plan.
        planning_key = self.method.planning_key(self.planning, key)
        b = self.planning.bucket_tokens
        step_over = (
            miss is not None and self.budget_bytes is not None and -miss > 0.01 * self.budget_bytes
            and bucket_key(planning_key, b) == bucket_key(key, b)
            and self.planning.would_plan_less(key, decision.blocks, -miss)
        )
        for curve, observed in curves:
            if decision.warmup or not curve.fitted:
                curve.add(key, observed)
                changed = True
                continue
            predicted = curve(key)
            under = step_under and observed > predicted + 0.005 * abs(observed)
            over = step_over and observed < predicted - 0.005 * abs(observed) and not curve.has(key)
            learn = under or over
            if curve is transient_curve:
                learn = learn or (curve is model.transient_partial and not curve.has(key) and curve.distinct_keys < 8)
                # a partial step beyond the partial curve's range extends it (NOTE [Two transient regimes])
                # (a plan that checkpointed nothing is left out: its transient matters only
                # once a shape that long needs a plan, and it then teaches the curve itself)
                learn = learn or (
                    curve is model.transient_partial and bool(decision.blocks) and not model.partial_covers(key[0] * key[1])
                )
            if learn:
                curve.add(key, observed)
                changed = True
        model.observe_key(key)
        if changed:
            self.planning.cache.clear()

    def _backward_start_dominates(self, key: tuple[int, int], blocks: Sequence[int]) -> bool:
        """Whether a partial plan's backward peak is its start (so it teaches the partial regime)."""
        model = self.planning.model
        if not model.ready or not model.transient_full.fitted:
            return True
        k = self.planning.plan_key(key)
        return model.backward_start_bytes(k, blocks) >= model.recompute_bytes(k, blocks)

    # ----------------------------------------------------------------- public
    @property
    def records(self) -> list[StepRecord]:
        """Step records so far (the last step's record is closed on access)."""
        if self._pending is not None and "saved" in self._pending:
            if self.accounting == "cuda":
                torch.cuda.synchronize(self.device)
            self._finish_step()
        return self._records

    def summary(self):
        """:class:`~memfit.records.RunSummary` of the records so far."""
        return summarize(self.records)

    @property
    def pending_oom_attempts(self) -> list[dict[str, Any]]:
        """The failed attempts of the step being replayed (its record gets them when it succeeds)."""
        return list(self._oom_attempts)

    def note_oom(self, error: BaseException | str | None = None) -> None:
        """Call after catching an OOM inside a step, before replaying it.

        Drops the failed step (nothing learned), keeps more room free and clears the plan
        cache so the replay runs a safer plan: on CUDA the allocator's slack grows to cover
        the reserved bytes that were not allocated when it failed, and where that explains
        nothing new the margin grows by a twentieth of the budget (NOTE [Allocator slack]). What the failed attempt was (plan, where it failed,
        memory then) goes into the ``oom_attempts`` of the step's record, written when the
        replay succeeds.

        Args:
            error: the caught error or its message (the allocation that failed), recorded. A
                message keeps the failed step's frames, and their tensors, out of reach.

        Raises:
            BudgetTooSmallError: when the failed step already checkpointed every block, or the
                method cannot adapt its plans (``none``, ``full``, ``precomputed``). ``reactive``
                adapts through the margin: it evicts earlier.
        """
        pending, self._pending = self._pending, None
        self._counter.stop()
        self._oom_retries += 1
        attempt = self._describe_oom(pending, error)
        self._oom_attempts.append(attempt)
        if not (self.method.uses_model or self.method.evicts):
            raise BudgetTooSmallError(
                f"out of memory under method {self.method.name!r}, which cannot adapt its plans; use "
                "method 'dynamic', or raise the memory budget"
            )
        decision = pending["decision"] if pending else None
        if decision is not None and len(decision.blocks) == len(self.blocks) and not decision.warmup:
            raise BudgetTooSmallError(
                f"out of memory with every block checkpointed (shape {pending['shape']}); static memory is "
                f"{format_bytes(pending['static'])} of the {format_bytes(self.budget_bytes)} budget. Raise "
                "--memory_budget, lower the batch size (use gradient accumulation), or use bf16/fp16 or a "
                "lighter optimizer (see `memfit estimate --advise`)"
            )
        if self.budget_bytes is not None:
            unusable = attempt.get("unusable_reserved_bytes") or 0
            if not self.planning.learn_slack(unusable):
                self.planning.raise_margin(max(self.budget_bytes // 20, 1))
        if self.accounting == "cuda":
            torch.cuda.empty_cache()
        logger.warning("memfit: %s; replaying it with %s kept free", describe_attempt(attempt, len(self.blocks)),
                       format_bytes(self.planning.margin_bytes + self.planning.slack_bytes))

    def _describe_oom(self, pending: dict[str, Any] | None, error: BaseException | str | None) -> dict[str, Any]:
        """The failed attempt, for its step's record: what ran, where it failed, memory then.

        ``stage`` is where the OOM was raised: ``forward`` (the forward had not finished),
        ``backward`` (it had; the optimizer step had not started) or ``optimizer``. On CUDA,
        ``peak_allocated_bytes`` is the highest allocation since the step's forward began
        (since the optimizer step's start, at that stage), before the request that failed,
        and ``unusable_reserved_bytes`` is reserved less that peak: at least what the
        allocator held but could not hand out then (NOTE [Allocator slack]). ``margin_bytes``
        and ``slack_bytes`` are those the failed plan was made with.
        """
        decision = pending["decision"] if pending else None
        stage = "forward" if not pending or "saved" not in pending else "optimizer" if "rest_peak" in pending else "backward"
        attempt: dict[str, Any] = {
            "stage": stage,
            "plan": list(decision.blocks) if decision else None,
            "phase": None if decision is None else "warmup" if decision.warmup else "steady",
            "shape": pending.get("shape") if pending else None,
            "predicted_peak_bytes": (
                self.planning.predict_peak(pending["key"], decision.blocks)
                if decision and self.planning.model.ready else None
            ),
            "margin_bytes": self.planning.margin_bytes,
            "slack_bytes": self.planning.slack_bytes,
            "evicted_blocks": list(self._reactive.evicted_blocks) if self._reactive is not None and decision else [],
            "error": str(error).splitlines()[0][:300] if error else None,
        }
        if self.accounting == "cuda":
            # the larger of the backward's start, read apart at its first recompute (NOTE
            # [Reading the backward's start]), and what came since
            start = pending.get("start_peak", 0) if pending and "rest_peak" not in pending else 0
            peak = max(torch.cuda.max_memory_allocated(self.device), start)
            reserved = torch.cuda.memory_reserved(self.device)
            attempt.update(
                allocated_bytes=torch.cuda.memory_allocated(self.device),
                peak_allocated_bytes=peak,
                reserved_bytes=reserved,
                unusable_reserved_bytes=max(0, reserved - peak),
                backward_peak_bytes=(
                    max(pending["rest_peak"], pending.get("start_peak", 0)) if pending and "rest_peak" in pending else None
                ),
            )
        return attempt

    def plans(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """Plans decided so far, per shape bucket."""
        return {k: p.blocks for (k, _), p in self.planning.cache.items()}

    def save_plans(self, path: str) -> None:
        """Write the plans of this run as JSON for the ``precomputed`` method."""
        save_plans(path, len(self.blocks), self.plans())

    def state_dict(self) -> dict[str, Any]:
        """Memory model and margin, for resuming without a new warm-up."""
        return {
            "model": self.planning.model.to_dict(), "margin_bytes": self.planning.margin_bytes,
            "slack_bytes": self.planning.slack_bytes, "step": self._step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.planning.model = MemoryModel.from_dict(state["model"])
        self.planning.model.bucket_tokens = self.planning.bucket_tokens
        self.planning.margin_bytes = int(state["margin_bytes"])
        self.planning.slack_bytes = int(state.get("slack_bytes", self.planning.slack_bytes))
        self.planning.cache.clear()
        self._step = int(state.get("step", 0))
        if isinstance(self.method, Dynamic):
            self.method.skip_warmup()

    def remove(self) -> None:
        """Close the last record, unhook and unwrap: the model is exactly as before ``fit``."""
        self.records  # noqa: B018 - closes the pending step
        for h in self._handles + self._optimizer_handles:
            h.remove()
        self._handles = self._optimizer_handles = []
        self._counter.stop()
        unwrap_blocks(self.blocks)
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> "Controller":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def fit(
    model: nn.Module,
    budget: int | str | None,
    method: str | Method = "dynamic",
    optimizer: torch.optim.Optimizer | None = None,
    blocks: Sequence[nn.Module] | str | None = None,
    log: str | None = None,
    margin: float | None = None,
    bucket_tokens: int = 8,
    cap: bool = True,
    **method_kwargs: Any,
) -> Controller:
    """Train ``model`` inside ``budget`` by checkpointing just enough blocks per batch.

    Args:
        model: the model, already on its device.
        budget: bytes (int) or a size string: ``"6GiB"`` = 6·2**30, ``"6GB"`` = 6·10**9;
            ``None`` runs the method with no budget (records only).
        method: ``none | full | dynamic | static | precomputed | reactive`` (or a Method
            instance).
        optimizer: its state is counted in the static need (measured from its tensors on
            CPU, by the allocator on CUDA).
        blocks: modules or a name regex, for models memfit cannot analyse.
        log: path of a JSONL file receiving one :class:`StepRecord` per step.
        margin: fraction of the budget kept free as a safety margin (default 3% on CUDA,
            0.1% with logical accounting, which is exact but for the fit's rounding). On
            CUDA the allocator's slack is kept free on top of it: ``min(256 MiB, budget / 16)``
            at first, more after an OOM that shows more (NOTE [Allocator slack]).
        bucket_tokens: plans are shared by shapes whose token counts round up to the same
            multiple of this (1 = a plan per exact shape).
        cap: on CUDA, enforce the budget with ``set_per_process_memory_fraction``.
        **method_kwargs: passed to the method (``path=`` for ``precomputed``,
            ``max_shape=`` for ``static``, ``warmup_steps=`` for ``dynamic``...).

    Returns:
        The :class:`Controller`; ``ctl.records[-1]`` is the last step's record and
        ``ctl.remove()`` restores the model.

    Raises:
        BudgetTooSmallError: when weights + gradients + optimizer state exceed the budget.
        UnknownMethodError: for an unknown method name.
        NoBlocksError: listing candidates, when no checkpointable block is found.

    Example:
        >>> import torch, memfit
        >>> from torch import nn
        >>> model = nn.Sequential(nn.ModuleList([nn.Linear(8, 8) for _ in range(4)]))
        >>> ctl = memfit.fit(model, budget="1GiB", method="full", blocks=r"0\\.\\d+")
        >>> len(ctl.blocks)
        4
        >>> ctl.remove()
    """
    budget_bytes = None if budget is None else parse_bytes(budget)
    method_obj = make_method(method, **method_kwargs)
    return Controller(model, budget_bytes, method_obj, optimizer, blocks, log, margin, bucket_tokens, cap)
