"""Selective compression from the performance model: compress a bucket only where it pays.

For a bucket of ``n`` elements (``M_b = n * element_size`` bytes) the policy compares what the
bucket adds to the step (:mod:`lightning_gc.perfmodel`, per bucket, with ``h`` the communication
time backward hides for it)::

    dense       T_host + max(0, T_comm - T_host - h)            T_comm = T_ar(M_b)
    compressed  c * n + T_host + max(0, T_comm - T_host - h)    T_comm = T_ar(s W) + T_ag((1 - s) W)

where ``W = compressor.wire_bytes(layout, element_size)``, ``s`` the fraction of the wire bytes
the compressor all-reduces (the rest is all-gathered), ``c`` the calibrated encode + decode
time per element, and ``T_host`` the byte terms of ``T_comm`` at the network's host bandwidth (0
without one; see :mod:`lightning_gc.perfmodel`). The bucket is compressed iff the compressed line
is strictly smaller.

A calibrated policy (:meth:`CompressWhenFaster.calibrate`) keeps the calibration's payloads by
exchange instead of ``s`` and scales them by ``W / W_cal``, the bucket's wire bytes over the
calibration layout's, both at 4 bytes per element (a bucket of fp16 gradients is priced as fp32):
a two-phase payload then costs its all-to-all and all-gather, and global top-k its
point-to-point rounds, as in :func:`~lightning_gc.perfmodel.comm_s`.

Every input is either the bucket layout, the compressor's settings, or a number of the policy,
so ranks holding the same policy decide the same. Calibrating in each process would give each
rank different numbers: :func:`lightning_gc.runtime.policy.agreed` hands every rank rank 0's policy (the
strategy calls it once when it registers its hook).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gc.common.layout import BucketLayout
from lightning_gc.common.validation import check_int, check_range
from lightning_gc.compressors.base import Compressor
from lightning_gc.perfmodel import DENSE, CodecCost, Network, exchange_cost_s


@dataclass(frozen=True)
class CompressWhenFaster:
    """Compress a bucket only where the model predicts a faster exchange than dense all-reduce.

    Attributes:
        network: the cluster (world size, bandwidth in bytes/s, latency).
        codec_s_per_element: ``c``, encode + decode seconds per bucket element.
        summed_fraction: ``s``, share of the compressor's wire bytes that is all-reduced, in [0, 1]
            (used without ``calibrated``).
        hidden_s: ``h``, communication time per bucket that backward hides (0: none).
        calibrated: the calibration's cost, whose payloads by exchange are scaled to each bucket
            (``None``: ``summed_fraction`` splits the wire bytes between all-reduce and all-gather).
        calibrated_wire_bytes: ``W_cal``, the compressor's wire bytes for the calibration layout.
    """

    network: Network
    codec_s_per_element: float
    summed_fraction: float = 0.0
    hidden_s: float = 0.0
    calibrated: CodecCost | None = None
    calibrated_wire_bytes: int = 0

    def __post_init__(self) -> None:
        check_range("codec_s_per_element", self.codec_s_per_element, 0.0, None)
        check_range("summed_fraction", self.summed_fraction, 0.0, 1.0)
        check_range("hidden_s", self.hidden_s, 0.0, None)
        if self.calibrated is not None:
            check_int("calibrated_wire_bytes", self.calibrated_wire_bytes, 1)

    @classmethod
    def calibrate(
        cls,
        compressor: str,
        network: Network,
        *,
        arguments: dict[str, Any] | None = None,
        numel: int = 1 << 22,
        device: str = "cpu",
        hidden_s: float = 0.0,
        gradients: Sequence[torch.Tensor] | None = None,
    ) -> CompressWhenFaster:
        """Time compressor ``compressor`` (built from ``arguments``) on ``numel`` elements here.

        ``gradients``: flat ``numel``-element gradients of the real model to time on (default:
        Gaussian data, which underestimates data-dependent selection such as DGC's).
        """
        from lightning_gc.compressors import create
        from lightning_gc.perfmodel.calibration import codec_cost, layout_of_shapes, representative_shapes

        cost = codec_cost(
            compressor, numel, world_size=network.world_size, arguments=arguments, device=device, gradients=gradients
        )
        sent = cost.bytes_sent
        wire = create(compressor, **(arguments or {})).wire_bytes(layout_of_shapes(representative_shapes(numel)), 4)
        return cls(
            network=network,
            codec_s_per_element=(cost.encode_s + cost.decode_s) / numel,
            summed_fraction=min(1.0, cost.summed_bytes / sent) if sent else 0.0,
            hidden_s=hidden_s,
            calibrated=cost,
            calibrated_wire_bytes=wire,
        )

    def step_cost_s(self, layout: BucketLayout, element_size: int, wire_bytes: int | None) -> float:
        """What the bucket adds to the step: dense when ``wire_bytes`` is None, else compressed."""
        if wire_bytes is None:
            cost, codec_s = CodecCost(DENSE, summed_bytes=layout.numel * element_size, gathered_bytes=0), 0.0
        elif self.calibrated is not None:
            cost = self.calibrated.scaled(wire_bytes / self.calibrated_wire_bytes, name="compressed")
            codec_s = self.codec_s_per_element * layout.numel
        else:
            summed = round(self.summed_fraction * wire_bytes)
            cost = CodecCost("compressed", summed_bytes=summed, gathered_bytes=wire_bytes - summed)
            codec_s = self.codec_s_per_element * layout.numel
        _, host, exposed = exchange_cost_s(cost, self.network, self.hidden_s)
        return codec_s + host + exposed

    def __call__(self, compressor: Compressor, layout: BucketLayout, element_size: int) -> bool:
        """Whether to compress this bucket (the hook's ``pays`` predicate)."""
        wire = compressor.wire_bytes(layout, 4 if self.calibrated is not None else element_size)
        compressed = self.step_cost_s(layout, element_size, wire)
        return compressed < self.step_cost_s(layout, element_size, None)
