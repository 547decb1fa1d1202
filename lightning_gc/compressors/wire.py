"""Byte layouts of a sparse payload: ``n`` (index, value) pairs of one bucket in one flat buffer.

One flat ``uint8`` buffer per rank means one all-gather per bucket. Its size is a pure function
of ``n`` (the bucket's total ``k``), the bucket's size ``universe`` (every index lies in
``[0, universe)``) and the value dtype; every rank sends the same ``n`` for the same layout, so
every rank's buffer has the same size and no size exchange is needed. Sizes are padded to 4 bytes,
which keeps each rank's row of the gathered ``[world, bytes]`` buffer aligned for dtype views.

Two index encodings share the interface (:meth:`SparseWireFormat.payload_bytes`,
:meth:`~SparseWireFormat.pack`, :meth:`~SparseWireFormat.unpack`):

* ``"int32"`` (:class:`Int32Indices`): ``n`` int32 indices, then ``n`` values. 32 bits per index.
* ``"elias_fano"`` (:class:`EliasFanoIndices`): ``n`` values, then the indices, sorted, as an
  Elias--Fano code: about ``2 + log2(universe / n)`` bits per index (12 at 0.1 % density).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from lightning_gc import kernels
from lightning_gc.compressors.numerics import aligned, saturating_copy_

VALUE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
INDEX_DTYPE = torch.int32
_INDEX_BYTES = 4


def _field_rows(gathered: torch.Tensor, world_size: int, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's ``count`` elements of ``dtype`` at byte ``start`` of its row, flattened rank after rank."""
    rows = gathered.view(world_size, -1)
    return rows[:, start : start + count * dtype.itemsize].view(dtype).reshape(-1)


