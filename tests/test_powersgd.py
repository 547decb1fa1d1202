"""PowerSGD: exact at full rank, torch's powerSGD_hook reproduced on 2 gloo ranks, several buckets work."""

from __future__ import annotations

import pytest
import torch
from test_hook_reference import make_model

from lightning_gc.common.layout import BucketLayout
from lightning_gc.compressors import PowerSGDCompressor
from lightning_gc.compressors.base import EncodeContext
from lightning_gc.compressors.powersgd import orthonormalise_


def _layout(*shapes: tuple[int, ...]) -> BucketLayout:
    params = [torch.empty(shape) for shape in shapes]
    names = {id(p): (f"p{i}", i) for i, p in enumerate(params)}
    return BucketLayout.build(0, params, names, sum(p.numel() for p in params))


def _encode_decode(compressor: PowerSGDCompressor, layout: BucketLayout, velocity: torch.Tensor, step: int = 0):
    """One rank's round trip (world size 1: the all-reduces are identities)."""
    out = torch.empty_like(velocity)
    encoded = compressor.encode(velocity, out, EncodeContext(layout, step=step, world_size=1))
    while encoded.next_round is not None:
        encoded = encoded.next_round()
    compressor.decode(encoded, out, world_size=1)
    return out, encoded


def test_full_rank_reproduces_the_matrix() -> None:
    layout = _layout((12, 30), (30,))
    velocity = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    compressor = PowerSGDCompressor(rank=12, min_compression_rate=0.1)  # full rank costs more than dense
    out, encoded = _encode_decode(compressor, layout, velocity)
    torch.testing.assert_close(out, velocity, rtol=1e-4, atol=1e-5)
    # what memory subtracts leaves no residual: M - P Q^T = 0, and the dense bias left exactly
    torch.testing.assert_close(encoded.sent.dense_values, velocity, rtol=1e-4, atol=1e-5)


def test_low_rank_is_the_projection_on_p_and_warm_start_converges() -> None:
    """P Q^T = P P^T M; repeated steps on one matrix are power iterations towards its top singular pair."""
    generator = torch.Generator().manual_seed(1)
    u, v = torch.randn(40, 1, generator=generator), torch.randn(1, 25, generator=generator)
    matrix = 10 * u @ v + 0.1 * torch.randn(40, 25, generator=generator)
    layout = _layout((40, 25))
    compressor = PowerSGDCompressor(rank=1)
    errors = []
    for step in range(4):
        out, _ = _encode_decode(compressor, layout, matrix.reshape(-1), step)
        errors.append((out.view(40, 25) - matrix).norm() / matrix.norm())
    best = torch.linalg.svd(matrix)
    rank1 = best.S[0] * best.U[:, :1] @ best.Vh[:1]
    assert errors[-1] <= errors[0]
    torch.testing.assert_close(out.view(40, 25), rank1, rtol=1e-3, atol=1e-3)


def test_small_and_1d_tensors_go_dense_and_bytes_are_counted() -> None:
    layout = _layout((64, 64), (64,), (4, 4))  # (4 + 4) * 1 * 2 >= 16: not worth it
    compressor = PowerSGDCompressor(rank=2)
    assert compressor.factor_shape(layout.segments[0]) == (64, 64, 2)
    assert compressor.factor_shape(layout.segments[1]) is None
    assert compressor.factor_shape(layout.segments[2]) is None
    assert compressor.wire_bytes(layout, 4) == 4 * ((64 + 64) * 2 + 64 + 16)
    velocity = torch.randn(layout.numel)
    out = torch.empty_like(velocity)
    first = compressor.encode(velocity, out, EncodeContext(layout, step=0, world_size=1))
    second = first.next_round()
    assert first.payload.bytes_sent + second.payload.bytes_sent == compressor.wire_bytes(layout, 4)
    compressor.decode(second, out, world_size=1)
    torch.testing.assert_close(out[64 * 64 :], velocity[64 * 64 :])  # dense tensors exact


