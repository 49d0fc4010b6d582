"""``chunked`` for the LM head: logits and loss a chunk of tokens at a time (engine/parts/head.py runs it),
and its options for the planner, priced per shape.

# NOTE [The head in the plan]
The LM head is a part beside the blocks (``HeadPart``, kind ``"head"``; NOTE [Parts beside the
blocks], plan/planner.py): its treatments (``keep``; ``chunked`` with a chunk count, NOTE [Head
bytes] in head.py) save bytes at the head's moment of the step and cost time like a block's. Each
head option is tried with the blocks' cheapest plan for what is still needed, and the cheapest sum
wins: so chunking the head is chosen over recomputing blocks only when it is cheaper, and the head
is kept when the blocks make room more cheaply. Ties go to the earlier option (keep first, then
chunk counts ascending: fewest chunks). A plan's ``option("head")`` is ``("keep", 1)`` or
``("chunked", n)``, None without a planned head.

# NOTE [Head options]
The planner (:func:`memfit.engine.plan.planner.plan_with_parts`) takes the head's options as
``(treatment, n_chunks, bytes saved, ms)`` relative to keeping the head. The bytes are the
head's peak at its moment of the step, ``saved + transient`` of :func:`head_saved_bytes`, kept
minus chunked; the time is ``extra_ms + per_chunk_ms * n_chunks`` (the caller's price of the
chunked head over keep at this shape, and what each further chunk adds: NOTE [Pricing the head]). Chunk counts are powers of two up to the batch's tokens (one token per chunk at
most); a count is offered only where it saves more than the count before it, and the counts
stop at the first doubling that saves less than ``MIN_CHUNK_GAIN_SHARE`` of the kept head's peak
more (each later one saves less still), so the options' bytes and times both rise and the
planner's tie rule picks the fewest chunks that fit. Each doubling saves about half what the one
before it did, while its launches double: without that floor a plan with no room left could
choose one-token chunks, seconds a step at long lengths to save a few megabytes over 64.

# NOTE [Pricing the head]
The chunked head costs time over keep (``pure`` recomputes each chunk's logits in backward; the
others compute the gradient in forward or run a fused kernel), and that time decides whether the
planner chunks the head or treats blocks to make the same room. So the first :data:`PROBE_STEPS`
warm-up steps time the head (:func:`memfit.engine.parts.head.probe_head`) on the body's real output, cut
to the probe's size (NOTE [A probe at the steps' size]), under each implementation usable here, at
:data:`PROBE_CHUNKS` chunks (a fused kernel at its own count only), each after an untimed run at
its shape (NOTE [A warm probe], head.py); a fused kernel at half the tokens too (NOTE [A fused
kernel's fixed part]). The probe of the most tokens is kept, and a later warm-up
step's probe of no more tokens is not run: the probe's size stops at :data:`PROBE_TOKENS`, which
a long batch passes at once, and a run of one length has one size, so timing every
implementation at each chunk count again would repeat a measurement the warm run already makes
steady: with four implementations installed, two dozen passes of the head at the probe's size
(keep and chunked, each warm then timed) a warm-up step. Within a step's probe keep is timed once per
size, beside the first chunked head timed there, and every other implementation and count reads it: keep
does not change with them, and timing it again for each took about a dozen more passes of the head (the
largest, its logits whole) at a new size; the implementations then compare by their chunked times
against one keep, its noise common to all. The price is a line: ``extra_ms_per_token x tokens +
per_chunk_ms x n_chunks``. The per-chunk slope is at least 0. The per-token price is at least 0
too where the probe ran on one chunk's rows: a head measured no slower chunked on a few hundred
tokens costs nothing, and the tie rule keeps it where nothing is needed, so plans stay
deterministic. Measured faster than keeping at the steps' size (NOTE [A probe at the steps'
size]), chunking is priced below keeping, and the planner chunks wherever that is the cheapest
mix, also where nothing is needed (where every implementation measured faster: docs/devlog.md). Until
the plans choose (NOTE [The plans choose the implementation]) the switch runs the one that keeps
least (NOTE [Warm-up's head keeps least]); its bytes are what :func:`head_options` prices. The
probe's gradients go to detached copies (``torch.autograd.grad``): training is untouched. An
installed kernel that raises when probed is said once and never used. Until the price is known the
head is free.

# NOTE [A kept head's retries]
A kept head's logits are a step's largest allocations (tokens x vocabulary, in float32 for the loss: gigabytes at
128k-256k vocabularies). At the tight end the long steps leave nearly the whole cap mapped, so the caching allocator
serves them from a free block at least as large, or by releasing its cache first (an allocator retry: a device sync,
every free page unmapped, and the rest of the step mapping pages again), and a larger batch that keeps the head needs
more. Such a retry cost a fifth to a third of a short step where keeping the head gained a few percent over chunking it
(docs/devlog.md, session 45). Nothing else prices it: the probe times the head with room to spare, and the room's
slack is one for every shape (NOTE [The slack is priced], room.py), whose price of a short step's retry, against
larger buckets' clean steps, reads 0. So once a steady step that kept the head had the allocator retry, the head is
not kept at as many tokens or more for the rest of the run (:class:`KeptRetries`): its options there are the chunked
ones (the planner takes any part's options as they come: NOTE [Parts beside the blocks], planner.py). Smaller batches
may still keep it, and a run whose head fits beside the cache never retries for it.

# NOTE [Warm-up's head keeps least]
Warm-up's steps run near the floor (NOTE [Warm-up on the floor], methods/dynamic.py), and the
implementations keep different bytes: ``pure_grad_in_forward`` holds a trained head weight's gradient
in float32 from forward to backward (vocabulary x hidden x 4 bytes), which a warm-up step run by it on
the floor may hold above the cap where ``pure`` or a fused kernel would fit (docs/devlog.md). So until
the plans choose, the head runs the implementation whose most chunks keep least at the probed step's
tokens (the fastest of those that keep as little: ``pure`` and ``pure_grad_in_forward`` on a frozen
weight). The few warm-up steps may run a slower head so; the plans then choose by cost. And where
a step on the floor runs out of memory with the head chunked by one that keeps more than that (the
plans chose it by a prediction that missed), it is not used again, the leanest runs from then on
and the step is replayed (:meth:`HeadPart.leaner`, ``PartKind.leaner``: NOTE [A replay treats
more], methods/dynamic.py).

# NOTE [The probe checks the formula]
What a chunked head keeps for backward is priced by formula (NOTE [Head bytes], head.py), which
knows each implementation's code as it was written; a kernel's next version may keep another dtype
or another tensor. The probe counts what each implementation saved (``probe_head``'s
``saved_bytes``), and where that differs from the formula at the probe's size by more than 1% of
the kept head's saved bytes, the difference is added to the formula's saved bytes for every size
(a constant: a weight gradient's dtype, a per-row buffer at the probe's size) and said once.
Priced as the code was, not as it runs, warm-up steps chunked by different implementations teach
the curves samples that disagree by the error, and a fit through them dips under the truth
between them: an under-prediction, an OOM (docs/devlog.md). Not on a head sharded as its own
FSDP unit: its probe runs a proxy of the local rows.

# NOTE [A probe at the steps' size]
A probe cut to one chunk's rows of a warm-up step (its ``keep`` then holds no more than the step's
own chunk does) runs a few hundred tokens, where launches and a fused kernel's fixed chunk count
decide the times: there Liger's fused cross-entropy was the slowest implementation, at 8-16k
tokens 2.4-3.3x faster than keeping the head (benchmarks/head_peaks.py, docs/devlog.md), and the
run chunked with a slower one. So where the meter counts the allocator's bytes and the budget is
known, the probe runs on the most tokens, up to the step's and :data:`PROBE_TOKENS`, whose kept head
fits in half of what the room has free at the head's moment (``free_bytes``), and never fewer than
one chunk's rows; a probe that runs out of memory there is run again at one chunk's rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from memfit.engine.parts.head import FUSED, HEAD_KEY, HeadSwitch, available_implementations, fused_chunks, head_saved_bytes, probe_head
from memfit.engine.budget import Budget, BudgetTooSmallError, format_bytes
from memfit.engine.parts.kind import PartKind, with_untreated
from memfit.engine.parts.treatments.base import KEEP, Treatment

if TYPE_CHECKING:
    from memfit.engine.parts.treatments.base import Block

__all__ = [
    "CHUNKED", "HEAD_MODES", "HEAD_LOGITS", "check_head_mode", "PROBE_STEPS", "PROBE_TOKENS", "PROBE_CHUNKS", "KeepHead",
    "KeptRetries",
    "ChunkedHead", "HeadPart", "RunHead", "head_options", "head_without_a_plan", "attach_head_part",
    "fused_line",
]

logger = logging.getLogger("memfit")

CHUNKED = "chunked"
#: warm-up steps whose head is timed (NOTE [Pricing the head])
PROBE_STEPS = 3
#: the most tokens a probe of the head runs on (NOTE [A probe at the steps' size])
PROBE_TOKENS = 8192
#: the chunk counts a probe times: the extra time at the fewest, the slope per chunk between them
PROBE_CHUNKS = (1, 4)
#: a chunk count is offered only if it saves this share of the kept head's peak over the count before it
MIN_CHUNK_GAIN_SHARE = 1 / 64
#: a batch makes the plans choose the implementation again where it has this many times the tokens of every shape
#: judged (NOTE [The plans choose the implementation]): a bounded number of choices, each a plan per shape and
#: implementation
JUDGED_GROWTH = 1.25


class KeepHead(Treatment):
    """The head as the model runs it: the whole ``tokens x vocab`` logits and their float32 loss."""

    name = KEEP
    help = "the LM head as the model runs it"
    parts = ("head",)
    order = 0


class ChunkedHead(Treatment):
    """The head's logits and loss a chunk of tokens at a time (NOTE [Chunk recomputed in backward], head.py)."""

    name = CHUNKED
    help = "the LM head's logits and loss a chunk of tokens at a time, never the whole float32 tokens x vocab"
    parts = ("head",)
    reruns = True
    order = 10

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        raise TypeError("the head's treatment is set on its HeadSwitch (engine/parts/head.py), not run as a block's")


