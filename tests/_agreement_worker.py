"""Two gloo ranks: the replay engine's agreement where the default group's backend reduces no host tensors
(as NCCL's does not) is reduced over a gloo group of its own, made once (NOTE [The ranks' agreement on the host]).
Writes ``agreement.rank<r>.json``: the agreements' results and keys, and the backends of the groups made."""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from _ddp_common import leave

from memfit.engine import ranks

dist.init_process_group("gloo")
rank = dist.get_rank()
made = []
new_group = dist.new_group


def counted(*args, **kwargs):
    made.append(kwargs.get("backend"))
    return new_group(*args, **kwargs)


dist.new_group = counted
# the default group as NCCL's: its host tensors are refused, so a device flag (no CUDA here) would fail
ranks._reduces_host_tensors = lambda group=None: group is not None
agreement = ranks.Agreement()
results = [agreement.any(rank == 1), agreement.any(False), agreement.any(rank == 0)]
keys = [agreement.key]
agreement.any(False, [(3, 100), (2, 300)][rank])  # each rank's step shape: the largest rows and length of the two
keys.append(agreement.key)
agreement.any(False, (4, 50) if rank else None)  # a rank without a shape counts as none
keys.append(agreement.key)
Path(sys.argv[1], f"agreement.rank{rank}.json").write_text(json.dumps({"results": results, "made": made, "keys": keys}))
leave()
