"""Transports: how one round of an encoded payload moves between ranks.

The pipeline (:mod:`lightning_gc.exchanges.pipeline`) hands a transport one round's
:class:`~lightning_gc.compressors.encoded.Payload` (the part of an
:class:`~lightning_gc.compressors.encoded.Encoded` that travels; what memory commits and the round
control stay with the pipeline); the transport launches its collectives *from the caller's thread*
(the comm hook, in bucket order on every rank, see :mod:`lightning_gc.exchanges.comm`) and returns a
future of the payload once its receive buffers hold what decode is to read:

* ``summed`` holds the sum over ranks of what they put there;
* ``gathered_out`` holds every rank's ``gathered`` payload, in rank order;
* ``scattered_out`` holds, in rank order, the row of every rank's ``scattered`` payload meant for
  this rank;
* ``peer.into`` holds the message rank ``peer.source`` sent this rank.

Two transports: :class:`GroupTransport`, the torch.distributed collectives over any process group
(the default one, a node's, the ranks with one local rank across nodes, a replica group), and
:class:`LocalTransport`, a stand-in without peers for calibration and benchmarks. A transport
knows nothing of codecs; an :class:`~lightning_gc.exchanges.base.Exchange` decides what runs over
which transport. Invariant: with the identity codec (the bucket whole through ``summed``) a
transport's round equals DDP's all-reduce.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future, collect_all

from lightning_gc.compressors.encoded import Payload
from lightning_gc.exchanges import comm
from lightning_gc.exchanges.traffic import ALLREDUCE, GATHER, exchange_bytes


class Transport(ABC):
    """Moves one round of a payload between ranks (see the module docstring).

    Attributes:
        world_size: the ranks taking part; ``rank``: this one's place among them.
    """

    world_size: int
    rank: int

    @abstractmethod
    def launch(self, payload: Payload) -> Future[Payload]:
        """Start the collectives of ``payload``; the future resolves to it once its receive buffers
        hold what decode is to read."""


def _payloads(payload: Payload) -> None:
    if payload.summed is None and payload.gathered is None and payload.scattered is None and payload.peer is None:
        raise RuntimeError(
            "a compressor round sends nothing: Payload needs `summed`, `gathered`, `scattered` or `peer`"
        )
    if payload.gathered is not None and payload.gathered_out is None:
        raise RuntimeError("Payload.gathered needs `gathered_out` to receive every rank's payload")
    if payload.scattered is not None and payload.scattered_out is None:
        raise RuntimeError("Payload.scattered needs `scattered_out` to receive every rank's row")


class GroupTransport(Transport):
    """The real collectives: a point-to-point round of ``peer`` (completed before the others), an
    all-reduce of ``summed``, an all-gather of ``gathered`` and an all-to-all of ``scattered``,
    launched in that order.

    Bytes on the wire per rank (:func:`traffic_bytes`) for a payload of ``m`` bytes over ``N``
    ranks: ring all-reduce ``2 (N-1)/N m``, all-gather ``(N-1) m``, all-to-all ``(N-1)/N m``,
    point to point ``m`` when this rank sends.
    """

    def __init__(self, group: comm.ProcessGroup = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def launch(self, payload: Payload) -> Future[Payload]:
        _payloads(payload)
        futures: list[Future[Any]] = []
        if payload.peer is not None:
            peer = payload.peer
            try:  # blocking (see comm.transfer): done before anything else is launched
                comm.transfer(peer.payload, peer.to, peer.into, peer.source, self.group)
            except Exception as error:  # a dead peer or a timeout fails the round, as a failed collective does
                return _resolved(payload, error)
            if payload.summed is None and payload.gathered is None and payload.scattered is None:
                return _resolved(payload)
        if payload.summed is not None:
            futures.append(comm.allreduce_sum(payload.summed, self.group))
        if payload.gathered is not None:
            assert payload.gathered_out is not None
            futures.append(comm.allgather_fixed(payload.gathered, payload.gathered_out, self.group))
        if payload.scattered is not None:
            assert payload.scattered_out is not None
            futures.append(comm.alltoall_fixed(payload.scattered, payload.scattered_out, self.group))
        joined = futures[0] if len(futures) == 1 else collect_all(futures).then(_raise_first_error)
        return joined.then(lambda done: _completed(done, payload))


class LocalTransport(Transport):
    """A stand-in without collectives, for timing and benchmarks: a world of ``world_size`` ranks
    that all send what this rank sends (the all-reduce sums ``world_size`` equal payloads, the
    all-gather repeats this one, the all-to-all hands every rank row ``rank`` of this one's, a
    point-to-point round receives this one's message; a payload with a ``stand_in`` fills its
    receive buffers itself). Completes at once. Counts the bytes each
    kind of collective payload would hand to its collective over all rounds (``summed_bytes``,
    ``gathered_bytes``, ``scattered_bytes``), its point-to-point rounds and the payload bytes they
    move, one per round (``peer_messages``, ``peer_bytes``), and the bytes each rank would put on
    the wire (``traffic``, see :func:`traffic_bytes`)."""

    def __init__(self, world_size: int, rank: int = 0) -> None:
        self.world_size = world_size
        self.rank = rank
        self.summed_bytes = 0
        self.gathered_bytes = 0
        self.scattered_bytes = 0
        self.peer_bytes = 0
        self.peer_messages = 0
        self.traffic = 0.0

    def launch(self, payload: Payload) -> Future[Payload]:
        _payloads(payload)
        self.summed_bytes += payload_bytes(payload.summed)
        self.gathered_bytes += payload_bytes(payload.gathered)
        self.scattered_bytes += payload_bytes(payload.scattered)
        if payload.peer is not None:  # a round in sequence, one payload through the link, sent or received
            self.peer_messages += 1
            self.peer_bytes += payload_bytes(payload.peer.payload)
        self.traffic += traffic_bytes(payload, self.world_size)
        if payload.peer is not None and payload.peer.into is not None:
            payload.peer.into.copy_(payload.peer.payload)
        if payload.summed is not None:
            payload.summed.mul_(self.world_size)
        if payload.stand_in is not None:
            payload.stand_in()
            return _resolved(payload)
        if payload.gathered is not None:
            assert payload.gathered_out is not None
            rows = payload.gathered_out.view(self.world_size, -1)
            rows.copy_(payload.gathered.view(1, -1).expand(self.world_size, -1))
        if payload.scattered is not None:
            assert payload.scattered_out is not None
            mine = payload.scattered.view(self.world_size, -1)[self.rank]
            payload.scattered_out.view(self.world_size, -1).copy_(mine.view(1, -1).expand(self.world_size, -1))
        return _resolved(payload)


def _resolved(payload: Payload, error: Exception | None = None) -> Future[Payload]:
    """A completed future of ``payload`` (failed with ``error`` when one is given)."""
    done: Future[Payload] = Future()
    if error is None:
        done.set_result(payload)
    else:
        done.set_exception(error)
    return done


def _raise_first_error(done: Future[list[Future[Any]]]) -> None:
    for future in done.value():
        future.value()  # re-raises a failed collective's error


def _completed(done: Future[Any], payload: Payload) -> Payload:
    done.value()  # a failed collective fails the round instead of passing on whatever the buffers hold
    return payload


def traffic_bytes(payload: Payload, world_size: int) -> float:
    """Bytes one rank puts on the wire for one round (what it sends; with these algorithms, also
    what it receives): ring all-reduce of ``summed`` and all-gather of ``gathered`` as the
    performance model counts them (:func:`~lightning_gc.perfmodel.exchange_bytes`), the
    all-to-all of ``scattered``, ``(N-1)/N m`` (every row but its own), and a point-to-point
    ``peer`` message when this rank sends one."""
    n = world_size
    sent_to_peer = payload.peer is not None and payload.peer.to is not None
    return (
        exchange_bytes(ALLREDUCE, payload_bytes(payload.summed), n)
        + exchange_bytes(GATHER, payload_bytes(payload.gathered), n)
        + (n - 1) / n * payload_bytes(payload.scattered)
        + (payload_bytes(payload.peer.payload) if sent_to_peer else 0)
    )


def payload_bytes(payload: torch.Tensor | None) -> int:
    """Bytes a payload hands to a collective (0 for none)."""
    return 0 if payload is None else payload.numel() * payload.element_size()
