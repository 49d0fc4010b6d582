"""Memory and time model per block as a function of the shape key; fitting and refits.

Shape key: ``(N, T)`` — batch rows and tokens per row at the first block (sequence length
for text, patches for vision; see :func:`memfit.engine.shapes.shape_key`). Features are ``N``, ``N·T`` and
``N·T²``: activations of a transformer layer are linear in tokens, plus a quadratic
attention-score term that vanishes with fused attention and for windowed (Swin) attention;
``N`` alone covers per-row tensors (pooler, logits of a classification head).

Per *group* of identical blocks (same class, same parameter count) the model keeps, per
treatment name (:class:`BlockGroupModel`):

* ``bytes["keep"]``: bytes the block saves for backward when kept (measured by the warm-up
  probe, then by the live counter on every step that keeps it);
* ``bytes["recompute"]``: bytes it keeps when recomputed (its inputs);
* ``ms["recompute"]``: its forward time, i.e. the recompute cost (measured by the probe);
* the same for each other treatment warm-up measured (``selective``, ``offload``, ...).

Plus, for the whole step, ``outside_bytes`` (embeddings, head, loss) and the *transient*:
observed peak minus static memory minus saved activations, fitted as an upper envelope, in
two regimes (NOTE [Two transient regimes]), and the optimizer step's own peak
(NOTE [Three peaks]).

# NOTE [Two transient regimes]
Static memory counts every gradient, but at the peak of a step that checkpoints little
(the start of backward) most gradients do not exist yet while activations start to be
freed: the transient is *negative* (minus the gradients, plus the loss's temporaries).
Under ``full`` the peak comes later in backward, with a recomputed block on top. Warm-up
runs ``full``, so one curve fitted there would over-predict every partial plan by about the
gradients' bytes. ``transient_full`` is fitted on steps that checkpoint every block,
``transient_partial`` on the others; the partial curve is used only inside the range of
token counts it has seen (interpolation, up to the plan bucket of its longest sample), else
the full one (conservative). A steady partial step outside that range always teaches the
partial curve, so the range grows to the lengths the run meets: the full curve at a partial
plan's backward start counts a recomputed block that is not there, a block's worth too much.
The range's top is its longest sample rounded up to its plan bucket: a range that ended at the
longest sample itself would leave that sample's own bucket outside, with the full regime's guess
(a block's worth too much) until a longer sample fell in it. Above the range, a model that reads the
parts' moment apart takes less than the full curve (NOTE [Above the partial range]).

# NOTE [Above the partial range]
Each new longest shape of a run is first planned above the partial curve's range, so the full
curve's guess (a block's worth too much: 1.9-3.2 GiB on a 1B model at 16k tokens) cost every such
step blocks re-run for nothing. Where the parts' moment is read apart (NOTE [The parts' moment]),
both curves are the rest's: neither holds the head, and both lose its freed bytes alike as the
tokens grow. The full regime then holds, on top of what a partial start holds, a recomputed block
(its bytes grow with the tokens) less the inputs freed above it; so the partial transient grows
no faster than the full one, and above the partial curve's largest sample ``k`` a partial plan
reads ``full(t) - (full(k) - partial(k))``, never more than ``full(t)``: the gap measured at the
range's top carried up. On the committed runs' models (1B and SmolLM full fine-tuning, 8B LoRA;
benchmarks/results), the next one or two longer samples came 0.0-1.9 GiB under this (median
0.05-1.9) against 0.6-6.9 under the full curve; once -0.01 GiB (a plan's spread at one shape,
which the margin covers). Without the parts apart the partial curve holds the head's moment,
which grows faster than the full regime's late-backward one (s32's per-tensor runs: 1 MB a
token against 0.86), and the full curve stays the guess. Below the range nothing bounds the
partial curve from above but the full one, which stays.

# NOTE [Full terms of a re-run step]
A step whose every block re-runs whole under other treatments than plain recompute (the floor:
host checkpoints, tiled re-runs) peaks in a re-run too, as ``full`` does, but its re-run holds
what its treatment keeps, not a kept block, and its stashes come back while it runs. Its
whole-step transient with the first given back and the second taken off (``rerun_gap``) is a
full-regime sample, and the recompute bound takes both off again for such a plan (NOTE [Treated
peaks]). So a run warmed up on the floor (NOTE [Warm-up on the floor], methods/dynamic.py)
learns the full regime; one with no full sample yet reads the partial curve for both, its only
measured transient. An empty curve reads 0, and the parts' savings, which hold the kept head's
backward transient (NOTE [Head in the peaks]), came off a transient never added: the plans that
keep most were predicted to fit. So too the re-run's lesser bytes: they come off the transient
that holds a kept block's re-run, never more than it holds. A meter that reads no transient (the
logical one, on a CPU) leaves that curve at 0, and a tiled floor taken off it predicted every
block re-run tiled a tiled MLP's saving under the step it ran (the whole of it, 2.25 of 5.1 MB,
at a tiny Llama's 800 tokens: docs/devlog.md, session 48).

# NOTE [Three peaks]
A step's peak is the largest of three moments:
* the start of backward: static + saved activations under the plan + the partial transient;
* the recompute of the topmost checkpointed block in backward: bounded by what ``full``
  holds then (static + every block's kept bytes + the full transient) plus the activations
  of un-checkpointed blocks *below* that block, still held (none for a first-k plan);
* the optimizer step: static + its temporaries (AdamW's foreach update holds about one
  extra copy of the parameters), the same for every shape. Short sequences peak here
  whatever the plan, so a transient fitted on whole-step peaks would be V-shaped in tokens,
  which no low-degree curve fits. The meter reads the two phases' peaks apart (an optimizer
  step pre-hook); ``optimizer_bytes`` is the largest optimizer-step peak above static seen.
Checkpointing lowers only the first; the planner removes bytes from it and the plan is
then checked against the first two.

# NOTE [A plan fits what it decides]
A plan of the blocks and the parts beside them decides the first two moments
(:meth:`MemoryModel.plan_bytes`), not the optimizer step's, which the step's own part decides at its
moment (NOTE [A part kind's moment], parts/kind.py); a step's prediction (``step_bytes``) is the
largest of the three. Checked against all three, a step whose optimizer moment alone was over the
room fit no plan, and every shape ran the floor (every block on the host, its MLP tiled) for nothing:
a 1.24B model's steps took up to twice their time once its margin had grown above the room the
per-tensor step left (docs/devlog.md, session 29).

# NOTE [Treated peaks]
A plan that gives some blocks ``selective`` or ``offload`` changes the three peaks so:
* each block holds, at the start of backward, what its treatment keeps on the device;
* ``offload`` brings a block back ``depth`` offloaded blocks ahead in backward (NOTE [Prefetch
  depth], treatments/offload.py): the moved bytes of ``depth + 1`` offloaded blocks (the largest)
  may be on the device at once, which the start of backward, and a recompute above them, hold on
  top. The depth is :meth:`MemoryModel.offload_depth`'s, the one the treatment runs with (its
  owner is the link's price, engine/parts/probe.py); without a measured link it is 1;
* a block that re-runs its body in part in backward (``selective``: ``Treatment.reruns_part``)
  brings back, while it does, what its treatment did not keep: up to its ``keep`` bytes. It
  is bounded at the backward's start plus the largest such return of one block, not from
  ``full``'s transient as a recomputed block is. ``full``'s transient is read late in
  backward, with the gradients of nearly every block allocated (NOTE [Two transient
  regimes]); the partial re-runs come early, while the blocks below still hold their bytes: a
  bound that added those held bytes to ``full``'s transient counted two moments at once
  (docs/devlog.md). The return is added because on CUDA the backward's start is read apart
  before the first re-run of a body (NOTE [Reading the backward's start], learner.py), so the
  partial transient never holds it (counted on a CPU, the whole step teaches that curve, and
  the bound is over by up to the return). ``elementwise`` re-runs modules inside its block's
  backward, never the body: nothing is read apart before them, so the partial transient
  learns its returns as part of the step, and it declares none. The blocks below a whole
  recompute still hold what their treatments keep;
* ``full``'s transient holds a recomputed block's kept bytes, back for its backward. A block re-run
  whole whose re-run holds less (its MLP tiled: ``Treatment.rerun_keeps``, NOTE [Tiled MLP],
  treatments/tiled_mlp.py) brings back what that treatment keeps instead: the recompute bound is
  lower by the least such difference over the plan's whole re-runs (none where one of them is a
  plain recompute, or where the run never measured ``rerun_keeps``).
One formula covers every plan (:meth:`MemoryModel._peaks`): a plan that treats by recompute
alone adds only zeros for the terms of the others, so it is predicted bit for bit as before
they existed.

# NOTE [Spread stashes]
The link carries one copy at a time, each way, so offloaded blocks in a run hide their copies
under one block's compute each (NOTE [Offload price], probe.py): priced so, ``offload`` lost to
recompute at every length memfit plans. Spread apart, each copy out hides under the forwards of
the blocks up to the next offloaded one, and each copy back under their backwards: 4 of a 1.24B
Llama's 16 blocks offloaded at 8 x 4,096 tokens ran within 1% of keeping every block spread
(0, 4, 8, 12), 39% over it in a run (12-15), and recomputing those 4 cost 6% (docs/devlog.md,
session 46). So:
* :func:`spread` walks up the stack on the blocks' measured forwards and picks each
  block whose forward ends once the link is free and whose copy out ends before the last
  block's forward does: every copy out is done when the forward is, none in flight at the
  backward's start (a copy still in flight there holds memory the allocator cannot reuse);
* the search offers those blocks offloaded at the link's fixed price beside the mixes of
  the other blocks (NOTE [Treatments never lose], search.py);
* the prefetch ``depth`` counts blocks of backward; with moved-out blocks ``gap`` blocks apart
  at the fewest, ``ceil(depth / gap)`` stashes come back ahead of the one in use, in the
  runtime (treatments/offload.py) and in the peaks alike;
* a stash comes back once backward has passed the blocks more than ``depth`` above it (it is
  fetched on the gradient of the outputs of the ``depth`` blocks above it, the first that fires;
  NOTE [Prefetch depth]), whose bytes are gone by then: the stashes back count at the backward's
  start only by what they pass the bytes of the blocks more than ``depth`` above the topmost one;
* ``offload`` stays a treatment a run names (``treatments=``, ``--memfit_treatments``): its first
  steps at a new length pin its host buffers (15.3 GiB pinned, 8.9 s more in those steps than
  the same batches without offload took: about 0.6 s a GiB where it was measured), which a
  run of a few hundred steps at the tight end did not win back (docs/devlog.md, session 46);
* a stash comes back into the compute stream's memory, which the blocks backward has passed
  just freed, the copy ordered after the compute stream's work so far (a side stream's own pool
  would hold it apart from the step's, and the room keeps such pools free: NOTE [Other streams'
  pools], room.py).

# NOTE [Head in the peaks]
The curves describe the step with the LM head, and every part beside the blocks, untreated
(the learner adds a treated part's saving back to what such a step teaches, its saved part to
the outside bytes and its transient part to the transient: NOTE [A chunked head's step in kept
terms], learner.py). A plan that chunks the head (NOTE [The head in the plan], planner.py)
saves ``values["parts_saved"]`` bytes of the kept head's float32 logits, and a part beside the
blocks its option's bytes, held from after the last block's forward (NOTE [A part kind's
moment], parts/kind.py): taken off the backward's start, and off the recompute bound too,
whose ``full`` transient was fitted on whole-step peaks that the kept head's moment may set.

# NOTE [The parts' moment]
The parts beside the blocks run their backward first (the LM head and its loss), with every block's
saved bytes held and no block's gradient made yet: a moment of its own, often the step's peak where the
blocks keep much. Its transient changes with the part's option (a chunked head's work per chunk, by
formula); the rest of the backward's does not (the part's bytes are gone by then). One curve in the
kept head's terms cannot hold both: a warm-up step whose head's transient was not held at its peak (it
peaked late in backward) would teach the kept head's transient less that head's, and steps whose head
holds its transient at the part's moment would come over their prediction. So where a part prices its transient (on CUDA: ``PartKind.moment_apart``), the meter reads
the peak apart when the top block's output gradient arrives (``Meter.parts_done``), and the model holds
``transient_parts`` (that moment, in kept terms: the learner adds the part's transient saving back, where
it was held) beside the transients of the rest, which hold no part's bytes: the learner takes the part's
saved bytes off them (gone by then, though the outside curve counts them), and the rest's moments take
no saving off. The backward's start is the larger of the parts' moment (the plan's saving off) and the
rest's. ``parts_apart`` says a model learns so, set before its first sample; a model that learnt the
other way (an older state, or logical accounting where no transient is priced) keeps one curve. A step
whose parts' moment was not read (its top block's output needs no gradient) teaches the rest its whole
transient, which bounds the rest's.

# NOTE [Treatment prices]
A treatment's price is the time it adds to a step: ``recompute``, the block's forward
(measured by the probe); ``selective``, the recompute of its unsaved ops (measured by the
probe under the selective cache); ``offload``, the part of moving its bytes out in forward
and back in backward that the neighbouring blocks' compute does not hide, from the link's
measured bandwidth (engine/parts/probe.py); a checkpoint on the host, those copies and its re-run, which is
``recompute``'s (the forward) or, for a tiled body, ``recompute_tiled``'s measured price (``reruns_as``).

# NOTE [Upper envelope]
Least squares under-predicts half of its samples. Every fitted curve of bytes is shifted up by
its largest positive residual, so it bounds every sample it was fitted on; out-of-sample
errors are caught by the margin (NOTE [Room] in room.py).

# NOTE [Central prices]
The time curves (``ms[name]``) only rank treatments against each other, and
bound nothing: they are plain least squares (no shift), keep the smallest of a key's samples
(a timing's noise only adds), and fit a line in tokens until six keys are seen. A shifted
quadratic through the three warm-up samples of a price of a few milliseconds interpolates their
noise, and the noise then chooses the treatment.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from memfit.engine.parts.treatments import KEEP, RECOMPUTE, TREATMENTS
from memfit.engine.shapes import KeyCheck

if TYPE_CHECKING:
    from memfit.engine.plan.planner import Plan

__all__ = ["Curve", "BlockGroupModel", "MemoryModel", "ShapePeaks", "PrefixRows", "KEEP", "RECOMPUTE"]

#: shapes the partial transient must have seen before partial plans are predicted from it (NOTE [Two transient regimes])
PARTIAL_MIN_KEYS = 2


def _maximum(a: Any, b: Any) -> Any:
    """``max(a, b)`` of floats, elementwise where either is an array (NOTE [One evaluator])."""
    return np.maximum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)


def _chord_above(value: Any, at_smallest: float, share: Any) -> Any:
    """``value``, raised to the chord ``at_smallest · share`` where ``at_smallest`` is above 0
    (NOTE [Transients below the samples]); ``share``: the tokens over the smallest sample's."""
    return _maximum(value, at_smallest * share) if at_smallest > 0 else value


