"""Tools around training: reports (report), the memory-anatomy estimator (estimate) and benchmarks (bench)."""
