"""The names the two-phase exchange used to have among the codecs, kept for imports written
before it moved (:mod:`lightning_gc.exchanges.two_phase` runs it now; a codec's part is its chunk
capability and the user's ``exchange``/``server_feedback`` arguments, :mod:`lightning_gc.compressors.chunks`)."""

from __future__ import annotations

from lightning_gc.compressors.chunks import EXCHANGES, ChunkCodec, ExchangeChoice, runs_two_phase, two_phase_compressors

__all__ = ["EXCHANGES", "ChunkCodec", "ExchangeChoice", "runs_two_phase", "two_phase_compressors"]
