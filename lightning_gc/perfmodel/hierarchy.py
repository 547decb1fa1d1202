"""Two-level cluster model: dense, gathered, global top-k and PowerSGD exchange times, flat and hierarchical.

A simulation (alpha-beta model), not a measurement: nothing here runs a collective.

Notation: ``K`` nodes of ``L`` devices (``N = K L`` ranks); intra-node link ``B_i`` bytes/s and
``a_i`` s per message per device; one inter-node link per node (the node's NIC, shared by its
``L`` devices) of ``B_e`` bytes/s and ``a_e`` s. ``M`` dense gradient bytes per rank, ``c`` wire
compression ratio (payload ``m = M/c`` bytes; DGC at 0.1 % density with int32 indices: ``c ~ 500``).
Ranks are numbered node by node. "Inter bytes per node" is the busiest direction of the busiest
node's NIC per step. Every inter term vanishes at ``K = 1``; every intra term at ``L = 1``.

    dense_ring            2(N-1)/N M / B_e + 2(N-1) a_e            inter 2(N-1)/N M
    dense_hierarchical    2 [(L-1)/L M / B_i + (L-1) a_i]
                          + 2(K-1)/K M / B_e + 2(K-1) a_e          inter 2(K-1)/K M
    flat_gather           (N-1) m / B_e + (N-1) a_e                inter (N-1) m
    hierarchical_gather   2 [(L-1)/L M / B_i + (L-1) a_i]
                          + (K-1) m / B_e + (K-1) a_e              inter (K-1) m
    global_topk           log2 L (a_i + m/B_i) + log2 K (a_e + L m/B_e)
                          + dense_hierarchical(v m)                 inter log2 K L m + 2(K-1)/K v m
    hierarchical_topk     2 [(L-1)/L M / B_i + (L-1) a_i] + log2 K (a_e + m/B_e)
                          + 2(K-1)/K v m / B_e + 2(K-1) a_e        inter log2 K m + 2(K-1)/K v m
    sparse_node_gather    log2 L (a_i + m/B_i) + 2(L-1)/L v m/B_i + 2(L-1) a_i
                          + (K-1) m / B_e + (K-1) a_e
                          + (L-1) K m/L / B_i + (L-1) a_i          inter (K-1) m
    powersgd(s)           dense_hierarchical with M = s (the summed low-rank factors)

(the global top-k exchange of :mod:`lightning_gc.exchanges.global_topk`: ``log2 N``
recursive-doubling merge rounds of the ``m``-byte candidate pairs, then an all-reduce of the
agreed values, a fraction ``v`` of ``m``: 1/2 for fp32 values with int32 indices. Ranks numbered
node by node make the first ``log2 L`` rounds intra-node; in the others all ``L`` devices of a node
swap through its NIC at once. A world size that is not a power of two adds up to two rounds.)

So the hierarchical gather's inter bytes per node do not depend on ``L``; the flat gather's
grow as ``K L - 1``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from lightning_gc.common.validation import check_int, check_range
from lightning_gc.perfmodel import Network, allgather_s, ring_allreduce_s


@dataclass(frozen=True)
class Cluster:
    """``nodes`` (K) nodes of ``per_node`` (L) devices.

    Attributes:
        nodes: number of nodes ``K`` (>= 1).
        per_node: devices per node ``L`` (>= 1).
        intra_bandwidth: ``B_i``, bytes/s each device can send inside its node (> 0).
        intra_latency: ``a_i``, seconds per intra-node message (>= 0).
        inter_bandwidth: ``B_e``, bytes/s of the node's one inter-node link, shared by its ``L``
            devices (> 0).
        inter_latency: ``a_e``, seconds per inter-node message (>= 0).
    """

    nodes: int
    per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float

    def __post_init__(self) -> None:
        check_int("nodes", self.nodes, 1)
        check_int("per_node", self.per_node, 1)
        check_range("intra_bandwidth", self.intra_bandwidth, 0.0, None, low_inclusive=False)
        check_range("intra_latency", self.intra_latency, 0.0, None)
        check_range("inter_bandwidth", self.inter_bandwidth, 0.0, None, low_inclusive=False)
        check_range("inter_latency", self.inter_latency, 0.0, None)

    @property
    def world_size(self) -> int:
        """``N = K L``."""
        return self.nodes * self.per_node

    @property
    def intra(self) -> Network:
        """The ``L`` ranks of one node on the intra-node link."""
        return Network(self.per_node, self.intra_bandwidth, self.intra_latency)

    @property
    def inter(self) -> Network:
        """One rank per node, the ``K`` nodes on the inter-node link."""
        return Network(self.nodes, self.inter_bandwidth, self.inter_latency)

    @property
    def flat(self) -> Network:
        """All ``N`` ranks, paced by the inter-node link (the intra one when ``K = 1``)."""
        if self.nodes == 1:
            return self.intra
        return Network(self.world_size, self.inter_bandwidth, self.inter_latency)


@dataclass(frozen=True)
class SchemeTime:
    """Predicted exchange of one scheme per step.

    Attributes:
        name: scheme name.
        seconds: exchange time per step.
        inter_bytes_per_node: bytes through the busiest node's NIC, busiest direction, per step.
    """

    name: str
    seconds: float
    inter_bytes_per_node: float


def _check(nbytes: float, compression: float | None = None) -> None:
    check_range("nbytes", nbytes, 0.0, None)
    if compression is not None:
        check_range("compression", compression, 1.0, None)


def _intra_phase_s(nbytes: float, cluster: Cluster) -> float:
    """Intra-node reduce-scatter (or all-gather) ring over ``L``, half a ring all-reduce:
    ``(L-1)/L M / B_i + (L-1) a_i``."""
    return ring_allreduce_s(nbytes, cluster.intra) / 2


def dense_ring(nbytes: float, cluster: Cluster) -> SchemeTime:
    """Flat ring all-reduce over all ``N`` ranks. A ring step moves at the pace of its slowest
    edge, the inter-node one when ``K > 1``: ``2(N-1)/N M / B_e + 2(N-1) a_e``; one ring edge
    leaves each node, so the NIC carries ``2(N-1)/N M``. At ``K = 1`` it is the intra ring."""
    _check(nbytes)
    n = cluster.world_size
    inter = 0.0 if cluster.nodes == 1 else 2 * (n - 1) / n * nbytes
    return SchemeTime("dense ring", ring_allreduce_s(nbytes, cluster.flat), inter)


def dense_hierarchical(nbytes: float, cluster: Cluster, name: str = "dense hierarchical") -> SchemeTime:
    """Intra reduce-scatter, an inter ring all-reduce of ``M/L`` per local rank across the ``K``
    nodes (``L`` rings share the NIC), intra all-gather (NCCL's hierarchical pattern):
    ``2[(L-1)/L M/B_i + (L-1) a_i] + 2(K-1)/K M/B_e + 2(K-1) a_e``; NIC bytes ``2(K-1)/K M``."""
    _check(nbytes)
    k = cluster.nodes
    inter_s = ring_allreduce_s(nbytes, cluster.inter)
    return SchemeTime(name, 2 * _intra_phase_s(nbytes, cluster) + inter_s, 2 * (k - 1) / k * nbytes)


def flat_gather(nbytes: float, compression: float, cluster: Cluster) -> SchemeTime:
    """All-gather of ``m = M/c`` per rank over all ``N`` ranks (node-ordered ring, as NCCL runs it):
    each ring edge, the node's outgoing inter edge included, carries ``(N-1) m``; time
    ``(N-1) m / B_e + (N-1) a_e``. Bounds: each node must take in at least its ``N-L`` remote
    payloads, ``(N-L) m``; an exchange where each of the ``L`` ranks fetches its own copies takes
    ``L (N-L) m`` through the NIC. At ``K = 1``: ``(L-1) m / B_i + (L-1) a_i``."""
    _check(nbytes, compression)
    n, m = cluster.world_size, nbytes / compression
    inter = 0.0 if cluster.nodes == 1 else (n - 1) * m
    return SchemeTime("flat gather", allgather_s(m, cluster.flat), inter)


def hierarchical_gather(nbytes: float, compression: float, cluster: Cluster) -> SchemeTime:
    """Intra reduce-scatter of the dense bucket (each local rank holds ``1/L`` of the node sum),
    each local rank compresses its shard to ``M/(L c)`` and all-gathers it (ring) among the ``K``
    ranks with its local rank; the ``L`` rings share the NIC, which carries ``L (K-1) M/(L c) =
    (K-1) m``, independent of ``L``; then an intra all-gather of the decoded shard averages
    (dense, ``M`` in all): ``2[(L-1)/L M/B_i + (L-1) a_i] + (K-1) m/B_e + (K-1) a_e``."""
    _check(nbytes, compression)
    k, m = cluster.nodes, nbytes / compression
    inter_s = allgather_s(m, cluster.inter)
    return SchemeTime("hierarchical gather", 2 * _intra_phase_s(nbytes, cluster) + inter_s, (k - 1) * m)


def global_topk(nbytes: float, compression: float, cluster: Cluster, values: float = 0.5) -> SchemeTime:
    """The library's global top-k over all ``N`` ranks (``hierarchy="flat"``): ``log2 L`` intra
    merge rounds of ``m`` bytes, ``log2 K`` inter rounds in which the node's ``L`` devices each
    swap ``m`` through the NIC, then the agreed values (``values`` of ``m``) all-reduced as NCCL's
    hierarchical pattern does (:func:`dense_hierarchical`)."""
    _check(nbytes, compression)
    check_range("values", values, 0.0, 1.0)
    m = nbytes / compression
    if m == 0:
        return SchemeTime("global top-k", 0.0, 0.0)
    intra_rounds, inter_rounds = math.ceil(math.log2(cluster.per_node)), math.ceil(math.log2(cluster.nodes))
    selection_s = intra_rounds * (cluster.intra_latency + m / cluster.intra_bandwidth) + inter_rounds * (
        cluster.inter_latency + cluster.per_node * m / cluster.inter_bandwidth
    )
    agreed = dense_hierarchical(values * m, cluster)
    inter = inter_rounds * cluster.per_node * m + agreed.inter_bytes_per_node
    return SchemeTime("global top-k", selection_s + agreed.seconds, inter)


def hierarchical_topk(nbytes: float, compression: float, cluster: Cluster, values: float = 0.5) -> SchemeTime:
    """The global top-k on the two-level exchange (``hierarchy="node"``): the intra reduce-scatter
    and all-gather of the dense bucket, and between them, per local rank on its shard (``m/L``),
    ``log2 K`` merge rounds and a ring all-reduce of its agreed values among the ``K`` nodes; the
    ``L`` ranks share the NIC: ``log2 K (a_e + m/B_e) + 2(K-1)/K v m / B_e + 2(K-1) a_e``."""
    _check(nbytes, compression)
    check_range("values", values, 0.0, 1.0)
    m = nbytes / compression
    k = cluster.nodes
    inter_rounds = math.ceil(math.log2(k))
    inter_s = inter_rounds * (cluster.inter_latency + m / cluster.inter_bandwidth) + ring_allreduce_s(
        values * m, cluster.inter
    )
    inter = inter_rounds * m + 2 * (k - 1) / k * values * m
    return SchemeTime("hierarchical global top-k", 2 * _intra_phase_s(nbytes, cluster) + inter_s, inter)


def sparse_node_gather(nbytes: float, compression: float, cluster: Cluster, values: float = 0.5) -> SchemeTime:
    """``hierarchy="node_sparse"`` (:mod:`lightning_gc.exchanges.hierarchy_sparse`): within the node, ``log2 L``
    merge rounds of ``m`` bytes and a ring all-reduce of the agreed values (``values`` of ``m``);
    across nodes, local rank ``l`` all-gathers its ``m/L`` slice of the node's pairs among the ``K``
    nodes (the ``L`` rings share the NIC, which carries ``(K-1) m``, independent of ``L``); within
    the node, an all-gather of the ``K m/L`` received. Nothing dense moves, so unlike
    :func:`hierarchical_gather` no term grows with ``M``."""
    _check(nbytes, compression)
    check_range("values", values, 0.0, 1.0)
    k, per_node, m = cluster.nodes, cluster.per_node, nbytes / compression
    if m == 0:
        return SchemeTime("sparse node gather", 0.0, 0.0)
    merge_s = math.ceil(math.log2(per_node)) * (cluster.intra_latency + m / cluster.intra_bandwidth)
    seconds = (
        merge_s
        + ring_allreduce_s(values * m, cluster.intra)
        + allgather_s(m, cluster.inter)
        + allgather_s(k * m / per_node, cluster.intra)
    )
    return SchemeTime("sparse node gather", seconds, (k - 1) * m)


def powersgd(summed_bytes: float, cluster: Cluster) -> SchemeTime:
    """PowerSGD: its low-rank factors (``summed_bytes`` per rank per step, e.g. ``(n + m) r``
    elements per matrix over both power-iteration halves) are summable, so they are all-reduced
    hierarchically: :func:`dense_hierarchical` of ``summed_bytes``."""
    return dense_hierarchical(summed_bytes, cluster, name="PowerSGD")


def all_schemes(nbytes: float, compression: float, powersgd_bytes: float, cluster: Cluster) -> list[SchemeTime]:
    """Every scheme of this module for one bucket of ``nbytes``, in a fixed order."""
    return [
        dense_ring(nbytes, cluster),
        dense_hierarchical(nbytes, cluster),
        flat_gather(nbytes, compression, cluster),
        hierarchical_gather(nbytes, compression, cluster),
        sparse_node_gather(nbytes, compression, cluster),
        global_topk(nbytes, compression, cluster),
        hierarchical_topk(nbytes, compression, cluster),
        powersgd(powersgd_bytes, cluster),
    ]


def flat_gather_loses_at(
    nbytes: float,
    compression: float,
    cluster: Cluster,
    dense: Callable[[float, Cluster], SchemeTime] = dense_ring,
    max_nodes: int = 1 << 16,
) -> int | None:
    """Smallest node count ``K`` (``cluster``'s ``L`` and links) at which :func:`flat_gather` takes
    longer than ``dense`` (:func:`dense_ring` by default), or ``None`` up to ``max_nodes``. Bytes
    alone: ``(N-1) M/c > 2(N-1)/N M`` iff ``N > 2c``, as in the flat model."""
    _check(nbytes, compression)
    check_int("max_nodes", max_nodes, 1)
    for k in range(1, max_nodes + 1):
        trial = Cluster(
            k,
            cluster.per_node,
            cluster.intra_bandwidth,
            cluster.intra_latency,
            cluster.inter_bandwidth,
            cluster.inter_latency,
        )
        if flat_gather(nbytes, compression, trial).seconds > dense(nbytes, trial).seconds:
            return k
    return None