@functools.lru_cache(maxsize=4096)  # pure, and asked for every peak a plan's evaluation reads (its saving)
def head_options(
    tokens: int, vocab: int, hidden: int, dtype: torch.dtype, extra_ms: float, per_chunk_ms: float,
    softcap: bool = False, implementation: str = "pure", transient: bool = True, logits_held: bool = True,
    weight_trains: bool = True, saved_gap: int = 0,
) -> tuple[tuple[str, int, int, float], ...]:
    """The head's options for one shape (NOTE [Head options]): keep first, then chunk counts ascending.
    ``transient`` False prices the saved bytes alone (logical accounting: its peaks hold no transient);
    ``logits_held``: the kept head's logits held through its backward (NOTE [Head bytes], head.py);
    ``weight_trains``: ``lm_head``'s weight trains (an implementation that takes gradients in forward holds its);
    ``saved_gap``: bytes the chunked head keeps beyond its formula, measured (NOTE [The probe checks the formula]).

    Example:
        >>> [o[:2] for o in head_options(8, 1000, 16, torch.float32, 1.0, 0.1)]
        [('keep', 1), ('chunked', 1), ('chunked', 2), ('chunked', 4), ('chunked', 8)]
    """
    kept = head_saved_bytes(tokens, vocab, hidden, dtype, KEEP, softcap=softcap, logits_held=logits_held)
    kept_peak = kept.saved_bytes + (kept.transient_bytes if transient else 0)
    out: list[tuple[str, int, int, float]] = [(KEEP, 1, 0, 0.0)]
    last_saved = 0
    n_chunks = 1
    if implementation in FUSED:  # the kernel's own chunk count, the only one (NOTE [Head bytes], head.py)
        n_chunks = fused_chunks(tokens, vocab, hidden)
    while True:
        n_chunks = min(n_chunks, max(1, tokens))
        chunked = head_saved_bytes(tokens, vocab, hidden, dtype, CHUNKED, n_chunks, softcap, implementation, weight_trains)
        saved = kept_peak - (max(0, chunked.saved_bytes + saved_gap) + (chunked.transient_bytes if transient else 0))
        if last_saved > 0 and saved < last_saved + MIN_CHUNK_GAIN_SHARE * kept_peak:
            return tuple(out)  # each later doubling saves less still
        if saved > last_saved:
            out.append((CHUNKED, n_chunks, int(saved), float(extra_ms + per_chunk_ms * n_chunks)))
            last_saved = saved
        if n_chunks >= tokens or implementation in FUSED:
            return tuple(out)
        n_chunks *= 2


def head_without_a_plan(options: tuple[tuple[str, int, int, float], ...]) -> tuple[str, int]:
    """The head a step whose plan names none runs (NOTE [A plan without a head]): among ``options``
    (:func:`head_options`), the fewest chunks that save 15/16 of the most any count saves; more save little.

    Example:
        >>> head_without_a_plan(head_options(2048, 32000, 64, torch.bfloat16, 0.0, 0.0))
        ('chunked', 16)
    """
    most = max(o[2] for o in options)
    return next(o[:2] for o in options if 16 * o[2] >= 15 * most)


