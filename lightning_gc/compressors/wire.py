"""Byte layout of a sparse payload: ``k`` int32 indices, then ``k`` values, padded to 4 bytes.

One flat ``uint8`` buffer per rank means one all-gather per bucket; because every rank sends the
same ``k``, every rank's buffer has the same size and no size exchange is needed. The 4-byte
padding keeps each rank's row of the gathered buffer aligned, so indices and values are read
back as zero-copy dtype views.
"""

from __future__ import annotations

import torch

VALUE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
INDEX_DTYPE = torch.int32
_INDEX_BYTES = 4


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class SparseWireFormat:
    """Packs (index, value) pairs for one bucket into bytes and reads all ranks' pairs back."""

    def __init__(self, value_dtype: torch.dtype) -> None:
        self.value_dtype = value_dtype
        self.value_bytes = _element_size(value_dtype)

    def payload_bytes(self, k: int) -> int:
        """Bytes on the wire for ``k`` pairs."""
        raw = k * (_INDEX_BYTES + self.value_bytes)
        return -(-raw // _INDEX_BYTES) * _INDEX_BYTES

    def views(self, payload: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) views into one rank's payload, or into ``[world, bytes]`` rows."""
        index_end = k * _INDEX_BYTES
        value_end = index_end + k * self.value_bytes
        return payload[..., :index_end].view(INDEX_DTYPE), payload[..., index_end:value_end].view(self.value_dtype)

    def pack(self, payload: torch.Tensor, k: int, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Write ``indices`` and ``values`` into ``payload``; return the values as receivers decode them.

        With a wire dtype narrower than ``values``' the result is the rounded values (in
        ``values``' dtype), so memory can keep exactly what rounding dropped; otherwise it is
        ``values`` itself.
        """
        index_view, value_view = self.views(payload, k)
        index_view.copy_(indices)
        value_view.copy_(values)
        if values.dtype == self.value_dtype:
            return values
        return value_view.to(values.dtype)

    def unpack(self, gathered: torch.Tensor, world_size: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All ranks' (indices, values) from the gathered buffer, each flattened to ``world_size * k``."""
        index_view, value_view = self.views(gathered.view(world_size, -1), k)
        return index_view.reshape(-1), value_view.reshape(-1)
