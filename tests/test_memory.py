"""Compensation memory: DGC's update maths, masking, conservation, and state across bucket rebuilds."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_gc.common.layout import BucketLayout
from lightning_gc.compressors.encoded import Sent
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.core.momentum import MomentumSpec


def _layout(index: int, params: list[torch.nn.Parameter], names: dict[int, tuple[str, int]]) -> BucketLayout:
    return BucketLayout.build(index, params, names, sum(p.numel() for p in params))


def _memory_with_momentum(
    names: dict[int, tuple[str, int]], momentum: float = 0.9, *, masking: bool = True, **spec: float
) -> CompensationMemory:
    memory = CompensationMemory(momentum_correction=True, momentum_masking=masking, clip_norm=None)
    memory.set_specs({name: MomentumSpec(momentum, **spec) for name, _ in names.values()})
    return memory


@pytest.fixture
def params() -> tuple[list[torch.nn.Parameter], dict[int, tuple[str, int]]]:
    torch.manual_seed(0)
    ps = [
        torch.nn.Parameter(torch.randn(4, 5)),
        torch.nn.Parameter(torch.randn(5)),
        torch.nn.Parameter(torch.randn(3, 3)),
    ]
    return ps, {id(p): (f"p{i}", i) for i, p in enumerate(ps)}


@pytest.mark.parametrize("nesterov", [False, True])
def test_compensate_follows_dgc_recurrence(params, nesterov: bool) -> None:
    ps, names = params
    m, wd = 0.9, 0.01
    memory = _memory_with_momentum(names, m, nesterov=nesterov, weight_decay=wd)
    layout = _layout(0, ps, names)
    flat_p = torch.cat([p.detach().reshape(-1) for p in ps])
    u = torch.zeros_like(flat_p)
    v = torch.zeros_like(flat_p)
    for _ in range(4):
        g = torch.randn_like(flat_p)
        state = memory.bucket(layout, g)
        got = memory.compensate(state, g.clone(), ps, world_size=2)
        d = g + wd * flat_p
        u = m * u + d  # torch.optim.SGD's buffer
        v = v + (d + m * u if nesterov else u)
        torch.testing.assert_close(got, v)
        torch.testing.assert_close(state.momentum, u)


def test_masking_zeroes_momentum_and_velocity_only_where_sent(params) -> None:
    ps, names = params
    memory = _memory_with_momentum(names)
    layout = _layout(0, ps, names)
    g = torch.randn(layout.numel)
    state = memory.bucket(layout, g)
    memory.compensate(state, g.clone(), ps, world_size=1)
    before_u, before_v = state.momentum.clone(), state.velocity.clone()
    sent = torch.tensor([0, 7, 20])
    memory.commit_sparse(state, sent, state.velocity[sent].clone())
    kept = torch.ones(layout.numel, dtype=torch.bool)
    kept[sent] = False
    assert (state.velocity[sent] == 0).all() and (state.momentum[sent] == 0).all()
    assert torch.equal(state.velocity[kept], before_v[kept]) and torch.equal(state.momentum[kept], before_u[kept])


def test_without_masking_momentum_survives_a_send(params) -> None:
    ps, names = params
    memory = _memory_with_momentum(names, masking=False)
    layout = _layout(0, ps, names)
    g = torch.ones(layout.numel)
    state = memory.bucket(layout, g)
    memory.compensate(state, g.clone(), ps, world_size=1)
    sent = torch.tensor([1, 2])
    memory.commit_sparse(state, sent, state.velocity[sent].clone())
    assert (state.momentum[[1, 2]] == 1).all() and (state.velocity[[1, 2]] == 0).all()


def test_error_feedback_conserves_every_input(params) -> None:
    """v + everything sent == sum of all gradients, element by element, whatever was selected."""
    ps, names = params
    memory = CompensationMemory(momentum_correction=False, momentum_masking=True, clip_norm=None)
    layout = _layout(0, ps, names)
    total_in = torch.zeros(layout.numel)
    total_sent = torch.zeros(layout.numel)
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        g = torch.randn(layout.numel, generator=gen)
        total_in += g
        state = memory.bucket(layout, g)
        v = memory.compensate(state, g.clone(), ps, world_size=2)
        idx = torch.topk(v.abs(), 5).indices
        wire = v[idx].to(torch.float16).to(torch.float32)  # a lossy wire dtype: the residual stays
        total_sent[idx] += wire
        memory.commit_sparse(state, idx, wire)
    torch.testing.assert_close(state.velocity + total_sent, total_in, atol=1e-5, rtol=0)


def test_zero_valued_pairs_are_no_ops_and_duplicates_accumulate(params) -> None:
    """The Triton selection pads with (i, 0) pairs: they must change nothing."""
    ps, names = params
    memory = _memory_with_momentum(names)
    layout = _layout(0, ps, names)
    g = torch.randn(layout.numel)
    state = memory.bucket(layout, g)
    memory.compensate(state, g.clone(), ps, world_size=1)
    u, v = state.momentum.clone(), state.velocity.clone()
    memory.commit_sparse(state, torch.tensor([3, 3, 5]), torch.tensor([0.0, 0.0, 0.0]))
    assert torch.equal(state.velocity, v) and torch.equal(state.momentum, u)
    half = v[7] / 2
    memory.commit_sparse(state, torch.tensor([7, 7]), torch.stack([half, half]))
    assert state.velocity[7].abs() <= 1e-6 * v[7].abs() and state.momentum[7] == 0


@pytest.mark.parametrize("sent", ["whole, exact", "whole, rounded", "sparse"])
def test_commit_without_error_feedback_drops_the_residual_and_hands_over_what_left(params, sent: str) -> None:
    """Without error feedback (an unbiased compressor under ``local_update``) the velocity is empty
    after every commit, and ``own`` is what left as receivers decode it."""
    ps, names = params
    memory = CompensationMemory(momentum_correction=False, momentum_masking=False, clip_norm=None, error_feedback=False)
    layout = _layout(0, ps, names)
    state = memory.bucket(layout, torch.zeros(layout.numel))
    for _ in range(2):  # the second step starts from no residual
        g = torch.randn(layout.numel)
        v = memory.compensate(state, g.clone(), ps, world_size=2).clone()
        assert torch.equal(v, g)
        if sent == "whole, exact":
            told, left = Sent.whole(), v
        elif sent == "whole, rounded":
            left = v.half().float()
            told = Sent.whole(left.clone())
        else:
            indices = torch.tensor([0, 7, 20])
            told = Sent(indices=indices, values=v[indices].clone())
            left = torch.zeros_like(v).index_copy_(0, indices, v[indices])
        own = torch.full_like(v, float("nan"))
        memory.commit(state, told, own)
        assert torch.equal(state.velocity, torch.zeros_like(v))
        assert torch.equal(own, left)


def test_local_clipping_scales_each_tensor_by_world_size(params) -> None:
    ps, names = params
    memory = CompensationMemory(momentum_correction=False, momentum_masking=True, clip_norm=2.0)
    layout = _layout(0, ps, names)
    g = torch.cat([torch.full((20,), 10.0), torch.full((5,), 1e-3), torch.full((9,), 3.0)])
    state = memory.bucket(layout, g)
    v = memory.compensate(state, g.clone(), ps, world_size=4)
    threshold = 2.0 / math.sqrt(4)
    assert torch.linalg.vector_norm(v[:20]).item() == pytest.approx(threshold, rel=1e-5)
    torch.testing.assert_close(v[20:25], g[20:25])  # below the threshold: untouched
    assert torch.linalg.vector_norm(v[25:]).item() == pytest.approx(threshold, rel=1e-5)


def test_state_follows_parameters_across_a_bucket_rebuild(params) -> None:
    ps, names = params
    memory = _memory_with_momentum(names, 0.5)
    big = _layout(0, ps, names)  # iteration 0: one bucket
    g = torch.arange(big.numel, dtype=torch.float32)
    state = memory.bucket(big, g)
    memory.compensate(state, g.clone(), ps, world_size=1)
    expected = memory.state_dict()
    # DDP rebuilds: reversed order, split in two buckets.
    first, second = _layout(0, [ps[2], ps[1]], names), _layout(1, [ps[0]], names)
    s1, s2 = memory.bucket(first, g), memory.bucket(second, g)
    assert s1 is not state
    torch.testing.assert_close(s1.velocity, torch.cat([expected["p2"]["velocity"], expected["p1"]["velocity"]]))
    torch.testing.assert_close(s2.momentum, expected["p0"]["momentum"])
    after = memory.state_dict()
    for name in expected:
        for key in expected[name]:
            torch.testing.assert_close(after[name][key], expected[name][key])


def test_state_dict_round_trip_and_independence(params) -> None:
    ps, names = params
    memory = _memory_with_momentum(names)
    layout = _layout(0, ps, names)
    g = torch.randn(layout.numel)
    memory.compensate(memory.bucket(layout, g), g.clone(), ps, world_size=1)
    saved = memory.state_dict()
    assert saved["p0"]["velocity"].untyped_storage().nbytes() == 20 * 4  # a standalone copy, not a view
    restored = _memory_with_momentum(names)
    restored.load_state_dict(saved)
    assert restored.state_dict()["p2"]["momentum"].equal(saved["p2"]["momentum"])  # before any bucket is seen
    state = restored.bucket(layout, g)
    torch.testing.assert_close(state.velocity, memory.bucket(layout, g).velocity)
    with pytest.raises(ValueError, match="unknown compression state entries"):
        restored.load_state_dict({"p0": {"residual": torch.zeros(1)}})
