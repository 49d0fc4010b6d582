"""The garbage collector's pauses: timed in every record, and kept short while memfit treats on a GPU.

# NOTE [The collector's pauses]
CPython collects its oldest generation when the objects promoted into it since its last full
collection reach a quarter of those that survived that one, and a full collection walks every
tracked object of the process: with torch, transformers, peft and a model loaded, about half a
million, a quarter of a second on a GPU host; frozen, nothing (docs/devlog.md). A step that
checkpoints makes Python objects that live through the step (checkpoints' frames, saved-tensor
packs, events), which the young collections promote, so full collections come every few dozen
steps (HF checkpointing of an 8B LoRA under FSDP2 on 2 GPUs: every 20 steps or so, 0.27-0.42 s
each), and under FSDP a pause on one rank holds every rank at the next collective. So:

* every record holds ``gc_ms``: the time the process spent in the collector's passes (every
  generation) since the record before, timed by a ``gc.callbacks`` entry;
* where memfit treats on CUDA (every method but ``none``, the allocator's accounting), at the end of the
  first steady step it collects once and freezes the heap (``gc.collect()``, ``gc.freeze()``: what is
  alive then, the libraries, the model, the optimizer's state, moves to a permanent generation that
  collections skip), as inference servers do after their start (vLLM): a full collection then walks
  only what the run made since, and the step's own objects. ``remove()`` unfreezes it, and so does
  the end of a memfit Trainer's ``train()``, which stays hooked (a notebook's ``del trainer, model;
  gc.collect()`` then frees their cycles; the next ``train()`` freezes again). Objects frozen that
  become cyclic garbage during the run are freed only then (a tensor freed by its last reference is
  freed at once, frozen or not: only cycles wait). A process that froze its heap itself
  keeps its own: memfit then neither freezes nor unfreezes; nor where the caller set
  ``ctl.pauses.freeze = False`` after ``fit``. Not on a CPU (steps there are long beside
  a collection) nor under ``none`` (and the peers' runs the benchmarks measure through it), which
  changes nothing.
"""

from __future__ import annotations

import gc
import time
from typing import Any

__all__ = ["Pauses", "freezes"]

#: the permanent generation's size before anything froze: CPython 3.12 keeps objects there that ``gc.unfreeze()`` does
#: not move (375 on the GPU hosts), so a process that froze nothing reads this, not 0
UNFROZEN = gc.get_freeze_count()


def freezes(treats: bool, accounting: str) -> bool:
    """Whether a run freezes the heap once steady: where it treats (every method but ``none``) on CUDA (NOTE [The
    collector's pauses])."""
    return treats and accounting == "cuda"


class Pauses:
    """Times the collector's passes between records and, where ``freeze``, freezes the heap once steady (NOTE [The
    collector's pauses])."""

    def __init__(self, freeze: bool):
        #: whether to freeze at the first steady step (not where the process froze its heap itself)
        self.freeze = freeze and gc.get_freeze_count() <= UNFROZEN
        self.frozen = False
        self._ms, self._start = 0.0, None
        gc.callbacks.append(self._timed)

    def _timed(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self._ms += (time.perf_counter() - self._start) * 1e3
            self._start = None

    def take(self, steady: bool) -> float:
        """The ms in the collector since the last take; a steady step's take freezes the heap once (where asked)."""
        ms, self._ms = self._ms, 0.0
        if steady and self.freeze and not self.frozen:
            gc.collect()  # no garbage frozen: cycles made in warm-up (probes' frames) are freed first
            gc.freeze()
            self.frozen = True
        return round(ms, 3)

    def thaw(self) -> None:
        """The heap unfrozen where this froze it; the next steady step freezes it again (between a Trainer's
        ``train()`` calls: NOTE [The collector's pauses])."""
        if self.frozen:
            gc.unfreeze()
            self.frozen = False

    def remove(self) -> None:
        """The callback off, the heap unfrozen where this froze it."""
        self.freeze = False  # a record closed after this (the model's last forward) freezes nothing
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)
        self.thaw()
