"""The treatment interface: what one file under ``engine/parts/treatments/`` declares.

# NOTE [A treatment is a plug-in]
A treatment is a :class:`Treatment` subclass in one file, registered by one line in
``treatments/__init__.py`` (or, for a run, passed by class to ``memfit.fit(treatments=...)``).
It declares everything the engine asks of it, so that no other file branches on its name:

* how a part runs one training forward under it (:meth:`Treatment.run`);
* what warm-up measures of it (:meth:`Treatment.probe`): the bytes a block keeps on the
  device under it and the time it adds, which the memory model learns as its curves, keyed
  by its name (``BlockGroupModel.bytes[name]`` and ``ms[name]``, model.py);
* its price where warm-up gives no time (:attr:`Treatment.priced_by_link`);
* what its plan does to the step's peaks (:attr:`Treatment.reruns`, :attr:`Treatment.rerun_keeps`,
  :attr:`Treatment.reruns_part`, :attr:`Treatment.moves_out`:
  NOTE [Treated peaks], model.py) and where it goes in a stack of alike blocks
  (:attr:`Treatment.order`: NOTE [Choosing treatments], planner.py);
* the parts it applies to (:attr:`Treatment.parts`): ``"block"`` today; the LM head
  registers its own treatments (``keep``, ``chunked``) with ``parts = ("head",)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch
    from torch import nn

    from memfit.engine.parts.accounting import SavedTensorCounter

__all__ = ["Treatment", "RunOptions", "Block", "ProbeKit", "KEEP", "RECOMPUTE"]


class Block(Protocol):
    """What a treatment uses of a block (the engine's is ``parts/blocks.py``'s ``Block``, which
    imports the treatments: they see it through this interface, not that module)."""

    index: int
    name: str
    module: "nn.Module"
    #: the block's forward as called (compiled or not), the eager one, and ``selective``'s compilation
    body: Callable[..., Any]
    eager_body: Callable[..., Any]
    lean_body: Callable[..., Any] | None
    compiled: bool
    draws_random: bool | None
    repeats_gradients: bool

    def run_body(self, *args: Any, **kwargs: Any) -> Any: ...

    def run_lean(self, *args: Any, **kwargs: Any) -> Any: ...


class ProbeKit(Protocol):
    """What a treatment's probe is handed (the engine's is ``parts/probe.py``'s ``ProbeKit``)."""

    block: Block
    detached: tuple[tuple, dict[str, Any]]
    counter: "SavedTensorCounter"
    device: "torch.device"
    timed_runs: int
    found: dict[str, Any]

    def fresh(self) -> tuple[tuple, dict[str, Any]]: ...

    def inputs(self) -> list["torch.Tensor"]: ...

    def input_bytes(self) -> int: ...

    def elapsed_ms(self, fn: Callable[[], Any]) -> float: ...

    def shield(self) -> Any: ...

    def distinct_bytes(self, tensors: list["torch.Tensor"]) -> int: ...

    def forward_backward_ms(self, body: Callable[..., Any], *contexts: Any) -> float: ...

    def plain_run_ms(self, run: int) -> float: ...

    def runs_after_check(self) -> int: ...

    def counter_of_run(self) -> Any: ...

    def small_saved_bytes(self, min_bytes: int) -> int: ...

KEEP = "keep"
RECOMPUTE = "recompute"


@dataclass(frozen=True)
class RunOptions:
    """What a run's treatment instances are made with (:meth:`Treatment.for_run`).

    Attributes:
        counter: the run's saved-tensor counter (a treatment counts what its hooks hide).
        compiled: the blocks' bodies are compiled (NOTE [Compiled blocks], blocks.py).
        offload: ``min_bytes``, ``max_host_bytes``, ``excluded_ptrs``, ``depth_for`` and the run's
            one pinned ``pool`` for the treatments that move tensors to the host (``moves_out``).
    """

    counter: "SavedTensorCounter | None" = None
    compiled: bool = False
    offload: dict[str, Any] = field(default_factory=dict)


