"""Treatments: what a part does with its saved activations in one step, one file each, and
the registry that names them.


A plan gives every block one treatment; the block runs it at its next training forward
(NOTE [Switch is read at call time] in blocks.py):

| name        | forward                                   | kept on the device for backward         | backward                   |
| ----------- | ----------------------------------------- | --------------------------------------- | -------------------------- |
| `keep`      | plain                                     | everything it saves                     | plain                      |
| `recompute` | under ``torch.utils.checkpoint``          | its inputs                              | the block runs again       |
| `selective` | under a selective checkpoint policy       | its inputs, matmul and attention outputs| the cheap rest runs again  |
|             | (compiled: under an activation budget)    | (compiled: what the partitioner keeps)  |                            |
| `offload`   | saved tensors copied to pinned host memory| small saved tensors                     | copied back, prefetched    |
| `elementwise`| plain, under saved-tensor hooks that     | all but what its norms and the gated    | those elementwise ops run  |
|             | take the norms' and gated MLP's outputs   | MLP's activation and product save       | again, never a matmul      |
| `host_checkpoint`| as `recompute`, its input copied to  | its keyword inputs (shared)             | input copied back, block   |
|             | pinned host memory                        |                                         | runs again                 |
| `tiled_mlp` | plain, its gated MLP in chunks of tokens  | all but the MLP's intermediates         | the MLP again, a chunk at  |
|             | (one autograd Function saving its input)  |                                         | a time                     |
| `recompute_tiled`| as `recompute`, the MLP tiled        | its inputs                              | the block again, its MLP a |
|             |                                           |                                         | chunk at a time            |
| `host_checkpoint_tiled`| as `host_checkpoint`, the MLP  | its keyword inputs (shared)             | as `host_checkpoint`, its  |
|             | tiled                                     |                                         | MLP a chunk at a time      |
| `lean`      | plain, its norms and LoRA layers saving   | all but the norms' and adapters'        | those norms and adapters'  |
|             | their bf16 input                          | float32 copies                          | down-projections again     |

Gradients are those of ``keep`` under every treatment: ``torch.utils.checkpoint`` is
non-reentrant and restores the RNG state, so a recompute draws the same dropout masks, and an
offloaded tensor comes back bit for bit.

A :class:`Treatment` instance is made per run (a treatment may hold per-run state: streams,
the host pool) and shared by every block it treats.

Each treatment is one file (NOTE [A treatment is a plug-in], base.py): keep.py,
recompute.py, selective.py, offload.py, elementwise.py, host_checkpoint.py, tiled_mlp.py (NOTE [Tiled MLP]),
recompute_tiled.py, host_checkpoint_tiled.py, lean.py (NOTE [Lean inputs in a tiled block]). Adding one is a new file and one line in
:data:`BUILTIN`; a run may also be given a treatment class that is not registered
(``memfit.fit(treatments=("recompute", MyTreatment))``): :func:`resolve` takes names and classes.

# NOTE [Recompute always at hand]
Every run can give ``keep`` and ``recompute``, whatever treatments were named: warm-up,
``full``, OOM replays and plan files of schema 1 treat blocks with ``recompute``, and the
planner always makes a recompute-only plan beside any mix (NOTE [Treatments never lose],
planning.py). :func:`run_treatment_names` adds it, and every run goes through it (the
controller, for its planner and its instances, and :func:`make_treatments`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Union

from memfit.engine.parts.optimizer_step import OptimizerStepPart
from memfit.engine.parts.treatments.base import KEEP, RECOMPUTE, RunOptions, Treatment
from memfit.engine.parts.treatments.chunked_head import CHUNKED, ChunkedHead, HeadPart, KeepHead, head_options
from memfit.engine.parts.treatments.elementwise import ELEMENTWISE, Elementwise
from memfit.engine.parts.treatments.host_checkpoint import HOST_CHECKPOINT, HostCheckpoint
from memfit.engine.parts.treatments.host_checkpoint_tiled import HOST_CHECKPOINT_TILED, HostCheckpointTiled
from memfit.engine.parts.treatments.keep import Keep
from memfit.engine.parts.treatments.lean import LEAN, Lean
from memfit.engine.parts.treatments.offload import OFFLOAD, HostMemoryError, Offload, _HostPool
from memfit.engine.parts.random_ops import draws_random, runs_random
from memfit.engine.parts.treatments.recompute import Recompute
from memfit.engine.parts.treatments.recompute_tiled import RECOMPUTE_TILED, RecomputeTiled
from memfit.engine.parts.treatments.tiled_mlp import TILED_MLP, TiledMlp
from memfit.engine.parts.treatments.selective import (
    SELECTIVE, CompiledSelective, Selective, keep_matmul_and_attention, selective_cache_tensors,
)

if TYPE_CHECKING:
    from memfit.engine.parts.accounting import SavedTensorCounter

__all__ = [
    "KEEP", "RECOMPUTE", "SELECTIVE", "OFFLOAD", "ELEMENTWISE", "HOST_CHECKPOINT", "Elementwise", "HostCheckpoint",
    "TILED_MLP", "RECOMPUTE_TILED", "HOST_CHECKPOINT_TILED", "LEAN", "Lean", "TiledMlp", "RecomputeTiled", "HostCheckpointTiled", "Treatment", "RunOptions", "Keep", "Recompute", "Selective",
    "CompiledSelective", "Offload", "HostMemoryError", "BUILTIN", "TREATMENTS", "TreatmentSpec", "resolve",
    "run_treatment_names", "make_treatments", "floor_treatment", "keep_matmul_and_attention", "selective_cache_tensors", "draws_random",
    "runs_random", "CHUNKED", "KeepHead", "ChunkedHead", "HEAD_BUILTIN", "BY_PART", "HeadPart", "head_options",
    "in_registry_order",
]

#: the registered treatments, one line each
BUILTIN: tuple[type[Treatment], ...] = (
    Keep,
    Recompute,
    Selective,
    Offload,
    Elementwise,
    HostCheckpoint,
    TiledMlp,
    RecomputeTiled,
    HostCheckpointTiled,
    Lean,
)

#: every registered treatment, by name (read-only)
TREATMENTS = MappingProxyType({t.name: t for t in BUILTIN})

#: the LM head's treatments (a part that is not a block registers its own: NOTE [A treatment is a plug-in])
HEAD_BUILTIN: tuple[type[Treatment], ...] = (
    KeepHead,
    ChunkedHead,
)

#: the part kinds memfit ships beside the blocks (parts/kind.py): imported here, with the registry every reader
#: uses, so their titles are known wherever records are read (:func:`~memfit.engine.parts.kind.part_title`)
PART_KINDS: tuple[type, ...] = (HeadPart, OptimizerStepPart)

#: every registered treatment by the part it applies to, then by name (read-only); ``"block"`` is :data:`TREATMENTS`
BY_PART = MappingProxyType({
    part: MappingProxyType({t.name: t for t in BUILTIN + HEAD_BUILTIN if part in t.parts})
    for part in ("block", "head")
})

def in_registry_order(names: Iterable[str], part: str = "block") -> list[str]:
    """``names`` once each, as every table and summary lists treatments: those :data:`BY_PART`
    registers for ``part`` in its order, then any other (a class a run was given, NOTE [A treatment
    is a plug-in]) alphabetically.

    Example:
        >>> in_registry_order(["mine", "elementwise", "recompute", "another"])
        ['recompute', 'elementwise', 'another', 'mine']
    """
    registered = list(BY_PART.get(part, {}))
    return sorted(set(names), key=lambda n: (registered.index(n), "") if n in registered else (len(registered), n))


#: a treatment as a run is given it: a registered name, or a class
TreatmentSpec = Union[str, type[Treatment]]


def _name(spec: TreatmentSpec) -> str:
    return spec if isinstance(spec, str) else spec.name


def resolve(specs: Sequence[TreatmentSpec] = ()) -> dict[str, type[Treatment]]:
    """The run's treatments by name: ``keep`` and ``recompute``, then ``specs`` in order
    (NOTE [Recompute always at hand]); a class is taken as it is, a name from :data:`TREATMENTS`.

    Raises:
        ValueError: for an unknown name, listing the known ones.

    Example:
        >>> list(resolve(("selective",)))
        ['keep', 'recompute', 'selective']
    """
    out: dict[str, type[Treatment]] = {KEEP: Keep, RECOMPUTE: Recompute}
    for spec in specs:
        if isinstance(spec, str):
            if spec not in TREATMENTS:
                raise ValueError(f"unknown treatment {spec!r}; choose from {', '.join(TREATMENTS)}, or give a Treatment class")
            out.setdefault(spec, TREATMENTS[spec])
        elif isinstance(spec, type) and issubclass(spec, Treatment) and spec.name:
            out.setdefault(spec.name, spec)
        else:
            raise ValueError(f"treatment {spec!r} is neither a registered name nor a Treatment class with a name")
    return out


def floor_treatment(registry: Mapping[str, type[Treatment]]) -> str:
    """The treatment of a run's floor plan (NOTE [A replay treats more], methods/dynamic.py): the one that keeps
    least on the device for sure, of those that re-run a block whole: one whose input leaves the device first,
    then one whose re-run holds less than the kept block (a tiled MLP: NOTE [Tiled MLP]), where the run offers
    them; else ``recompute``.

    Example:
        >>> floor_treatment(resolve(("offload", "host_checkpoint")))
        'host_checkpoint'
        >>> floor_treatment(resolve(("host_checkpoint", "recompute_tiled", "host_checkpoint_tiled")))
        'host_checkpoint_tiled'
        >>> floor_treatment(resolve(("recompute_tiled",)))
        'recompute_tiled'
        >>> floor_treatment(resolve(("offload",)))
        'recompute'
    """
    rerun = [(not cls.moves_out, cls.rerun_keeps == KEEP, i, name) for i, (name, cls) in enumerate(registry.items()) if cls.reruns]
    return min(rerun, default=(0, 0, 0, RECOMPUTE))[3]


def run_treatment_names(names: Sequence[TreatmentSpec]) -> tuple[TreatmentSpec, ...]:
    """What a run may give a block besides ``keep``: ``recompute`` first, then ``names`` in
    order, without ``keep`` or repeats (NOTE [Recompute always at hand]); a class stays a class.

    Example:
        >>> run_treatment_names(("keep", "selective"))
        ('recompute', 'selective')
    """
    out: dict[str, TreatmentSpec] = {RECOMPUTE: RECOMPUTE}
    for spec in names:
        if _name(spec) != KEEP:
            out.setdefault(_name(spec), spec)
    return tuple(out.values())


def make_treatments(
    names: Sequence[TreatmentSpec] = (KEEP, RECOMPUTE), counter: "SavedTensorCounter | None" = None,
    compiled: bool = False, **offload: Any,
) -> dict[str, Treatment]:
    """One instance per treatment for a run (``keep`` and ``recompute`` always included,
    NOTE [Recompute always at hand]).

    Args:
        names: the treatments the planner may give (names or classes).
        counter: the run's counter (``selective`` and ``offload`` count what the hooks cannot see).
        compiled: the blocks' bodies are compiled (``selective`` is then :class:`CompiledSelective`).
        **offload: ``min_bytes``, ``max_host_bytes``, ``excluded_ptrs`` and ``depth_for`` for the treatments
            that move tensors to the host (``moves_out``), which share one pinned pool bounded by
            ``max_host_bytes`` (NOTE [Pinned pool], offload.py).

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    classes = resolve(names)
    if any(cls.moves_out for cls in classes.values()) and "pool" not in offload:
        offload = {**offload, "pool": _HostPool(offload.get("max_host_bytes", 64 * 2**30))}
    options = RunOptions(counter, compiled, dict(offload))
    return {name: cls.for_run(options) for name, cls in classes.items()}
