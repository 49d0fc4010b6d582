"""Memory and time model per block as a function of the shape key; fitting and refits.

Shape key: ``(N, T)`` — batch rows and tokens per row at the first block (sequence length
for text, patches for vision; see :func:`memfit.engine.shapes.shape_key`). Features are ``N``, ``N·T`` and
``N·T²``: activations of a transformer layer are linear in tokens, plus a quadratic
attention-score term that vanishes with fused attention and for windowed (Swin) attention;
``N`` alone covers per-row tensors (pooler, logits of a classification head).

Per *group* of identical blocks (same class, same parameter count) the model keeps:

* ``full_bytes``: bytes the block saves for backward when not checkpointed (measured by the
  warm-up probe, then by the live counter on every un-checkpointed step);
* ``kept_bytes``: bytes it keeps when checkpointed (its inputs);
* ``cost_ms``: its forward time, i.e. the recompute cost (measured by the probe).

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
then checked against all three.

# NOTE [Treated peaks]
A plan that gives some blocks ``selective`` or ``offload`` changes the three peaks so:
* each block holds, at the start of backward, what its treatment keeps on the device;
* ``offload`` brings a block back one block ahead in backward (NOTE [Offload],
  treatments.py): two offloaded blocks' moved bytes may be on the device at once, which the
  start of backward, and a recompute above them, hold on top;
* a ``selective`` block recomputes part of itself in backward, as a recomputed block does
  all of itself: the recompute peak is bounded from its topmost such block as from a
  recomputed one (with ``full``'s transient, a whole block's recompute), and the blocks
  below it hold what their treatments keep.
A plan that treats by recompute alone is predicted by the original arithmetic, bit for bit.

# NOTE [Treatment prices]
A treatment's price is the time it adds to a step: ``recompute``, the block's forward
(measured by the probe); ``selective``, the recompute of its unsaved ops (measured by the
probe under the selective cache); ``offload``, the part of moving its bytes out in forward
and back in backward that the neighbouring blocks' compute does not hide, from the link's
measured bandwidth (engine/probe.py).

# NOTE [Upper envelope]
Least squares under-predicts half of its samples. Every fitted curve of bytes is shifted up by
its largest positive residual, so it bounds every sample it was fitted on; out-of-sample
errors are caught by the margin (NOTE [Room] in planning.py).

# NOTE [Central prices]
The time curves (``cost_ms``, ``selective_ms``) only rank treatments against each other, and
bound nothing: they are plain least squares (no shift), keep the smallest of a key's samples
(a timing's noise only adds), and fit a line in tokens until six keys are seen. A shifted
quadratic through the three warm-up samples of a price of a few milliseconds interpolates their
noise, and the noise then chooses the treatment.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Curve", "curve_values", "BlockGroupModel", "MemoryModel"]


def _features(n: Any, t: Any, intercept: bool, quadratic: bool = True) -> list[Any]:
    """``[1,] N, N·T, N·T²`` (or ``[1,] N·T``) of floats, or of arrays of keys for a fit."""
    tokens = n * t
    f = [n, tokens, tokens * t] if quadratic else [tokens]
    return [1.0] + f if intercept else f


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
        if value is not None:
            return value
        if not self.xs:
            return 0.0
        if not self.coef:
            self._fit()
        tokens = key[0] * key[1]
        if self.floor is not None and tokens < self.min_tokens:  # NOTE [Sizes outside the samples]
            smallest = self._extreme_key(largest=False)
            value = self._memo[key] = self(smallest) * float(tokens) / float(smallest[0] * smallest[1])
            return value
        features = _features(float(key[0]), float(key[1]), self.intercept, self._quadratic)
        value = sum(c * f for c, f in zip(self.coef, features)) + self.shift
        value = value if self.floor is None else max(self.floor, value)
        if self.floor is not None and tokens > self.max_tokens:
            largest = self._extreme_key(largest=True)
            value = max(value, self(largest) * float(tokens) / float(largest[0] * largest[1]))
        self._memo[key] = value
        return value

    def _slots(self) -> tuple[list[float], float, float]:
        """Coefficients on the slots ``(1, N, N·T, N·T²)``, the shift and the floor, as
        :func:`curve_values` reads them (zeros for a curve without samples)."""
        if not self.xs:
            return [0.0] * 4, 0.0, -math.inf
        if not self.coef:
            self._fit()
        coef = list(self.coef)
        if not self.intercept:
            coef.insert(0, 0.0)
        if not self._quadratic:  # [1, N·T]
            coef = [coef[0], 0.0, coef[1], 0.0]
        return coef, self.shift, -math.inf if self.floor is None else self.floor

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


def curve_values(curves: Sequence[Curve], n: int, ts: np.ndarray) -> np.ndarray:
    """``curve((n, t))`` for each curve and every ``t`` of ``ts``: an array of
    ``len(curves) × len(ts)`` float64, with the very same arithmetic as ``Curve.__call__``.

    The sum runs over the feature slots ``1, N, N·T, N·T²`` in the order ``__call__`` sums a
    curve's features; a slot a curve lacks adds ``0.0``, which changes no finite float. One
    pass over every curve of a row costs a handful of numpy calls instead of a dozen per curve
    (NOTE [Planning a row] in planning.py).
    """
    slots = [c._slots() for c in curves]
    coef = np.array([s[0] for s in slots])
    tokens = float(n) * ts.astype(np.float64)
    value = np.zeros((len(curves), len(ts)))
    for j, feature in enumerate((1.0, float(n), tokens, tokens * ts)):
        value = value + coef[:, j : j + 1] * feature
    value = value + np.array([[s[1]] for s in slots])
    value = np.maximum(np.array([[s[2]] for s in slots]), value)
    all_tokens = n * ts
    for i, curve in enumerate(curves):  # NOTE [Sizes outside the samples]
        if curve.xs and curve.floor is not None:
            below, above = all_tokens < curve.min_tokens, all_tokens > curve.max_tokens
            if below.any():
                smallest = curve._extreme_key(largest=False)
                value[i, below] = curve(smallest) * all_tokens[below].astype(np.float64) / float(smallest[0] * smallest[1])
            if above.any():
                largest = curve._extreme_key(largest=True)
                scaled = curve(largest) * all_tokens[above].astype(np.float64) / float(largest[0] * largest[1])
                value[i, above] = np.maximum(value[i, above], scaled)
    return value


def _price_curve() -> Curve:
    """A curve of a treatment's time (NOTE [Central prices])."""
    return Curve(intercept=True, linear_until=6, envelope=False)