# NOTE [The plans choose the implementation]
# The probe times each implementation's chunked head (NOTE [Pricing the head]), but they keep
# different bytes (NOTE [Head bytes], head.py): ``pure_grad_in_forward`` holds the weight's gradient
# in float32 from forward to backward, Cut Cross-Entropy holds neither it nor a chunk of logits.
# Under a budget that binds, bytes the head holds are bytes some block must free, so the fastest
# head can make the step slower: on Qwen2.5-1.5B's shape at 22 GiB, compiled, runs that chunked
# by ``pure_grad_in_forward`` (probed the fastest) recomputed 95% of the blocks where runs with
# Cut Cross-Entropy recomputed 84%, and took 8-10% longer a step (docs/devlog.md). So once the probes
# are done and the memory model can plan, each implementation is priced as the planner would run
# it: the sum over the probed steps' shapes of the cheapest plan of blocks and head, with its price
# line and bytes. The cheapest sum is run from then on (the fastest where the sums tie, as where
# nothing binds). Warm-up's batches may all be short, where nothing binds, so the longest batch
# seen is judged too where it has more tokens than every probed one, and a longer batch later makes
# the choice again (each step learns the head's bytes of the implementation it ran: NOTE [A
# chunked head's step in kept terms], learner.py). A shape where no plan fits is priced above every
# plan, by the bytes the most any plan saves leaves over the room: the head that holds less wins it.
# A choice plans every judged shape once per implementation, the planner's largest cost in a step,
# so a batch asks again only where it is at least ``JUDGED_GROWTH`` times the
# longest judged: a run meets at most log(longest / shortest) / log(1.25) choices, and a batch a few
# tokens longer than one judged, whose choice would hardly move, asks for none.


def undominated(names: list[str], offered: dict[str, list[tuple[tuple[str, int, int, float], ...]]]) -> list[str]:
    """``names`` (in the order that wins ties) less each one dominated by one before it: at every shape of ``offered``
    (per name, its :func:`head_options` per shape), every option of the later is matched by an option of the earlier
    that saves at least as many bytes for at most its time.

    # NOTE [A dominated implementation is not judged]
    Choosing the implementation plans every shape judged once per implementation (NOTE [The plans choose the
    implementation]), the planner's largest cost in a step. An implementation whose every option some earlier one matches or beats in bytes and time at every shape
    cannot have a cheaper plan there (any plan with its option has one as cheap with the earlier's) nor win a tie (the
    earlier wins ties): it is left out, and the choice is the same. With a frozen head weight ``pure`` keeps what
    ``pure_grad_in_forward`` keeps and is slower, for one.

    Example:
        >>> undominated(["a", "b"], {"a": [(("keep", 1, 0, 0.0), ("chunked", 4, 90, 1.0))],
        ...                          "b": [(("keep", 1, 0, 0.0), ("chunked", 4, 80, 2.0))]})
        ['a']
    """
    def covers(a: str, b: str) -> bool:
        return all(any(sa >= sb and ma <= mb for _, _, sa, ma in oa) for oa, ob in zip(offered[a], offered[b])
                   for _, _, sb, mb in ob)

    return [b for i, b in enumerate(names) if not any(covers(a, b) for a in names[:i])]


def fused_line(probe: dict[str, Any], vocab: int, hidden: int) -> tuple[float, float]:
    """A fused kernel's price line from its probes at two sizes (``probe`` and ``probe["half"]``):
    ``(ms per token, ms per chunk)`` over keeping the head, the fixed part priced per chunk of its own count.

    # NOTE [A fused kernel's fixed part]
    A fused kernel runs its own chunk count (:func:`memfit.engine.parts.head.fused_chunks`): Liger between
    half of ``vocab / hidden`` and that many whatever the tokens, and its chunks each read the whole weight
    twice and read and write its whole gradient: a fixed part of the head's time, the same at 2,000
    tokens as at 16,000. Timed at one size, the fixed part is spread over that size's tokens, and a
    probe that the room keeps short (a kept head must fit in half of it: NOTE [A probe at the steps'
    size]) prices every longer step several times too high, where the implementation is chosen (NOTE
    [The plans choose the implementation]). So a fused kernel is timed at the probe's tokens and at
    half of them (:func:`_probe_half`), and its price is the line through both: the intercept is its
    fixed part (at least 0; below, the larger size's time per token prices it as before), per chunk of
    its count at the probe's size, which is the count of every longer step. Its slope, the price per
    token over keeping the head, may be below 0: keeping grows with the tokens where such a kernel's
    time hardly does, so past some length it is the faster of the two.
    """
    full, half = probe, probe["half"]
    t1, t2 = full["tokens"], half["tokens"]
    e1, e2 = full["chunked"] - full["keep"], half["chunked"] - half["keep"]
    fixed = (e2 * t1 - e1 * t2) / (t1 - t2)
    if fixed <= 0:
        return e1 / t1, 0.0
    return (e1 - fixed) / t1, fixed / fused_chunks(int(t1), vocab, hidden)


def price_line(implementation: str, seen: dict[int, dict[str, Any]], vocab: int, hidden: int) -> tuple[float, float, float]:
    """``implementation``'s price line from its probes ``seen`` (per chunk count: NOTE [Pricing the head]): ms per token
    and per chunk over keeping the head, and the least ms per token it was timed at (how the implementations compare)."""
    counts = sorted(seen)
    extra = {n: seen[n]["chunked"] - seen[n]["keep"] for n in counts}
    slope = max(0.0, (extra[counts[-1]] - extra[counts[0]]) / (counts[-1] - counts[0])) if len(counts) > 1 else 0.0
    per_token = (extra[counts[0]] - slope * counts[0]) / seen[counts[0]]["tokens"]
    if implementation in FUSED and "half" in seen[counts[0]]:
        per_token, slope = fused_line(seen[counts[0]], vocab, hidden)
    if not seen[counts[0]].get("sized"):  # timed on one chunk's rows: no gain read from it
        per_token = max(0.0, per_token)
    # compared per token: an implementation probed again at one chunk's rows after an OOM (NOTE [A probe at the
    # steps' size]) was timed on fewer tokens than the others
    return per_token, slope, min(extra.values()) / seen[counts[0]]["tokens"]


def _probe_half(spec: Any, scale: float, h: torch.Tensor, y: torch.Tensor, n_chunks: int, implementation: str,
                kept: dict[int, dict[str, float]]) -> dict[str, float]:
    """A fused kernel's probe at half the probe's tokens (NOTE [A fused kernel's fixed part])."""
    half = h.shape[1] // 2
    measured = _measured(spec, h[:, :half], y[:, :half], n_chunks, implementation, kept)
    return {**_scaled_ms(measured, scale), "tokens": float(half)}