class SparseWireFormat(ABC):
    """Packs one bucket's (index, value) pairs into bytes and reads all ranks' pairs back.

    Args:
        value_dtype: dtype of the values on the wire.
    """

    name: str

    def __init__(self, value_dtype: torch.dtype) -> None:
        self.value_dtype = value_dtype
        self.value_bytes = value_dtype.itemsize

    @abstractmethod
    def payload_bytes(self, n: int, universe: int) -> int:
        """Bytes on the wire for ``n`` pairs with indices in ``[0, universe)`` (a multiple of 4)."""

    @abstractmethod
    def pack(self, payload: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, universe: int) -> torch.Tensor:
        """Write the pairs ``(indices, values)`` into ``payload`` (``payload_bytes`` bytes); return
        the values as receivers decode them, in the caller's pair order.

        With a wire dtype narrower than ``values``' the result is the rounded values (in
        ``values``' dtype, saturated at the wire dtype's largest finite value), so memory can keep
        exactly what rounding and saturation dropped; otherwise it is ``values`` itself. Indices
        may repeat.
        """

    @abstractmethod
    def unpack(
        self, gathered: torch.Tensor, world_size: int, n: int, universe: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All ranks' (indices, values) from the gathered ``world_size`` payloads, each flattened to
        ``world_size * n``, rank after rank. The values are in the wire dtype."""

    def _value_rows(self, gathered: torch.Tensor, world_size: int, start: int, n: int) -> torch.Tensor:
        """The values of every rank: ``n`` of the wire dtype at byte ``start`` of each row."""
        return _field_rows(gathered, world_size, start, n, self.value_dtype)

    def _as_decoded(self, values: torch.Tensor, wire_values: torch.Tensor) -> torch.Tensor:
        """``values`` as receivers decode them, given their copy in the wire dtype."""
        return values if values.dtype == self.value_dtype else wire_values.to(values.dtype)


def check_int32_positions(universe: int) -> None:
    """Raise ``ValueError`` for a bucket of more elements than int32 positions address (they would
    wrap to negative ones: an out-of-bounds write on a GPU)."""
    if universe > torch.iinfo(INDEX_DTYPE).max + 1:
        raise ValueError(
            f"a bucket of {universe} elements has positions past int32's {torch.iinfo(INDEX_DTYPE).max}; "
            "use index_encoding='elias_fano' or a smaller bucket_cap_mb (a tensor this large alone needs "
            "index_encoding='elias_fano')"
        )


class Int32Indices(SparseWireFormat):
    """``n`` int32 indices, then ``n`` values, padded to 4 bytes; pairs keep the caller's order."""

    name = "int32"

    def payload_bytes(self, n: int, universe: int) -> int:
        check_int32_positions(universe)
        return aligned(n * (_INDEX_BYTES + self.value_bytes))

    def pack(self, payload: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, universe: int) -> torch.Tensor:
        n = indices.numel()
        payload[: n * _INDEX_BYTES].view(INDEX_DTYPE).copy_(indices)
        value_end = n * (_INDEX_BYTES + self.value_bytes)
        value_view = payload[n * _INDEX_BYTES : value_end].view(self.value_dtype)
        saturating_copy_(value_view, values)
        payload[value_end:].zero_()  # padding: sent, so keep it deterministic
        return self._as_decoded(values, value_view)

    def unpack(
        self, gathered: torch.Tensor, world_size: int, n: int, universe: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        indices = _field_rows(gathered, world_size, 0, n, INDEX_DTYPE)
        return indices, self._value_rows(gathered, world_size, n * _INDEX_BYTES, n)


def low_bits(n: int, universe: int) -> int:
    """Elias--Fano's low-part width ``l = max(0, floor(log2(universe / n)))``, in integers."""
    return max(0, (universe // n).bit_length() - 1) if n > 0 else 0


def elias_fano_bits(n: int, universe: int) -> int:
    """Bits of the Elias--Fano code of ``n`` integers in ``[0, universe)``: ``n`` low parts of
    ``l`` bits, then the high-part bitvector of ``n + (universe >> l) + 1`` bits."""
    width = low_bits(n, universe)
    return n * width + n + (universe >> width) + 1


class EliasFanoIndices(SparseWireFormat):
    """``n`` values, then the sorted indices as one Elias--Fano code, padded to 4 bytes.

    The pairs are sorted by index (values move with them; ties keep the caller's order) and the
    non-decreasing indices ``x_0 <= ... <= x_{n-1}`` in ``[0, universe)`` are coded as

    * low parts ``x_i & (2^l - 1)``, ``l`` bits each, packed densely (bit ``j`` of ``x_i`` is bit
      ``i * l + j`` of the stream), with ``l = max(0, floor(log2(universe / n)))``;
    * high parts ``h_i = x_i >> l`` as a bitvector of ``n + (universe >> l) + 1`` bits with bit
      ``h_i + i`` set. Decoding finds the positions ``p_i`` of the ``n`` set bits: ``h_i = p_i - i``.

    Both parts form one bit stream, packed 8 bits per byte, least significant first
    (:func:`lightning_gc.kernels.pack_codes` with 1-bit codes). Duplicate indices are allowed
    (the Triton selection pads with no-op pairs). Values come first so their views stay aligned.

    Everything is vectorised torch, identical on CPU and CUDA, without host syncs (the set bits
    are found with ``torch.nonzero_static``, whose size ``world * n`` is known). Indices outside
    ``[0, universe)`` are a caller bug; they are not checked, as that would need a sync. Unlike
    the int32 layout, each call allocates temporaries of 1 to 8 bytes per code bit (the sort,
    the bit stream expanded to one element per bit): ~2 MB for a 25 M-element bucket at 0.1 %.
    """

    name = "elias_fano"

    def payload_bytes(self, n: int, universe: int) -> int:
        return aligned(n * self.value_bytes + -(-elias_fano_bits(n, universe) // 8))

    def pack(self, payload: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, universe: int) -> torch.Tensor:
        n = indices.numel()
        width = low_bits(n, universe)
        device = indices.device
        sorted_indices, order = torch.sort(indices.to(torch.int64), stable=True)
        wire_values = saturating_copy_(torch.empty_like(values, dtype=self.value_dtype), values)
        value_end = n * self.value_bytes
        payload[:value_end].view(self.value_dtype).copy_(wire_values[order])

        shifts = torch.arange(width, device=device, dtype=torch.int64)
        low = (sorted_indices.unsqueeze(1) >> shifts) & 1  # [n, l]: bit j of x_i at i*l + j
        high = torch.zeros(n + (universe >> width) + 1, dtype=torch.uint8, device=device)
        high[(sorted_indices >> width) + torch.arange(n, device=device)] = 1
        bits = torch.cat([low.reshape(-1).to(torch.uint8), high])
        packed = kernels.pack_codes(bits, 1)
        payload[value_end : value_end + packed.numel()].copy_(packed)
        payload[value_end + packed.numel() :].zero_()  # padding: sent, so keep it deterministic
        return self._as_decoded(values, wire_values)

    def unpack(
        self, gathered: torch.Tensor, world_size: int, n: int, universe: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width = low_bits(n, universe)
        device = gathered.device
        value_end = n * self.value_bytes
        code_bytes = -(-elias_fano_bits(n, universe) // 8)
        rows = gathered.view(world_size, -1)
        codes = rows[:, value_end : value_end + code_bytes].reshape(-1)
        bits = kernels.unpack_codes(codes, 1, codes.numel() * 8).view(world_size, code_bytes * 8)

        low_end = n * width
        shifts = torch.arange(width, device=device, dtype=torch.int64)
        low = (bits[:, :low_end].reshape(world_size, n, width).to(torch.int64) << shifts).sum(-1)
        high_bits = bits[:, low_end : low_end + n + (universe >> width) + 1]
        # every row holds exactly n set bits, found in row-major order: no sync for the size
        positions = torch.nonzero_static(high_bits, size=world_size * n)[:, 1].view(world_size, n)
        high = positions - torch.arange(n, device=device)
        indices = ((high << width) | low).reshape(-1)
        return indices, self._value_rows(gathered, world_size, 0, n)


INDEX_ENCODINGS: dict[str, type[SparseWireFormat]] = {"int32": Int32Indices, "elias_fano": EliasFanoIndices}
