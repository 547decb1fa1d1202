"""What an exchange costs: the alpha-beta time of each collective and of a compressor's payload.

Notation (DESIGN.md §6): ``p`` workers, ``M`` gradient bytes per worker, ``B`` link bandwidth in
bytes/s, ``a`` latency per message in seconds, ``r`` wire ratio, ``n`` collective rounds per step
(DDP buckets).

Communication (alpha-beta cost of the classic algorithms, per step)::

    ring all-reduce of M bytes            T_ar(M) = n * 2(p-1) a + 2(p-1)/p * M / B
    all-gather of m = M/r bytes per rank  T_ag(m) = n * (p-1) a   + (p-1) * m / B
    two-phase of m bytes per rank         T_2p(m) = n * 2(p-1) a + 2(p-1)/p * m / B

Two-phase (DeepSpeed's compressed all-reduce, for payloads that cannot be summed encoded): the
payload is split into p chunks; an all-to-all hands rank r every rank's chunk r
(``(p-1) a + (p-1)/p * m / B``), rank r decodes, averages and re-encodes them, and an all-gather
of the re-encoded chunk averages (``m/p`` bytes per rank: ``(p-1) a + (p-1) * m/p / B``) gives
every rank the whole average. Its alpha-beta cost equals the ring all-reduce's of ``m`` bytes:
per-rank bytes stay below ``2m`` at any p, where the all-gather's ``(p-1) m`` grow with p. With
``m = M/r``, the all-gather sends more bytes than dense ring all-reduce exactly when
``(p-1) M/r > 2(p-1)/p * M``, i.e. ``p > 2r`` (:func:`gather_loses_to_dense_at`).

A compressor's payload has a summed part (all-reduced), a gathered part (all-gathered), a
two-phase part and point-to-point rounds (global top-k's merges: ``q`` rounds in sequence, each
moving one payload into or out of the rank, ``b`` bytes over the ``q`` rounds; a swap sends and
receives at once on a full-duplex link): ``T_comm = T_ar(summed) + T_ag(gathered) +
T_2p(two_phase) + T_p2p``, ``T_p2p = n q a + b / B``; dense DDP is ``T_ar(M)``.

Host-bound transports (optional): where the transport's own work (TCP, the collective's copies and
reductions) runs on the core that also computes, the fraction of the exchange spent on it cannot
overlap with backward. With ``H`` the bytes per second that core can push through the transport
(``Network.host_bandwidth``; e.g. a socket test on an unshaped link), ``T_host`` is ``T_comm``'s
byte term with ``B`` replaced by ``H``: every step gains it, and only ``T_comm - T_host`` can hide
behind compute (:func:`exchange_cost_s`). On a slow link ``T_host`` is a small part of ``T_comm``
and changes little; on a fast one the exchange is all host time and nothing of it is hidden.
``H = None`` (the default) means the transport has resources of its own (NCCL on a GPU, a spare
core): ``T_host = 0``.

The world of one rank exchanges nothing: every ``T`` is 0 for ``p = 1``. The step time these
make, and whether compression pays: :mod:`lightning_gc.perfmodel.step`. ``T_enc`` and ``T_dec``
come from :mod:`lightning_gc.perfmodel.calibration` (the real compressor timed on this device) or
are given. The model is checked against measured two-node runs by ``benchmarks/netbench``; it is
a model, not a measurement. Command line: ``python -m lightning_gc.perfmodel --help``
(:mod:`lightning_gc.perfmodel.__main__`). The outer loop (one compressed sync every ``sync_every``
inner steps, in fragments, overlapped by a delay): :mod:`lightning_gc.perfmodel.outer`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lightning_gc.common.validation import check_int, check_range
from lightning_gc.exchanges.traffic import ALLREDUCE, GATHER, PEER, TWO_PHASE, exchange_bytes

DENSE = "dense"
"""Name of the reference: plain DDP ring all-reduce, no encode/decode."""

BITS_PER_BYTE = 8


@dataclass(frozen=True)
class Network:
    """The cluster as the exchange sees it.

    Attributes:
        world_size: number of workers ``p`` (>= 1).
        bandwidth: link bandwidth ``B`` in bytes per second (> 0).
        latency: per-message latency ``a`` in seconds (>= 0).
        host_bandwidth: bytes per second ``H`` a worker's compute core can push through the
            transport when the transport runs on it (> 0), or ``None``: the transport does not
            take compute time (see the module docstring).
    """

    world_size: int
    bandwidth: float
    latency: float = 0.0
    host_bandwidth: float | None = None

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1)
        check_range("bandwidth", self.bandwidth, 0.0, None, low_inclusive=False)
        check_range("latency", self.latency, 0.0, None)
        if self.host_bandwidth is not None:
            check_range("host_bandwidth", self.host_bandwidth, 0.0, None, low_inclusive=False)

    @classmethod
    def from_bits(
        cls,
        world_size: int,
        bits_per_second: float,
        latency: float = 0.0,
        host_bits_per_second: float | None = None,
    ) -> Network:
        """A network whose bandwidths are given in bits per second (``1e9`` for 1 Gbit/s)."""
        check_range("bandwidth", bits_per_second, 0.0, None, low_inclusive=False)
        host = None
        if host_bits_per_second is not None:
            host = check_range("host_bandwidth", host_bits_per_second, 0.0, None, low_inclusive=False) / BITS_PER_BYTE
        return cls(world_size, bits_per_second / BITS_PER_BYTE, latency, host)


@dataclass(frozen=True)
class CodecCost:
    """What one compressor costs one worker per step, for the whole gradient.

    The payload's bytes are split by the exchange that carries them (:data:`EXCHANGES`).

    Attributes:
        name: compressor name (``"dense"`` for plain DDP).
        summed_bytes: bytes all-reduced per step (exchange ``"allreduce"``).
        gathered_bytes: bytes all-gathered per rank per step (exchange ``"gather"``).
        encode_s: compensation + encoding (+ memory commit) time per step.
        decode_s: decoding time per step, for ``p`` ranks' payloads.
        two_phase_bytes: encoded bytes per rank per step exchanged two-phase (exchange
            ``"two_phase"``: all-to-all, then all-gather of the re-encoded chunk averages).
        peer_bytes: bytes per rank per step its point-to-point rounds move (exchange ``"peer"``):
            one payload per round, sent, received or both (a rank that only receives in a round
            still waits for the payload).
        peer_messages: point-to-point rounds in sequence per bucket (each costs a latency).
        decode_timed_ranks: when calibration decoded fewer payloads than the world has, how many
            (``decode_s`` is then scaled in proportion, see :mod:`lightning_gc.perfmodel.calibration`);
            0 when ``decode_s`` was timed or given as it is.
    """

    name: str
    summed_bytes: int
    gathered_bytes: int
    encode_s: float = 0.0
    decode_s: float = 0.0
    two_phase_bytes: int = 0
    peer_bytes: int = 0
    peer_messages: int = 0
    decode_timed_ranks: int = 0

    def __post_init__(self) -> None:
        check_int("summed_bytes", self.summed_bytes, 0)
        check_int("gathered_bytes", self.gathered_bytes, 0)
        check_range("encode_s", self.encode_s, 0.0, None)
        check_range("decode_s", self.decode_s, 0.0, None)
        check_int("two_phase_bytes", self.two_phase_bytes, 0)
        check_int("peer_bytes", self.peer_bytes, 0)
        check_int("peer_messages", self.peer_messages, 0)
        check_int("decode_timed_ranks", self.decode_timed_ranks, 0)

    @property
    def payloads(self) -> dict[str, int]:
        """Encoded bytes per rank per step by exchange: ``{"allreduce": .., "gather": .., "two_phase": ..,
        "peer": ..}``."""
        return {
            ALLREDUCE: self.summed_bytes,
            GATHER: self.gathered_bytes,
            TWO_PHASE: self.two_phase_bytes,
            PEER: self.peer_bytes,
        }

    @property
    def bytes_sent(self) -> int:
        """Encoded payload bytes per rank per step, all exchanges together (on the wire:
        :meth:`wire_bytes`)."""
        return sum(self.payloads.values())

    def wire_bytes(self, world_size: int) -> float:
        """Bytes one rank sends per step on ``world_size`` ranks: :func:`exchange_bytes` summed over
        the exchanges."""
        return sum(exchange_bytes(kind, nbytes, world_size) for kind, nbytes in self.payloads.items())

    def scaled(self, factor: float, name: str | None = None) -> CodecCost:
        """This cost for a gradient ``factor`` times as large: bytes and seconds in proportion,
        the point-to-point rounds kept (their number depends on the world size, not the size)."""
        return dataclasses.replace(
            self,
            name=self.name if name is None else name,
            summed_bytes=round(self.summed_bytes * factor),
            gathered_bytes=round(self.gathered_bytes * factor),
            two_phase_bytes=round(self.two_phase_bytes * factor),
            peer_bytes=round(self.peer_bytes * factor),
            encode_s=self.encode_s * factor,
            decode_s=self.decode_s * factor,
        )


def ring_allreduce_s(nbytes: float, network: Network, rounds: int = 1) -> float:
    """``T_ar = n 2(p-1) a + 2(p-1)/p * nbytes / B``; 0 when nothing is sent or ``p = 1``."""
    p = network.world_size
    if nbytes <= 0 or p == 1:
        return 0.0
    return rounds * 2 * (p - 1) * network.latency + 2 * (p - 1) / p * nbytes / network.bandwidth


def allgather_s(nbytes_per_rank: float, network: Network, rounds: int = 1) -> float:
    """``T_ag = n (p-1) a + (p-1) * nbytes_per_rank / B``; 0 when nothing is sent or ``p = 1``."""
    p = network.world_size
    if nbytes_per_rank <= 0 or p == 1:
        return 0.0
    return rounds * (p - 1) * network.latency + (p - 1) * nbytes_per_rank / network.bandwidth


def two_phase_s(nbytes_per_rank: float, network: Network, rounds: int = 1) -> float:
    """``T_2p`` of ``m = nbytes_per_rank`` encoded bytes: an all-to-all of ``p`` chunks,
    ``n (p-1) a + (p-1)/p * m / B``, then an all-gather of ``m/p`` bytes per rank,
    ``n (p-1) a + (p-1) * (m/p) / B``; 0 when nothing is sent or ``p = 1``. Chunks are taken
    padding-free (``m/p`` bytes each). The sum equals :func:`ring_allreduce_s` of ``m``."""
    p = network.world_size
    if nbytes_per_rank <= 0 or p == 1:
        return 0.0
    chunk = nbytes_per_rank / p
    all_to_all = rounds * (p - 1) * network.latency + (p - 1) * chunk / network.bandwidth
    all_gather = rounds * (p - 1) * network.latency + (p - 1) * chunk / network.bandwidth
    return all_to_all + all_gather


def peer_s(nbytes: float, network: Network, rounds: int = 1, messages: int = 1) -> float:
    """``T_p2p = n q a + b / B`` for ``q = messages`` point-to-point rounds per bucket that move
    ``b = nbytes`` through the rank (one payload per round; a swap's send and receive overlap);
    0 when nothing moves or ``p = 1``."""
    if nbytes <= 0 or network.world_size == 1:
        return 0.0
    return rounds * messages * network.latency + nbytes / network.bandwidth


_EXCHANGE_S = {ALLREDUCE: ring_allreduce_s, GATHER: allgather_s, TWO_PHASE: two_phase_s}


def gather_loses_to_dense_at(compression: float) -> int:
    """Smallest world size ``p`` at which all-gathering a payload compressed ``r = compression``
    times sends more bytes per rank than dense ring all-reduce: ``(p-1) M/r > 2(p-1)/p * M``
    iff ``p > 2r``, so ``floor(2r) + 1`` (at ``p = 2r`` they tie; at least 2). Bytes only: the
    all-gather's fewer messages (``(p-1) a`` against ``2(p-1) a``) move the time crossover a
    little higher. Two-phase sends ``2(p-1)/p * M/r``, below dense at every ``p`` when ``r > 1``."""
    check_range("compression", compression, 0.0, None, low_inclusive=False)
    return max(2, math.floor(2 * compression) + 1)


def comm_s(cost: CodecCost, network: Network, rounds: int = 1) -> float:
    """``T_comm = T_ar(summed) + T_ag(gathered) + T_2p(two_phase) + T_p2p``."""
    collectives = sum(
        _EXCHANGE_S[kind](nbytes, network, rounds) for kind, nbytes in cost.payloads.items() if kind != PEER
    )
    return collectives + peer_s(cost.peer_bytes, network, rounds, cost.peer_messages)


def two_phase_cost(cost: CodecCost, world_size: int) -> CodecCost:
    """``cost``'s compressor with its gathered payload exchanged two-phase, named ``"<name>+two_phase"``.

    Bytes: ``gathered_bytes`` move to ``two_phase_bytes`` (the summed part stays all-reduced).
    Seconds: ``decode_s`` is calibrated for decoding the ``p`` payloads of an all-gather; two-phase
    decodes ``p`` chunks of ``1/p`` payload each in its first phase and ``p`` chunk averages in its
    second, two payloads' worth: ``decode_s * 2/p``. It also re-encodes its chunk average, ``1/p``
    of an encode: ``encode_s * (1 + 1/p)``.
    """
    check_int("world_size", world_size, 1)
    return CodecCost(
        f"{cost.name}+{TWO_PHASE}",
        summed_bytes=cost.summed_bytes,
        gathered_bytes=0,
        encode_s=cost.encode_s * (1 + 1 / world_size),
        decode_s=cost.decode_s * min(1.0, 2 / world_size),
        two_phase_bytes=cost.gathered_bytes + cost.two_phase_bytes,
    )


def host_s(cost: CodecCost, network: Network) -> float:
    """``T_host``: ``T_comm``'s byte terms at the host bandwidth ``H``; 0 without one."""
    if network.host_bandwidth is None:
        return 0.0
    host = Network(network.world_size, network.host_bandwidth)
    return comm_s(cost, host)


def exposed_s(communication_s: float, hidden_s: float) -> float:
    """``max(0, T_comm - f C)``: what overlap with backward cannot hide."""
    return max(0.0, communication_s - hidden_s)


def exchange_cost_s(cost: CodecCost, network: Network, hidden_s: float, rounds: int = 1) -> tuple[float, float, float]:
    """``(T_comm, T_host, exposed)`` with ``exposed = max(0, T_comm - T_host - h)``: the exchange
    adds ``T_host + exposed`` to the step, where ``h`` is what backward hides."""
    t_comm = comm_s(cost, network, rounds)
    t_host = host_s(cost, network)
    return t_comm, t_host, exposed_s(max(0.0, t_comm - t_host), hidden_s)


def parse_rate(text: str, name: str = "rate") -> float:
    """``"1gbit"``, ``"100mbit"``, ``"2.5e9"`` (bits/s) -> bits per second; ``name`` is used in errors."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    lowered = text.strip().lower()
    unit = next((u for u in units if lowered.endswith(u)), "")
    try:
        return float(lowered.removesuffix(unit)) * units.get(unit, 1.0)
    except ValueError:
        raise ValueError(f"`{name}` must look like 1gbit, 100mbit or 2.5e9 (bits/s), got {text!r}") from None