def _measured(spec: Any, h: torch.Tensor, y: torch.Tensor, n_chunks: int, implementation: str,
              kept: dict[int, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``probe_head``'s keep and chunked at ``h``'s size, keep timed at a size's first probe of the step and read
    by the others (``kept``, per size: NOTE [Pricing the head])."""
    size = int(h.shape[1])
    if size in kept:
        chunked = probe_head(spec, h, y, n_chunks, implementation, treatments=("chunked",))["chunked"]
        return {"keep": kept[size], "chunked": chunked}
    measured = probe_head(spec, h, y, n_chunks, implementation)
    kept[size] = measured["keep"]
    return measured


def _scaled_ms(measured: dict[str, dict[str, float]], scale: float) -> dict[str, float]:
    """A probe's keep and chunked times, scaled (a sharded head's proxy: NOTE [The head as its own FSDP unit])."""
    return {t: scale * measured[t]["ms"] for t in ("keep", "chunked")}


def shard_head(spec: "HeadSpec") -> tuple["HeadSpec", float]:
    """This rank's rows of ``lm_head``'s weight as a head of that many rows, and the vocabulary over
    the rows: what the warm-up's probe times where ``lm_head`` is an FSDP unit of its own (NOTE [The
    head as its own FSDP unit], head.py)."""
    from memfit.engine.parts.accounting import local

    lm_head = spec.lm_head
    weight = local(lm_head.weight).detach()
    proxy = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=lm_head.bias is not None, device="meta")
    proxy.weight = torch.nn.Parameter(weight, requires_grad=lm_head.weight.requires_grad)
    if lm_head.bias is not None:
        proxy.bias = torch.nn.Parameter(local(lm_head.bias).detach(), requires_grad=lm_head.bias.requires_grad)
    rows = max(1, weight.shape[0])
    return dataclasses.replace(spec, lm_head=proxy, vocab_size=rows), spec.vocab_size / rows


# NOTE [A step's head as it ran]
# A warm-up step may have run a chunk count that the options no longer offer: its plan was
# made before the probe chose another implementation (a fused kernel's own count, or pure's
# after it) or priced the counts. Its saving is still the kept head's bytes less the chunked
# head's, by formula (pure's at that count): taken as 0, the outside curve would learn the
# step without the kept head's bytes, and every later step would be predicted too low
# (docs/devlog.md).
#
# NOTE [A plan without a head]
# A plan made without the head (warm-up's, ``none``'s and ``full``'s, a replay's) runs the head
# chunked too, at :func:`head_without_a_plan`'s count: so warm-up's longest batches fit where a
# kept head would not, and what the step ran is what its plan says (the learner adds the saving
# back: NOTE [Head in the peaks]). ``memfit estimate`` estimates a chunked head at that count.


class KeptRetries:
    """The fewest tokens at which a steady step that kept the LM head made the allocator retry (NOTE [A kept head's
    retries]): the head is not kept at as many tokens or more."""

    def __init__(self):
        self.tokens: int | None = None

    def add(self, tokens: int) -> bool:
        """A steady step of ``tokens`` tokens kept the head and the allocator retried; True where the bound fell."""
        if self.tokens is not None and self.tokens <= tokens:
            return False
        self.tokens = int(tokens)
        return True

    def offered(self, tokens: int, options: tuple[tuple[str, int, int, float], ...]) -> tuple[tuple[str, int, int, float], ...]:
        """The head's ``options`` at ``tokens`` tokens without keeping it where a kept head retried at as few."""
        return options[1:] if self.tokens is not None and tokens >= self.tokens and len(options) > 1 else options