@dataclass
class BlockGroupModel:
    """Model of one group of identical blocks: bytes kept on the device under each treatment,
    and what each treatment costs (treatments.py)."""

    #: kept (every saved tensor)
    full_bytes: Curve = field(default_factory=Curve)
    #: recomputed: its inputs
    kept_bytes: Curve = field(default_factory=Curve)
    #: the forward's time: what a recompute costs (NOTE [Central prices])
    cost_ms: Curve = field(default_factory=_price_curve)
    #: selective: inputs and the matmul/attention outputs
    selective_bytes: Curve = field(default_factory=Curve)
    #: selective: the time of recomputing the rest
    selective_ms: Curve = field(default_factory=_price_curve)
    #: offloaded: the saved tensors too small to move
    offload_bytes: Curve = field(default_factory=Curve)

    def to_dict(self) -> dict:
        return {k: getattr(self, k).to_dict() for k in _GROUP_CURVES}

    @classmethod
    def from_dict(cls, data: dict) -> "BlockGroupModel":
        return cls(**{k: Curve.from_dict(v, envelope=k not in _PRICE_CURVES) for k, v in data.items() if k in _GROUP_CURVES})


_GROUP_CURVES = ("full_bytes", "kept_bytes", "cost_ms", "selective_bytes", "selective_ms", "offload_bytes")
_PRICE_CURVES = ("cost_ms", "selective_ms")
_RECOMPUTE, _SELECTIVE, _OFFLOAD = "recompute", "selective", "offload"


