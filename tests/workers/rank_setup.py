"""What every raw-DDP test worker does around its body: read the plan, join the gloo process group,
and leave it so that the process exits with the body's status, never with SIGABRT."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_gc.runtime.teardown import shut_down_process_group


def run_gloo_rank(body: Callable[[dict[str, Any], int], None]) -> None:
    """Call ``body(plan, rank)`` with the plan (JSON file named by ``sys.argv[1]``) after one torch
    thread per process (ranks share the cores) and ``init_process_group("gloo")`` from the
    launcher's environment.

    The body is a function so that what it built (its DDP model, which holds the group) is
    unreachable once it returns or raises; the group is then destroyed and that garbage collected,
    so the group's worker threads are joined now and not by interpreter finalization, where one
    still holding a collective aborts the process ("terminate called without an active exception",
    see :mod:`lightning_gc.runtime.teardown`). A body that raised prints its traceback and exits with 1."""
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    failed = False
    try:
        body(plan, rank)
    except Exception:
        traceback.print_exc()
        failed = True
    shut_down_process_group()
    if failed:
        sys.exit(1)
