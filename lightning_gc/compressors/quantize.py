"""Quantising compressors: every element as a few-bit code, one float32 scale per tensor.

Payload per rank and bucket (all-gathered, the same size on every rank)::

    [ scale of tensor 0 .. S-1 : float32 ][ codes of tensor 0 ][ codes of tensor 1 ] ... (4-byte padded)

Each tensor's codes start on a byte boundary. Decoding sums every rank's dequantised values and
divides by the world size.

* ``qsgd`` (Alistarh et al. 2017): ``x -> ||x||_2 * sign(x) * l / s`` with the level ``l`` rounded
  stochastically so that the result is unbiased; ``s`` = ``levels``.
* ``terngrad`` (Wen et al. 2017): ternary ``max|x| * sign(x) * b`` with ``b ~ Bernoulli(|x| / max|x|)``,
  i.e. the same stochastic rounding with one level and scale ``max|x|``; unbiased, 2-bit codes.
* ``onebit`` (EF-signSGD, Karimireddy et al. 2019): ``mean|x| * sign(x)``, 1 bit per element;
  biased, so error feedback keeps what the signs lose.

Rounding randomness is a pure function of (step, rank, tensor), so runs are reproducible and ranks
draw independently.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gc import kernels
from lightning_gc._validation import check_int
from lightning_gc.compressors.base import Compressor, Encoded
from lightning_gc.compressors.registry import register
from lightning_gc.kernels.reference import packed_bytes
from lightning_gc.layout import BucketLayout

_SEED_STEP, _SEED_RANK = 1_000_003, 7_919


@dataclass
class _QuantPlan:
    layout: BucketLayout
    world_size: int
    code_offsets: tuple[int, ...]  # byte offset of each tensor's codes in the payload
    code_sizes: tuple[int, ...]
    payload: torch.Tensor
    gathered: torch.Tensor
    decoded: torch.Tensor  # this rank's values as receivers decode them (for error feedback)


class _PerTensorQuantizer(Compressor):
    """Shared payload layout, encode and decode; subclasses define scale and codes."""

    code_bits: int

    def __init__(self) -> None:
        self._plans: dict[int, _QuantPlan] = {}

    @abstractmethod
    def scale_of(self, values: torch.Tensor) -> torch.Tensor:
        """The tensor's float32 scale, a 0-d tensor on its device."""

    @abstractmethod
    def encode_codes(self, values: torch.Tensor, scale: torch.Tensor, seed: int) -> torch.Tensor:
        """Packed codes (uint8) of ``values``."""

    @abstractmethod
    def decode_codes(self, codes: torch.Tensor, scale: torch.Tensor, numel: int) -> torch.Tensor:
        """float32 values of packed ``codes``."""

    def _layout_bytes(self, layout: BucketLayout) -> tuple[list[int], list[int], int]:
        """(byte offset of each tensor's codes, their sizes, the padded payload size)."""
        offset = 4 * len(layout.segments)
        offsets, sizes = [], []
        for segment in layout.segments:
            offsets.append(offset)
            sizes.append(packed_bytes(segment.numel, self.code_bits))
            offset += sizes[-1]
        return offsets, sizes, -(-offset // 4) * 4

    def wire_bytes(self, layout: BucketLayout, element_size: int) -> int:
        return self._layout_bytes(layout)[2]

    def _plan(self, layout: BucketLayout, like: torch.Tensor, world_size: int) -> _QuantPlan:
        plan = self._plans.get(layout.index)
        if plan is not None and plan.layout is layout and plan.world_size == world_size:
            return plan
        offsets, sizes, payload_bytes = self._layout_bytes(layout)
        plan = _QuantPlan(
            layout=layout,
            world_size=world_size,
            code_offsets=tuple(offsets),
            code_sizes=tuple(sizes),
            payload=torch.zeros(payload_bytes, dtype=torch.uint8, device=like.device),
            gathered=torch.empty(world_size * payload_bytes, dtype=torch.uint8, device=like.device),
            decoded=like.new_empty(layout.numel),
        )
        self._plans[layout.index] = plan
        return plan

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
        scales = plan.payload[: 4 * len(layout.segments)].view(torch.float32)
        for position, segment in enumerate(layout.segments):
            values = segment.of(velocity)
            scales[position] = self.scale_of(values)
            seed = step * _SEED_STEP + rank * _SEED_RANK + segment.order
            start = plan.code_offsets[position]
            codes = self.encode_codes(values, scales[position], seed)
            plan.payload[start : start + plan.code_sizes[position]].copy_(codes)
            segment.of(plan.decoded).copy_(self.decode_codes(codes, scales[position], segment.numel))
        return Encoded(
            gathered=plan.payload,
            gathered_out=plan.gathered,
            dense_all=True,
            bytes_sent=plan.payload.numel(),
            elements_sent=velocity.numel(),
            context=plan,
            dense_sent=plan.decoded,
        )

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        plan: _QuantPlan = encoded.context
        rows = plan.gathered.view(world_size, -1)
        count = len(plan.layout.segments)
        out.zero_()
        for row in rows:
            scales = row[: 4 * count].view(torch.float32)
            for position, segment in enumerate(plan.layout.segments):
                start = plan.code_offsets[position]
                codes = row[start : start + plan.code_sizes[position]]
                segment.of(out).add_(self.decode_codes(codes, scales[position], segment.numel))
        out.div_(world_size)


class _StochasticLevels(_PerTensorQuantizer):
    levels: int

    def encode_codes(self, values: torch.Tensor, scale: torch.Tensor, seed: int) -> torch.Tensor:
        return kernels.stochastic_quantize(values, scale, self.levels, seed)

    def decode_codes(self, codes: torch.Tensor, scale: torch.Tensor, numel: int) -> torch.Tensor:
        return kernels.stochastic_dequantize(codes, scale, self.levels, numel)


@register
class QSGDCompressor(_StochasticLevels):
    """QSGD: ``levels`` stochastic levels of ``|x| / ||x||_2`` per tensor, unbiased.

    Args:
        levels: quantisation levels ``s`` in [2, 127] (one level is TernGrad); codes take 4 bits
            up to 7 levels, 8 bits up to 127 (the sign is one of the bits).
    """

    name = "qsgd"
    biased = False

    def __init__(self, levels: int = 7) -> None:
        super().__init__()
        self.levels = check_int("levels", levels, 2, 127)
        self.code_bits = kernels.code_width(levels)

    def scale_of(self, values: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(values.float())

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "levels": self.levels}


@register
class TernGradCompressor(_StochasticLevels):
    """TernGrad: unbiased ternary ``{-1, 0, +1} * max|x|`` per tensor, 2 bits per element."""

    name = "terngrad"
    biased = False
    levels = 1
    code_bits = 2

    def scale_of(self, values: torch.Tensor) -> torch.Tensor:
        return values.float().abs().max()

    def config(self) -> dict[str, Any]:
        return {"name": self.name}


@register
class OneBitCompressor(_PerTensorQuantizer):
    """EF-signSGD: ``mean|x| * sign(x)`` per tensor, 1 bit per element, with error feedback."""

    name = "onebit"
    code_bits = 1

    def scale_of(self, values: torch.Tensor) -> torch.Tensor:
        return values.float().abs().mean()

    def encode_codes(self, values: torch.Tensor, scale: torch.Tensor, seed: int) -> torch.Tensor:
        return kernels.pack_signs(values)

    def decode_codes(self, codes: torch.Tensor, scale: torch.Tensor, numel: int) -> torch.Tensor:
        negative = kernels.unpack_codes(codes, 1, numel).bool()
        magnitude = scale.float().expand(numel)
        return torch.where(negative, -magnitude, magnitude)

    def config(self) -> dict[str, Any]:
        return {"name": self.name}