def _kinds(plan: Any) -> dict[int, str] | None:
    """Per treated block its treatment, or None when the plan treats by recompute alone
    (a tuple of block indices, or a :class:`~memfit.engine.planner.Plan` without kinds)."""
    kinds = getattr(plan, "kinds", ())
    return dict(zip(plan.blocks, kinds)) if kinds else None


class MemoryModel:
    """Predicts per-block savings and costs, and the step peak, from the shape key.

    Args:
        groups: for each block, the id of its group of identical blocks.
    """

    def __init__(self, groups: Sequence[int], bucket_tokens: int = 1):
        self.groups = list(groups)
        #: token granularity of the plan buckets this model is asked about (bucket_key)
        self.bucket_tokens = bucket_tokens
        self.group_models = {g: BlockGroupModel() for g in sorted(set(self.groups))}
        self._group_sizes = {g: self.groups.count(g) for g in self.group_models}
        self._every = tuple(range(len(self.groups)))
        self.outside = Curve()
        self.transient_full = Curve(intercept=True, floor=None, linear_until=6)
        self.transient_partial = Curve(intercept=True, floor=None, linear_until=6)
        #: largest optimizer-step peak above static memory seen (NOTE [Three peaks])
        self.optimizer_bytes = 0.0
        self.max_key: tuple[int, int] | None = None

    @property
    def ready(self) -> bool:
        return all(g.full_bytes.fitted and g.kept_bytes.fitted for g in self.group_models.values())

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
        self._group_sizes = {g: groups.count(g) for g in self.group_models}

    def observe_key(self, key: tuple[int, int]) -> None:
        if self.max_key is None or key[0] * key[1] > self.max_key[0] * self.max_key[1]:
            self.max_key = key

    def block_full(self, i: int, key: tuple[int, int]) -> float:
        return self.group_models[self.groups[i]].full_bytes(key)

    def block_kept(self, i: int, key: tuple[int, int]) -> float:
        return self.group_models[self.groups[i]].kept_bytes(key)

    def block_cost_ms(self, i: int, key: tuple[int, int]) -> float:
        return self.group_models[self.groups[i]].cost_ms(key)

    def block_bytes(self, i: int, key: tuple[int, int], kind: str) -> float:
        """What block ``i`` keeps on the device under treatment ``kind`` (its full bytes where
        the treatment's curve has no sample yet: no saving assumed)."""
        m = self.group_models[self.groups[i]]
        if kind == "keep":
            return m.full_bytes(key)
        if kind == _RECOMPUTE:
            return m.kept_bytes(key)
        curve = m.selective_bytes if kind == _SELECTIVE else m.offload_bytes
        return curve(key) if curve.fitted else m.full_bytes(key)

    def options(
        self, key: tuple[int, int], kinds: Sequence[str], offload_ms: Callable[[float, float], float] | None = None,
    ) -> list[list[tuple[str, int, float]]]:
        """Per block, each available treatment as ``(name, bytes saved, ms)`` (NOTE [Treatment prices]).

        Args:
            key: the shape.
            kinds: the treatments the run may give (``keep`` aside).
            offload_ms: the price of moving ``bytes`` out and back for a block whose forward
                takes ``ms`` (engine/probe.py's link model); offload is left out without it.
        """
        per_group = {}
        for g, m in self.group_models.items():
            full, fwd = m.full_bytes(key), max(m.cost_ms(key), 1e-6)
            choices = []
            if _RECOMPUTE in kinds:
                choices.append((_RECOMPUTE, int(max(0.0, full - m.kept_bytes(key))), fwd))
            if _SELECTIVE in kinds and m.selective_bytes.fitted and m.selective_ms.fitted:
                choices.append((_SELECTIVE, int(max(0.0, full - m.selective_bytes(key))), max(m.selective_ms(key), 1e-6)))
            if _OFFLOAD in kinds and offload_ms is not None and m.offload_bytes.fitted:
                moved = max(0.0, full - m.offload_bytes(key))
                choices.append((_OFFLOAD, int(moved), max(offload_ms(moved, fwd), 1e-6)))
            per_group[g] = choices
        return [per_group[g] for g in self.groups]

    def savings(self, key: tuple[int, int]) -> list[int]:
        per_group = {
            g: int(max(0.0, m.full_bytes(key) - m.kept_bytes(key))) for g, m in self.group_models.items()
        }
        return [per_group[g] for g in self.groups]

    def costs(self, key: tuple[int, int]) -> list[float]:
        per_group = {g: max(m.cost_ms(key), 1e-6) for g, m in self.group_models.items()}
        return [per_group[g] for g in self.groups]

    def transient(self, key: tuple[int, int], every_block: bool) -> float:
        """Transient bytes of a step (NOTE [Two transient regimes])."""
        partial = self.transient_partial
        use_partial = (
            not every_block
            and partial.distinct_keys >= 2
            and self.partial_covers(key[0] * key[1])
        )
        return (partial if use_partial else self.transient_full)(key)

    def partial_covers(self, tokens: Any) -> Any:
        """Whether ``tokens`` (``N·T``: an int, or an array of them) lie in the range the
        partial transient has seen.

        The range's top is its longest sample rounded up to its plan bucket: a range that
        ended at the longest sample itself would leave that sample's own bucket outside, with
        the full regime's guess (a block's worth too much) until a longer sample fell in it. A
        longer shape of that bucket is still planned with the partial curve, a few tokens past it.
        """
        partial = self.transient_partial
        return (partial.min_tokens <= tokens) & (tokens <= partial.max_bucket_tokens(self.bucket_tokens))

    def row(self, n: int, ts: np.ndarray) -> dict[str, np.ndarray] | None:
        """Per shape ``(n, t)`` for ``t`` in ``ts``, what planning a one-group stack needs.

        ``outside``, ``full`` and ``kept`` (one block's bytes), ``transient`` (of a partial
        plan: NOTE [Two transient regimes]), ``transient_full`` and ``cost_ms`` (one block's),
        as arrays computed exactly as the per-key methods compute them. ``None`` for a stack of several groups.
        """
        if len(self.group_models) != 1:
            return None
        (group,) = self.group_models.values()
        partial = self.transient_partial
        outside, full, kept, transient_full, partial_values, cost = curve_values(
            (self.outside, group.full_bytes, group.kept_bytes, self.transient_full, partial, group.cost_ms), n, ts
        )
        transient = transient_full
        if partial.distinct_keys >= 2:
            covered = self.partial_covers(n * ts)
            if covered.any():
                transient = np.where(covered, partial_values, transient_full)
        return {
            "outside": outside, "full": full, "kept": kept, "transient": transient, "transient_full": transient_full,
            "cost_ms": cost,
        }

    def backward_start_bytes(self, key: tuple[int, int], plan: Any = ()) -> float:
        """Peak above static at the start of backward (NOTE [Three peaks]); what plans lower.

        Offloaded blocks add what two of them bring back at once (NOTE [Treated peaks]).
        """
        kinds = _kinds(plan)
        if kinds is not None:
            return self.activation_bytes(key, plan) + self.transient(key, False) + self._in_flight(key, kinds, len(self.groups))
        every_block = len(set(plan)) == len(self.groups)
        return self.activation_bytes(key, plan) + self.transient(key, every_block)

    def _in_flight(self, key: tuple[int, int], kinds: dict[int, str], below: int) -> float:
        """Bytes of the two largest offloaded blocks under ``below``: the block in use and the
        one being brought back (NOTE [Treated peaks])."""
        moved = sorted(
            (self.block_full(i, key) - self.block_bytes(i, key, _OFFLOAD) for i, k in kinds.items() if k == _OFFLOAD and i < below),
            reverse=True,
        )
        return float(sum(moved[:2]))

    def recompute_bytes(self, key: tuple[int, int], plan: Any) -> float:
        """Bound on the peak above static while backward recomputes ``plan``'s topmost block."""
        kinds = _kinds(plan)
        if kinds is not None:
            remat = [i for i, k in kinds.items() if k in (_RECOMPUTE, _SELECTIVE)]
            if not remat:
                return -math.inf
            top = max(remat)
            held = sum(
                max(0.0, self.block_bytes(i, key, kinds.get(i, "keep")) - self.block_kept(i, key))
                for i in range(top) if kinds.get(i) != _RECOMPUTE
            )
            return self.activation_bytes(key, self._every) + self.transient_full(key) + held + self._in_flight(key, kinds, top)
        planned = set(plan)
        if not planned:
            return -math.inf
        top = max(planned)
        if len(planned) == top + 1:  # a run of first blocks: nothing un-checkpointed below
            return self.activation_bytes(key, self._every) + self.transient_full(key)
        below = self._count_per_group([i for i in range(top) if i not in planned])
        held = sum(n * max(0.0, self.group_models[g].full_bytes(key) - self.group_models[g].kept_bytes(key)) for g, n in below.items())
        return self.activation_bytes(key, self._every) + self.transient_full(key) + held

    def step_bytes(self, key: tuple[int, int], plan: Any = ()) -> float:
        """Predicted step peak above static memory under ``plan``: the largest of the three."""
        if _kinds(plan) is not None:
            backward = max(self.backward_start_bytes(key, plan), self.recompute_bytes(key, plan))
        elif len(set(plan)) == len(self.groups):
            backward = self.activation_bytes(key, plan) + self.transient_full(key)
        else:
            backward = max(self.backward_start_bytes(key, plan), self.recompute_bytes(key, plan))
        return max(backward, self.optimizer_bytes)

    def activation_bytes(self, key: tuple[int, int], plan: Any = ()) -> float:
        """Saved bytes of the whole step under ``plan`` (outside + every block)."""
        kinds = _kinds(plan)
        if kinds is not None:
            return self.outside(key) + sum(self.block_bytes(i, key, kinds.get(i, "keep")) for i in range(len(self.groups)))
        planned_per_group = self._count_per_group(plan)
        total = self.outside(key)
        for g, m in self.group_models.items():
            n_planned = planned_per_group.get(g, 0)
            total += n_planned * m.kept_bytes(key) + (self._group_sizes[g] - n_planned) * m.full_bytes(key)
        return total

    def _count_per_group(self, blocks: Sequence[int]) -> dict[int, int]:
        if len(self._group_sizes) == 1:  # one group (a homogeneous stack): just count
            return {self.groups[0]: len(set(blocks))} if blocks else {}
        counts: dict[int, int] = {}
        for i in set(blocks):
            g = self.groups[i]
            counts[g] = counts.get(g, 0) + 1
        return counts

    def to_dict(self) -> dict:
        return {
            "groups": self.groups,
            "group_models": {str(g): m.to_dict() for g, m in self.group_models.items()},
            "outside": self.outside.to_dict(),
            "transient_full": self.transient_full.to_dict(),
            "transient_partial": self.transient_partial.to_dict(),
            "optimizer_bytes": self.optimizer_bytes,
            "max_key": list(self.max_key) if self.max_key else None,
            "bucket_tokens": self.bucket_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "MemoryModel":
        model = cls(data["groups"], int(data.get("bucket_tokens", 1)))
        model.group_models = {int(g): BlockGroupModel.from_dict(m) for g, m in data["group_models"].items()}
        model.outside = Curve.from_dict(data["outside"])
        model.transient_full = Curve.from_dict(data["transient_full"])
        model.transient_partial = Curve.from_dict(data["transient_partial"])
        model.optimizer_bytes = float(data.get("optimizer_bytes", 0.0))
        model.max_key = tuple(data["max_key"]) if data.get("max_key") else None
        return model
