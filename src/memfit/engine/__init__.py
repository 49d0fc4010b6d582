"""The engine: what happens in a training step, one owner per rule.

* parts: :mod:`~memfit.engine.parts.blocks` finds the blocks and wraps each so that a treatment
  applies per step; :mod:`~memfit.engine.parts.treatments` says what each treatment does;
* measuring: :mod:`~memfit.engine.parts.accounting` (saved bytes), :mod:`~memfit.engine.run.meter`
  (allocator or logical readings), :mod:`~memfit.engine.parts.probe` (warm-up probes);
* predicting and choosing: :mod:`~memfit.engine.plan.model` (memory and time per part and
  treatment), :mod:`~memfit.engine.plan.planner` (pure: the cheapest plan that fits),
  :mod:`~memfit.engine.plan.planning` (the owner of the model, the plan cache and the room),
  :mod:`~memfit.engine.plan.learner` (pure: a finished step's readings -> updates),
  :mod:`~memfit.engine.methods` (one class per method);
* running: :mod:`~memfit.engine.run.controller` (:func:`fit`, the hooks),
  :mod:`~memfit.engine.run.step` (one step's state), :mod:`~memfit.engine.run.replay` (surviving an
  OOM), :mod:`~memfit.engine.run.protection` and :mod:`~memfit.engine.parts.store` (what a method does
  mid-step when memory runs short);
* recording: :mod:`~memfit.engine.records`, :mod:`~memfit.engine.summary_text`.

Nothing is imported here: ``memfit`` itself exposes the public names.
"""