def _select(cond: Any, then: Callable[[], Any], otherwise: Any) -> Any:
    """``then()`` where ``cond`` holds, else ``otherwise``: of floats, or elementwise of arrays
    (``then`` is called only when some element needs it)."""
    if isinstance(cond, np.ndarray):
        return np.where(cond, then(), otherwise) if cond.any() else otherwise
    return then() if cond else otherwise


# NOTE [Refit in Python]
# Each change of the memory model refits the curves that learned, inside the next step's
# plan, where numpy's least squares costs several times a tight loop's (every numpy and
# LAPACK path pays a first-call cost after torch ran; plain Python barely slows down). So a
# curve keeps the sums of its normal equations over its distinct keys (a key whose largest
# value rises moves only Σ u·y), and a refit scales them as the least-squares path scaled
# its columns and solves the 2-4 unknowns in Python: values equal numpy's ``lstsq`` to 1e-9
# of the largest sample (tested), and the envelope shift is taken from the residuals of this
# very fit, so the curve stays above its samples.


def _min_norm_solve(gram: list[list[float]], rhs: list[float]) -> list[float]:
    """Minimum-norm solution of ``gram · x = rhs`` (symmetric, at most 4×4), by Jacobi rotations.

    Eigenvalues under 1e-12 of the largest are dropped (singular values under 1e-6): a stack
    whose batches all have one row count makes the slots 1 and N collinear, and
    ``np.linalg.lstsq`` splits the weight between them the same way.
    """
    p = len(rhs)
    a = [row[:] for row in gram]
    v = [[float(i == j) for j in range(p)] for i in range(p)]
    for _ in range(16):
        off = sum(a[i][j] * a[i][j] for i in range(p) for j in range(p) if i != j)
        if off <= 1e-30 * sum(a[i][i] * a[i][i] for i in range(p)):
            break
        for i in range(p - 1):
            for j in range(i + 1, p):
                if abs(a[i][j]) < 1e-300:
                    continue
                theta = (a[j][j] - a[i][i]) / (2.0 * a[i][j])
                t = math.copysign(1.0, theta) / (abs(theta) + math.sqrt(theta * theta + 1.0))
                c = 1.0 / math.sqrt(t * t + 1.0)
                s = t * c
                for m in (a, v):
                    for row in m:
                        ri, rj = row[i], row[j]
                        row[i], row[j] = c * ri - s * rj, s * ri + c * rj
                ai, aj = a[i], a[j]
                for k in range(p):
                    aik, ajk = ai[k], aj[k]
                    ai[k], aj[k] = c * aik - s * ajk, s * aik + c * ajk
    w = [a[i][i] for i in range(p)]
    cut = 1e-12 * max(max(w), 0.0)
    x = [0.0] * p
    for k in range(p):
        if w[k] > cut:
            proj = sum(v[i][k] * rhs[i] for i in range(p)) / w[k]
            for i in range(p):
                x[i] += v[i][k] * proj
    return x


