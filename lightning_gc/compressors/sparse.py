"""Sparsifying compressors: send the ``k = ceil(ratio * numel)`` largest values of each large tensor.

Per bucket, tensors with ``dim() > 1`` and at least ``min_compress_numel`` elements are
*compressed*: each contributes exactly ``k`` (index, value) pairs to one fixed-size all-gather.
Every other tensor (biases, norms, small tensors) is *dense*: its values are all-reduced. With
``compress_ratio == 1`` every tensor is dense and the bucket goes through one plain all-reduce.

Decompression::

    out = 0;  out[idx_r] += val_r / N  for every rank r   (duplicates add: scatter-add)
    out[dense] = (sum over ranks of dense values) / N

All buffers of a bucket (payload, gathered payloads, dense values, index lists) are allocated once
per (layout, ratio) and reused every step.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gc import kernels
from lightning_gc._validation import check_choice, check_int
from lightning_gc.compressors.base import (
    AdjustableRatio,
    Compressor,
    DensePart,
    Encoded,
    decode_whole_bucket,
    encode_whole_bucket,
)
from lightning_gc.compressors.wire import VALUE_DTYPES, SparseWireFormat
from lightning_gc.layout import BucketLayout, Segment

_SALT_STEP = 1_000_003  # distinct steps must map far apart before the per-parameter offset is added


@dataclass
class _SparsePlan:
    """Sizes and reusable buffers for one bucket layout at one compression ratio."""

    layout: BucketLayout
    ratio: float
    world_size: int
    compressed: tuple[tuple[Segment, int, int], ...]  # (segment, k, first slot in the payload)
    total_k: int
    dense_all: bool
    dense: DensePart | None  # the dense tensors of a partly compressed bucket
    sent_indices: torch.Tensor
    sent_values: torch.Tensor
    payload: torch.Tensor
    gathered: torch.Tensor


class SparseCompressor(AdjustableRatio, Compressor):
    """Shared machinery of top-k style sparsifiers; subclasses choose the ``k`` indices.

    Args:
        compress_ratio: fraction of each compressed tensor's elements sent, in (0, 1].
        min_compress_numel: tensors with fewer elements (and all 1-D tensors) are sent dense.
        value_dtype: dtype of the values on the wire: ``"float32"``, ``"float16"`` or
            ``"bfloat16"``. What a narrower dtype rounds away stays in the velocity (error
            feedback). Dense tensors are always sent in the gradient's dtype.
    """

    def __init__(self, compress_ratio: float, min_compress_numel: int, value_dtype: str | torch.dtype) -> None:
        self.compress_ratio = compress_ratio
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 1)
        if isinstance(value_dtype, torch.dtype):
            value_dtype = next((k for k, v in VALUE_DTYPES.items() if v == value_dtype), str(value_dtype))
        self.value_dtype_name = check_choice("value_dtype", value_dtype, VALUE_DTYPES)
        self.wire = SparseWireFormat(VALUE_DTYPES[self.value_dtype_name])
        self._plans: dict[int, _SparsePlan] = {}

    def compresses(self, segment: Segment) -> bool:
        """Whether ``segment`` is sparsified at the current ratio (else it is sent dense)."""
        return self._compress_ratio < 1.0 and len(segment.shape) > 1 and segment.numel >= self.min_compress_numel

    def k_for(self, numel: int) -> int:
        """Elements sent of a compressed tensor of ``numel`` elements: ``ceil(ratio * numel)``."""
        return min(numel, math.ceil(self._compress_ratio * numel))

    @abstractmethod
    def select(
        self, values: torch.Tensor, k: int, salt: int, out_indices: torch.Tensor, out_values: torch.Tensor
    ) -> None:
        """Write the ``k`` (index, value) pairs of the 1-D ``values`` to send into the outputs.

        Each pair is a selected element (its index in ``values`` and its value) or a no-op
        (any index, value 0).
        """

    # ------------------------------------------------------------------ planning
    def _split(self, layout: BucketLayout) -> tuple[list[tuple[Segment, int, int]], list[Segment], int]:
        """(compressed segments with k and first payload slot, dense segments, total k)."""
        compressed, dense, total_k = [], [], 0
        for segment in layout.segments:
            if self.compresses(segment):
                k = self.k_for(segment.numel)
                compressed.append((segment, k, total_k))
                total_k += k
            else:
                dense.append(segment)
        return compressed, dense, total_k

    def wire_bytes(self, layout: BucketLayout, element_size: int) -> int:
        compressed, dense, total_k = self._split(layout)
        if not compressed:
            return layout.numel * element_size
        return self.wire.payload_bytes(total_k) + sum(s.numel for s in dense) * element_size

    def _plan(self, layout: BucketLayout, like: torch.Tensor, world_size: int) -> _SparsePlan:
        plan = self._plans.get(layout.index)
        if (
            plan is not None
            and plan.layout is layout
            and plan.ratio == self._compress_ratio
            and plan.world_size == world_size
        ):
            return plan
        compressed, dense, total_k = self._split(layout)
        device = like.device
        dense_all = not compressed
        payload_bytes = self.wire.payload_bytes(total_k)
        plan = _SparsePlan(
            layout=layout,
            ratio=self._compress_ratio,
            world_size=world_size,
            compressed=tuple(compressed),
            total_k=total_k,
            dense_all=dense_all,
            dense=None if dense_all else DensePart.of(dense, like),
            sent_indices=torch.empty(total_k, dtype=torch.int64, device=device),
            sent_values=like.new_empty(total_k),
            payload=torch.empty(payload_bytes, dtype=torch.uint8, device=device),
            gathered=torch.empty(world_size * payload_bytes, dtype=torch.uint8, device=device),
        )
        self._plans[layout.index] = plan
        return plan

    # ------------------------------------------------------------------ encode / decode
    def encode(
        self,
        velocity: torch.Tensor,
        out: torch.Tensor,
        layout: BucketLayout,
        *,
        step: int,
        world_size: int,
        rank: int = 0,
    ) -> Encoded:
        plan = self._plan(layout, velocity, world_size)
        if plan.dense_all:
            return encode_whole_bucket(velocity, out)
        for segment, k, first in plan.compressed:
            chosen = slice(first, first + k)
            self.select(
                segment.of(velocity),
                k,
                step * _SALT_STEP + segment.order,
                out_indices=plan.sent_indices[chosen],
                out_values=plan.sent_values[chosen],
            )
            plan.sent_indices[chosen].add_(segment.start)
        sent = self.wire.pack(plan.payload, plan.total_k, plan.sent_indices, plan.sent_values)
        summed = None if plan.dense is None else plan.dense.gather(velocity)
        return Encoded(
            summed=summed,
            gathered=plan.payload,
            gathered_out=plan.gathered,
            sent_indices=plan.sent_indices,
            sent_values=sent,
            dense_positions=None if plan.dense is None else plan.dense.positions,
            bytes_sent=plan.payload.numel() + (0 if summed is None else summed.numel() * summed.element_size()),
            elements_sent=plan.total_k + (0 if summed is None else summed.numel()),
            context=plan,
        )

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        if decode_whole_bucket(encoded, out, world_size):
            return
        plan: _SparsePlan = encoded.context
        out.zero_()
        indices, values = self.wire.unpack(plan.gathered, world_size, plan.total_k)
        kernels.scatter_average_(out, indices, values, world_size)
        if plan.dense is not None:
            plan.dense.write_mean(out, world_size)

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "compress_ratio": self._compress_ratio,
            "min_compress_numel": self.min_compress_numel,
            "value_dtype": self.value_dtype_name,
        }
