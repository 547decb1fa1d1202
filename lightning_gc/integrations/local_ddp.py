"""DDP that sends nothing: the wrapper the outer loop's Lightning front ends keep (Lightning's
gradient accumulation, ``no_sync`` and device handling expect a ``DistributedDataParallel``) while
the gradients stay on their rank.

No ``from __future__ import annotations`` here: DDP checks a comm hook's annotations at runtime.
"""

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def keep_local_gradients(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook that sends nothing: the bucket's own gradients, as a completed future."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


LOCAL_BUFFERS = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)
"""DDP's switch for syncing buffers at every forward: torch >= 2.10 names it ``forward_sync_buffers``
and deprecates ``broadcast_buffers`` (which older versions only have). Off under the outer loop: it
averages buffers at each sync; the sync at construction (new name only) is harmless, every rank
starts alike."""
