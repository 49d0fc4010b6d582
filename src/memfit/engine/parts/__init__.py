"""Parts: what a step's memory is made of and what a treatment can change.

The blocks (:mod:`.blocks`: found, wrapped, each run under the treatment its plan names), the LM
head with its loss (:mod:`.head`), the optimizer's state and step (:mod:`.optim_state`), the
treatments (:mod:`.treatments`, one file each, and the registry every reader uses), and how parts
are measured: saved bytes (:mod:`.accounting`), warm-up probes (:mod:`.probe`), the saved-tensor
store that evicts mid-step (:mod:`.store`), the compiler's guard sides (:mod:`.guard_sides`).

Imports: torch, :mod:`memfit.errors` and the engine's shared modules (``budget``, ``shapes``,
``ranks``); never ``plan`` or ``run``.
"""
