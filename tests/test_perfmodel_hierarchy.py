"""Two-level exchange model and leaf-spine simulation (lightning_gc.perfmodel.hierarchy, .leafspine)."""

from __future__ import annotations

import pytest

from lightning_gc.perfmodel import hierarchy as h
from lightning_gc.perfmodel import leafspine as fs

# K = 2 nodes of L = 2, B_i = 100 B/s, a_i = 1 s, B_e = 10 B/s, a_e = 2 s; M = 1000 B, c = 10 (m = 100 B).
SMALL = h.Cluster(2, 2, 100.0, 1.0, 10.0, 2.0)


@pytest.mark.parametrize(
    ("scheme", "seconds", "inter"),
    [
        (lambda c: h.dense_ring(1000, c), 2 * 3 / 4 * 1000 / 10 + 2 * 3 * 2, 1500),  # 162
        (lambda c: h.dense_hierarchical(1000, c), 2 * (500 / 100 + 1) + 1000 / 10 + 2 * 2, 1000),  # 116
        (lambda c: h.flat_gather(1000, 10, c), 3 * 100 / 10 + 3 * 2, 300),  # 36
        (lambda c: h.hierarchical_gather(1000, 10, c), 2 * (500 / 100 + 1) + 100 / 10 + 2, 100),  # 24
        # log2 L = 1 intra round, log2 K = 1 inter round of L m, then 50 B of agreed values hierarchically
        (lambda c: h.global_topk(1000, 10, c), (1 + 1) + (2 + 200 / 10) + 2 * (25 / 100 + 1) + 50 / 10 + 4, 250),
        (lambda c: h.hierarchical_topk(1000, 10, c), 2 * (500 / 100 + 1) + (2 + 100 / 10) + 50 / 10 + 2 * 2, 150),
        (lambda c: h.powersgd(200, c), 2 * (100 / 100 + 1) + 200 / 10 + 2 * 2, 200),  # 28
        # one merge round of m, 50 B of agreed values all-reduced in the node, m across, K m / L back in the node
        (lambda c: h.sparse_node_gather(1000, 10, c), (1 + 1) + (50 / 100 + 2) + (100 / 10 + 2) + (100 / 100 + 1), 100),
    ],
)
def test_two_node_formulas_match_hand_computed(scheme, seconds, inter):
    result = scheme(SMALL)
    assert result.seconds == pytest.approx(seconds)
    assert result.inter_bytes_per_node == pytest.approx(inter)


def _cluster(nodes: int, per_node: int) -> h.Cluster:
    return h.Cluster(nodes, per_node, 200e9, 2e-6, 10e9 / 8, 10e-6)


def test_hierarchical_gather_inter_bytes_do_not_grow_with_per_node_flat_gather_does():
    hier = [h.hierarchical_gather(1e8, 500, _cluster(16, n)).inter_bytes_per_node for n in (1, 2, 4, 8, 16)]
    sparse = [h.sparse_node_gather(1e8, 500, _cluster(16, n)).inter_bytes_per_node for n in (1, 2, 4, 8, 16)]
    flat = [h.flat_gather(1e8, 500, _cluster(16, n)).inter_bytes_per_node for n in (1, 2, 4, 8, 16)]
    assert hier == pytest.approx([hier[0]] * 5)
    assert sparse == pytest.approx(hier)
    assert all(a < b for a, b in zip(flat, flat[1:]))


@pytest.mark.parametrize("per_node", [1, 4, 8])
def test_one_node_has_no_inter_terms(per_node):
    cluster = h.Cluster(1, per_node, 200e9, 2e-6, 1.0, 1.0)  # a 1 B/s NIC would dominate if used
    for result in h.all_schemes(1e8, 500, 1e6, cluster):
        assert result.inter_bytes_per_node == 0
        assert result.seconds < 0.01, result.name
    assert h.dense_ring(1e8, cluster).seconds == pytest.approx(h.dense_hierarchical(1e8, cluster).seconds)


def test_single_rank_exchanges_nothing():
    assert all(r.seconds == 0 for r in h.all_schemes(1e8, 500, 1e6, _cluster(1, 1)))


