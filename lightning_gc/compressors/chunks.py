"""The chunk capability of a codec: encode and decode any run of segments into a payload whose size
is known in advance. An exchange that moves pieces of a flat tensor separately (the two-phase
exchange's chunks, :mod:`lightning_gc.exchanges.two_phase`) asks a codec for it; a codec that has it
is a :class:`ChunkCodec`, and one that also takes the user's ``exchange`` and ``server_feedback``
arguments (which choose the exchange that runs it) is an :class:`ExchangeChoice`.

Random rounding is salted by :func:`encode_seed` (step, sender, chunk) plus each tensor's order, so
a chunk encodes alike wherever its segments sit (at bucket positions or packed), whichever rank
sends it and however DDP buckets the parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lightning_gc.common.layout import Segment
from lightning_gc.common.validation import check_bool, check_choice

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


EXCHANGES = ("gather", "two_phase", "auto")
"""``exchange`` choices of a chunk codec: its own payload gathered (every rank's), the two-phase
compressed all-reduce (:class:`lightning_gc.exchanges.two_phase.TwoPhaseExchange`), or two-phase
from three ranks on."""


def runs_two_phase(exchange: str, world_size: int) -> bool:
    """Whether ``exchange`` (one of :data:`EXCHANGES`) runs the two-phase form on ``world_size``
    ranks: ``"two_phase"`` from two ranks on, ``"auto"`` from three (at two both send the same
    bytes and the gathered form needs one collective less)."""
    return world_size > 1 and (exchange == "two_phase" or (exchange == "auto" and world_size > 2))


class ExchangeChoice(ChunkCodec):
    """A chunk codec that takes the user's ``exchange`` and ``server_feedback`` arguments. They
    choose the exchange that runs the codec (:func:`lightning_gc.exchanges.select.exchange_for`);
    the codec itself only encodes and decodes (its own gathered or all-reduced form, or chunks for
    the two-phase exchange), and keeps no state of the exchange's."""

    exchange_arguments = ("exchange", "server_feedback")

    server_feedback_default: ClassVar[bool] = False
    """``server_feedback`` when not given. Off for the sign codecs: with it onebit on
    ResNet-20/CIFAR-10 lost 5.1 top-1 points on 2 ranks (two seeds) and 8.8 on 4
    (benchmarks/RESULTS.md), while without it the two-phase form matched or beat the gathered one.
    Off for the unbiased quantisers: error feedback needs a contractive codec (``||x - C(x)|| <
    ||x||``), and their rounding noise can exceed the signal (QSGD's bound at 7 levels and 512
    elements is 3.2x its energy): fed back it grows from step to step (QSGD diverged that way in
    the two-phase training test). Off for the casts, whose rounding of the mean is negligible.
    On for ``fft``: re-encoding keeps a few frequency bins of the mean, and without the feedback
    the rest of it is lost for good."""

    exchange: str
    server_feedback: bool

    def init_exchange(self, exchange: str, server_feedback: bool | None) -> None:
        """Validate and keep the arguments (call from the compressor's ``__init__``).

        ``server_feedback``: whether the chunk owner keeps what re-encoding the mean dropped and
        adds it to the next mean (DeepSpeed's compressed all-reduce, DoubleSqueeze); ``None``: the
        codec's :attr:`server_feedback_default`. ``True`` needs a two-phase ``exchange``.
        """
        self.exchange = check_choice("exchange", exchange, EXCHANGES)
        if server_feedback is None:  # the codec's default where a two-phase form can run
            self.server_feedback = self.server_feedback_default and self.exchange != "gather"
        else:
            self.server_feedback = check_bool("server_feedback", server_feedback)
            if self.server_feedback and self.exchange == "gather":
                raise ValueError(
                    f"server_feedback=True needs exchange='two_phase' or 'auto' (the owner of a chunk keeps "
                    f"what re-encoding its mean dropped), got exchange={self.exchange!r}"
                )

    def two_phase_at(self, world_size: int) -> bool:
        """Whether ``world_size`` ranks use the two-phase form."""
        return runs_two_phase(self.exchange, world_size)

    def exchange_form(self, world_size: int) -> str:
        return "two_phase" if self.two_phase_at(world_size) else "gather"

    def inert_settings(self, world_size: int) -> list[str]:
        """``server_feedback=True`` asked of a codec whose default is off, where ``exchange="auto"``
        runs the gathered form (below three ranks): it does nothing there."""
        if self.server_feedback and not self.server_feedback_default and not self.two_phase_at(world_size):
            return [
                f"compressor {getattr(self, 'name', '?')!r}: server_feedback=True does nothing at world size "
                f"{world_size}, where exchange={self.exchange!r} all-gathers (the two-phase form runs from 3 ranks "
                "on); pass exchange='two_phase' to use it"
            ]
        return []


def two_phase_compressors() -> list[str]:
    """Names of the registered compressors that take ``exchange="two_phase"`` (for error messages)."""
    from lightning_gc.compressors.registry import available, compressor_class  # registered after this module

    return [name for name in available() if issubclass(compressor_class(name), ExchangeChoice)]
