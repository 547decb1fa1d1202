"""FFT sparsification with range-based floats (Wang et al., HPDC 2020).

Per compressed tensor ``x`` (flattened, ``n`` elements; ``dim() > 1`` and at least
``min_compress_numel``)::

    c      <- rfft(x)                                   n // 2 + 1 complex coefficients
    keep   <- the k = ceil(compress_ratio * n / 2) largest |c|     (2k real numbers ~ ratio * n)
    send   <- keep's indices (int32) + Re, Im of c[keep] as range-based ``bits``-bit floats
    x_hat  <- irfft(c[keep] as decoded, zero elsewhere)  what receivers reconstruct from this rank

Receivers scatter-add every rank's decoded coefficients into one spectrum per tensor and take a
single ``irfft`` (the transform is linear), then divide by N. Gradients are smooth along their
flattened layout often enough that a few frequencies carry most of the energy; what is dropped
or rounded stays in the residual (error feedback, on by default: the compressor is biased),
``v <- v - x_hat``. Dense tensors (biases, norms, small ones) are all-reduced exactly.

Payload per rank and bucket (all-gathered, the same size on every rank)::

    [ (emax, E) int32 pair per tensor ][ k indices per tensor, int32 ][ 2k codes per tensor, 4-byte aligned ]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_gc.compressors import rangefloat
from lightning_gc.compressors.base import (
    AdjustableRatio,
    DensePart,
    EncodeContext,
    Encoded,
    PlannedCompressor,
    aligned,
    decode_whole_bucket,
    encode_whole_bucket,
    split_segments,
)
from lightning_gc.compressors.registry import register
from lightning_gc.layout import BucketLayout, Segment
from lightning_gc.validation import check_choice, check_int


@dataclass(frozen=True)
class _Spectrum:
    """One compressed tensor: ``k`` coefficients kept, and where its parts sit in the payload."""

    segment: Segment
    k: int
    index_start: int  # int32 slot of its first index
    code_start: int  # byte offset of its codes
    code_bytes: int

    @property
    def bins(self) -> int:
        return self.segment.numel // 2 + 1


@dataclass
class _FFTPlan:
    spectra: tuple[_Spectrum, ...]
    dense: DensePart | None
    payload: torch.Tensor
    gathered: torch.Tensor
    local: torch.Tensor  # x_hat of this rank (velocity where dense): what memory subtracts
    total_k: int


@register
class FFTCompressor(AdjustableRatio, PlannedCompressor[_FFTPlan]):
    """Top frequency components of each large tensor, sent as range-based few-bit floats.

    Args:
        compress_ratio: real values' worth sent per compressed tensor, in (0, 1]: ``k =
            ceil(ratio * n / 2)`` complex coefficients (each carries two reals).
        bits: bits per real or imaginary part, one of 4, 8, 16 (sign + range-sized exponent +
            mantissa; see :mod:`lightning_gc.compressors.rangefloat`).
        min_compress_numel: tensors with fewer elements (and 1-D tensors) are sent dense.
    """

    name = "fft"
    arguments = ("compress_ratio", "bits", "min_compress_numel")

    def __init__(self, compress_ratio: float = 0.01, *, bits: int = 8, min_compress_numel: int = 1024) -> None:
        super().__init__()
        self.compress_ratio = compress_ratio
        self.bits = check_choice("bits", bits, rangefloat.CODE_BITS)
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 2)

    def k_for(self, numel: int) -> int:
        """Coefficients kept of a tensor of ``numel`` elements."""
        return min(numel // 2 + 1, self.ratio_of(numel / 2))

    def _sizes(self, layout: BucketLayout) -> tuple[list[_Spectrum], list[Segment], int, int]:
        """(spectra, dense segments, total k, payload bytes)."""
        compressed, dense = split_segments(layout.segments, self.min_compress_numel)
        total_k = sum(self.k_for(s.numel) for s in compressed)
        offset = 4 * (2 * len(compressed) + total_k)  # headers, then indices
        spectra, index_start = [], 0
        for segment in compressed:
            k = self.k_for(segment.numel)
            code_bytes = aligned(rangefloat.packed_size(2 * k, self.bits))
            spectra.append(_Spectrum(segment, k, index_start, offset, code_bytes))
            index_start += k
            offset += code_bytes
        return spectra, dense, total_k, offset

    def wire_bytes(self, layout: BucketLayout, element_size: int) -> int:
        spectra, dense, _, payload_bytes = self._sizes(layout)
        if not spectra:
            return layout.numel * element_size
        return payload_bytes + sum(s.numel for s in dense) * element_size

    def build_plan(self, layout: BucketLayout, like: torch.Tensor, world_size: int) -> _FFTPlan:
        spectra, dense, total_k, payload_bytes = self._sizes(layout)
        return _FFTPlan(
            spectra=tuple(spectra),
            dense=DensePart.of(dense, like),
            payload=torch.zeros(payload_bytes, dtype=torch.uint8, device=like.device),
            gathered=torch.empty(world_size * payload_bytes, dtype=torch.uint8, device=like.device),
            local=like.new_empty(layout.numel),
            total_k=total_k,
        )

    # ------------------------------------------------------------------ encode / decode
    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        plan = self.plan(context, velocity)
        if not plan.spectra:
            return encode_whole_bucket(velocity, out)
        headers, indices = self._views(plan.payload, plan)
        for position, spectrum in enumerate(plan.spectra):
            x = spectrum.segment.of(velocity)
            coefficients = torch.fft.rfft(x.float())
            kept = torch.topk(coefficients.abs(), spectrum.k, sorted=False).indices
            parts = torch.view_as_real(coefficients[kept]).reshape(-1)
            head = rangefloat.header(parts, self.bits)
            codes = rangefloat.encode(parts, head, self.bits)
            headers[position].copy_(head)
            indices[spectrum.index_start : spectrum.index_start + spectrum.k].copy_(kept)
            packed = rangefloat.pack(codes, self.bits)
            plan.payload[spectrum.code_start : spectrum.code_start + packed.numel()].copy_(packed)
            decoded = torch.zeros_like(coefficients)
            decoded[kept] = torch.view_as_complex(rangefloat.decode(codes, head, self.bits).view(-1, 2))
            spectrum.segment.of(plan.local).copy_(torch.fft.irfft(decoded, n=x.numel()))
        summed = None
        if plan.dense is not None:
            summed = plan.dense.gather(velocity)
            plan.local.index_copy_(0, plan.dense.positions, summed)  # dense tensors leave exactly
        return Encoded(
            summed=summed,
            gathered=plan.payload,
            gathered_out=plan.gathered,
            dense_all=True,
            dense_sent=plan.local,
            bytes_sent=plan.payload.numel() + (0 if summed is None else summed.numel() * summed.element_size()),
            elements_sent=2 * plan.total_k + (0 if summed is None else summed.numel()),
            context=plan,
        )

    @staticmethod
    def _views(payload: torch.Tensor, plan: _FFTPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(headers ``[tensors, 2]``, indices) int32 views of one rank's payload."""
        count = len(plan.spectra)
        header_end, index_end = 8 * count, 8 * count + 4 * plan.total_k
        return payload[:header_end].view(torch.int32).view(count, 2), payload[header_end:index_end].view(torch.int32)

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        if decode_whole_bucket(encoded, out, world_size):
            return
        plan: _FFTPlan = encoded.context
        rows = plan.gathered.view(world_size, -1)
        for position, spectrum in enumerate(plan.spectra):
            total = torch.zeros(spectrum.bins, dtype=torch.complex64, device=out.device)
            for row in rows:
                headers, indices = self._views(row, plan)
                packed = row[spectrum.code_start : spectrum.code_start + spectrum.code_bytes]
                codes = rangefloat.unpack(packed, self.bits, 2 * spectrum.k)
                parts = rangefloat.decode(codes, headers[position], self.bits).view(-1, 2)
                kept = indices[spectrum.index_start : spectrum.index_start + spectrum.k].long()
                total.index_add_(0, kept, torch.view_as_complex(parts.contiguous()))
            signal = torch.fft.irfft(total, n=spectrum.segment.numel)
            spectrum.segment.of(out).copy_(signal.div_(world_size))
        if plan.dense is not None:
            plan.dense.write_mean(out, world_size)