class HeadPart(PartKind):
    """The head as the planner and the controller see it, a part kind (parts/kind.py): its options per shape
    (NOTE [Head options]) and the switch a plan sets (``plan.option("head")``, NOTE [The head in the plan]).

    Args:
        switch: the model's head switch (:func:`memfit.engine.parts.head.attach_head`).
        extra_ms: the chunked head's time over keep, whatever the tokens.
        per_chunk_ms: what each chunk adds (0: the planner's tie rule picks the fewest chunks that fit).
        transient: price the head's transient bytes too (False under logical accounting: NOTE [Head options]).
        extra_ms_per_token: the chunked head's time over keep per token of the batch.
        free_bytes: what the room has free now, given the probe's device (None: not known; the probe
            then runs on one chunk's rows: NOTE [A probe at the steps' size]).
        aside: a context the probe runs in, its bytes not the step's (``Meter.aside``: NOTE [Work aside from the step]).

    Attributes:
        probes: per implementation and chunk count, the least ``keep`` and ``chunked`` times (ms)
            and the tokens they were timed on (NOTE [Pricing the head]).
        probed_steps: warm-up steps whose head was timed so far.

    Example:
        >>> part = HeadPart(attach_head(model))               # doctest: +SKIP
        >>> plan = plan_with_parts(blocks, [("head", part.options(n * l))], need)  # doctest: +SKIP
        >>> part.apply(plan.option("head"))                      # doctest: +SKIP
    """

    name, title, param_words = HEAD_KEY, "LM head", "chunks"
    floor_words = ("the LM head's logits and loss, in its most chunks", "lower --per_device_train_batch_size or --max_seq_length (its chunks grow with both)")
    moment_apart = property(lambda self: self.transient)  # its moment read apart where priced (NOTE [The parts' moment])

    def __init__(self, switch: HeadSwitch, extra_ms: float = 0.0, per_chunk_ms: float = 0.0, transient: bool = True,
                 extra_ms_per_token: float = 0.0, free_bytes: Callable[[torch.device], int | None] | None = None,
                 aside: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.switch, self.extra_ms, self.per_chunk_ms = switch, float(extra_ms), float(per_chunk_ms)
        self.extra_ms_per_token, self.transient = float(extra_ms_per_token), transient
        self.free_bytes, self.aside, self.kept_retries = free_bytes, aside, KeptRetries()
        #: how many times its price changed (warm-up's probes, the plans' choice): NOTE [Parts priced anew]; probed_steps
        self.priced = self.probed_steps = 0
        self.probes: dict[str, dict[int, dict[str, float]]] = {}
        #: implementations not used: one that raised when probed (NOTE [Pricing the head]), or kept more than the
        #: leanest where the floor ran out of memory (:meth:`leaner`)
        self.failed: set[str] = set()
        #: per implementation, bytes its chunked head kept beyond its formula (NOTE [The probe checks the formula])
        self.saved_gap: dict[str, int] = {}
        #: per implementation its price line (per token, per chunk, least per token), and the shapes the
        #: plans choose among them on (NOTE [The plans choose the implementation])
        self.lines: dict[str, tuple[float, float, float]] = {}
        self.keys: list[tuple[int, int]] = []
        self.chosen_by_plans = False

    def probe(self, hidden: torch.Tensor, labels: torch.Tensor | None) -> None:
        """Time the chunked head against keep on this step's body output, under every implementation
        usable here, and price the head from the least times so far (NOTE [Pricing the head])."""
        if labels is None:
            return  # the caller gave shifted labels only: nothing to cut a probe from
        self.probed_steps += 1
        self.keys.append((int(hidden.shape[0]), int(hidden.shape[1])) if hidden.dim() == 3 else (1, int(hidden.shape[0])))
        spec, scale = self.switch.spec, 1.0
        usable = available_implementations(spec, hidden.device)  # the real head's, whatever the probe times
        rows = hidden.detach().reshape(-1, hidden.shape[-1])
        cut = max(1, min(rows.shape[0], -(-rows.shape[0] // self.switch.n_chunks), PROBE_TOKENS))
        tokens = self._probe_tokens(rows.shape[0], cut, hidden.device)
        if self.switch.unit:  # no collective in a probe (NOTE [The head as its own FSDP unit], head.py)
            spec, scale = shard_head(spec)
        kept: dict[int, dict[str, float]] = {}  # keep's probe per size, timed once a step (NOTE [Pricing the head])
        with self.aside():  # its bytes are not the step's (NOTE [Work aside from the step], meter.py)
            for implementation in usable:
                if implementation in self.failed:
                    continue
                counts = (1,) if implementation in FUSED else PROBE_CHUNKS  # a fused kernel runs its own count
                try:
                    try:
                        seen = self._timed(spec, scale, rows, labels, tokens, counts, implementation, tokens > cut, kept)
                    except torch.OutOfMemoryError:
                        if tokens == cut:
                            raise  # the step's: replayed like any OOM in a forward
                        tokens = cut  # NOTE [A probe at the steps' size]
                        seen = self._timed(spec, scale, rows, labels, tokens, counts, implementation, False, kept)
                except torch.OutOfMemoryError:
                    raise
                except Exception as err:  # an installed kernel that fails here is not used (the pure path always runs)
                    if implementation == "pure":
                        raise
                    self.failed.add(implementation)
                    self.probes.pop(implementation, None)
                    logger.warning("memfit: the LM head's %s implementation failed when probed (%s); memfit does not use it",
                                   implementation, str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
                    continue
                self.probes[implementation] = seen
                self._check_formula(implementation, seen)
        self._price()

    def _probe_tokens(self, rows: int, cut: int, device: torch.device) -> int:
        """The probe's size: the most tokens, up to ``rows`` and :data:`PROBE_TOKENS`, whose kept head fits in
        half the room's free bytes, never fewer than ``cut`` (NOTE [A probe at the steps' size])."""
        free = self.free_bytes(device) if self.free_bytes is not None else None
        per_token = self._peak(1, KEEP)
        if not free or free <= 0 or per_token <= 0:
            return cut
        return max(cut, min(rows, PROBE_TOKENS, int(free // 2 // per_token)))

    def _timed(self, spec: Any, scale: float, rows: torch.Tensor, labels: torch.Tensor, tokens: int,
               counts: tuple[int, ...], implementation: str, sized: bool, kept: dict[int, dict]) -> dict[int, dict[str, float]]:
        """``implementation``'s probes at ``tokens`` tokens (``sized``: more than one chunk's rows), merged
        with those kept: the most tokens win, and a size probed already is not run again (NOTE [Pricing the head])."""
        # the probe's rows in a storage of their own: a view of the step's would be counted whole as saved
        h = (rows[:tokens].clone() if tokens < rows.shape[0] else rows).unsqueeze(0)
        y = labels.reshape(-1)[:tokens].unsqueeze(0)
        if self.switch.unit:
            y = torch.where(y >= 0, y % spec.vocab_size, y)
        seen: dict[int, dict[str, float]] = {}
        for n_chunks in sorted({min(n, tokens) for n in counts}):
            was = self.probes.get(implementation, {}).get(n_chunks)
            if was is not None and was["tokens"] >= tokens:
                seen[n_chunks] = was  # a probe of as many tokens or more prices the steps as well: none is run
                continue
            measured = _measured(spec, h, y, n_chunks, implementation, kept)
            timed = _scaled_ms(measured, scale)
            seen[n_chunks] = {"keep": timed["keep"], "chunked": timed["chunked"], "tokens": float(tokens), "sized": sized,
                              "saved": measured["chunked"]["saved_bytes"], "kept_saved": measured["keep"]["saved_bytes"]}
            if implementation in FUSED and sized and tokens > 1:  # NOTE [A fused kernel's fixed part]
                seen[n_chunks]["half"] = _probe_half(spec, scale, h, y, n_chunks, implementation, kept)
        return seen

    def _check_formula(self, implementation: str, seen: dict[int, dict[str, float]]) -> None:
        """What the chunked head kept beyond its formula at the probe's size, kept where it passes 1% of
        the kept head's saved bytes (NOTE [The probe checks the formula])."""
        probe = seen[n_chunks := min(seen)]
        if self.switch.unit or "saved" not in probe or probe["kept_saved"] <= 0:
            return  # a sharded head's proxy, or nothing measured
        tokens = int(probe["tokens"])
        formula = self._bytes(tokens, CHUNKED, n_chunks, implementation, gap=False).saved_bytes
        gap = int(probe["saved"] - formula)
        if abs(gap) <= 0.01 * max(probe["kept_saved"], 1.0):
            self.saved_gap.pop(implementation, None)
            return
        if implementation not in self.saved_gap:
            logger.debug("memfit: the LM head chunked by %s kept %s for backward at %d tokens where memfit's formula says "
                         "%s; planned with the measured bytes", implementation, format_bytes(int(probe["saved"])), tokens, format_bytes(formula))
        self.saved_gap[implementation] = gap

    def _price(self) -> None:
        """Every implementation's price line from the probes so far (NOTE [Pricing the head]), kept for the plans to
        choose among (NOTE [The plans choose the implementation]); until they do, the leanest runs."""
        lines = {name: price_line(name, seen, self.switch.spec.vocab_size, self.switch.spec.weight.shape[-1])
                 for name, seen in self.probes.items()}
        if not lines:
            return
        self.lines = lines
        best = self.leanest(self.keys[-1][0] * self.keys[-1][1])  # NOTE [Warm-up's head keeps least]
        self.extra_ms_per_token, self.per_chunk_ms = lines[best][:2]
        self.extra_ms, self.switch.implementation = 0.0, best
        self.priced += 1  # NOTE [Parts priced anew] (planning.py)
        if self.probed_steps == PROBE_STEPS:
            logger.debug("memfit: the LM head chunked (%s) costs %.4f ms per 1k tokens and %.4f ms per chunk over keeping it",
                        best, 1e3 * self.extra_ms_per_token, self.per_chunk_ms)

    def budget_share(self, tokens: int, size: Callable[[float], str]) -> tuple[float, float, str]:
        """The head's bytes kept and in its most chunks, from its formula (NOTE [The head's bytes in a budget error])."""
        kept, least, n = self.head_bytes(tokens)
        return kept, least, f"the LM head in {n} chunks (the head takes {size(least)} so, {size(kept)} kept)"

    def recover_in_step(self, note: "Callable[[str, str], None] | None") -> None:
        """While ``note`` is set, an OOM in the head's loss computes it again in its most chunks (NOTE [Replay under FSDP])."""
        self.switch.on_oom = note and (lambda message, tokens: note(message, "the LM head") or self.head_bytes(tokens)[2])

    def choose_by_plans(self, plan_ms: Callable[[tuple[int, int]], float | None], key: tuple[int, int] | None = None,
                        shape: Callable[[tuple[int, int]], tuple[int, int]] = lambda k: k) -> bool:
        """Run the implementation whose plans cost least (``plan_ms``: a shape's, None where not known yet) over the probed
        shapes and ``key``, the longest seen (``shape``: where each is planned); True once chosen (NOTE [The plans choose
        the implementation])."""
        if key is not None and self.keys and key[0] * key[1] >= JUDGED_GROWTH * max(b * n for b, n in self.keys):
            self.keys.append(tuple(key))
            self.chosen_by_plans = False
        if self.chosen_by_plans or self.probed_steps < PROBE_STEPS or not self.lines:
            return self.chosen_by_plans
        was = (self.switch.implementation, self.extra_ms_per_token, self.per_chunk_ms)
        fastest = sorted((name for name in self.lines if name not in self.failed), key=lambda name: self.lines[name][2])
        offered = {}
        for name in fastest:  # each one's options as priced by its own line, at every shape judged
            self.switch.implementation, (self.extra_ms_per_token, self.per_chunk_ms) = name, self.lines[name][:2]
            offered[name] = [self.options(b * n) for b, n in map(shape, self.keys)]
        fastest = undominated(fastest, offered)  # NOTE [A dominated implementation is not judged]
        totals: dict[str, float] = {}
        for name in fastest:
            self.switch.implementation, (self.extra_ms_per_token, self.per_chunk_ms) = name, self.lines[name][:2]
            costs = [plan_ms(shape) for shape in self.keys]
            if any(c is None for c in costs):
                self.switch.implementation, self.extra_ms_per_token, self.per_chunk_ms = was
                return False
            totals[name] = float(sum(costs))
        best = min(fastest, key=lambda name: totals[name])  # the fastest first: it wins ties
        self.switch.implementation = best
        self.extra_ms_per_token, self.per_chunk_ms = self.lines[best][:2]
        self.chosen_by_plans = True
        if best != was[0]:
            logger.debug("memfit: the LM head chunked by %s from now on: its plans over %d shapes cost %.1f ms, %.1f ms with %s",
                        best, len(self.keys), totals[best], totals.get(was[0], float("nan")), was[0])  # nan: dominated
        self.priced += 1  # the plans cached before are stale (NOTE [Parts priced anew], planning.py)
        return True

    def options(self, tokens: int, implementation: str | None = None) -> tuple[tuple[str, int, int, float], ...]:
        """The head's options for a batch of ``tokens`` tokens (``batch x length``), chunked by ``implementation``
        (None: the one the switch runs), priced by its price line; not kept where NOTE [A kept head's retries] says."""
        spec, implementation = self.switch.spec, implementation or self.switch.implementation
        weight = spec.weight
        return self.kept_retries.offered(tokens, head_options(
            tokens, spec.vocab_size, weight.shape[-1], weight.dtype, self.extra_ms + self.extra_ms_per_token * tokens,
            self.per_chunk_ms,
            softcap=spec.softcap is not None, implementation=implementation, transient=self.transient,
            logits_held=self.switch.logits_held, weight_trains=weight.requires_grad,
            saved_gap=self.saved_gap.get(implementation, 0),
        ))

    def leanest(self, tokens: int) -> str:
        """Of the implementations probed and in use (else the switch's), the one that keeps least at ``tokens`` tokens
        (NOTE [Warm-up's head keeps least])."""
        names = [name for name in self.lines if name not in self.failed] or [self.switch.implementation]
        most = {name: max(option[2] for option in self.options(tokens, name)) for name in names}
        return min(names, key=lambda name: (-most[name], self.lines[name][2] if name in self.lines else 0.0))

    def leaner(self, tokens: int) -> bool:
        """The floor ran out of memory at ``tokens`` tokens: the head runs its leanest from now on, the one it ran never
        again; True where that changed it (NOTE [Warm-up's head keeps least])."""
        lean, was = self.leanest(tokens), self.switch.implementation
        if lean == was:
            return False
        self.failed.add(was)  # the plans no longer choose it (choose_by_plans)
        self.switch.implementation = lean
        self.extra_ms_per_token, self.per_chunk_ms = self.lines[lean][:2] if lean in self.lines else (0.0, 0.0)
        self.priced += 1  # NOTE [Parts priced anew] (planning.py)
        logger.warning("memfit: the floor ran out of memory with the LM head chunked by %s; it is chunked by %s from "
                       "now on, which keeps less", was, lean)
        return True

    def head_bytes(self, tokens: int) -> tuple[int, int, int]:
        """The head's peak bytes at ``tokens`` tokens kept, and at its most chunks with that count
        (``saved + transient`` of :func:`head_saved_bytes`, the transient where the meter sees it):
        what a budget error or warning names (NOTE [The head's bytes in a budget error])."""
        kept_bytes = self._peak(tokens, KEEP)
        _, n_chunks, saved, _ = max(self.options(tokens), key=lambda o: o[2])
        return kept_bytes, kept_bytes - saved, n_chunks

    def _peak(self, tokens: int, treatment: str, n_chunks: int = 1) -> int:
        """The head's peak at ``tokens`` tokens by formula (``pure`` where chunked): ``saved + transient``,
        the transient where the meter sees it, the kept logits where the caller holds the outputs."""
        bytes_ = self._bytes(tokens, treatment, n_chunks)
        return bytes_.saved_bytes + (bytes_.transient_bytes if self.transient else 0)

    def _bytes(self, tokens: int, treatment: str, n_chunks: int = 1, implementation: str = "pure", gap: bool = True) -> Any:
        """This head's :func:`head_saved_bytes` at ``tokens`` tokens, with what the probe measured beyond its
        saved bytes (``gap``: NOTE [The probe checks the formula])."""
        spec, weight = self.switch.spec, self.switch.spec.weight
        out = head_saved_bytes(tokens, spec.vocab_size, weight.shape[-1], weight.dtype, treatment, max(1, n_chunks),
                               spec.softcap is not None, implementation, weight.requires_grad, self.switch.logits_held)
        extra = self.saved_gap.get(implementation, 0) if gap and treatment == CHUNKED else 0
        return dataclasses.replace(out, saved_bytes=max(0, out.saved_bytes + extra)) if extra else out

    def saved_bytes(self, tokens: int, head: tuple[str, int] | None) -> int:
        """What ``head`` (a plan's, NOTE [The head in the plan]) saves at ``tokens`` tokens against
        keeping the head: what the memory model takes off the step's peaks (NOTE [Head in the peaks], model.py)."""
        if head is None or head[0] == KEEP:
            return 0
        offered = next((saved for name, n, saved, _ in self.options(tokens) if (name, n) == tuple(head)), None)
        if offered is not None:
            return offered
        return max(0, self._peak(tokens, KEEP) - self._peak(tokens, CHUNKED, head[1]))  # NOTE [A step's head as it ran]

    def transient_saved_bytes(self, tokens: int, head: tuple[str, int] | None) -> int:
        """The part of :meth:`saved_bytes` that is the heads' transients (the kept head's backward less the chunks' work,
        negative where a chunk holds more), the rest being the kept head's saved logits less the chunked head's saved
        rows (NOTE [A chunked head's step in kept terms], learner.py). 0 where transients are not priced (logical accounting)."""
        if head is None or head[0] == KEEP or not self.transient:
            return 0
        offered = any((name, n) == tuple(head) for name, n, _, _ in self.options(tokens))
        implementation = self.switch.implementation if offered else "pure"  # as saved_bytes priced it
        kept, chunked = self._bytes(tokens, KEEP), self._bytes(tokens, CHUNKED, head[1], implementation)
        return int(kept.transient_bytes - chunked.transient_bytes)

    def untreated(self, tokens: int) -> tuple[str, int]:
        """What a step whose plan names no head runs: chunked (NOTE [A plan without a head])."""
        return head_without_a_plan(self.options(max(1, tokens)))

    def apply(self, option: tuple[str, int] | None) -> None:
        """Set the switch to ``option`` (a plan's ``head``; None, a plan without one, leaves it as it is)."""
        if option is not None:
            self.switch.set(option[0], option[1], self.switch.implementation)

    def apply_step(self, decision: Any, key: tuple[int, int]) -> Any:
        """A step's decision (its shape ``key``), fixed at its first block, with the head's treatment set
        and named in its plan (NOTE [A plan without a head])."""
        plan = decision.plan
        if decision.warmup and self.probed_steps < PROBE_STEPS:
            self.switch.probe = self.probe  # NOTE [Pricing the head]
        decision = dataclasses.replace(decision, plan=with_untreated(plan, [self], key[0] * key[1]))
        self.apply(decision.plan.option(HEAD_KEY))
        return decision

    def remove(self) -> None:
        """Take the switch's hooks off the model."""
        self.switch.remove()


#: what ``memfit.fit(head=...)`` takes
HEAD_MODES = ("auto", True, False)
#: what ``memfit.fit(head_logits=...)`` takes (NOTE [How the chunked head hooks into the model], head.py, Rule 3)
HEAD_LOGITS = ("drop", "detached")


def check_head_mode(head: Any, logits: Any = "drop") -> None:
    """Raises ValueError naming the argument unless ``head`` is one of :data:`HEAD_MODES` and ``logits``
    one of :data:`HEAD_LOGITS`."""
    if not any(head is mode or (isinstance(mode, str) and head == mode) for mode in HEAD_MODES):
        raise ValueError(f"head={head!r}: give 'auto' (plan the LM head where memfit recognises it), True (plan it, or "
                         "raise where it cannot) or False (leave it to the model)")
    if logits not in HEAD_LOGITS:
        raise ValueError(f"head_logits={logits!r}: give 'drop' (no logits where the head is chunked) or 'detached' "
                         "(computed without grad, tokens x vocab in the model's dtype)")


def attach_head_part(
    model: torch.nn.Module, planning: Any, transient: bool, mode: bool | str = True, plans: bool = True,
    logits: str = "drop", aside: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> tuple[HeadPart | None, str]:
    """``memfit.fit(..., head=mode)``: the model's head as a planned part (or None) and the words the
    start line says of the head.

    # NOTE [The head by default]
    The default is ``"auto"``: a causal LM's head is planned wherever memfit can plan it, as
    every block is. A step that chunked the head teaches the memory model less than one that
    kept it (NOTE [A chunked head's step teaches less], learner.py), so later steps are not
    over-predicted; ``False`` (``--memfit_head keep``) leaves the head to the model.
    ``head="auto"`` plans the head wherever :func:`memfit.engine.parts.head.find_head`
    recognises a causal LM's head, the method plans per batch from its memory model (``plans``:
    ``dynamic``, ``static``) under a budget; otherwise the model keeps its head and the start line
    says why. A model sharded by FSDP2 plans it too: where ``lm_head``'s parameters belong to the
    root's unit they are gathered for the root's forward and, before its backward, by FSDP's hook
    on the root's output (memfit's loss), so each chunk's recompute reads the whole weight and its
    gradient reaches the root's reduce-scatter like the model's own; where ``lm_head`` is a unit of
    its own, NOTE [The head as its own FSDP unit] (head.py). A training forward
    without ``labels`` (the caller computes the loss from the logits) drops the head from the plans
    for the rest of the run, said once (:meth:`RunHead.leave`). ``True`` plans it whatever
    the method, and raises where memfit cannot: under a method that does not plan per batch
    (``none``, ``full``) each step's plan names no head, so every step chunks it (NOTE [A plan
    without a head]), as ``memfit estimate --advise`` ranks such a setup; ``False`` leaves it to the model, and the
    over-budget warning then names ``head="auto"`` where the head's logits dominate.

    The part's options are priced by :func:`head_saved_bytes` (``transient``: the meter's peaks hold
    transients), its time by warm-up's probes (NOTE [Pricing the head]), free until then;
    ``planning`` plans with it from now on; the probes run in ``aside`` (the meter's: NOTE [Work aside from
    the step], meter.py).

    Raises:
        ValueError: ``mode`` True and the head cannot be planned (the message says why and names ``head``).
    """
    from memfit.engine.parts.head import HeadNotFound, HeadSwitch, find_head

    if mode is False:
        return None, "LM head kept (plan it per batch: head='auto', --memfit_head auto)"
    if mode == "auto" and not plans:
        return None, "LM head kept (the method does not plan per batch under a budget)"
    try:
        switch = HeadSwitch(find_head(model), logits=logits)
    except HeadNotFound as reason:
        if mode is True:
            raise ValueError(f"head=True: {reason}; pass head='auto' or head=False") from None
        return None, f"LM head kept ({reason})"
    part = HeadPart(switch, transient=transient,
                    free_bytes=room_free_bytes(planning) if transient else None, aside=aside)
    planning.add_part(part)
    if not plans:  # none, full: their plans name no head, so every step chunks it (NOTE [A plan without a head])
        return part, "LM head chunked on each step whose plan does not keep it (the method does not plan it per batch)"
    return part, "LM head planned per batch (kept, or its logits and loss chunked)"


def room_free_bytes(planning: Any) -> Callable[[torch.device], int | None]:
    """What the room has free on a CUDA device now (None elsewhere or without a budget): the probe's size
    reads it (NOTE [A probe at the steps' size])."""
    def free(device: torch.device) -> int | None:
        if planning.budget_bytes is None or torch.device(device).type != "cuda":
            return None
        return int(planning.room.free_bytes - torch.cuda.memory_allocated(device))
    return free


def evaluation_chunks(tokens: int, vocab: int, size: int, free: int | None) -> tuple[int, bool]:
    """How a forward that does not train computes its loss (NOTE [The head in evaluation], head.py): the chunk count
    (0: the model's own head, where ``tokens x vocab x (size + 8)`` fit ``free``) and whether its logits are made. Each
    chunk's float32 bytes (its upcast and ``log_softmax``'s output, with its logits in ``size`` where they are not made
    whole) are kept to half of what is left; the logits are made where they and a chunk of one row fit."""
    logits = tokens * vocab * size
    if free is None or logits + tokens * vocab * 8 <= free:
        return 0, True
    with_logits = logits + 2 * vocab * 8 <= free
    left, per_logit = (free - logits, 8) if with_logits else (free, size + 8)
    return min(tokens, max(1, -(-2 * tokens * vocab * per_logit // max(1, left)))), with_logits


class RunHead:
    """The run's LM head as the controller sees it: the planned part or None, what the start line
    says of it, and each step's decision with the head's treatment set (NOTE [The head by default]).

    Args:
        model: the hooked model.
        planning: the run's planning (it plans with the part).
        transient: whether the meter's peaks hold the head's transient bytes (not under logical accounting).
        mode: ``fit``'s ``head``; logits: ``fit``'s ``head_logits``.
        plans: whether the method plans per batch under a budget (``auto`` plans the head only then).
        aside: the context warm-up's head probes run in (the meter's :meth:`~memfit.engine.run.meter.Meter.aside`).

    Attributes:
        part: the :class:`HeadPart`, or None where the model keeps its head.
        words: what the start line says of the head (planned, or why it is kept).

    Raises:
        ValueError: a bad ``mode`` or ``logits``, or ``mode`` True where memfit cannot plan the head.
    """

    def __init__(self, model: torch.nn.Module, planning: Any, transient: bool, mode: bool | str, logits: str, plans: bool,
                 aside: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        check_head_mode(mode, logits)
        self.model, self.planning = model, planning
        self.part, self.words = attach_head_part(model, planning, transient, mode, plans, logits, aside)
        self._switch = None if self.part is None else self.part.switch
        self._said_evaluation = False
        if self._switch is not None:
            self._switch.on_left_to_caller = self.leave
            if transient:
                self._switch.on_evaluation, self._free = self.evaluation, room_free_bytes(planning)

    def start_words(self) -> str:
        """What the start line adds of the head: ``", <words>"`` for a causal LM, nothing for other models."""
        model = self.model
        causal = self.part is not None or type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")) or hasattr(model, "peft_config")
        return f", {self.words}" if causal else ""

    def evaluation(self, tokens: int) -> tuple[int, bool]:
        """How a forward that does not train computes its loss (:func:`evaluation_chunks` with what the room has free
        now); said once where its logits are not made (NOTE [The head in evaluation], head.py)."""
        spec = self._switch.spec
        n_chunks, logits = evaluation_chunks(tokens, spec.vocab_size, spec.weight.dtype.itemsize, self._free(spec.weight.device))
        if n_chunks and not logits and not self._said_evaluation:
            self._said_evaluation = True
            logger.warning("memfit: an evaluation forward of %d tokens computes its loss in %d chunks, without logits: "
                           "its %s of logits do not fit the budget's room (outputs.logits is None from here on where they "
                           "do not fit; a Trainer evaluates its loss alone, as without compute_metrics)", tokens, n_chunks,
                           format_bytes(tokens * spec.vocab_size * spec.weight.dtype.itemsize))
        return n_chunks, logits

    def leave(self) -> None:
        """A training forward without labels (the caller computes the loss; called by the switch before the
        body runs): the head leaves the plans for the rest of the run, said once."""
        if self.part is None:
            return
        self._switch.on_left_to_caller = None
        self._switch.set("keep")  # a later forward with labels: the model's own loss, bitwise
        self.part, self.words = None, "LM head kept (the model is called without labels: the caller computes the loss)"
        self.planning.remove_part(HEAD_KEY)
        logger.warning("memfit: the model is called without labels (its loss is computed outside it), so memfit leaves "
                       "the LM head to the caller and counts its bytes with the rest of the step")

    def decide(self, decision: Any, key: tuple[int, int]) -> Any:
        """``decision`` with the head's treatment set (:meth:`HeadPart.apply_step`), after checking that the
        static part (the optimizer state still to come in it: NOTE [Static at the step's peak], meter.py) and the least
        head fit the budget
        (:meth:`check_fits`); as it is without a planned head."""
        if self.part is None:
            return decision
        decision = self.part.apply_step(decision, key)
        self.check_fits(key[0] * key[1], self.planning.static_bytes - self.planning.weights.most_saved, self.planning.budget)
        return decision

    def check_fits(self, tokens: int, static_bytes: int, budget: Budget | None) -> None:
        """Raise the one-line budget error where the static part and the head at its most chunks
        alone exceed the budget (NOTE [The head's bytes in a budget error]).

        # NOTE [The head's bytes in a budget error]
        No plan makes a step smaller than its static part plus the head at its most chunks (every
        block's activations aside). Where those two already exceed the budget, no replay can help,
        so the step's first block raises at once, naming the head's bytes chunked and kept and what
        to change; a warning on a step that does not fit names them too (planning.py).

        Raises:
            BudgetTooSmallError: ``static_bytes`` + the head's least bytes exceed ``budget``.
        """
        if budget is None or self.part is None:
            return
        kept, least, n_chunks = self.part.head_bytes(tokens)
        if static_bytes + least <= budget.bytes:
            return
        size = budget.size
        raise BudgetTooSmallError(
            f"memory budget {budget} is below what a step of {tokens} tokens needs before any block's activation: "
            f"the static part {size(static_bytes)} (weights, gradients, optimizer state) and the LM head's logits and "
            f"loss {size(least)} in {n_chunks} chunks ({size(kept)} kept). Raise {budget.name} above "
            f"{size(static_bytes + least)}, or lower --per_device_train_batch_size or --max_seq_length (the head grows "
            "with the tokens)"
        )

    def record(self, record: Any, plan: Any) -> None:
        """What a step's record says of the head: its label under ``treatments["head"]`` and, where it
        ran chunked, the implementation (NOTE [The head in a record], records.py); nothing without a
        planned head (a plan that names one, from a method that does not plan the head, ran it kept: not said)."""
        head = plan.option(HEAD_KEY)
        if self.part is None or head is None:
            return
        record.treatments[HEAD_KEY] = plan.part_labels()[HEAD_KEY]
        if head[0] == CHUNKED and self._switch is not None:
            record.implementations[HEAD_KEY] = self._switch.implementation
        elif head[0] == KEEP and record.alloc_retries and record.phase == "steady" and self.part.kept_retries.add(record.tokens):
            self.part.priced += 1  # NOTE [A kept head's retries]; the plans cached before are stale (NOTE [Parts priced anew])
            logger.debug("memfit: a step of %d tokens kept the LM head and the allocator released its cache to serve it; "
                         "the head is chunked at %d tokens or more from now on", record.tokens, record.tokens)

    def remove(self) -> None:
        """Take the head's hooks off the model (they stay on, inert, after :meth:`leave`, until now)."""
        if self._switch is not None:
            self._switch.remove()
