"""The chunk capability of a codec: encode and decode any run of segments into a payload whose size
is known in advance. An exchange that moves pieces of a flat tensor separately (the two-phase
exchange's chunks, :mod:`lightning_gc.compressors.two_phase`) asks a codec for it; a codec that has it
is a :class:`ChunkCodec`.

Random rounding is salted by :func:`encode_seed` (step, sender, chunk) plus each tensor's order, so
a chunk encodes alike wherever its segments sit (at bucket positions or packed), whichever rank
sends it and however DDP buckets the parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gc.common.layout import Segment

_SEED_STEP, _SEED_SENDER, _SEED_CHUNK = 1_000_003, 7_919, 104_729


def encode_seed(step: int, sender: int, chunk: int = 0) -> int:
    """The salt of one encode of a run of values, a pure function of the step, who encodes
    (rank ``r``; ``N + r`` for rank ``r``'s re-encode of its chunk mean) and which chunk: runs are
    reproducible and ranks draw independently. A codec adds each tensor's ``order``."""
    return step * _SEED_STEP + sender * _SEED_SENDER + chunk * _SEED_CHUNK


@dataclass(frozen=True)
class ChunkFormat:
    """How a set of segments of a bucket (a whole bucket, or one two-phase chunk) is laid out in a
    payload: the codec's own description (``layout``) and the payload's size in bytes."""

    segments: tuple[Segment, ...]
    nbytes: int
    layout: Any = None


class ChunkCodec(ABC):
    """A codec of flat runs of values described by segments, into payloads of known size."""

    @abstractmethod
    def chunk_format(self, segments: Sequence[Segment], dtype: torch.dtype) -> ChunkFormat:
        """The payload format of ``segments`` (starts relative to the run) for values of ``dtype``."""

    @abstractmethod
    def encode_chunk(
        self, values: torch.Tensor, fmt: ChunkFormat, payload: torch.Tensor, decoded: torch.Tensor, seed: int
    ) -> None:
        """Encode ``fmt``'s segments of ``values`` (the flat run they address: a bucket, or a chunk
        packed by :func:`~lightning_gc.common.layout.packed_layout`) into ``payload`` (uint8, ``fmt.nbytes``)
        and write what receivers will decode into the same segments of ``decoded``; ``seed`` (plus
        each tensor's order) salts random rounding. The payload depends on the segments' names,
        orders and shapes, never on their starts: a chunk encodes alike at bucket positions and packed."""

    @abstractmethod
    def add_decoded_chunk(
        self, payload: torch.Tensor, fmt: ChunkFormat, total: torch.Tensor, dtype: torch.dtype
    ) -> None:
        """``total += decode(payload)`` on ``fmt``'s segments (``total`` in :func:`summing_dtype`
        of ``dtype``, the run they address), each value clamped to ``dtype``'s finite range."""
