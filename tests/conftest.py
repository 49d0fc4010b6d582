import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# NOTE [One thread per test process]: the tests' models are tiny, so torch's intra-op threads
# only add the cost of waking them; where another process holds a core (a second test
# process, a torchrun rank, another job) a parallel region waits on a descheduled thread,
# which made some tests 5-20x slower. Set before torch is imported, so the processes the
# tests start (the CLI, torchrun's ranks, the benchmark scripts) inherit it too; a value
# already set wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from one RNG state: torch seeds itself at random when a process starts, so a
    test that draws its model or data without seeding got other numbers in every run (a tolerance that
    held for most draws failed on some: docs/devlog.md, session 43). A test that seeds keeps its own."""
    import random

    import numpy

    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _device_memory_freed(request):
    """A GPU test's models and tensors go when it ends: a cycle left to the collector's next full pass would
    otherwise still hold device memory under the next test's cap (and in its measured allocations)."""
    yield
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
