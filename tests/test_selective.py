"""Selective compression from the performance model: the per-bucket decision and the hook's use of it."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_gc.compressors import create
from lightning_gc.compressors.simple import NoCompressor
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.perfmodel import Network
from lightning_gc.perfmodel.calibration import layout_of_shapes
from lightning_gc.runtime.hook import CompressionHookState
from lightning_gc.runtime.hook_options import HookOptions
from lightning_gc.runtime.policy import agreed
from lightning_gc.runtime.selective import CompressWhenFaster

LAYOUT = layout_of_shapes([(1000, 1000)])  # 4 MB of fp32 gradient
DGC = create("dgc", compress_ratio=0.001)  # 8 kB on the wire


def policy(bits_per_s: float, codec_s: float, hidden_s: float = 0.0) -> CompressWhenFaster:
    return CompressWhenFaster(Network.from_bits(2, bits_per_s), codec_s_per_element=codec_s / 1e6, hidden_s=hidden_s)


def test_decision_follows_the_model():
    # 1 Gbit/s: dense all-reduce of 4 MB on 2 workers takes 32 ms
    assert policy(1e9, codec_s=0.010)(DGC, LAYOUT, 4)  # 10 ms + 0.06 ms < 32 ms
    assert not policy(1e9, codec_s=0.040)(DGC, LAYOUT, 4)  # 40 ms > 32 ms
    assert not policy(100e9, codec_s=0.010)(DGC, LAYOUT, 4)  # 0.3 ms of dense comm: not worth 10 ms
    assert not policy(1e9, codec_s=0.010, hidden_s=0.030)(DGC, LAYOUT, 4)  # 2 ms exposed < 10 ms codec
    dense = policy(1e9, 0.0).step_cost_s(LAYOUT, 4, None)
    assert dense == pytest.approx(0.032)


def test_a_host_bound_transport_counts_as_the_perfmodel_counts_it():
    """With the transport on the compute core (host 1 GB/s, link 10 GB/s, 2 workers), all-reducing
    the 4 MB bucket costs T_host = 4 ms that backward cannot hide, however much it hides (10 ms)."""
    from lightning_gc.perfmodel import CodecCost
    from lightning_gc.perfmodel.step import Workload, pays

    network = Network(2, bandwidth=10e9, host_bandwidth=1e9)
    host_bound = CompressWhenFaster(network, codec_s_per_element=2e-3 / 1e6, hidden_s=0.010)
    assert host_bound.step_cost_s(LAYOUT, 4, None) == pytest.approx(4e-3)
    wire = DGC.wire_bytes(LAYOUT, 4)
    assert host_bound.step_cost_s(LAYOUT, 4, wire) == pytest.approx(2e-3 + wire / 1e9)
    assert host_bound(DGC, LAYOUT, 4)  # 2 ms + 8 us < 4 ms
    # the same decision as the performance model on a one-bucket workload
    workload = Workload(LAYOUT.numel, compute_s=0.020, overlap=0.5)
    assert pays(CodecCost("dgc", summed_bytes=0, gathered_bytes=wire, encode_s=2e-3), workload, network)
    assert not CompressWhenFaster(Network(2, bandwidth=10e9), codec_s_per_element=2e-3 / 1e6, hidden_s=0.010)(
        DGC, LAYOUT, 4
    )  # without the host term everything is hidden and the 2 ms codec is pure loss


def test_summed_payloads_cost_an_allreduce():
    fp16 = create("fp16")
    network = Network.from_bits(8, 1e9)
    as_gathered = CompressWhenFaster(network, codec_s_per_element=0.0, summed_fraction=0.0)
    as_summed = CompressWhenFaster(network, codec_s_per_element=0.0, summed_fraction=1.0)
    # 8 workers: all-gathering 2 MB per rank (14 MB in) loses to all-reducing 4 MB; all-reducing 2 MB wins
    assert not as_gathered(fp16, LAYOUT, 4)
    assert as_summed(fp16, LAYOUT, 4)


def test_hook_state_sends_dense_where_the_policy_says_so(world_of_one):
    memory = CompensationMemory(momentum_correction=False, momentum_masking=True, clip_norm=None)
    fast, slow = policy(100e9, codec_s=0.010), policy(1e9, codec_s=0.010)
    assert agreed(fast, None) is fast and agreed(None, None) is None
    assert isinstance(
        CompressionHookState(DGC, memory, {}, options=HookOptions(pays=fast)).compressor_for(LAYOUT, 4), NoCompressor
    )
    assert CompressionHookState(DGC, memory, {}, options=HookOptions(pays=slow)).compressor_for(LAYOUT, 4) is DGC
    assert CompressionHookState(DGC, memory, {}).compressor_for(LAYOUT, 4) is DGC  # off by default


def test_a_calibrated_policy_costs_each_exchange_as_it_travels():
    """Two-phase onebit on 128 ranks sends about 2 M/32 per rank where its gather would send
    127 M/32 (more than dense's 2 M); global top-k's merge rounds each cost a latency."""
    import dataclasses

    network = Network.from_bits(128, 1e9)
    onebit = create("onebit")
    gathered = CompressWhenFaster.calibrate("onebit", network, numel=1 << 14)
    phased = CompressWhenFaster.calibrate("onebit", network, arguments={"exchange": "two_phase"}, numel=1 << 14)
    free = {"codec_s_per_element": 0.0}  # decide on the wire alone
    assert not dataclasses.replace(gathered, **free)(onebit, LAYOUT, 4)
    assert dataclasses.replace(phased, **free)(create("onebit", exchange="two_phase"), LAYOUT, 4)

    slow = Network(16, bandwidth=1e12, latency=0.010)  # the rounds' latency dominates
    merged = CompressWhenFaster.calibrate(
        "dgc", slow, arguments={"compress_ratio": 0.001, "exchange": "global_topk"}, numel=1 << 14
    )
    assert merged.calibrated is not None and merged.calibrated.peer_messages == 4  # log2(16)
    wire = create("dgc", compress_ratio=0.001, exchange="global_topk").wire_bytes(LAYOUT, 4)
    rounds_s = dataclasses.replace(merged, **free).step_cost_s(LAYOUT, 4, wire)
    allreduce_s = 2 * 15 * 0.010  # the agreed values' ring all-reduce: 30 latencies
    assert rounds_s == pytest.approx(allreduce_s + 4 * 0.010, rel=1e-3)


def test_calibrated_policy_is_consistent():
    calibrated = CompressWhenFaster.calibrate("fp16", Network.from_bits(2, 1e9), numel=1 << 16)
    assert calibrated.summed_fraction == 1.0 and calibrated.codec_s_per_element > 0
    with pytest.raises(ValueError, match="`summed_fraction` must be in"):
        CompressWhenFaster(Network(2, 1.0), codec_s_per_element=0.0, summed_fraction=1.5)


def _agree_worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mine = policy(1e9, codec_s=0.010 if rank == 0 else 0.040)  # each rank calibrated differently
        decision = agreed(mine, None)(DGC, LAYOUT, 4)
        with open(f"{out}.{rank}", "w") as f:
            f.write(f"{agreed(mine, None).codec_s_per_element!r} {decision}")
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_rank_zeros_policy(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "decision")
    mp.spawn(_agree_worker, args=(str(tmp_path / "store"), out), nprocs=2)
    # rank 1 alone would not compress (40 ms codec > 32 ms dense); with rank 0's policy both do
    assert [open(f"{out}.{r}").read() for r in range(2)] == [f"{0.010 / 1e6!r} True"] * 2
