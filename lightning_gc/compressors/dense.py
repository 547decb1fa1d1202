"""The dense part of a compressed bucket: the tensors that leave whole, not compressed.

Biases, norms and small tensors (those :func:`~lightning_gc.compressors.base.compressible` rejects)
and whole buckets sent uncompressed travel in one of three ways:

* :class:`DensePart` -- gathered into a send buffer that is all-reduced beside the compressed
  payload, then its mean written back into the bucket;
* :class:`DenseBlock` -- carried inside a gathered (or two-phase) payload as one block of values in
  the wire dtype: tensors of at least :data:`GATHER_BELOW` elements copied one by one, the smaller
  ones moved by one gather on encode and one scatter-add on decode;
* :func:`encode_whole_bucket` / :func:`decode_whole_bucket` -- the bucket's velocity sent whole
  and exactly through one all-reduce in the gradient buffer, then divided by the world size.

Invariant: what memory subtracts is what receivers decode. A float32 wire (the default of a
:class:`DenseBlock`) carries every fp16, bf16 and float32 value exactly, so error feedback keeps
nothing of it; a narrower wire saturates so that the sum over ranks stays finite
(:func:`~lightning_gc.compressors.numerics.saturating_copy_`) and rounds, and the decoded values
(``Sent.dense_values``) say so, leaving the rounding in the residual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lightning_gc.common.layout import Segment, segment_positions
from lightning_gc.compressors.encoded import Encoded, Payload, Sent
from lightning_gc.compressors.numerics import mean_into, saturating_copy_


@dataclass
class DensePart:
    """The tensors of a bucket sent whole (through an all-reduce) while the rest is compressed.

    ``values`` is the send buffer: :meth:`gather` fills it from the velocity, the collective sums
    it over ranks in place, :meth:`write_mean` writes the mean back into the bucket. A send buffer
    narrower than the velocity (e.g. fp16) is summed in that dtype; as with the ``fp16``
    compressor, :attr:`sent` then hands memory the rounded values so the rounding stays in the
    residual. ``staging`` is the velocity-dtype scratch such a buffer needs (else ``None``).
    """

    positions: torch.Tensor  # int64 bucket positions, in segment order
    values: torch.Tensor
    staging: torch.Tensor | None = None

    @staticmethod
    def of(
        segments: Sequence[Segment],
        like: torch.Tensor,
        values: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> DensePart | None:
        """The dense part made of ``segments`` (``None`` if there are none); ``values`` may be a
        caller-owned buffer of their total size (e.g. the tail of a larger send buffer), ``dtype``
        the wire dtype of a buffer made here (default: ``like``'s)."""
        if not segments:
            return None
        return DensePart.over(segment_positions(segments, like.device), like, values, dtype)

    @staticmethod
    def over(
        positions: torch.Tensor,
        like: torch.Tensor,
        values: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> DensePart:
        """The dense part at the distinct bucket ``positions`` (int64; the caller may rewrite them
        in place between steps, e.g. the positions a global top-k agreed on); ``values`` and
        ``dtype`` as for :meth:`of`."""
        if values is None:
            values = torch.empty(positions.numel(), dtype=dtype or like.dtype, device=like.device)
        elif values.numel() != positions.numel():
            raise ValueError(f"dense buffer holds {values.numel()} elements, the positions {positions.numel()}")
        staging = None if values.dtype == like.dtype else like.new_empty(positions.numel())
        return DensePart(positions=positions, values=values, staging=staging)

    @property
    def sent(self) -> torch.Tensor | None:
        """What receivers decode when the wire dtype differs from the velocity's (``Sent.dense_values``:
        memory subtracts it before the collective overwrites it); ``None`` when the values leave exactly."""
        return None if self.staging is None else self.values

    def gather(self, velocity: torch.Tensor, world_size: int = 1) -> torch.Tensor:
        """Copy the dense positions of ``velocity`` into the send buffer and return it; a narrow
        buffer saturates so that the sum over ``world_size`` ranks stays finite."""
        if self.staging is None:
            return torch.index_select(velocity, 0, self.positions, out=self.values)
        exact = torch.index_select(velocity, 0, self.positions, out=self.staging)
        return saturating_copy_(self.values, exact, world_size)

    def write_mean(self, out: torch.Tensor, world_size: int) -> None:
        """After the all-reduce: ``out[positions] = summed values / world_size``."""
        mean = mean_into(self.values if self.staging is None else self.staging, self.values, world_size)
        out.index_copy_(0, self.positions, mean)


GATHER_BELOW = 4096
"""Tensors of a :class:`DenseBlock` with fewer elements move in one gather for all of them; larger
ones are copied one by one, at full bandwidth (a gather also reads an int64 position per value)."""


@dataclass(frozen=True)
class DenseBlock:
    """Whole tensors carried inside a payload as one block of values in the wire ``dtype``, from
    byte ``start`` (a multiple of the dtype's size): first the values of each tensor of at least
    :data:`GATHER_BELOW` elements, then those of the smaller ones, each group in segment order.

    In float32 (the default) every fp16, bf16 and float32 value leaves exactly: what receivers
    decode equals the velocity, and error feedback keeps nothing of it. A narrower wire dtype
    saturates (:func:`~lightning_gc.compressors.numerics.saturating_copy_`) and rounds, and the
    decoded values say so. Each large tensor is one copy; all the small ones together are one gather
    on encode and one scatter-add on decode, however many there are (a model's dozens of biases and
    norms would otherwise cost a few ops each, which on a GPU are kernel launches). The gather's
    positions are built once per device.
    """

    segments: tuple[Segment, ...]
    start: int
    dtype: torch.dtype = torch.float32
    numel: int = field(init=False)
    copied: tuple[Segment, ...] = field(init=False)
    gathered: tuple[Segment, ...] = field(init=False)
    _positions: dict[torch.device, torch.Tensor] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", sum(segment.numel for segment in self.segments))
        object.__setattr__(self, "copied", tuple(s for s in self.segments if s.numel >= GATHER_BELOW))
        object.__setattr__(self, "gathered", tuple(s for s in self.segments if s.numel < GATHER_BELOW))

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def positions(self, device: torch.device) -> torch.Tensor:
        """The bucket positions (int64) of the gathered tensors' values, in block order."""
        cached = self._positions.get(device)
        if cached is None:
            cached = self._positions[device] = segment_positions(self.gathered, device)
        return cached

    def values_in(self, payload: torch.Tensor) -> torch.Tensor:
        """The block's view inside ``payload`` (uint8), in the wire dtype."""
        return payload[self.start : self.start + self.nbytes].view(self.dtype)

    def encode(self, values: torch.Tensor, payload: torch.Tensor, decoded: torch.Tensor) -> None:
        """Copy the segments of ``values`` (bucket-sized) into the block of ``payload``, and what
        receivers will read (the wire values, in ``decoded``'s dtype) into ``decoded``."""
        block, offset = self.values_in(payload), 0
        for segment in self.copied:
            wire = block[offset : offset + segment.numel]
            segment.of(decoded).copy_(saturating_copy_(wire, segment.of(values)))
            offset += segment.numel
        if not self.gathered:
            return
        tail, positions = block[offset:], self.positions(values.device)
        if values.dtype == self.dtype:
            torch.index_select(values, 0, positions, out=tail)
        else:
            saturating_copy_(tail, values.index_select(0, positions))
        decoded.index_copy_(0, positions, tail.to(decoded.dtype))

    def add_into(self, payload: torch.Tensor, total: torch.Tensor) -> None:
        """``total[segments] += `` the block's values (``total`` bucket-sized)."""
        block, offset = self.values_in(payload), 0
        for segment in self.copied:
            segment.of(total).add_(block[offset : offset + segment.numel])
            offset += segment.numel
        if self.gathered:
            total.index_add_(0, self.positions(total.device), block[offset:].to(total.dtype))


def encode_whole_bucket(velocity: torch.Tensor, out: torch.Tensor) -> Encoded:
    """The bucket's velocity, sent whole and exactly through one all-reduce in ``out``; the
    compressor's decode finishes it with :func:`decode_whole_bucket`."""
    numel = velocity.numel()
    payload = Payload(summed=out.copy_(velocity), bytes_sent=numel * velocity.element_size(), elements_sent=numel)
    return Encoded(payload, Sent.whole())


def decode_whole_bucket(encoded: Encoded, out: torch.Tensor, world_size: int) -> bool:
    """Finish a bucket from :func:`encode_whole_bucket` (``out`` was the all-reduce buffer, so the
    mean is ``out / N``) and return ``True``; return ``False`` for any other encoding."""
    if encoded.payload.summed is not out:
        return False
    out.div_(world_size)
    return True