def test_flat_gather_crossover_near_twice_the_ratio():
    nodes = h.flat_gather_loses_at(1e8, 500, _cluster(1, 8))
    assert nodes is not None and 2 * 500 < nodes * 8 <= 2 * 500 + 16 * 8
    assert h.flat_gather_loses_at(1e8, 500, _cluster(1, 8), max_nodes=10) is None


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: h.Cluster(0, 8, 1.0, 0.0, 1.0, 0.0), "nodes"),
        (lambda: h.Cluster(2, 8, 0.0, 0.0, 1.0, 0.0), "intra_bandwidth"),
        (lambda: h.Cluster(2, 8, 1.0, -1.0, 1.0, 0.0), "intra_latency"),
        (lambda: h.Cluster(2, 8, 1.0, 0.0, float("nan"), 0.0), "inter_bandwidth"),
        (lambda: h.flat_gather(1e6, 0.5, SMALL), "compression"),
        (lambda: h.dense_ring(-1, SMALL), "nbytes"),
        (lambda: fs.LeafSpine(8, 0, 4, 1.0), "hosts_per_leaf"),
        (lambda: fs.route([(0, 9, 1.0)], fs.LeafSpine(8, 2, 2, 1.0)), "dst_node"),
        (lambda: fs.route([(0, 1, 1.0)], fs.LeafSpine(8, 2, 2, 1.0), subflows=0), "subflows"),
    ],
)
def test_bad_input_raises_naming_the_value(make, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        make()


FABRIC = fs.LeafSpine(64, 8, 8, 1e9)
CROSSING = fs.ring_step_flows(64, 1e6, stride=8)  # every flow crosses the spine


def test_spraying_equals_ideal_and_ecmp_is_at_least_ideal():
    sprayed = fs.route(CROSSING, FABRIC, spray=True)
    assert sprayed.max_link_load == pytest.approx(sprayed.ideal_load)
    assert sprayed.ideal_load == pytest.approx(1e6)  # 8 flows per leaf over 8 uplinks
    assert sprayed.completion_s == pytest.approx(1e6 / 1e9)
    for seed in range(5):
        assert fs.route(CROSSING, FABRIC, seed=seed).relative >= 1.0


def test_splitting_brings_max_load_toward_ideal():
    def mean_relative(subflows: int) -> float:
        return sum(fs.route(CROSSING, FABRIC, subflows=subflows, seed=s).relative for s in range(10)) / 10

    means = [mean_relative(m) for m in (1, 4, 16, 64)]
    assert all(a > b for a, b in zip(means, means[1:]))
    assert means[0] > 2.0 and means[-1] < 1.5


def test_shard_flows_are_ring_flows_split_per_local_rank():
    shards = fs.shard_gather_step_flows(64, 8, 1e6 / 8, stride=8)
    assert len(shards) == 8 * 64 and sum(b for *_, b in shards) == pytest.approx(64 * 1e6)
    # Same hashing draws: L shard flows under ECMP = one pair flow cut into L sub-flows.
    assert fs.route(shards, FABRIC, seed=3).max_link_load == pytest.approx(
        fs.route(CROSSING, FABRIC, subflows=8, seed=3).max_link_load
    )


def test_topology_aware_ring_inside_one_leaf_uses_no_spine():
    result = fs.route(fs.ring_step_flows(8, 1e6), fs.LeafSpine(8, 8, 4, 1e9))
    assert result.max_link_load == 0 and result.relative == 1.0
    assert result.completion_s == pytest.approx(1e6 / 1e9)  # host link bound


def test_compare_rows():
    rows = fs.compare(node_counts=(16, 64), seed=0)
    assert [r.nodes for r in rows] == [16, 64]
    for row in rows:
        assert set(row.relative) == {"ecmp", "L=2", "L=4", "L=8", "spray"}
        assert row.relative["spray"] == pytest.approx(1.0)
        assert min(row.relative.values()) == pytest.approx(1.0)


def test_global_topk_node_bytes_grow_with_log_nodes_where_the_gather_grows_with_nodes():
    """Through the busiest NIC per step: the global top-k exchange's merge rounds (log2 K of them,
    one payload m each on two levels) and its agreed values (2(K-1)/K v m) against the flat
    gather's (N-1) m."""
    m = 1e8 / 500
    for nodes in (2, 8, 64, 512):
        log_nodes = nodes.bit_length() - 1
        two_level = h.hierarchical_topk(1e8, 500, _cluster(nodes, 8)).inter_bytes_per_node
        assert two_level == pytest.approx(log_nodes * m + 2 * (nodes - 1) / nodes * 0.5 * m)
        flat = h.global_topk(1e8, 500, _cluster(nodes, 8)).inter_bytes_per_node
        assert flat == pytest.approx(log_nodes * 8 * m + 2 * (nodes - 1) / nodes * 0.5 * m)
        assert flat < h.flat_gather(1e8, 500, _cluster(nodes, 8)).inter_bytes_per_node
    with pytest.raises(ValueError, match="values"):
        h.global_topk(1e8, 500, _cluster(2, 8), values=1.5)


def test_sparse_node_gather_wins_where_the_node_link_is_no_faster_than_the_network():
    """With an intra-node link as slow as the NIC the dense intra phases dominate the two-level
    gather, which the sparse node reduction does not have; with NVLink-class links both are far
    below the flat gather at 32 nodes."""
    slow = h.Cluster(4, 8, 10e9 / 8, 10e-6, 10e9 / 8, 10e-6)
    assert h.sparse_node_gather(1e8, 500, slow).seconds < 0.1 * h.hierarchical_gather(1e8, 500, slow).seconds
    fast = _cluster(32, 8)
    flat = h.flat_gather(1e8, 500, fast).seconds
    assert h.sparse_node_gather(1e8, 500, fast).seconds < 0.5 * flat
