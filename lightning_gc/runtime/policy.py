"""Which buckets to compress: the policy the strategy and the hook take, and its agreement across ranks.

A policy is any callable ``policy(compressor, layout, element_size) -> bool``; a bucket it says
``False`` to is sent exactly through one all-reduce. It must decide the same on every rank, which
:func:`agreed` ensures by handing every rank rank 0's policy. The strategy stands on this protocol
only: :class:`lightning_gc.runtime.selective.CompressWhenFaster` (the performance model's policy) is one
implementation, and nothing here imports the model.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from lightning_gc.common.layout import BucketLayout
from lightning_gc.compressors.base import Compressor


class CompressionPolicy(Protocol):
    """Whether compressing a bucket of ``layout`` with ``compressor`` pays; the same on every rank."""

    def __call__(self, compressor: Compressor, layout: BucketLayout, element_size: int) -> bool: ...


Policy = TypeVar("Policy", bound=CompressionPolicy)


def agreed(policy: Policy | None, group: dist.ProcessGroup | None) -> Policy | None:
    """Rank 0's ``policy`` on every rank of ``group`` (collective: every rank must call it)."""
    if policy is None or dist.get_world_size(group) == 1:
        return policy
    holder: list[Any] = [policy]
    dist.broadcast_object_list(holder, group=group, group_src=0)
    return holder[0]
