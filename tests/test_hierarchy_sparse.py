"""The two-level exchange with a sparse node reduction (lightning_gc.exchanges.hierarchy_sparse) on gloo
processes as 2 nodes x 2 devices (and 2 x 4), and its slice layout in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import launch_ranks

from lightning_gc import DGCStrategy, GradientCompressionStrategy
from lightning_gc.compressors.registry import create
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.exchanges.hierarchy import NodeHierarchy, NodeTopology, resolve_hierarchy
from lightning_gc.exchanges.hierarchy_sparse import NodeMean, SparseNodeHierarchy, _NodePairs
from lightning_gc.runtime.checkpoint import IncompatibleCheckpoint
from lightning_gc.runtime.hook import CompressionHookState
from lightning_gc.runtime.settings import CompressionSettings

SPARSE_NODE = {"hierarchy": "node_sparse"}
DGC = {"compressor": "dgc", "optimizer": "sgd", "steps": 12, "kwargs": {"compress_ratio": 0.05}}


def _relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _with(run: dict, **kwargs: object) -> dict:
    return {**run, "kwargs": {**run["kwargs"], **kwargs}}


def test_sparse_node_reduction_equals_ddp_at_ratio_one_keeps_ranks_identical_and_halves_the_bytes(
    tmp_path: Path,
) -> None:
    """At ratio 1 it is DDP (float summation order aside); DGC at 5 % keeps all four ranks
    identical, differs from the flat exchange (k positions per tensor per node) but is as close to
    DDP, sends each node's pairs once across nodes (half per local rank), and keeps every rank's
    whole residual; a grad scaler changes nothing; a delayed run and local clipping work through it."""
    runs = [
        {"compressor": None, "optimizer": "sgd", "steps": 12},
        _with(DGC, compress_ratio=1.0, **SPARSE_NODE),
        DGC,
        _with(DGC, **SPARSE_NODE),
        _with(DGC, **SPARSE_NODE, delay=1),
        _with(DGC, **SPARSE_NODE, clip_norm=0.05),
        {"compressor": "topk", "optimizer": "sgd", "steps": 12, "kwargs": {"compress_ratio": 0.05, **SPARSE_NODE}},
        {**_with(DGC, **SPARSE_NODE), "scaler": True},
        {**_with(DGC, compress_ratio=1.0, **SPARSE_NODE), "scaler": True},
        {**_with(DGC, **SPARSE_NODE), "bucket_cap_mb": 1e-5},  # one bucket per tensor
    ]
    ranks = launch_ranks("attach_worker.py", {"runs": runs}, tmp_path, world_size=4, devices_per_node=2)
    ddp, dense, flat, node, delayed, clipped, topk, scaled, dense_scaled, buckets = ranks[0]
    # one bucket per tensor, each finished at the next one's hook; every choice is per tensor, so the
    # same update up to float summation order (the biases' buckets are too small to compress: flat)
    assert buckets["buckets"] == 4 and buckets["deferred"] >= 11 * 2
    assert _relative_difference(buckets["params"], node["params"]) < 1e-5
    assert _relative_difference(dense["params"], ddp["params"]) < 1e-5
    # a power-of-two loss scale is exact: with a grad scaler the same parameters, bit for bit
    assert torch.equal(scaled["params"], node["params"])
    assert torch.equal(dense_scaled["params"], dense["params"])
    assert not torch.equal(node["params"], flat["params"])
    assert _relative_difference(node["params"], ddp["params"]) < 1.5 * _relative_difference(
        flat["params"], ddp["params"]
    )
    for run in (delayed, clipped, topk):
        assert torch.isfinite(run["params"]).all()
        assert not torch.equal(run["params"], node["params"])
    for other in ranks[1:]:
        for ours, theirs in zip(ranks[0], other):
            assert torch.equal(ours["params"], theirs["params"])
    # each rank: half of its node's k agreed pairs (4-byte value, int32 position) and half of the
    # dense values (positions known), each rounded up to 4 slots; the flat exchange: every rank's k
    # pairs and its dense values
    k = 205 + 64  # ceil(0.05 * 4096) + ceil(0.05 * 1280)
    dense_values = 128 + 10
    slice_bytes = 136 * 8 + 72 * 4  # ceil(269 / 2) -> 136 slots, ceil(138 / 2) -> 72
    assert node["totals"]["bytes_sent"] * (8 * k + 4 * dense_values) == flat["totals"]["bytes_sent"] * slice_bytes
    assert node["memory_numel"] == flat["memory_numel"]  # the whole residual on every rank


def test_sparse_node_reduction_resumes_exactly_also_from_and_into_a_flat_run(tmp_path: Path) -> None:
    """Rebuilt from a checkpoint's state after step 6, a run ends bit for bit where an uninterrupted
    one does, synchronous or delayed; since every rank keeps its whole residual, a flat run's state
    resumes under the sparse node reduction and the other way round (ranks identical)."""
    node = _with(DGC, **SPARSE_NODE)
    delayed = _with(DGC, **SPARSE_NODE, delay=1)
    runs = [
        node,
        {**node, "resume_after": 6},
        delayed,
        {**delayed, "resume_after": 6},
        {**DGC, "resume_after": 6, "resume_kwargs": node["kwargs"]},
        {**node, "resume_after": 6, "resume_kwargs": DGC["kwargs"]},
    ]
    ranks = launch_ranks("attach_worker.py", {"runs": runs}, tmp_path, world_size=4, devices_per_node=2)
    for straight, resumed, delayed_straight, delayed_resumed, flat_then_node, node_then_flat in ranks:
        assert torch.equal(straight["params"], resumed["params"])
        assert torch.equal(delayed_straight["params"], delayed_resumed["params"])
        assert not torch.equal(flat_then_node["params"], straight["params"])
        assert not torch.equal(node_then_flat["params"], straight["params"])
    for other in ranks[1:]:
        for ours, theirs in zip(ranks[0], other):
            assert torch.equal(ours["params"], theirs["params"])


def test_two_nodes_of_four_devices_merge_twice_within_the_node(tmp_path: Path) -> None:
    """2 x 4: two merge rounds within each node; DDP at ratio 1, identical ranks at 5 %."""
    runs = [
        {"compressor": None, "optimizer": "sgd", "steps": 8},
        _with({**DGC, "steps": 8}, compress_ratio=1.0, **SPARSE_NODE),
        {**DGC, "steps": 8},
        _with({**DGC, "steps": 8}, **SPARSE_NODE),
    ]
    ranks = launch_ranks("attach_worker.py", {"runs": runs}, tmp_path, world_size=8, devices_per_node=4)
    ddp, dense, flat, node = ranks[0]
    assert _relative_difference(dense["params"], ddp["params"]) < 1e-5
    assert _relative_difference(node["params"], ddp["params"]) < 2 * _relative_difference(flat["params"], ddp["params"])
    for other in ranks[1:]:
        for ours, theirs in zip(ranks[0], other):
            assert torch.equal(ours["params"], theirs["params"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("agreed", "dense"), [(1, 0), (7, 3), (10, 1), (13, 6), (0, 9)])
def test_node_pairs_slices_tile_the_node_and_scatter_the_mean_over_nodes(
    dtype: torch.dtype, agreed: int, dense: int
) -> None:
    """Every local rank's slice staged (scaled by 2) and the two all-gathers emulated by
    concatenation (across nodes, then within the node) scatter exactly ``(2/K) sum_k P_k``, for
    any slice alignment and value width: the agreed positions differ by node and travel, the dense
    ones are every node's and do not; the padding adds nothing."""
    nodes, per_node, numel = 3, 2, 40
    generator = torch.Generator().manual_seed(agreed * 100 + dense)
    dense_positions = torch.arange(numel - dense, numel)
    node_means = []
    for _ in range(nodes):
        positions = torch.cat([torch.randperm(numel - dense, generator=generator)[:agreed], dense_positions])
        node_means.append(
            NodeMean(positions, torch.randn(agreed + dense, generator=generator).to(dtype), agreed, False)
        )
    staged = {}  # (node, local) -> row
    for node in range(nodes):
        for local in range(per_node):
            pairs = _NodePairs.build(
                node_means[node], NodeTopology(nodes, per_node, node, local), node_means[node].means
            )
            pairs.stage(node_means[node], 2.0)
            staged[node, local] = pairs.mine.clone()
    row_bytes = {row.numel() for row in staged.values()}
    assert len(row_bytes) == 1  # every rank's row the same size, as an all-gather needs
    for local in range(per_node):  # what local rank `local` of node 0 holds after both all-gathers
        pairs = _NodePairs.build(node_means[0], NodeTopology(nodes, per_node, 0, local), node_means[0].means)
        pairs.everyone.copy_(torch.cat([staged[node, other] for other in range(per_node) for node in range(nodes)]))
        out = torch.full((numel,), 9.0, dtype=dtype)
        pairs.scatter_mean(out, nodes)
        expected = torch.zeros(numel, dtype=torch.float64)
        for mean in node_means:
            expected.index_add_(0, mean.positions, mean.means.double() * 2 / nodes)
        scale = expected.abs().max().item()  # the rounding of a sum of three is of its terms' size
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=4 * torch.finfo(dtype).eps * scale)


