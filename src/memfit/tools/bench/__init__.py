"""Benchmark tooling: the matrix runner, the peers memfit is compared with, and the oracle.

Not part of what users train with: ``memfit bench`` and the suites in ``benchmarks/`` use it.

* :mod:`memfit.tools.bench.matrix`: ``memfit bench``, a tasks × methods × budgets × repeats matrix
  of ``memfit train`` runs, one process each, written to ``results.jsonl``;
* :mod:`memfit.tools.bench.peers`: the alternatives (Hugging Face's checkpointing and offload,
  ``torch.compile``'s activation memory budget, activation offloading, ckptplan), each run
  by ``memfit train`` with memfit only measuring;
* :mod:`memfit.tools.bench.oracle`: per shape, the fewest first blocks that fit, found by a sweep
  of the run's own batches (what ``dynamic`` is judged against).
* :mod:`memfit.tools.bench.provenance`: the commit a result line ran, whether its code was
  committed and the suite call that ran it (``commit``, ``tree_clean``, ``call``), written into every line.
"""
