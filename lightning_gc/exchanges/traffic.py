"""Bytes one rank puts on the wire per kind of exchange: the one formula the exchanges count by
(:func:`~lightning_gc.exchanges.transport.traffic_bytes`) and the performance model predicts from
(:mod:`lightning_gc.perfmodel`)."""

from __future__ import annotations

from lightning_gc.common.validation import check_choice, check_int

ALLREDUCE = "allreduce"
"""Exchange of a summable payload: ring all-reduce (``CodecCost.summed_bytes``)."""
GATHER = "gather"
"""Exchange of a payload that cannot be summed: all-gather (``CodecCost.gathered_bytes``)."""
TWO_PHASE = "two_phase"
"""All-to-all of chunks, decode + average + re-encode, all-gather (``CodecCost.two_phase_bytes``)."""
PEER = "peer"
"""Point-to-point rounds, one partner each (``CodecCost.peer_bytes`` over ``peer_messages`` rounds)."""
EXCHANGES = (ALLREDUCE, GATHER, TWO_PHASE, PEER)


def exchange_bytes(kind: str, payload_bytes: float, world_size: int) -> float:
    """Bytes one rank sends to exchange ``m = payload_bytes`` on ``p = world_size`` ranks:
    ``"allreduce"`` ``2(p-1)/p * m`` (ring), ``"gather"`` ``(p-1) * m``, ``"two_phase"``
    ``(p-1)/p * m + (p-1) * m/p = 2(p-1)/p * m`` (padding-free chunks), ``"peer"`` ``m`` (the
    point-to-point payloads, one per round); 0 for ``p = 1``."""
    check_choice("exchange", kind, EXCHANGES)
    check_int("world_size", world_size, 1)
    p = world_size
    if p == 1:
        return 0.0
    if kind == PEER:
        return float(payload_bytes)
    return (p - 1) * payload_bytes if kind == GATHER else 2 * (p - 1) / p * payload_bytes
