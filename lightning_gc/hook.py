"""The DDP communication hook: compensate -> compress -> communicate -> decompress, per bucket.

Modelled on torch's ``powerSGD_hook``: a state object plus a hook function. For each bucket::

    v   = memory.compensate(local gradient)          velocity (residual + momentum-corrected update)
    enc = compressor.encode(v)                       what this rank sends
    memory.commit(enc)                               v (and u) forget what was sent
    launch all-reduce(enc.summed), all-gather(enc.gathered)     both from the hook, in bucket order
    on completion: compressor.decode(enc) -> the bucket's averaged gradient

The step counter advances on DDP's last bucket of each synchronising backward pass; it salts the
threshold sample so that a step's selection depends only on (step, parameter), not on how DDP
happened to bucket the parameters. That makes results identical across DDP's bucket rebuild and
across a checkpoint resume (which starts again with DDP's initial bucketing).
"""

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future, collect_all

from lightning_gc import comm
from lightning_gc.compressors.base import Compressor, Encoded
from lightning_gc.compressors.simple import NoCompressor
from lightning_gc.layout import BucketLayout
from lightning_gc.memory import BucketMemory, CompensationMemory
from lightning_gc.stats import CompressionStats


def reaches_wire_ratio(compressor: Compressor, layout: BucketLayout, element_size: int, min_ratio: float) -> bool:
    """Whether ``compressor`` sends at most ``1 / min_ratio`` of the bucket's dense bytes."""
    return layout.numel * element_size >= min_ratio * compressor.wire_bytes(layout, element_size)


class CompressionHookState:
    """Everything the hook needs between calls: compressor, memory, layouts, step and stats.

    Args:
        compressor: encodes/decodes bucket payloads.
        memory: velocity/momentum of this rank.
        names: ``id(param) -> (name, position in named_parameters())`` for the wrapped module.
        process_group: group to communicate over (``None``: the default group).
        min_wire_ratio: buckets on which the compressor would not reach this wire ratio (dense
            bytes / bytes sent) are sent exactly through one all-reduce instead. The decision
            depends on the layout and the compressor's settings only, so every rank agrees.
        pays: optional further rule ``pays(compressor, layout, element_size) -> bool``; buckets
            where it is false are sent exactly (e.g. :class:`lightning_gc.selective.CompressWhenFaster`).
            It must decide the same on every rank.
    """

    def __init__(
        self,
        compressor: Compressor,
        memory: CompensationMemory,
        names: dict[int, tuple[str, int]],
        process_group: dist.ProcessGroup | None = None,
        min_wire_ratio: float = 1.0,
        pays: Callable[[Compressor, BucketLayout, int], bool] | None = None,
    ) -> None:
        self.compressor = compressor
        self.min_wire_ratio = min_wire_ratio
        self.pays = pays
        self.uncompressed = NoCompressor()
        self.memory = memory
        self.names = names
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.step = 0
        self.stats = CompressionStats()
        self.layouts: dict[int, BucketLayout] = {}
        self.layouts_built = 0

    def layout_for(self, bucket: dist.GradBucket) -> BucketLayout:
        """The layout of ``bucket``, rebuilt when DDP re-bucketed its parameters."""
        params = bucket.parameters()
        layout = self.layouts.get(bucket.index())
        if layout is None or not layout.matches(params):
            layout = BucketLayout.build(bucket.index(), params, self.names, bucket.buffer().numel())
            self.layouts[bucket.index()] = layout
            self.layouts_built += 1
        return layout

    def compressor_for(self, layout: BucketLayout, element_size: int) -> Compressor:
        """The configured compressor, or exact all-reduce where it would not pay its way."""
        if reaches_wire_ratio(self.compressor, layout, element_size, self.min_wire_ratio) and (
            self.pays is None or self.pays(self.compressor, layout, element_size)
        ):
            return self.compressor
        return self.uncompressed

    def state_dict(self) -> dict[str, Any]:
        """This rank's resumable state: step counter and memory."""
        return {"step": self.step, "memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.memory.load_state_dict(state["memory"])


def commit(memory: CompensationMemory, bucket_memory: BucketMemory, encoded: Encoded) -> None:
    """Tell ``memory`` what left this rank for one bucket, as described by ``encoded``."""
    if encoded.sent_indices is not None:
        assert encoded.sent_values is not None
        memory.commit_sparse(bucket_memory, encoded.sent_indices, encoded.sent_values)
    if encoded.dense_all or encoded.dense_positions is not None:
        positions = None if encoded.dense_all else encoded.dense_positions
        memory.commit_dense(bucket_memory, positions, encoded.dense_sent)
    memory.end_step(bucket_memory)


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP comm hook implementing compressed gradient exchange; register with ``register_comm_hook``.

    (This module avoids ``from __future__ import annotations``: DDP checks these annotations at runtime.)
    """
    started = time.perf_counter()
    grad = bucket.buffer()
    layout = state.layout_for(bucket)
    memory = state.memory.bucket(layout, grad)
    velocity = state.memory.compensate(memory, grad, bucket.parameters(), state.world_size)
    compressor = state.compressor_for(layout, grad.element_size())
    encoded = compressor.encode(velocity, grad, layout, step=state.step, world_size=state.world_size, rank=state.rank)
    commit(state.memory, memory, encoded)

    futures = []
    if encoded.summed is not None:
        futures.append(comm.allreduce_sum(encoded.summed, state.process_group))
    if encoded.gathered is not None:
        assert encoded.gathered_out is not None
        futures.append(comm.allgather_fixed(encoded.gathered, encoded.gathered_out, state.process_group))
    if bucket.is_last():
        state.step += 1
    state.stats.add(
        bytes_sent=encoded.bytes_sent,
        dense_bytes=grad.numel() * grad.element_size(),
        elements_sent=encoded.elements_sent,
        elements_total=grad.numel(),
        seconds=time.perf_counter() - started,
    )

    def decode(_: Any) -> torch.Tensor:
        decode_started = time.perf_counter()
        compressor.decode(encoded, grad, world_size=state.world_size)
        state.stats.add(seconds=time.perf_counter() - decode_started)
        return grad

    joined = futures[0] if len(futures) == 1 else collect_all(futures)
    return joined.then(decode)