def test_start_iter_sends_whole_buckets_first() -> None:
    layout = _layout((64, 64))
    compressor = PowerSGDCompressor(rank=1, start_iter=2)
    velocity = torch.randn(layout.numel)
    assert (
        compressor.encode(velocity, torch.empty_like(velocity), EncodeContext(layout, step=1, world_size=1)).next_round
        is None
    )
    assert (
        compressor.encode(velocity, torch.empty_like(velocity), EncodeContext(layout, step=2, world_size=1)).next_round
        is not None
    )


def test_warm_start_state_round_trips() -> None:
    layout = _layout((32, 16))
    compressor = PowerSGDCompressor(rank=2)
    _encode_decode(compressor, layout, torch.randn(layout.numel))
    state = compressor.state_dict()
    assert set(state["q"]) == {"p0"} and state["q"]["p0"].shape == (16, 2)
    restored = PowerSGDCompressor(rank=2)
    restored.load_state_dict(state)
    velocity = torch.randn(layout.numel)
    torch.testing.assert_close(
        _encode_decode(restored, layout, velocity)[0], _encode_decode(compressor, layout, velocity)[0]
    )
    with pytest.raises(ValueError, match="expected \\['q'\\]"):
        restored.load_state_dict({"p": {}})


def test_a_snapshot_rolls_q_back_in_place_on_its_device_and_reuses_its_buffers() -> None:
    """The step guard's snapshot (every guarded step: each mixed-precision one) copies ``Q`` on its
    own device into the buffers of the snapshot before, never through ``state_dict``'s host
    copies; a roll-back writes it back into the same tensors, and a ``Q`` first drawn in the
    rolled-back step is dropped, then drawn again alike."""
    layout, late = _layout((32, 16)), _layout((32, 16), (24, 8))
    compressor = PowerSGDCompressor(rank=2)
    _encode_decode(compressor, layout, torch.randn(layout.numel))
    first = compressor.snapshot()
    q = compressor._q["p0"]
    before = q.clone()
    again = compressor.snapshot(first)
    assert again["p0"] is first["p0"] and again["p0"] is not q  # the buffer reused, a copy of Q
    velocity = torch.randn(late.numel)
    rolled_back, _ = _encode_decode(compressor, late, velocity, step=1)  # Q moves, p1's Q is drawn
    assert not torch.equal(q, before) and "p1" in compressor._q
    compressor.restore(again)
    assert compressor._q["p0"] is q and torch.equal(q, before) and "p1" not in compressor._q
    retried, _ = _encode_decode(compressor, late, velocity, step=1)
    assert torch.equal(retried, rolled_back)


def test_orthonormalise_handles_zero_columns() -> None:
    matrix = torch.zeros(10, 3)
    orthonormalise_(matrix)
    assert torch.isfinite(matrix).all()
    torch.testing.assert_close(matrix.t() @ matrix, torch.eye(3), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, "`rank` must be an integer >= 1, got 0"),
        ({"min_compression_rate": 0}, "`min_compression_rate` must be in (0, inf], got 0"),
        ({"start_iter": -1}, "`start_iter` must be an integer >= 0, got -1"),
        ({"warm_start": "yes"}, "`warm_start` must be True or False, got 'yes'"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        PowerSGDCompressor(**kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize("rank", [1, 4])
def test_matches_torch_powersgd_hook_and_runs_several_buckets(run_ranks, rank: int) -> None:
    plan = {"rank": rank, "start_iter": 2, "steps": 10, "lr": 0.05, "modes": ["torch", "ours", "ours_buckets"]}
    ranks = run_ranks(plan, worker="powersgd_worker.py")
    initial = [p.detach() for p in make_model().parameters()]
    for results in ranks:
        for ours, theirs, several, p0 in zip(results["ours"], results["torch"], results["ours_buckets"], initial):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(several, ours, rtol=1e-4, atol=1e-5)
            assert not torch.allclose(ours, p0)
    for mine, other in zip(ranks[0]["ours_buckets"], ranks[1]["ours_buckets"]):
        assert torch.equal(mine, other)
