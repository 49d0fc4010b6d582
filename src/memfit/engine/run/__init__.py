"""Running: the hooks around a training step, and what happens when memory runs short.

:mod:`.controller` (:func:`memfit.fit`: setup all or nothing, the step's hooks), :mod:`.step` (one
step's state), :mod:`.meter` (the allocator's or the logical readings), :mod:`.replay` (the one
OOM-replay engine), :mod:`.protection` (what a method does mid-step when its plan was wrong), :mod:`.collectives`
(how long a sharded rank's step waited on its all-gathers).

Imports: :mod:`memfit.engine.plan`, :mod:`memfit.engine.parts`, :mod:`memfit.engine.methods` and the
engine's shared modules; never :mod:`memfit.integrations` (the process group comes through
:mod:`memfit.engine.ranks`).
"""