def test_sparse_node_reduction_is_refused_for_what_it_cannot_run() -> None:
    """Only sparse compressors that gather: each refusal names the value and the way out."""
    settings = CompressionSettings(hierarchy="node_sparse")
    settings.check_compressor(create("dgc", compress_ratio=0.01))
    settings.check_compressor(create("topk", compress_ratio=0.01))
    with pytest.raises(ValueError, match=r"compressor 'onebit'.*\['dgc', 'topk'\].*hierarchy='node'"):
        settings.check_compressor(create("onebit"))
    with pytest.raises(ValueError, match=r"exchange='gather', got exchange='global_topk'"):
        settings.check_compressor(create("dgc", compress_ratio=0.01, exchange="global_topk"))
    with pytest.raises(ValueError, match=r"'node_sparse'.*got 'tree'"):
        CompressionSettings(hierarchy="tree")
    with pytest.raises(ValueError, match=r"exchange='gather', got exchange='global_topk'"):  # at construction
        DGCStrategy(hierarchy="node_sparse", exchange="global_topk")
    with pytest.raises(ValueError, match=r"compressor 'qsgd'"):
        GradientCompressionStrategy("qsgd", hierarchy="node_sparse")
    with pytest.warns(UserWarning, match="with one node this is exchange='global_topk' among its devices"):
        assert resolve_hierarchy("node_sparse", 2, 1, 2) == NodeTopology(nodes=1, per_node=2, node=0, local=1)


