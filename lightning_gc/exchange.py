"""Exchanges: how one round of a bucket's encoded payload moves between ranks.

The per-bucket pipeline (:mod:`lightning_gc.pipeline`) is fixed; only the exchange varies. An
exchange takes one round of :class:`~lightning_gc.compressors.base.Encoded` and launches its
collectives *from the caller's thread* (the comm hook, in bucket order on every rank, see
:mod:`lightning_gc.comm`), returning a future that completes when decode may read the result:

* ``summed`` is replaced in place by its sum over ranks;
* ``gathered_out`` receives every rank's ``gathered`` payload, in rank order.

Invariant for every exchange: with the identity codec (sending the bucket whole through
``summed``) it equals DDP's all-reduce. Delayed, hierarchical and two-phase exchanges are further
implementations of :class:`Exchange`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch.futures import Future, collect_all

from lightning_gc import comm
from lightning_gc.compressors.base import Encoded


class Exchange(ABC):
    """Moves one round of a bucket's payload between ranks (see the module docstring)."""

    @abstractmethod
    def launch(self, encoded: Encoded) -> Future[Any]:
        """Start the collectives of ``encoded``; the future completes when all have."""


def _payloads(encoded: Encoded) -> None:
    if encoded.summed is None and encoded.gathered is None:
        raise RuntimeError("a compressor round sends nothing: Encoded needs `summed` or `gathered`")
    if encoded.gathered is not None and encoded.gathered_out is None:
        raise RuntimeError("Encoded.gathered needs `gathered_out` to receive every rank's payload")


class CollectiveExchange(Exchange):
    """The real collectives: an all-reduce of ``summed`` and an all-gather of ``gathered``.

    Bytes per rank for a bucket payload of ``m`` bytes over ``N`` ranks: ring all-reduce
    ``2 (N-1)/N m``, all-gather ``(N-1) m``.
    """

    def __init__(self, group: comm.ProcessGroup = None) -> None:
        self.group = group

    def launch(self, encoded: Encoded) -> Future[Any]:
        _payloads(encoded)
        futures = []
        if encoded.summed is not None:
            futures.append(comm.allreduce_sum(encoded.summed, self.group))
        if encoded.gathered is not None:
            assert encoded.gathered_out is not None
            futures.append(comm.allgather_fixed(encoded.gathered, encoded.gathered_out, self.group))
        return futures[0] if len(futures) == 1 else collect_all(futures)


class LocalExchange(Exchange):
    """A stand-in without collectives, for timing and benchmarks: a world of ``world_size`` ranks
    that all send what this rank sends (the all-reduce sums ``world_size`` equal payloads, the
    all-gather repeats this one). Completes at once. Counts the bytes each kind of payload would
    hand to its collective over all rounds (``summed_bytes``, ``gathered_bytes``)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.summed_bytes = 0
        self.gathered_bytes = 0

    def launch(self, encoded: Encoded) -> Future[Any]:
        _payloads(encoded)
        self.summed_bytes += payload_bytes(encoded.summed)
        self.gathered_bytes += payload_bytes(encoded.gathered)
        if encoded.summed is not None:
            encoded.summed.mul_(self.world_size)
        if encoded.gathered is not None:
            assert encoded.gathered_out is not None
            rows = encoded.gathered_out.view(self.world_size, -1)
            rows.copy_(encoded.gathered.view(1, -1).expand(self.world_size, -1))
        done: Future[Any] = Future()
        done.set_result(None)
        return done


def payload_bytes(payload: torch.Tensor | None) -> int:
    """Bytes a payload hands to a collective (0 for none)."""
    return 0 if payload is None else payload.numel() * payload.element_size()
