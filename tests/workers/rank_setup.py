"""What every raw-DDP test worker does first: read the plan, join the gloo process group."""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


@contextmanager
def gloo_rank() -> Iterator[tuple[dict[str, Any], int]]:
    """The plan (JSON file named by ``sys.argv[1]``) and this rank, after one torch thread per
    process (ranks share the cores) and ``init_process_group("gloo")`` from the launcher's
    environment. On the way out the group is destroyed, also when the rank raises, and only after
    what the rank built (its DDP model) is freed: a rank that raised kept its DDP model alive in the
    traceback's frames past the group's destruction, or left the group to interpreter shutdown, and
    either way aborted now and then ("terminate called without an active exception", SIGABRT)
    instead of exiting with status 1. A rank that raised prints its traceback and exits with 1."""
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    failed = False
    try:
        yield plan, rank
    except Exception:
        traceback.print_exc()
        failed = True
    gc.collect()  # the failed rank's frames, and any cycles holding a DDP model, go before the group
    dist.destroy_process_group()
    if failed:
        sys.exit(1)
