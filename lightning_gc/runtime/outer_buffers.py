"""The outer loop's weights beside ``theta_g``: the exact average of floating-point buffers at a
sync, and what :meth:`~lightning_gc.runtime.outer.OuterLoop.global_weights` sets aside."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_gc.exchanges.comm import ProcessGroup


class LocalWeights(NamedTuple):
    """This rank's own weights, set aside while :meth:`~lightning_gc.runtime.outer.OuterLoop.global_weights`
    holds ``theta_g``: ``parameters`` (``theta_r``, the synced ones by name) and floating-point
    ``buffers`` by name."""

    parameters: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def average_buffers(buffers: list[torch.Tensor], group: ProcessGroup) -> None:
    """Each buffer <- its exact mean over ``group`` (all-reduce sum / N, one per dtype and device),
    in place; a collective: every rank calls it with its buffers in the same order."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for buffer in buffers:
        by_kind.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    world_size = dist.get_world_size(group)
    with torch.no_grad():
        for kind in by_kind.values():
            flat = torch.cat([b.reshape(-1) for b in kind])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(world_size)
            for buffer, piece in zip(kind, flat.split([b.numel() for b in kind])):
                buffer.copy_(piece.view(buffer.shape))
