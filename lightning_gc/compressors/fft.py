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

With ``exchange="two_phase"`` (:mod:`lightning_gc.exchanges.two_phase`) each rank owns the
``r``-th piece of every tensor: a compressed tensor's piece is transformed and sparsified on its
own (the same rule on a contiguous run of the flattened tensor, ``k`` from the piece's size), and
the pieces of dense tensors travel as float32 values in the same payload, after the codes. The
owner averages what it received, re-encodes the average the same way (with server error feedback:
the compressor is biased) and every rank gathers every piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_gc.common.layout import BucketLayout, Segment
from lightning_gc.common.validation import check_choice, check_int
from lightning_gc.compressors import rangefloat
from lightning_gc.compressors.base import AdjustableRatio, EncodeContext, PlannedCompressor, split_segments
from lightning_gc.compressors.chunks import ChunkFormat, ExchangeChoice
from lightning_gc.compressors.dense import DenseBlock, DensePart, decode_whole_bucket, encode_whole_bucket
from lightning_gc.compressors.encoded import Encoded, Payload, Sent
from lightning_gc.compressors.numerics import aligned
from lightning_gc.compressors.registry import register


@dataclass(frozen=True)
class _Spectrum:
    """One compressed tensor (or piece): ``k`` coefficients kept, and where its parts sit in the payload."""

    segment: Segment
    k: int
    index_start: int  # int32 slot of its first index
    code_start: int  # byte offset of its codes
    code_bytes: int

    @property
    def bins(self) -> int:
        return self.segment.numel // 2 + 1


@dataclass(frozen=True)
class _SpectraLayout:
    """A payload's spectra (headers, then indices, then codes) and its dense values (float32) after them."""

    spectra: tuple[_Spectrum, ...]
    dense: DenseBlock  # the dense tensors' (pieces') float32 values, after the codes
    total_k: int


@dataclass
class _FFTPlan:
    fmt: ChunkFormat  # the compressed tensors' payload (the dense ones are all-reduced)
    dense: DensePart | None
    payload: torch.Tensor
    gathered: torch.Tensor
    local: torch.Tensor  # x_hat of this rank (velocity where dense): what memory subtracts

    @property
    def layout(self) -> _SpectraLayout:
        return self.fmt.layout


@register
class FFTCompressor(AdjustableRatio, ExchangeChoice, PlannedCompressor[_FFTPlan]):
    """Top frequency components of each large tensor, sent as range-based few-bit floats.

    Args:
        compress_ratio: real values' worth sent per compressed tensor, in (0, 1]: ``k =
            ceil(ratio * n / 2)`` complex coefficients (each carries two reals).
        bits: bits per real or imaginary part, one of 4, 8, 16 (sign + range-sized exponent +
            mantissa; see :mod:`lightning_gc.compressors.rangefloat`).
        min_compress_numel: tensors with fewer elements (and 1-D tensors) are sent dense.
        exchange, server_feedback: ``"gather"`` (default), ``"two_phase"`` or ``"auto"``, and the
            owner's error feedback, on unless ``False`` (see :mod:`lightning_gc.exchanges.two_phase`).
    """

    name = "fft"
    server_feedback_default = True  # re-encoding the mean keeps a few of its bins: feed the rest back
    arguments = ("compress_ratio", "bits", "min_compress_numel", *ExchangeChoice.exchange_arguments)

    def __init__(
        self,
        compress_ratio: float = 0.01,
        *,
        bits: int = 8,
        min_compress_numel: int = 1024,
        exchange: str = "gather",
        server_feedback: bool | None = None,
    ) -> None:
        super().__init__()
        self.compress_ratio = compress_ratio
        self.bits = check_choice("bits", bits, rangefloat.CODE_BITS)
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 2)
        self.init_exchange(exchange, server_feedback)

    def k_for(self, numel: int) -> int:
        """Coefficients kept of a tensor of ``numel`` elements."""
        return min(numel // 2 + 1, self.ratio_of(numel / 2))

    # ------------------------------------------------------------------ payload of a run of tensors
    def chunk_format(self, segments: Sequence[Segment], dtype: torch.dtype | None = None) -> ChunkFormat:
        """Headers of the compressed tensors, their indices, their codes (each from a 4-byte
        boundary), then the dense tensors' float32 values. Which tensors are compressed follows the
        whole tensor (:func:`~lightning_gc.compressors.base.split_segments`); empty pieces send nothing."""
        compressed, dense = split_segments([s for s in segments if s.numel], self.min_compress_numel)
        total_k = sum(self.k_for(s.numel) for s in compressed)
        offset = 4 * (2 * len(compressed) + total_k)  # headers, then indices
        spectra, index_start = [], 0
        for segment in compressed:
            k = self.k_for(segment.numel)
            code_bytes = aligned(rangefloat.packed_size(2 * k, self.bits))
            spectra.append(_Spectrum(segment, k, index_start, offset, code_bytes))
            index_start += k
            offset += code_bytes
        block = DenseBlock(tuple(dense), offset)
        layout = _SpectraLayout(tuple(spectra), block, total_k)
        return ChunkFormat(segments=tuple(segments), nbytes=aligned(offset + block.nbytes), layout=layout)

    def encode_chunk(
        self, values: torch.Tensor, fmt: ChunkFormat, payload: torch.Tensor, decoded: torch.Tensor, seed: int
    ) -> None:
        layout: _SpectraLayout = fmt.layout
        headers, indices = self._views(payload, layout)
        for position, spectrum in enumerate(layout.spectra):
            x = spectrum.segment.of(values)
            coefficients = torch.fft.rfft(x.float())
            kept = torch.topk(coefficients.abs(), spectrum.k, sorted=False).indices
            parts = torch.view_as_real(coefficients[kept]).reshape(-1)
            head = rangefloat.header(parts, self.bits)
            codes = rangefloat.encode(parts, head, self.bits)
            headers[position].copy_(head)
            indices[spectrum.index_start : spectrum.index_start + spectrum.k].copy_(kept)
            packed = rangefloat.pack(codes, self.bits)
            payload[spectrum.code_start : spectrum.code_start + packed.numel()].copy_(packed)
            spectrum_of_sent = torch.zeros_like(coefficients)
            spectrum_of_sent[kept] = torch.view_as_complex(rangefloat.decode(codes, head, self.bits).view(-1, 2))
            signal = torch.fft.irfft(spectrum_of_sent, n=x.numel())
            spectrum.segment.of(decoded).copy_(_within(signal, decoded.dtype))  # as receivers clamp it
        layout.dense.encode(values, payload, decoded)  # float32 on the wire: memory keeps a wider gradient's rounding

    def add_decoded_chunk(
        self, payload: torch.Tensor, fmt: ChunkFormat, total: torch.Tensor, dtype: torch.dtype
    ) -> None:
        layout: _SpectraLayout = fmt.layout
        for position, spectrum in enumerate(layout.spectra):
            coefficients = torch.zeros(spectrum.bins, dtype=torch.complex64, device=total.device)
            coefficients.index_add_(0, *self._coefficients(payload, layout, position))
            signal = torch.fft.irfft(coefficients, n=spectrum.segment.numel)
            spectrum.segment.of(total).add_(_within(signal, dtype))
        layout.dense.add_into(payload, total)

    @staticmethod
    def _views(payload: torch.Tensor, layout: _SpectraLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """(headers ``[tensors, 2]``, indices) int32 views of one payload."""
        count = len(layout.spectra)
        header_end, index_end = 8 * count, 8 * count + 4 * layout.total_k
        return payload[:header_end].view(torch.int32).view(count, 2), payload[header_end:index_end].view(torch.int32)

    # ------------------------------------------------------------------ the whole bucket, all-gathered
    def wire_bytes(self, layout: BucketLayout, element_size: int) -> int:
        compressed, dense = split_segments(layout.segments, self.min_compress_numel)
        if not compressed:
            return layout.numel * element_size
        return self.chunk_format(compressed).nbytes + sum(s.numel for s in dense) * element_size

    def build_plan(self, layout: BucketLayout, like: torch.Tensor, world_size: int) -> _FFTPlan:
        compressed, dense = split_segments(layout.segments, self.min_compress_numel)
        fmt = self.chunk_format(compressed)
        return _FFTPlan(
            fmt=fmt,
            dense=DensePart.of(dense, like),
            payload=torch.zeros(fmt.nbytes, dtype=torch.uint8, device=like.device),
            gathered=torch.empty(world_size * fmt.nbytes, dtype=torch.uint8, device=like.device),
            local=like.new_empty(layout.numel),
        )

    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        plan = self.plan(context, velocity)
        if not plan.layout.spectra:
            return encode_whole_bucket(velocity, out)
        self.encode_chunk(velocity, plan.fmt, plan.payload, plan.local, seed=0)
        summed = None
        if plan.dense is not None:
            summed = plan.dense.gather(velocity)
            plan.local.index_copy_(0, plan.dense.positions, summed)  # dense tensors leave exactly
        payload = Payload.all_gather(plan.payload, plan.gathered, elements_sent=2 * plan.layout.total_k, summed=summed)
        return Encoded(payload, Sent.whole(plan.local), context=plan)

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        """Every rank's coefficients added into one spectrum per tensor, one ``irfft`` (the
        transform is linear), divided by ``N``; the dense tensors' all-reduced mean."""
        if decode_whole_bucket(encoded, out, world_size):
            return
        plan: _FFTPlan = encoded.context
        rows = plan.gathered.view(world_size, -1)
        for position, spectrum in enumerate(plan.layout.spectra):
            total = torch.zeros(spectrum.bins, dtype=torch.complex64, device=out.device)
            for row in rows:
                total.index_add_(0, *self._coefficients(row, plan.layout, position))
            signal = torch.fft.irfft(total, n=spectrum.segment.numel)
            spectrum.segment.of(out).copy_(signal.div_(world_size))
        if plan.dense is not None:
            plan.dense.write_mean(out, world_size)

    def _coefficients(
        self, payload: torch.Tensor, layout: _SpectraLayout, position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(bin indices, decoded complex coefficients) of spectrum ``position`` in ``payload``."""
        spectrum = layout.spectra[position]
        headers, indices = self._views(payload, layout)
        packed = payload[spectrum.code_start : spectrum.code_start + spectrum.code_bytes]
        codes = rangefloat.unpack(packed, self.bits, 2 * spectrum.k)
        parts = rangefloat.decode(codes, headers[position], self.bits).view(-1, 2)
        kept = indices[spectrum.index_start : spectrum.index_start + spectrum.k].long()
        return kept, torch.view_as_complex(parts.contiguous())


def _within(signal: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``signal`` (float32) clamped in place to ``dtype``'s finite range when that is narrower
    (fp16): the decoded value memory subtracts must be one receivers can hold."""
    limit = torch.finfo(dtype).max
    return signal.clamp_(-limit, limit) if limit < torch.finfo(signal.dtype).max else signal