# NOTE [Sizes outside the samples]
# A curve of sizes or costs (``floor`` set: saved bytes per block, bytes outside the blocks,
# recompute time) is a quadratic through the keys seen, and outside them it may bend
# anywhere: a fit on a few close shapes can predict next to nothing for a shape further
# out, which then runs with nothing treated into an OOM however much the margin grows.
# These values grow with the tokens at least in proportion (activations are linear in the
# tokens, or faster: convex, and nothing at no tokens), so outside its samples a curve
# gives its nearest extreme sample's value scaled by the tokens: below the smallest that is
# an upper bound (the shape's own value is learnt when it runs), above the largest a lower
# bound on the growth, which the fit may exceed. (Below, the smallest sample's value itself
# would also be safe, but it over-treats short batches far below the samples.) The
# transients (``floor=None``) may fall with the tokens and keep their fit, a line until six
# keys.
#
# A curve with ``linear_until`` set fits ``a + b·N·T`` until it has seen that many distinct
# keys: a quadratic through three noisy points extrapolates wildly (to negative bytes).
#
# NOTE [Transients below the samples]
# A transient is convex in the tokens (loss and backward temporaries grow with them, attention's
# and the head's part faster) and at no tokens at most 0 (gradients not yet made, if any). So below
# its smallest sample ``T0`` the chord from ``(0, 0)`` to ``(T0, f(T0))`` lies above it; a line fitted
# on long shapes alone, extrapolated down, may not: on a 256k-vocabulary model whose warm-up saw
# only long batches, the full transient's line gave a quarter less than a short batch's step then
# held, and that step, planned with no block treated, ran out of memory. Where ``f(T0)`` is above 0, a
# transient below its samples is the larger of its fit and that chord; where it is not (gradients
# dominate, full fine-tuning), the fit stays, falling with the tokens as the transient does.


#: the most values a curve memoises between two samples (NOTE [One evaluator])
MEMO_LIMIT = 4096


