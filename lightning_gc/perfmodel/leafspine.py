"""Leaf-spine load simulation: ECMP flow hashing vs sub-flow splitting vs ideal packet spraying.

A simulation, not a measurement: flows are placed on links and bytes are counted; there is no
congestion control, no queueing and no time dimension beyond ``load / bandwidth``.

LeafSpine: ``nodes`` hosts, ``hosts_per_leaf`` per leaf switch (node ``i`` on leaf
``i // hosts_per_leaf``), every leaf linked to each of ``spines`` spines; every link (host-leaf
and leaf-spine, each direction) has ``link_bandwidth`` bytes/s. A flow ``(src, dst, bytes)``
between leaves ``a != b`` through spine ``s`` loads the uplink ``a -> s`` and the downlink
``s -> b``; a flow inside one leaf loads no spine link. Routing:

* ``subflows = 1``: ECMP, each whole flow hashed (a seeded RNG stands in for the hash) to one spine;
* ``subflows = m``: each flow cut into ``m`` equal sub-flows hashed independently;
* ``spray=True``: ideal packet spraying, every flow spread evenly, ``bytes / spines`` per spine.

Completion time of a step = max(busiest spine link, busiest host link) / ``link_bandwidth``.
Spraying's spine load is the lower bound for any routing of the same flows (it is the mean per
leaf's uplinks and downlinks), so ``max_load / ideal_load >= 1`` measures hashing collisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_gc.common.validation import check_int, check_range

Flow = tuple[int, int, float]
"""``(src_node, dst_node, bytes)``."""

NODE_COUNTS = (16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class LeafSpine:
    """Two-tier leaf-spine network (see the module docstring)."""

    nodes: int
    hosts_per_leaf: int
    spines: int
    link_bandwidth: float

    def __post_init__(self) -> None:
        check_int("nodes", self.nodes, 1)
        check_int("hosts_per_leaf", self.hosts_per_leaf, 1)
        check_int("spines", self.spines, 1)
        check_range("link_bandwidth", self.link_bandwidth, 0.0, None, low_inclusive=False)

    @property
    def leaves(self) -> int:
        """``ceil(nodes / hosts_per_leaf)``."""
        return -(-self.nodes // self.hosts_per_leaf)


@dataclass(frozen=True)
class Routing:
    """Outcome of routing one flow set.

    Attributes:
        max_link_load: bytes on the busiest leaf-spine link.
        ideal_load: the same under ideal spraying (lower bound).
        host_load: bytes on the busiest host link (same under every routing).
        completion_s: ``max(max_link_load, host_load) / link_bandwidth``.
    """

    max_link_load: float
    ideal_load: float
    host_load: float
    completion_s: float

    @property
    def relative(self) -> float:
        """``max_link_load / ideal_load`` (1.0 when nothing crosses the spine)."""
        return self.max_link_load / self.ideal_load if self.ideal_load else 1.0


def _spine_loads(
    flows: Sequence[Flow], topology: LeafSpine, subflows: int, spray: bool, rng: np.random.Generator
) -> float:
    up = np.zeros((topology.leaves, topology.spines))
    down = np.zeros((topology.spines, topology.leaves))
    table = np.asarray(
        [(src // topology.hosts_per_leaf, dst // topology.hosts_per_leaf, nbytes) for src, dst, nbytes in flows]
    )
    table = table.reshape(-1, 3)
    table = table[table[:, 0] != table[:, 1]]  # flows inside one leaf never reach a spine
    a, b, nbytes = table[:, 0].astype(int), table[:, 1].astype(int), table[:, 2]
    if spray:
        np.add.at(up, a, (nbytes / topology.spines)[:, None])
        np.add.at(down.T, b, (nbytes / topology.spines)[:, None])
    else:
        paths = rng.integers(topology.spines, size=(len(a), subflows))
        share = np.repeat(nbytes / subflows, subflows)
        np.add.at(up, (np.repeat(a, subflows), paths.ravel()), share)
        np.add.at(down, (paths.ravel(), np.repeat(b, subflows)), share)
    return float(max(up.max(), down.max()))


def route(flows: Sequence[Flow], topology: LeafSpine, subflows: int = 1, spray: bool = False, seed: int = 0) -> Routing:
    """Route ``flows`` on ``topology`` (ECMP with ``subflows`` sub-flows per flow, or ideal spraying)."""
    check_int("subflows", subflows, 1)
    egress, ingress = np.zeros(topology.nodes), np.zeros(topology.nodes)
    for src, dst, nbytes in flows:
        check_int("src_node", src, 0, topology.nodes - 1)
        check_int("dst_node", dst, 0, topology.nodes - 1)
        check_range("flow bytes", nbytes, 0.0, None)
        egress[src] += nbytes
        ingress[dst] += nbytes
    rng = np.random.default_rng(seed)
    load = _spine_loads(flows, topology, subflows, spray, rng)
    ideal = _spine_loads(flows, topology, 1, True, rng)
    host = float(max(egress.max(), ingress.max()))
    return Routing(load, ideal, host, max(load, host) / topology.link_bandwidth)


def ring_step_flows(nodes: int, nbytes: float, stride: int = 1) -> list[Flow]:
    """One ring step: node ``i`` sends ``nbytes`` to node ``(i + stride) % nodes`` (one flow per
    node pair). ``stride = 1`` is the topology-aware ring (one flow per leaf crosses the spine);
    ``stride = hosts_per_leaf`` puts every ring neighbour on the next leaf (all flows cross)."""
    check_int("nodes", nodes, 2)
    check_int("stride", stride, 1)
    check_range("nbytes", nbytes, 0.0, None)
    return [(i, (i + stride) % nodes, nbytes) for i in range(nodes)]


def shard_gather_step_flows(nodes: int, per_node: int, shard_bytes: float, stride: int = 1) -> list[Flow]:
    """One step of the hierarchical gather's inter-node rings: ``per_node`` (``L``) parallel flows
    of ``shard_bytes`` from node ``i`` to node ``(i + stride) % nodes``, one per local rank.
    The same traffic as :func:`ring_step_flows` of ``L shard_bytes`` split into ``L`` sub-flows."""
    check_int("per_node", per_node, 1)
    return [flow for flow in ring_step_flows(nodes, shard_bytes, stride) for _ in range(per_node)]


@dataclass(frozen=True)
class ComparisonRow:
    """One node count: ``relative`` loads (``max / ideal``) and completion seconds per routing,
    keyed ``"ecmp"``, ``"L=2"``, ... , ``"spray"``."""

    nodes: int
    relative: dict[str, float]
    completion_s: dict[str, float]


def compare(
    node_counts: Sequence[int] = NODE_COUNTS,
    splits: Sequence[int] = (2, 4, 8),
    hosts_per_leaf: int = 8,
    spines: int = 8,
    link_bandwidth: float = 100e9 / 8,
    pair_bytes: float = 204_800.0,
    seed: int = 0,
) -> list[ComparisonRow]:
    """Per node count: the hierarchical gather's ring step with every neighbour on the next leaf
    (``stride = hosts_per_leaf``, the spine's worst case), ``pair_bytes`` per node pair, routed as
    one ECMP flow per pair, as ``L`` ECMP flows for each ``L`` in ``splits`` (the hierarchical
    exchange's shards), and sprayed. Default bytes: one hierarchical DGC step of ResNet-50
    (``M/c = 102.4 MB / 500``). Non-blocking when ``spines >= hosts_per_leaf``."""
    rows = []
    for nodes in node_counts:
        topology = LeafSpine(nodes, hosts_per_leaf, spines, link_bandwidth)
        cases = {"ecmp": (ring_step_flows(nodes, pair_bytes, hosts_per_leaf), False)}
        for split in splits:
            cases[f"L={split}"] = (shard_gather_step_flows(nodes, split, pair_bytes / split, hosts_per_leaf), False)
        cases["spray"] = (ring_step_flows(nodes, pair_bytes, hosts_per_leaf), True)
        routed = {name: route(flows, topology, spray=spray, seed=seed) for name, (flows, spray) in cases.items()}
        rows.append(
            ComparisonRow(
                nodes, {k: r.relative for k, r in routed.items()}, {k: r.completion_s for k, r in routed.items()}
            )
        )
    return rows