class Treatment:
    """How a part runs one training forward (NOTE [A treatment is a plug-in]); subclasses set
    ``name`` and :meth:`run`. An instance is made per run and shared by every part it treats."""

    name: ClassVar[str] = ""
    #: one line for ``--memfit_treatments``' help
    help: ClassVar[str] = ""
    #: the kinds of part it applies to
    parts: ClassVar[tuple[str, ...]] = ("block",)
    #: the block keeps only its inputs, which no saved-tensor hook sees (NOTE [Who sees a
    #: checkpointed block's tensors] in accounting.py): the runtime counts them at block entry
    holds_inputs: ClassVar[bool] = False
    #: the whole block runs again in backward: the recompute peak is bounded from the topmost
    #: such block (NOTE [Treated peaks], model.py)
    reruns: ClassVar[bool] = False
    #: what a block that ``reruns`` holds again while its backward runs: the bytes it would keep under this
    #: treatment (``keep``: everything it saves; ``tiled_mlp`` for a re-run whose MLP is tiled: NOTE [Tiled MLP])
    rerun_keeps: ClassVar[str] = KEEP
    #: the treatment whose measured price is this one's re-run (its forward again and what the re-run adds), where
    #: warm-up measured it: a checkpoint on the host re-runs as the checkpoint on the device of the same body (None:
    #: the block's forward and what ``rerun_keeps`` adds: NOTE [Treatment prices], model.py)
    reruns_as: ClassVar[str | None] = None
    #: the treatment that keeps the same bytes at the backward's start (None: none): a leaner re-run of it, which
    #: the planner swaps in where only the re-run's peak is over the room (NOTE [Leaner re-runs], search.py)
    keeps_as: ClassVar[str | None] = None
    #: the block's body runs again in backward in part, bringing back what it did not keep: bounded
    #: at the backward's start plus those bytes (NOTE [Treated peaks], model.py)
    reruns_part: ClassVar[bool] = False
    #: its saved tensors leave the device and come back, prefetched, in backward (NOTE [Prefetch depth], offload.py)
    moves_out: ClassVar[bool] = False
    #: what a block that ``moves_out`` would keep on the device had it not moved it: the treatment whose
    #: bytes less its own are the bytes moved (``keep`` for offload; ``recompute`` for a checkpoint on the host)
    moves_from: ClassVar[str] = KEEP
    #: priced by the host link's measured bandwidth (engine/parts/probe.py), not by a measured time
    priced_by_link: ClassVar[bool] = False
    #: where it goes in a stack of alike blocks, from the first block up (lower first)
    order: ClassVar[int] = 50
    #: it treats eager blocks only: a run that compiles the blocks never plans it, and says so
    eager_only: ClassVar[bool] = False

    @classmethod
    def for_run(cls, options: RunOptions) -> "Treatment":
        """The run's instance."""
        return cls()

    @classmethod
    def by_default(cls, modules: "Sequence[nn.Module]", compile_options: "dict[str, Any] | None") -> bool:
        """Whether a run that names no treatments offers it for these blocks, their bodies compiled
        with ``compile_options`` (None: eager). NOTE [Recompute always at hand] adds ``recompute`` to
        every run whatever this says."""
        return False

    @classmethod
    def probe(cls, block: "Block", kit: "ProbeKit") -> tuple[int, float | None] | None:
        """What warm-up measures of ``block`` under this treatment: the bytes it keeps on the
        device and the time it adds in ms (None: priced by the link), or None where it cannot
        apply (never planned for that block). ``keep`` is measured by the plain probe
        (engine/parts/probe.py) and returns None here."""
        return None

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def start_step(self) -> None:
        """A training step starts (per-step state is dropped)."""

    def block_done(self, block: "Block", output: Any) -> None:
        """Any block of the step, under any treatment, ended its forward with ``output`` (a treatment that fetches back
        ahead hooks it: NOTE [Spread stashes], plan/model.py)."""