@dataclass
class Curve:
    """A non-negative upper-envelope fit of ``y`` on the shape features (NOTE [Upper envelope]);
    with ``envelope`` False, a least-squares fit of each key's smallest ``y`` (NOTE [Central prices])."""

    intercept: bool = False
    #: lowest value returned (None: may be negative, as a transient can be)
    floor: float | None = 0.0
    xs: list[tuple[int, int]] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)
    coef: list[float] = field(default_factory=list)
    shift: float = 0.0
    #: fit a line in tokens (with intercept) until this many distinct keys are seen (0: never)
    linear_until: int = 0
    #: shift the fit above every sample and keep each key's largest y (False: NOTE [Central prices])
    envelope: bool = True
    _quadratic: bool = field(default=True, init=False, repr=False)
    #: values already computed per key, dropped on every new sample (the planner asks for
    #: the same key many times)
    _memo: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        #: the largest y per distinct key (the smallest without ``envelope``): what the fit uses
        self._by_key: dict[tuple[int, int], float] = {}
        #: sums of the normal equations over the distinct keys, on the slots (1, N, N·T, N·T²):
        #: Σ u·uᵀ, Σ u·y, and each slot's largest |u| (NOTE [Refit in Python])
        self._gram = [[0.0] * 4 for _ in range(4)]
        self._rhs = [0.0] * 4
        self._col_max = [1.0] * 4
        for k, y in zip(self.xs, self.ys):
            self._keep(k, float(y))

    def has(self, key: tuple[int, int]) -> bool:
        return key in self._by_key

    def _keep(self, key: tuple[int, int], y: float) -> None:
        old = self._by_key.get(key)
        if old is not None and (y <= old if self.envelope else y >= old):
            return
        n, t = float(key[0]), float(key[1])
        u = (1.0, n, n * t, n * t * t)
        if old is None:
            for i in range(4):
                row = self._gram[i]
                for j in range(4):
                    row[j] += u[i] * u[j]
                self._col_max[i] = max(self._col_max[i], abs(u[i]))
            old = 0.0
        for i in range(4):
            self._rhs[i] += u[i] * (y - old)
        self._by_key[key] = y

    def add(self, key: tuple[int, int], y: float) -> None:
        self.xs.append(key)
        self.ys.append(float(y))
        self._keep(key, float(y))
        self.coef = []  # refit lazily
        self._memo.clear()

    @property
    def fitted(self) -> bool:
        return bool(self.xs)

    def _fit(self) -> None:
        # One sample per distinct key (the largest y seen there); NOTE [Refit in Python].
        self._quadratic = len(self._by_key) >= self.linear_until
        slots = ([0] if self.intercept else []) + ([1, 2, 3] if self._quadratic else [2])
        scale = [self._col_max[i] for i in slots]
        gram = [[self._gram[i][j] / (si * sj) for j, sj in zip(slots, scale)] for i, si in zip(slots, scale)]
        rhs = [self._rhs[i] / si for i, si in zip(slots, scale)]
        coef = [c / si for c, si in zip(_min_norm_solve(gram, rhs), scale)]
        self.coef = coef
        full = [0.0] * 4
        for i, c in zip(slots, coef):
            full[i] = c
        c0, c1, c2, c3 = full
        residuals = (y - (c0 + n * (c1 + t * (c2 + c3 * t))) for (n, t), y in self._by_key.items())
        self.shift = max(0.0, max(residuals)) if self.envelope else 0.0

    def __call__(self, key: tuple[int, int]) -> float:
        value = self._memo.get(key)
        if value is None:
            if len(self._memo) >= MEMO_LIMIT:  # chat data asks a new shape nearly every step: the memo stays bounded
                self._memo.clear()
            value = self._memo[key] = self.values(key[0], key[1])
        return value

    def values(self, n: int, t: Any) -> Any:
        """The curve at ``(n, t)``: ``t`` an int, or an array of ints for a row of shapes.

        # NOTE [One evaluator]
        A curve has one formula, written with operators that act on floats and numpy arrays
        alike: the planner's rows (NOTE [Planning a row], planning.py) and a single shape are
        the very same float operations, so they agree bit for bit without a copy to keep in
        step. The slots ``1, N, N·T, N·T²`` are summed in that order; a slot the fit lacks adds
        ``0.0 · x``, which changes no finite float.
        """
        row = isinstance(t, np.ndarray)
        if not self.xs:
            return np.zeros(len(t)) if row else 0.0
        coef, shift = self._slots()
        nf, tf = float(n), (t.astype(np.float64) if row else float(t))
        tokens = nf * tf
        value = 0.0
        for c, f in zip(coef, (1.0, nf, tokens, tokens * tf)):
            value = value + c * f
        value = value + shift
        if self.floor is None:  # a transient: NOTE [Transients below the samples]
            smallest = self._extremes()[0]
            t0 = float(smallest[0] * smallest[1])
            return _select(n * t < self.min_tokens, lambda: _chord_above(value, self(smallest), (nf * tf) / t0), value)
        value = _maximum(self.floor, value)
        all_tokens = n * t  # NOTE [Sizes outside the samples]
        all_float = all_tokens.astype(np.float64) if row else float(all_tokens)
        smallest, largest = self._extremes()
        value = _select(
            all_tokens > self.max_tokens,
            lambda: _maximum(value, self(largest) * all_float / float(largest[0] * largest[1])), value,
        )
        return _select(all_tokens < self.min_tokens, lambda: self(smallest) * all_float / float(smallest[0] * smallest[1]), value)

    def _slots(self) -> tuple[list[float], float]:
        """Coefficients on the slots ``(1, N, N·T, N·T²)`` and the shift (fitted first if needed; kept until a sample)."""
        slots = self._memo.get("slots")
        if slots is None:
            if not self.coef:
                self._fit()
            coef = list(self.coef)
            if not self.intercept:
                coef.insert(0, 0.0)
            if not self._quadratic:  # [1, N·T]
                coef = [coef[0], 0.0, coef[1], 0.0]
            slots = self._memo["slots"] = coef, self.shift
        return slots

    def _extremes(self) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """The sample keys with the fewest and the most ``N·T`` (the largest ``N`` among ties), or None."""
        extremes = self._memo.get("extremes")
        if extremes is None and self._by_key:
            extremes = self._memo["extremes"] = (
                min(self._by_key, key=lambda k: (k[0] * k[1], -k[0])),
                max(self._by_key, key=lambda k: (k[0] * k[1], k[0])),
            )
        return extremes

    def _extreme_key(self, largest: bool) -> tuple[int, int]:
        """The sample key with the most (``largest``) or the fewest ``N·T``."""
        return self._extremes()[1 if largest else 0]

    def max_bucket_tokens(self, bucket_tokens: int) -> int:
        """Largest ``N·T`` among the samples with ``T`` rounded up to a multiple of ``bucket_tokens``."""
        cached = self._memo.get(("max_bucket", bucket_tokens))
        if cached is None:
            cached = max((n * -(-t // bucket_tokens) * bucket_tokens for n, t in self._by_key), default=0)
            self._memo[("max_bucket", bucket_tokens)] = cached
        return cached

    @property
    def distinct_keys(self) -> int:
        """How many different keys have samples."""
        return len(self._by_key)

    @property
    def min_tokens(self) -> int:
        """Smallest ``N·T`` among the samples (0 without samples)."""
        extremes = self._extremes()
        return extremes[0][0] * extremes[0][1] if extremes else 0

    @property
    def max_tokens(self) -> int:
        """Largest ``N·T`` among the samples (0 without samples)."""
        extremes = self._extremes()
        return extremes[1][0] * extremes[1][1] if extremes else 0

    def to_dict(self) -> dict:
        return {
            "intercept": self.intercept, "floor": self.floor, "linear_until": self.linear_until,
            "envelope": self.envelope, "xs": [list(k) for k in self.xs], "ys": self.ys,
        }

    @classmethod
    def from_dict(cls, data: dict, envelope: bool = True) -> "Curve":
        """The curve of :meth:`to_dict`; ``envelope`` where ``data`` (an older file) does not say."""
        return cls(
            data["intercept"], data.get("floor", 0.0), [tuple(k) for k in data["xs"]], list(data["ys"]),
            linear_until=data.get("linear_until", 0), envelope=data.get("envelope", envelope),
        )


def _price_curve() -> Curve:
    """A curve of a treatment's time (NOTE [Central prices])."""
    return Curve(intercept=True, linear_until=6, envelope=False)


#: a group's saved state before curves were keyed by treatment name: field -> (bytes or ms, name)
_LEGACY_FIELDS = {
    "full_bytes": ("bytes", KEEP), "kept_bytes": ("bytes", RECOMPUTE), "cost_ms": ("ms", RECOMPUTE),
    "selective_bytes": ("bytes", "selective"), "selective_ms": ("ms", "selective"), "offload_bytes": ("bytes", "offload"),
}


@dataclass
class BlockGroupModel:
    """Model of one group of identical blocks, per treatment name (engine/parts/treatments/): the
    bytes a block keeps on the device under it, and the time it adds to a step.

    ``bytes["keep"]`` is every saved tensor, ``bytes["recompute"]`` the block's inputs and
    ``ms["recompute"]`` its forward (what a recompute costs: NOTE [Central prices]); another
    treatment's curves appear once warm-up measured it.
    """

    bytes: dict[str, Curve] = field(default_factory=lambda: {KEEP: Curve(), RECOMPUTE: Curve()})
    ms: dict[str, Curve] = field(default_factory=lambda: {RECOMPUTE: _price_curve()})

    def bytes_curve(self, name: str) -> Curve:
        """The curve of what ``name`` keeps on the device (made empty on first use)."""
        return self.bytes.setdefault(name, Curve())

    def ms_curve(self, name: str) -> Curve:
        """The curve of the time ``name`` adds (made empty on first use)."""
        return self.ms.setdefault(name, _price_curve())

    def measured(self, name: str) -> bool:
        """Whether warm-up measured what ``name`` keeps."""
        curve = self.bytes.get(name)
        return curve is not None and curve.fitted

    def moved(self, name: str, moves_from: str, key: tuple[int, int]) -> float:
        """Bytes a block under ``name`` moves off the device: what it would keep under ``moves_from`` less what it keeps."""
        return max(0.0, self.kept(moves_from, key) - self.bytes[name](key))

    def added_ms(self, name: str, key: tuple[int, int]) -> float:
        """The time ``name`` adds where warm-up measured it, else 0 (``keep``'s: nothing)."""
        curve = self.ms.get(name)
        return max(0.0, curve(key)) if curve is not None and curve.fitted else 0.0

    def rerun_ms(self, t: Any, key: tuple[int, int], fwd: float) -> float:
        """What a moving treatment ``t``'s re-run adds: the measured price of the treatment it re-runs as where warm-up
        measured it (``Treatment.reruns_as``), else its forward again (where it ``reruns``) and what its re-run keeps adds."""
        if t.reruns_as is not None and (curve := self.ms.get(t.reruns_as)) is not None and curve.fitted:
            return max(0.0, curve(key))
        return (fwd if t.reruns else 0.0) + self.added_ms(t.rerun_keeps, key)

    def kept(self, name: str, key: tuple[int, int]) -> float:
        """Bytes a block keeps under ``name`` (its full bytes where ``name`` has no sample yet:
        no saving assumed; ``recompute`` always its own curve)."""
        if name == RECOMPUTE or self.measured(name):
            return self.bytes[name](key) if name in self.bytes else 0.0
        return self.bytes[KEEP](key)

    def to_dict(self) -> dict:
        return {"bytes": {k: c.to_dict() for k, c in self.bytes.items()}, "ms": {k: c.to_dict() for k, c in self.ms.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "BlockGroupModel":
        """The group of :meth:`to_dict`, or of the older state with one field per treatment."""
        group = cls()
        if "bytes" in data:
            group.bytes.update({k: Curve.from_dict(v) for k, v in data["bytes"].items()})
            group.ms.update({k: Curve.from_dict(v, envelope=False) for k, v in data.get("ms", {}).items()})
            return group
        for old, value in data.items():
            if old in _LEGACY_FIELDS:
                kind, name = _LEGACY_FIELDS[old]
                curve = Curve.from_dict(value, envelope=kind == "bytes")
                if curve.fitted or name in (KEEP, RECOMPUTE):
                    getattr(group, kind)[name] = curve
        return group


def _kept(values: dict[Any, Any], g: int, name: str) -> Any:
    """A block of group ``g``'s bytes under ``name`` (its full bytes for a treatment never measured)."""
    value = values.get((g, name))
    return values[(g, KEEP)] if value is None else value


@dataclass
class _Layout:
    """What the peak formula needs of a plan (NOTE [Three peaks], [Treated peaks]): per group,
    how many blocks take each treatment; the same below the topmost re-run block for those not
    recomputed; whether that block exists and whether every block re-runs whole; the groups of
    the offloaded blocks, in all and below it. Counts and flags are ints and bools for one plan,
    or arrays for a row of plans (first ``c`` blocks recomputed: :meth:`MemoryModel.prefix_rows`).
    """

    counts: dict[int, dict[str, Any]]
    held: dict[tuple[int, str], int]
    rerun: Any
    every: Any
    offloaded: list[tuple[int, str]] = field(default_factory=list)
    offloaded_below: list[tuple[int, str]] = field(default_factory=list)
    #: the offloaded blocks' prefetch depth, in blocks of backward (NOTE [Treated peaks])
    depth: int = 1
    #: the fewest blocks between two moved-out blocks, one above the other (NOTE [Spread stashes])
    gap: int = 1
    #: ``(group, treatment)`` of the blocks above the topmost moved-out block, from the bottom up (NOTE [Spread stashes])
    above: list[tuple[int, str]] = field(default_factory=list)
    #: ``(group, treatment)`` of the blocks that re-run in part (NOTE [Treated peaks])
    part_reruns: list[tuple[int, str]] = field(default_factory=list)
    #: ``(group, Treatment.rerun_keeps)`` of the blocks re-run whole (NOTE [Treated peaks])
    rerun_keeps: list[tuple[int, str]] = field(default_factory=list)

    def ahead(self, depth: int) -> int:
        """The stashes fetched ahead of the one in use, ``depth`` blocks of backward apart (NOTE [Spread stashes])."""
        return -(-depth // self.gap)


#: the most plans whose layouts a model keeps (a long run's plans are not bounded)
LAYOUTS_KEPT = 1024


class _Layouts:
    """Each plan's :class:`_Layout` for a model's blocks (their groups and the run's treatments), made once per plan
    (the same plans come back step after step) and read, never changed, by the peak formula; the model makes a new
    one when its groups change. Also each group's number of blocks (``sizes``)."""

    def __init__(self, groups: list[int], treatments: Mapping[str, Any]):
        self.groups, self.treatments = groups, treatments
        self.sizes = {g: groups.count(g) for g in sorted(set(groups))}
        self._made: dict[tuple, _Layout] = {}

    def __call__(self, plan: "Plan") -> _Layout:
        layout = self._made.get(seen := (plan.blocks, plan.kinds))
        if layout is None:
            if len(self._made) >= LAYOUTS_KEPT:
                self._made.clear()
            layout = self._made[seen] = self._make(plan)
        return layout

    def _make(self, plan: "Plan") -> _Layout:
        names, groups, treatments = plan.treatments(len(self.groups)), self.groups, self.treatments
        counts: dict[int, dict[str, Any]] = {g: {} for g in self.sizes}
        for g, name in zip(groups, names):
            counts[g][name] = counts[g].get(name, 0) + 1
        reruns = [i for i, name in enumerate(names) if treatments[name].reruns]
        top = max(reruns, default=-1)
        # summed per (group, treatment) in the order a set of the blocks iterates, the order
        # these sums always took (floats: the order is part of the value)
        held: dict[tuple[int, str], int] = {}
        for i in {i for i in range(max(top, 0)) if names[i] != RECOMPUTE}:
            held[(groups[i], names[i])] = held.get((groups[i], names[i]), 0) + 1
        offloaded = [i for i, name in enumerate(names) if treatments[name].moves_out]
        parts = {(groups[i], name) for i, name in enumerate(names) if treatments[name].reruns_part}
        gap = min((b - a for a, b in zip(offloaded, offloaded[1:])), default=len(names))
        above = [(groups[i], names[i]) for i in range(offloaded[-1] + 1, len(names))] if offloaded else []
        return _Layout(  # a block re-run whole brings its own stash back for its recompute: at or below the top
            counts, held, bool(reruns), len(reruns) == len(names),
            [(groups[i], names[i]) for i in offloaded], [(groups[i], names[i]) for i in offloaded if i <= top],
            gap=max(1, gap), above=above,
            part_reruns=sorted(parts), rerun_keeps=sorted({(groups[i], treatments[names[i]].rerun_keeps) for i in reruns}),
        )




def _rerun_less(values: dict[Any, Any], rerun_keeps: list[tuple[int, str]]) -> Any:
    """What every whole re-run of a plan holds less than a kept block's bytes, the least of them (NOTE [Treated
    peaks]): ``full``'s transient was read with a kept block's bytes back, a plain recompute's."""
    less: Any = None
    for g, name in rerun_keeps:
        value = _maximum(0.0, values[(g, KEEP)] - _kept(values, g, name)) if name != KEEP else 0.0
        less = value if less is None else -_maximum(-less, -value)  # the smaller
    return 0.0 if less is None else less


class MemoryModel:
    """Predicts per-block savings and costs, and the step peak, from the shape key.

    Args:
        groups: for each block, the id of its group of identical blocks.
        bucket_tokens: token granularity of the plan buckets this model is asked about.
        treatments: the run's treatments by name (engine/parts/treatments/: their peaks and prices); the registered ones.
    """

    def __init__(self, groups: Sequence[int], bucket_tokens: int = 1, treatments: Mapping[str, Any] = TREATMENTS):
        self.groups = list(groups)
        self.treatments = treatments
        self.bucket_tokens = bucket_tokens  # token granularity of the plan buckets this model is asked about (bucket_key)
        self.group_models = {g: BlockGroupModel() for g in sorted(set(self.groups))}
        self.layouts = _Layouts(self.groups, treatments)  # each plan's, and each group's size
        self.outside = Curve()
        self.transient_full = Curve(intercept=True, floor=None, linear_until=6)
        self.transient_partial = Curve(intercept=True, floor=None, linear_until=6)
        self.transient_parts = Curve(intercept=True, floor=None, linear_until=6)
        self.parts_apart = False  # the parts' moment read apart (NOTE [The parts' moment])
        self.searched: ShapePeaks | None = None  # the shape a search plans, while it does (NOTE [A search reads the curves once])
        #: largest optimizer-step peak above static memory seen (NOTE [Three peaks])
        self.optimizer_bytes = 0.0
        self.step_saved = 0.0  # what the optimizer step's part saves at its moment (NOTE [A part kind's moment], parts/kind.py)
        self.max_key: tuple[int, int] | None = None
        #: per part kind beside the blocks, ``(tokens, (treatment, param)) -> bytes`` its option saves (NOTE [Head in the peaks])
        self.part_saving: dict[str, Callable[[int, Any], int]] = {}
        #: the host link's price, with its ``depth(moved bytes, forward ms)`` (engine/parts/probe.py
        #: LinkPrice); None until measured: prefetch depth 1 (NOTE [Treated peaks])
        self.link: Any = None
        self.key_check = KeyCheck()  # whether the key carries every block's shape (NOTE [What the key cannot see])

    @property
    def ready(self) -> bool:
        return all(g.bytes[KEEP].fitted and g.bytes[RECOMPUTE].fitted for g in self.group_models.values())

    def split(self, groups: Sequence[int]) -> None:
        """Regroup the blocks by splitting groups (NOTE [Blocks alike only in name], learner.py).

        Each id of ``groups`` must take its blocks from one old group; a new id starts with
        a copy of that old group's curves (its samples are of sizes where the blocks were
        measured alike).
        """
        groups = list(groups)
        if len(groups) != len(self.groups):
            raise ValueError(f"split: {len(groups)} group ids for {len(self.groups)} blocks")
        parents: dict[int, set[int]] = {}
        for new, old in zip(groups, self.groups):
            parents.setdefault(new, set()).add(old)
        if any(len(olds) > 1 for olds in parents.values()):
            raise ValueError("split: a new group may not merge blocks of different groups")
        self.group_models = {
            g: self.group_models[g] if g in self.group_models and parents[g] == {g} else copy.deepcopy(self.group_models[next(iter(parents[g]))])
            for g in sorted(parents)
        }
        self.groups = groups
        self.layouts = _Layouts(groups, self.treatments)

    def observe_key(self, key: tuple[int, int]) -> None:
        if self.max_key is None or key[0] * key[1] > self.max_key[0] * self.max_key[1]:
            self.max_key = key

    def block_bytes(self, i: int, key: tuple[int, int], name: str) -> float:
        """What block ``i`` keeps on the device under treatment ``name`` (BlockGroupModel.kept)."""
        return self.group_models[self.groups[i]].kept(name, key)

    def block_cost_ms(self, i: int, key: tuple[int, int]) -> float:
        return self.group_models[self.groups[i]].ms[RECOMPUTE](key)

    def options(self, key: tuple[int, int], names: Sequence[str],
                offload_ms: Callable[[float, float], float] | None = None) -> list[list[tuple[str, int, float]]]:
        """Per block, each available treatment as ``(name, bytes saved, ms)`` (NOTE [Treatment prices]).

        Args:
            key: the shape.
            names: the treatments the run may give (``keep`` aside).
            offload_ms: the price of moving ``bytes`` out and back for a block whose forward
                takes ``ms`` (engine/parts/probe.py's link model); offload is left out without it.
        """
        per_group = {}
        for g, m in self.group_models.items():
            full, fwd = m.bytes[KEEP](key), max(m.ms[RECOMPUTE](key), 1e-6)
            choices = []
            for name in names:
                if name == RECOMPUTE:
                    choices.append((name, int(max(0.0, full - m.bytes[RECOMPUTE](key))), fwd))
                elif not m.measured(name):
                    continue
                elif name in m.ms and m.ms[name].fitted:  # priced by its own measured time
                    choices.append((name, int(max(0.0, full - m.bytes[name](key))), max(m.ms[name](key), 1e-6)))
                elif (t := self.treatments[name]).priced_by_link and offload_ms is not None:  # a re-run block pays its forward too
                    ms = offload_ms(m.moved(name, t.moves_from, key), fwd) + m.rerun_ms(t, key, fwd)
                    choices.append((name, int(max(0.0, full - m.bytes[name](key))), max(ms, 1e-6)))
            per_group[g] = choices
        return [per_group[g] for g in self.groups]

    def offload_depth(self, key: tuple[int, int]) -> int:
        """The prefetch depth of offloaded blocks at ``key`` (NOTE [Treated peaks]): the link's
        depth for the group that needs the deepest, 1 without a link."""
        if self.searched is not None and self.searched.key == key:  # NOTE [A search reads the curves once]
            return self.searched.depth
        depth = getattr(self.link, "depth", None)
        if depth is None:
            return 1
        deepest = 1
        for m in self.group_models.values():
            for name in m.bytes:
                if name in self.treatments and self.treatments[name].moves_out and m.measured(name):
                    moved = m.moved(name, self.treatments[name].moves_from, key)
                    deepest = max(deepest, int(depth(moved, max(m.ms[RECOMPUTE](key), 1e-6))))
        return deepest

    def savings(self, key: tuple[int, int]) -> list[int]:
        per_group = {g: int(max(0.0, m.bytes[KEEP](key) - m.bytes[RECOMPUTE](key))) for g, m in self.group_models.items()}
        return [per_group[g] for g in self.groups]

    def costs(self, key: tuple[int, int]) -> list[float]:
        per_group = {g: max(m.ms[RECOMPUTE](key), 1e-6) for g, m in self.group_models.items()}
        return [per_group[g] for g in self.groups]

    def transient(self, key: tuple[int, int], every_block: bool) -> float:
        """Transient bytes of a step (NOTE [Two transient regimes])."""
        return self._values(key[0], key[1])["transient_full" if every_block else "transient"]

    def partial_covers(self, tokens: Any) -> Any:
        """Whether ``tokens`` (``N·T``: an int, or an array of them) lie in the range the partial transient has
        seen, up to its longest sample's plan bucket (NOTE [Two transient regimes])."""
        partial = self.transient_partial
        return (partial.min_tokens <= tokens) & (tokens <= partial.max_bucket_tokens(self.bucket_tokens))

    def rerun_gap(self, key: tuple[int, int], plan: "Plan") -> float | None:
        """What a whole-step transient read under ``plan`` lacks of a full-regime sample, where every block re-runs
        whole (NOTE [Full terms of a re-run step]); None where one does not."""
        if not all(self.treatments[name].reruns for name in plan.treatments(len(self.groups))):
            return None
        values, layout = self._values(*key), self.layouts(plan)
        stashes = layout.ahead(self.offload_depth(key)) if layout.offloaded else 0
        return float(_rerun_less(values, layout.rerun_keeps) - self._in_flight(values, layout.offloaded_below, stashes))

    def partial_predicts(self, tokens: int) -> bool:
        """Whether a partial plan at ``tokens`` (``N·T``) reads the partial transient (NOTE [Two transient regimes])."""
        return self.transient_partial.distinct_keys >= PARTIAL_MIN_KEYS and bool(self.partial_covers(tokens))

    # ------------------------------------------------------------ the one peak evaluator
    def _values(self, n: int, t: Any) -> dict[Any, Any]:
        """Every curve the peak formula reads, at ``(n, t)`` (``t`` an int or an array of them):
        ``outside``, ``transient_full``, ``transient`` (a partial plan's: NOTE [Two transient
        regimes]) and per ``(group, name)`` the bytes a block keeps under each treatment
        (BlockGroupModel.kept)."""
        def at(curve: Curve) -> Any:
            return curve.values(n, t) if isinstance(t, np.ndarray) else curve((n, t))  # a shape's: memoised

        partial = self.transient_partial
        # no full sample yet (NOTE [Full terms of a re-run step]): the partial curve, the only transient measured
        full = self.transient_full if self.transient_full.fitted or not partial.fitted else partial
        values: dict[Any, Any] = {"outside": at(self.outside), "transient_full": at(full)}
        transient = values["transient_full"]
        covers = self.partial_covers(n * t) if partial.distinct_keys >= PARTIAL_MIN_KEYS else False
        if self.parts_apart and partial.fitted and self.transient_full.fitted:  # NOTE [Above the partial range]
            top = partial._extreme_key(True)
            below_full = min(0.0, partial(top) - self.transient_full(top))
            above = np.logical_and(n * t >= partial.max_tokens, np.logical_not(covers))
            transient = _select(above, lambda: transient + below_full, transient)
        if partial.distinct_keys >= PARTIAL_MIN_KEYS:
            transient = _select(covers, lambda: at(partial), transient)
        values["transient"] = transient
        if self.parts_apart and self.transient_parts.fitted:
            values["transient_parts"] = at(self.transient_parts)
        for g, m in self.group_models.items():
            full = values[(g, KEEP)] = at(m.bytes[KEEP])
            values[(g, RECOMPUTE)] = at(m.bytes[RECOMPUTE])
            for name in m.bytes:
                if name not in (KEEP, RECOMPUTE):
                    values[(g, name)] = at(m.bytes[name]) if m.measured(name) else full
        return values

    def _activation(self, values: dict[Any, Any], counts: dict[int, dict[str, Any]]) -> Any:
        total = values["outside"]
        for g in self.group_models:
            per = counts.get(g, {})
            # recompute, keep, then the other treatments: a plan without them sums as it always did
            names = sorted(per, key=lambda name: (name != RECOMPUTE, name != KEEP))
            group = 0
            for name in names:
                group = group + per[name] * _kept(values, g, name)
            total = total + group
        return total

    def _in_flight(self, values: dict[Any, Any], moved_out: list[tuple[int, str]], depth: int) -> float:
        """Bytes of the ``depth + 1`` largest offloaded blocks (``(group, treatment)`` each, moving what it would
        keep by ``Treatment.moves_from`` less what it keeps): the one in use and those coming back (NOTE [Treated peaks])."""
        moved = [_kept(values, g, self.treatments[name].moves_from) - _kept(values, g, name) for g, name in moved_out]
        return float(sum(sorted(moved, reverse=True)[: depth + 1]))

    def _peaks(self, values: dict[Any, Any], layout: _Layout) -> tuple[Any, Any, Any]:
        """``(backward start, recompute, step)`` above static (NOTE [Three peaks]): the one formula
        for a shape and for the planner's rows (NOTE [One evaluator]); the parts' savings: NOTE [Head in the peaks]."""
        head_saved = values.get("parts_saved", 0)
        parts = values.get("transient_parts")  # the parts' moment read apart: the rest holds no part (NOTE [The parts' moment])
        rest_saved = head_saved if parts is None else 0
        activation = self._activation(values, layout.counts)
        stashes = layout.ahead(layout.depth)
        in_flight = self._in_flight(values, layout.offloaded, stashes)
        freed = 0.0  # what the blocks above the topmost stash held, gone before any stash comes back
        for g, name in layout.above[layout.depth:]:  # the topmost stash comes back ``depth`` blocks above it
            freed = freed + _kept(values, g, name)
        back = _maximum(0.0, in_flight - freed)
        # every block re-run whole: the full regime's transient, read in its terms (NOTE [Full terms of a re-run step]),
        # less what the re-runs hold less than a kept block, never more than that transient holds
        full = values["transient_full"]
        less = -_maximum(-_rerun_less(values, layout.rerun_keeps), -_maximum(full, 0.0))  # the smaller
        start = activation + _select(layout.every, lambda: full - less, values["transient"])
        start = start + back - rest_saved
        if parts is not None:
            start = _maximum(start, activation + back + parts - head_saved)
        # every block as recomputed, but those re-run whole by another treatment (NOTE [Treated peaks]): their own bytes
        apart = {g: {k: c for k, c in per.items() if k != RECOMPUTE and self.treatments[k].reruns} for g, per in layout.counts.items()}
        every = {g: {RECOMPUTE: n - sum(apart[g].values()), **apart[g]} for g, n in self.layouts.sizes.items()}
        recompute = self._activation(values, every) + values["transient_full"]
        held = 0
        for (g, name), n in layout.held.items():
            held = held + n * _maximum(0.0, _kept(values, g, name) - values[(g, RECOMPUTE)])
        recompute = (recompute + held) + self._in_flight(values, layout.offloaded_below, stashes)
        recompute = recompute - rest_saved - less
        recompute = _select(layout.rerun, lambda: recompute, -math.inf)
        part = 0.0
        for g, name in layout.part_reruns:  # NOTE [Treated peaks]: the largest return of a part re-run
            part = _maximum(part, values[(g, KEEP)] - _kept(values, g, name))
        return start, recompute, _maximum(_maximum(start + part, recompute), 0.0)  # no moment under static

    def parts_saved_bytes(self, key: tuple[int, int], plan: "Plan") -> int:
        """What ``plan``'s parts beside the blocks save at ``key`` against their untreated options (NOTE [Head in the peaks])."""
        tokens = key[0] * key[1]
        return int(sum(self.part_saving[kind](tokens, (name, param)) for kind, name, param in plan.parts if kind in self.part_saving))

    def _plan_peaks(self, key: tuple[int, int], plan: "Plan") -> tuple[Any, Any, Any]:
        shape = self.searched if self.searched is not None and self.searched.key == key else ShapePeaks(self, key)
        return shape.peaks(plan)

    def backward_start_bytes(self, key: tuple[int, int], plan: "Plan") -> float:
        """Peak above static at the start of backward (NOTE [Three peaks]); what plans lower."""
        return self._plan_peaks(key, plan)[0]

    def recompute_bytes(self, key: tuple[int, int], plan: "Plan") -> float:
        """Bound on the peak above static while backward re-runs ``plan``'s topmost re-run block."""
        return self._plan_peaks(key, plan)[1]

    def step_bytes(self, key: tuple[int, int], plan: "Plan") -> float:
        """Predicted step peak above static memory under ``plan``: the largest of the three."""
        return _maximum(self._plan_peaks(key, plan)[2], self.optimizer_bytes - self.step_saved)

    def plan_bytes(self, key: tuple[int, int], plan: "Plan") -> float:
        """The peak above static that ``plan`` decides: forward and backward's (NOTE [A plan fits what it decides])."""
        return self._plan_peaks(key, plan)[2]

    def activation_bytes(self, key: tuple[int, int], plan: "Plan") -> float:
        """Saved bytes of the whole step under ``plan`` (outside + every block)."""
        return self._activation(self._values(*key), self.layouts(plan).counts)

    def prefix_rows(self, n: int, ts: np.ndarray) -> "PrefixRows | None":
        """The plans that recompute the first blocks of a stack of one group, for every shape
        ``(n, t)`` of ``ts`` (what the planner's rows read: NOTE [Planning a row], planning.py);
        ``None`` for a stack of several groups."""
        if len(self.group_models) != 1:
            return None
        return PrefixRows(self, n, ts)

    def to_dict(self) -> dict:
        return {
            "groups": self.groups,
            "group_models": {str(g): m.to_dict() for g, m in self.group_models.items()},
            "outside": self.outside.to_dict(),
            "transient_full": self.transient_full.to_dict(),
            "transient_partial": self.transient_partial.to_dict(),
            "transient_parts": self.transient_parts.to_dict(), "parts_apart": self.parts_apart,
            "optimizer_bytes": self.optimizer_bytes,
            "max_key": list(self.max_key) if self.max_key else None,
            "bucket_tokens": self.bucket_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict, treatments: Mapping[str, Any] = TREATMENTS) -> "MemoryModel":
        model = cls(data["groups"], int(data.get("bucket_tokens", 1)), treatments)
        model.group_models = {int(g): BlockGroupModel.from_dict(m) for g, m in data["group_models"].items()}
        model.outside = Curve.from_dict(data["outside"])
        model.transient_full = Curve.from_dict(data["transient_full"])
        model.transient_partial = Curve.from_dict(data["transient_partial"])
        model.transient_parts = Curve.from_dict(data["transient_parts"]) if "transient_parts" in data else model.transient_parts
        model.parts_apart = bool(data.get("parts_apart", False))
        model.optimizer_bytes = float(data.get("optimizer_bytes", 0.0))
        model.max_key = tuple(data["max_key"]) if data.get("max_key") else None
        return model


def spread(model: "MemoryModel", key: tuple[int, int], name: str) -> list[int]:
    """The blocks whose copies out under ``name`` (a treatment that moves out) the forward hides one after another,
    walking up ``model``'s stack (NOTE [Spread stashes]); [] without a measured link or where ``name`` was never
    measured."""
    link, t = model.link, model.treatments.get(name)
    if getattr(link, "d2h", None) is None or t is None or not t.moves_out:
        return []
    per = {}  # per group: (forward ms, ms of its copy out), read once
    for g, m in model.group_models.items():
        moved = m.moved(name, t.moves_from, key) if m.measured(name) else 0.0
        per[g] = (max(m.ms[RECOMPUTE](key), 1e-6), moved / link.d2h if moved > 0 else None)
    end = sum(per[g][0] for g in model.groups)
    now, free, picks = 0.0, 0.0, []
    for i, g in enumerate(model.groups):
        now += per[g][0]
        out = per[g][1]
        if out is not None and free <= now and now + out <= end:
            picks.append(i)
            free = now + out
    return picks


class ShapePeaks:
    """The peaks of plans at one shape while a search plans it: :meth:`MemoryModel._peaks` over the curves read once.

    # NOTE [A search reads the curves once]
    A search plans one shape (plan/search.py): it asks the peaks of a dozen plans there (the need, each ask's mix,
    its leaner re-runs, the plan it returns), each of which read every curve at the shape (and the offload depth
    there), while nothing in the model changes. ``with ShapePeaks(model, key):`` makes the model's peaks at ``key``
    read them once and each plan's peaks once until it ends, with the very values and formula of a plan asked
    alone (NOTE [One evaluator]): the same floats. What the plan's parts beside the blocks save is asked each time
    and keys its peaks: a part may be priced anew while the search runs (the LM head's implementation, while the
    plans choose it: NOTE [The plans choose the implementation], chunked_head.py). The model must not change
    inside the block.
    """

    def __init__(self, model: MemoryModel, key: tuple[int, int]):
        self.model, self.key, self._outer, self.values = model, key, None, model._values(*key)
        self.depth: int | None = None  # the offload depth at the shape, read once inside the block
        self._peaks: dict[tuple, tuple[Any, Any, Any]] = {}

    def __enter__(self) -> "ShapePeaks":
        self.depth = self.model.offload_depth(self.key)  # before the model reads it from here
        self._outer, self.model.searched = self.model.searched, self
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.searched = self._outer

    def peaks(self, plan: "Plan") -> tuple[Any, Any, Any]:
        """``(backward start, recompute, step)`` above static of ``plan`` at this shape (:meth:`MemoryModel._peaks`)."""
        model, saved = self.model, self.model.parts_saved_bytes(self.key, plan)
        found = self._peaks.get(seen := (plan.blocks, plan.kinds, saved))
        if found is None:
            layout = model.layouts(plan)  # the model's, read only: the depth at this shape on a copy of its own
            if layout.offloaded:
                layout = dataclasses.replace(layout, depth=model.offload_depth(self.key) if self.depth is None else self.depth)
            found = self._peaks[seen] = model._peaks({**self.values, "parts_saved": saved} if saved else self.values, layout)
        return found


class PrefixRows:
    """Peaks of first-``count`` recompute plans over a row of shapes ``(n, t)``, one group:
    :meth:`MemoryModel.step_bytes`'s formula over arrays (NOTE [One evaluator]).

    Attributes:
        saving: per shape, the bytes one block's recompute frees (as ``MemoryModel.savings``).
        cost_ms: per shape, one block's recompute price (as ``MemoryModel.costs``).
    """

    def __init__(self, model: MemoryModel, n: int, ts: np.ndarray):
        self._model, self._shape = model, ts.shape
        (self._group, group), = model.group_models.items()
        self._values = model._values(n, ts)
        full, kept = self._values[(self._group, KEEP)], self._values[(self._group, RECOMPUTE)]
        self.saving = np.floor(np.maximum(0.0, full - kept)).astype(np.int64)
        self.cost_ms = np.maximum(group.ms[RECOMPUTE].values(n, ts), 1e-6)

    def peaks(self, count: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(backward start, the plan's peak)`` above static when the first ``count`` blocks (an int, or one per
        shape) are recomputed (the plan's peak: :meth:`MemoryModel.plan_bytes`)."""
        m = len(self._model.groups)
        count = np.broadcast_to(np.asarray(count, dtype=np.int64), self._shape)
        layout = _Layout({self._group: {RECOMPUTE: count, KEEP: m - count}}, {}, count > 0, count == m)
        start, _, step = self._model._peaks(self._values, layout)
        return start, step
