"""The engine: what happens in a training step, one owner per rule.

* parts: :mod:`~memfit.engine.blocks` finds the blocks and wraps each so that a treatment
  applies per step; :mod:`~memfit.engine.treatments` says what each treatment does;
* measuring: :mod:`~memfit.engine.accounting` (saved bytes), :mod:`~memfit.engine.meter`
  (allocator or logical readings), :mod:`~memfit.engine.probe` (warm-up probes);
* predicting and choosing: :mod:`~memfit.engine.model` (memory and time per part and
  treatment), :mod:`~memfit.engine.planner` (pure: the cheapest plan that fits),
  :mod:`~memfit.engine.planning` (the owner of the model, the plan cache and the room),
  :mod:`~memfit.engine.learner` (pure: a finished step's readings -> updates),
  :mod:`~memfit.engine.methods` (one class per method);
* running: :mod:`~memfit.engine.controller` (:func:`fit`, the hooks),
  :mod:`~memfit.engine.step` (one step's state), :mod:`~memfit.engine.replay` (surviving an
  OOM), :mod:`~memfit.engine.protection` and :mod:`~memfit.engine.store` (what a method does
  mid-step when memory runs short);
* recording: :mod:`~memfit.engine.records`, :mod:`~memfit.engine.summary_text`.

Nothing is imported here: ``memfit`` itself exposes the public names.
"""
