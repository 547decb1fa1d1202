"""What an encode returns: one round of one bucket, split by who reads it.

What :meth:`~lightning_gc.compressors.base.Compressor.encode` returns, an :class:`Encoded` round,
has three parts, one for each of its readers:

* :class:`Payload` -- what travels, for the transport (:mod:`lightning_gc.exchanges.transport`):
  the tensors each kind of collective carries and receives into, and the bytes and values counted;
* :class:`Sent` -- what left, as receivers decode it, for memory
  (:meth:`~lightning_gc.core.memory.CompensationMemory.commit`), which keeps the rest;
* round control and the codec's own data, for the pipeline (:mod:`lightning_gc.exchanges.pipeline`)
  and the codec's decode: ``next_round``, ``commit_after_decode``, ``context``.

A payload comes in four kinds, and one round may use several:

* ``summed`` -- a floating tensor whose element-wise sum over ranks is meaningful (dense
  values): all-reduced;
* ``gathered`` -- a byte buffer of the same size on every rank (e.g. sparse values + indices):
  all-gathered into ``gathered_out`` without a size exchange;
* ``scattered`` -- ``world_size`` equal rows, row ``j`` for rank ``j``: exchanged all-to-all into
  ``scattered_out``, whose row ``i`` is what rank ``i`` sent to this rank (the first phase of the
  two-phase exchange, :mod:`lightning_gc.exchanges.two_phase`);
* ``peer`` -- a :class:`PeerTransfer`: a payload sent to one rank and/or one received from one
  rank, point to point (the rounds of the global top-k selection,
  :mod:`lightning_gc.exchanges.global_topk`).

A compressor may need several rounds of communication per bucket (PowerSGD all-reduces P, then
Q computed from the reduced P). Its encode then returns the first round with ``next_round`` set;
the hook completes each round's collectives *from the hook itself* before asking for the next, so
every rank issues every collective in the same order (see :mod:`lightning_gc.exchanges.comm`).
Only the last round is left in flight for DDP to overlap, and only the last round's :class:`Sent`
is committed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class PeerTransfer:
    """One round of point-to-point traffic (ranks are ranks of the exchange's group).

    ``payload`` is this rank's message of the round, sent to rank ``to`` unless that is ``None``;
    when ``source`` is set, rank ``source``'s message (of the same size) is received into ``into``.
    Neither: this rank sits the round out. Both ends of every transfer are in the same round on
    their two ranks, so a round is a set of matched pairs and cannot deadlock.
    """

    payload: torch.Tensor
    to: int | None = None
    into: torch.Tensor | None = None
    source: int | None = None

    def __post_init__(self) -> None:
        if (self.into is None) != (self.source is None):
            raise ValueError("PeerTransfer receives with both `into` and `source`, or neither")


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


@dataclass(frozen=True, kw_only=True, eq=False)
class Payload:
    """What one round of one bucket puts on the wire: the part of an :class:`Encoded` that a
    transport reads (:meth:`~lightning_gc.exchanges.transport.Transport.launch` takes it, and nothing
    else of the round), and the counts the pipeline adds up (they describe these tensors, so they
    travel with them: a counting transport reads them too). At least one of ``summed``,
    ``gathered``, ``scattered`` and ``peer`` is set. Most rounds are built by :meth:`all_reduce` or
    :meth:`all_gather`, which count the bytes.

    Attributes:
        bytes_sent: bytes this rank hands to the collectives in this round.
        elements_sent: number of gradient values this rank sends in this round (a value sent in
            several rounds, e.g. re-encoded, counts once).
        summed: all-reduced in place (sum over ranks), or ``None``.
        gathered: all-gathered into ``gathered_out`` (``world_size`` x its size), or ``None``.
        scattered: exchanged all-to-all: ``world_size`` equal rows, row ``j`` goes to rank ``j``
            and row ``i`` of ``scattered_out`` comes from rank ``i``; or ``None``.
        peer: a point-to-point round (:class:`PeerTransfer`), or ``None``.
        stand_in: for transports without collectives (:class:`~lightning_gc.exchanges.transport.LocalTransport`):
            fills ``gathered_out`` / ``scattered_out`` with what ranks holding this rank's velocity
            would send, where a copy of this rank's own payload is no valid message (a two-phase
            round's rows each have their chunk's format); ``None``: the copy is one. It sits here,
            not with the round control, because a transport is its only reader: it stands in for
            the collectives that fill these buffers.
    """

    bytes_sent: int
    elements_sent: int
    summed: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    gathered_out: torch.Tensor | None = None
    scattered: torch.Tensor | None = None
    scattered_out: torch.Tensor | None = None
    peer: PeerTransfer | None = None
    stand_in: Callable[[], None] | None = None

    @staticmethod
    def all_reduce(values: torch.Tensor, *, elements_sent: int | None = None) -> Payload:
        """``values`` all-reduced (summed over ranks) in place: ``bytes_sent`` their bytes,
        ``elements_sent`` their count unless given."""
        count = values.numel() if elements_sent is None else elements_sent
        return Payload(summed=values, bytes_sent=_nbytes(values), elements_sent=count)

    @staticmethod
    def all_gather(
        payload: torch.Tensor,
        into: torch.Tensor,
        *,
        elements_sent: int,
        summed: torch.Tensor | None = None,
        stand_in: Callable[[], None] | None = None,
    ) -> Payload:
        """``payload`` (the same size on every rank) all-gathered into ``into`` and, when given,
        ``summed`` all-reduced beside it (e.g. a bucket's dense tensors): ``bytes_sent`` both;
        ``elements_sent`` the gradient values ``payload`` carries, to which ``summed``'s count is
        added."""
        return Payload(
            gathered=payload,
            gathered_out=into,
            summed=summed,
            bytes_sent=_nbytes(payload) + _nbytes(summed),
            elements_sent=elements_sent + (0 if summed is None else summed.numel()),
            stand_in=stand_in,
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class Sent:
    """What left this rank for one bucket, as receivers decode it: the part of an :class:`Encoded`
    that memory commits (:meth:`~lightning_gc.core.memory.CompensationMemory.commit` takes it, and
    nothing else of the round), so that the velocity keeps the rest (error feedback). The default,
    nothing, is what an earlier round of a multi-round compressor says (only the last round's is
    committed). A whole bucket: :meth:`whole`.

    Attributes:
        indices: bucket positions (int64) of the pairs sent sparsely, or ``None``.
        values: the values of those pairs as receivers decode them; a pair with value 0 is a
            no-op (the Triton selection pads with such pairs).
        dense_positions: bucket positions (int64) whose velocity left whole; ``None`` when the
            whole bucket did (``dense_all``) or nothing did.
        dense_all: every element of the bucket left this rank (exactly, or as ``dense_values``).
        dense_values: the dense values as receivers decode them, when the wire rounds them (e.g.
            fp16); ``None`` means they left exactly. Valid until decode, which may overwrite it
            (see :func:`~lightning_gc.compressors.numerics.widened_for_commit`), except with
            ``commit_after_decode`` (:class:`Encoded`), where decode fills it.
    """

    indices: torch.Tensor | None = None
    values: torch.Tensor | None = None
    dense_positions: torch.Tensor | None = None
    dense_all: bool = False
    dense_values: torch.Tensor | None = None

    @staticmethod
    def whole(decoded: torch.Tensor | None = None) -> Sent:
        """Every element of the bucket left: exactly (``decoded`` ``None``), or as receivers decode
        ``decoded`` (bucket-sized)."""
        return Sent(dense_all=True, dense_values=decoded)


@dataclass
class Encoded:
    """One rank's round for one bucket: what travels, what memory commits, and round control.

    The parts are split by reader, so that each sees only what it acts on: a transport takes the
    ``payload`` (and cannot depend on memory's facts or a codec's plan), memory takes ``sent`` (and
    cannot depend on how bytes move), and the pipeline reads the round control below. A new
    transport, memory rule or exchange is then written against the small type it needs, and a test
    can build one part alone. Built as ``Encoded(payload, sent, context=...)``; ``sent`` may be left
    out on a round that is not the last.

    Attributes:
        payload: what this round puts on the wire (:class:`Payload`).
        sent: what left this rank, for memory (:class:`Sent`); read from the last round only.
        context: compressor-private data needed by :meth:`~lightning_gc.compressors.base.Compressor.decode`.
        next_round: for multi-round compressors, called once this round's collectives have
            completed; returns the next round. ``None`` on the last round.
        commit_after_decode: memory learns what was sent only after the codec's decode
            (``sent.dense_values`` is filled there), for compressors whose residual depends on the
            aggregate (PowerSGD's ``e = M - P Q_avg^T``).
    """

    payload: Payload
    sent: Sent = field(default_factory=Sent)
    _: KW_ONLY
    context: Any = None
    next_round: Callable[[], Encoded] | None = None
    commit_after_decode: bool = False
