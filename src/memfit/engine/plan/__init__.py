"""Planning: from what warm-up measured to the cheapest plan that fits the next step.

:mod:`.model` (the one peak evaluator: memory and time per part and treatment), :mod:`.planner`
(pure and bounded: options -> the cheapest plan), :mod:`.planning` (the owner of the model, the
plan cache and the room), :mod:`.search` (one shape's plan on a cache miss, read from the planning's
public face), :mod:`.rows` (a row of lengths' plans at once, for one group planned by recompute
alone), :mod:`.room` (what is free under the cap), :mod:`.learner` (pure: a
finished step's readings -> updates of the model).

Imports: :mod:`memfit.engine.parts` and the engine's shared modules; never ``run``.
"""
