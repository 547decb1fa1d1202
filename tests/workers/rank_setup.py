"""What every raw-DDP test worker does first: read the plan, join the gloo process group."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


@contextmanager
def gloo_rank() -> Iterator[tuple[dict[str, Any], int]]:
    """The plan (JSON file named by ``sys.argv[1]``) and this rank, after one torch thread per
    process (ranks share the cores) and ``init_process_group("gloo")`` from the launcher's
    environment. The group is destroyed on the way out, also when the rank raises: a gloo group
    left to interpreter shutdown can abort the process ("terminate called without an active
    exception", SIGABRT), which turned an expected exit status 1 into -6 now and then."""
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    try:
        yield plan, rank
    finally:
        dist.destroy_process_group()