@pytest.mark.usefixtures("world_of_one")
def test_a_sharded_residual_does_not_resume_where_residuals_are_whole() -> None:
    """A ``hierarchy='node'`` state (each rank a piece of every residual) is refused by a
    ``node_sparse`` or flat run, naming both layouts; flat and ``node_sparse`` states load into
    each other."""
    topology = NodeTopology(1, 1, 0, 0)

    def memory() -> CompensationMemory:
        return CompensationMemory(momentum_correction=True, momentum_masking=True, clip_norm=None)

    def hook_state(hierarchy: NodeHierarchy | None) -> CompressionHookState:
        return CompressionHookState(create("dgc", compress_ratio=0.01), memory(), {}, exchange=hierarchy)

    sharded = hook_state(NodeHierarchy(topology)).state_dict()
    flat = hook_state(None).state_dict()
    whole = hook_state(SparseNodeHierarchy(topology)).state_dict()
    assert "hierarchy" not in whole
    hook_state(SparseNodeHierarchy(topology)).load_state_dict(flat)
    hook_state(None).load_state_dict(whole)
    for hierarchy in (SparseNodeHierarchy(topology), None):
        with pytest.raises(IncompatibleCheckpoint, match=r"=\(1, 1\) and this run is whole residuals"):
            hook_state(hierarchy).load_state_dict(sharded)
