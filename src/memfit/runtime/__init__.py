"""The runtime: one training step at a time, from the hooks on the model to the step record.

* :mod:`~memfit.runtime.controller`: :func:`fit` and the :class:`Controller`, which only wires
  the model's hooks to the parts below, the method (memfit.methods) and the learner;
* :mod:`~memfit.runtime.step`: the state of one step, with an explicit stage;
* :mod:`~memfit.runtime.meter`: how memory is read (the CUDA allocator, or logical counting);
* :mod:`~memfit.runtime.probe`: warm-up probes of what a block saves and costs;
* :mod:`~memfit.runtime.replay`: surviving an OOM (the failed attempt's record, a safer plan,
  ``Controller.run_step``).
"""

from memfit.runtime.controller import Controller, fit

__all__ = ["fit", "Controller"]
