"""Triton kernels equal their torch references (CPU tensors under TRITON_INTERPRET=1, or a GPU)."""

from __future__ import annotations

import pytest
import torch

from lightning_gc import kernels
from lightning_gc.kernels import compensation, dispatch, packing, rng, selection

triton = pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() and not dispatch.interpreting() else "cpu"
TOLERANCE = {torch.float32: (1e-6, 1e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}


SIZES = [0, 1, 1023, 1024, 1025, 4099]  # empty, single, around the 1024 block, ragged
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
COMPENSATE_VARIANTS = {
    "error-feedback": {"momentum": 0.0},
    "momentum": {"momentum": 0.9},
    "nesterov": {"momentum": 0.9, "nesterov": True},
    "nesterov+clip+decay": {"momentum": 0.9, "nesterov": True, "scale": 0.3, "weight_decay": 1e-2},
    "feedback+clip+decay": {"momentum": 0.0, "scale": 0.5, "weight_decay": 1e-3},
}


def grid(firsts: list, seconds: list) -> list[tuple]:
    """Every ``(first, second)`` pair where the kernels are compiled (a GPU); under the CPU
    interpreter, about a hundred times slower, each value of either list in one pair (the longer
    list once through, the shorter cycled), so every dtype and every size is still tested."""
    if DEVICE != "cpu":
        return [(a, b) for a in firsts for b in seconds]
    return [(firsts[i % len(firsts)], seconds[i % len(seconds)]) for i in range(max(len(firsts), len(seconds)))]


def _randn(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(COMPENSATE_VARIANTS))
def test_compensate_kernel_equals_reference(numel: int, dtype: torch.dtype, variant: str) -> None:
    options = dict(COMPENSATE_VARIANTS[variant])
    scale = options.pop("scale", None)
    g, u, v, p = (_randn(numel, dtype, seed=numel * 4 + i) for i in range(4))
    kwargs = {**options, "param": p, "grad_scale": None if scale is None else torch.tensor(scale, device=DEVICE)}
    # Reference in fp32 from the same inputs, rounded once at the end, as the kernel does.
    u_ref, v_ref = u.float(), v.float()
    ref_kwargs = {**kwargs, "param": p.float()}
    compensation.compensate_(g.float(), v_ref, u_ref, **ref_kwargs)
    g_before, u_before = g.clone(), u.clone()
    with kernels.use_backend("triton"):
        assert kernels.backend_for(g) == "triton"
        kernels.compensate_(g, v, u, **kwargs)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(v, v_ref.to(dtype), rtol=rtol, atol=atol)
    expected_u = u_ref.to(dtype) if options["momentum"] else u_before  # error feedback leaves u alone
    torch.testing.assert_close(u, expected_u, rtol=rtol, atol=atol)
    assert torch.equal(g, g_before)  # the kernel reads the gradient, never writes it


@pytest.mark.parametrize("nesterov", [False, True])
def test_memory_compensate_is_the_same_on_either_backend(nesterov: bool) -> None:
    from lightning_gc.common.layout import BucketLayout
    from lightning_gc.core.memory import CompensationMemory
    from lightning_gc.core.momentum import MomentumSpec

    shapes = [(33, 31), (7,), (5, 40), (64,)]
    params = [torch.nn.Parameter(torch.randn(*shape, device=DEVICE)) for shape in shapes]
    names = {id(p): (f"p{i}", i) for i, p in enumerate(params)}
    layout = BucketLayout.build(0, params, names, sum(p.numel() for p in params))
    specs = {"p0": MomentumSpec(0.9, nesterov, 1e-3), "p1": MomentumSpec(0.9, nesterov)}
    specs |= {"p2": MomentumSpec(0.9, nesterov, 1e-3), "p3": MomentumSpec(0.9, nesterov, 1e-3)}
    initial = [p.detach().clone() for p in params]
    for clip_norm in (1.0, None):  # without clipping, Triton merges p2 and p3 (same decay) into one launch
        results, pieces = [], []
        for backend in ("torch", "triton"):
            with torch.no_grad():
                for param, value in zip(params, initial):
                    param.copy_(value)
            memory = CompensationMemory(momentum_correction=True, momentum_masking=True, clip_norm=clip_norm)
            memory.set_specs(specs)
            gen = torch.Generator().manual_seed(0)
            with kernels.use_backend(backend):
                for step in range(3):
                    grad = torch.randn(layout.numel, generator=gen).to(DEVICE)
                    bucket = memory.bucket(layout, grad)
                    velocity = memory.compensate(bucket, grad, params, world_size=2)
                    with torch.no_grad():
                        params[step % 4].add_(0.5)  # the parameters move: the merged launch must read them afresh
            results.append(velocity.clone())
            pieces.append([(piece.start, piece.stop) for piece in bucket.pieces])
        torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-6)
        if clip_norm is None:
            merged = (layout.segments[2].start, layout.segments[3].stop)
            assert merged in pieces[1] and merged not in pieces[0]


def test_auto_dispatch_follows_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert kernels.backend_for(torch.zeros(1)) == "torch"
    with kernels.use_backend("torch"):
        assert kernels.backend_for(torch.zeros(1)) == "torch"
    if DEVICE == "cuda":
        assert kernels.backend_for(torch.zeros(1, device=DEVICE)) == "triton"
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    # CPU tensors reach Triton only in its interpreter (on in the CPU test suite); CUDA ones always
    assert kernels.backend_for(torch.zeros(1, device=DEVICE)) == "triton"


def test_float64_runs_on_torch_whatever_is_asked() -> None:
    """The Triton kernels compute in float32: float64 values would be rounded (an average off in its
    8th digit) and its range overflow (every magnitude past 3.4e38 ties as inf)."""
    for backend in ("auto", "triton"):
        with kernels.use_backend(backend):
            assert kernels.backend_for(torch.zeros(1, dtype=torch.float64, device=DEVICE)) == "torch"
    with kernels.use_backend("triton"):
        assert kernels.backend_for(torch.zeros(1, device=DEVICE)) == "triton"  # float32 still does


def test_bad_backend_names_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"one of \['auto', 'torch', 'triton'\], got 'cuda'"):
        with kernels.use_backend("cuda"):
            pass
    monkeypatch.setenv(dispatch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="LIGHTNING_GC_KERNELS"):
        kernels.backend_for(torch.zeros(1))


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with kernels.use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.backend_for(torch.zeros(1))


def _pairs(indices: torch.Tensor, values: torch.Tensor) -> dict[int, float]:
    return {int(i): float(v) for i, v in zip(indices.cpu(), values.float().cpu())}


def _select(values: torch.Tensor, k: int, backend: str, salt: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    out_indices = torch.empty(k, dtype=torch.int64, device=values.device)
    out_values = torch.empty(k, dtype=values.dtype, device=values.device)
    with kernels.use_backend(backend):
        kernels.sampled_topk_(
            values, k, sample_ratio=0.01, salt=salt, scratch=None, out_indices=out_indices, out_values=out_values
        )
    return out_indices, out_values


def _select_segments(values: torch.Tensor, k: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    from lightning_gc.kernels.selection import SegmentedTopK

    segments = SegmentedTopK(starts=(0,), numels=(values.numel(),), ks=(k,), firsts=(0,), salts=(0,))
    out_indices = torch.empty(k, dtype=torch.int64, device=values.device)
    out_values = torch.empty(k, dtype=values.dtype, device=values.device)
    with kernels.use_backend(backend):
        kernels.sampled_topk_segments_(values, segments, sample_ratio=0.01, step_salt=5, scratch=None,
                                       out_indices=out_indices, out_values=out_values)  # fmt: skip
    return out_indices, out_values


@pytest.mark.parametrize("select", [_select, _select_segments], ids=["one tensor", "segments"])
def test_a_full_candidate_buffer_keeps_the_largest_not_the_first(select) -> None:
    """Too many candidates for the buffer: a sparse gradient's sampled threshold is 0, and half a
    tensor tied at the threshold. The Triton selection kept the first candidates by position, so
    zeros (or ties) at the front starved the largest values behind them (0 of 60 sent); now zeros
    are never candidates and hits above the threshold go before ties, as the exact top-k has it."""
    numel, k = 1 << 17, 132
    sparse = torch.zeros(numel, device=DEVICE)
    behind = torch.arange(numel - 60 * 397, numel, 397, device=DEVICE)[:60]  # all in the last 20 %
    sparse[behind] = torch.linspace(1, 2, behind.numel(), device=DEVICE)
    tied = torch.zeros(numel, device=DEVICE)
    tied[: numel // 2] = 1.0
    tied[-30:] = 2.0
    for values, largest in ((sparse, behind), (tied, torch.arange(numel - 30, numel, device=DEVICE))):
        for backend in ("torch", "triton"):
            indices, sent = select(values, k, backend)
            assert set(largest.tolist()) <= set(indices[sent != 0].tolist()), backend
            assert torch.equal(sent, values[indices])  # genuine pairs (no-op pairs hold a zero)


@pytest.mark.parametrize(
    ("size", "dtype"), grid([(5_000, 5), (100_003, 100), (300_001, 3_000), (262_144, 262)], DTYPES)
)
def test_sync_free_selection_equals_exact_selection(size: tuple[int, int], dtype: torch.dtype) -> None:
    numel, k = size
    values = (_randn(numel, torch.float32, seed=numel) ** 3).to(dtype)  # heavy-ish tails
    got = _pairs(*_select(values, k, "triton"))
    want = _pairs(*_select(values, k, "torch"))
    assert len(got) == k
    assert all(float(values[i]) == v for i, v in got.items())  # genuine (index, value) pairs
    assert sorted(map(abs, got.values())) == sorted(map(abs, want.values()))
    cut = min(map(abs, want.values()))  # elements tied at the cut may be chosen either way
    assert {i for i, v in got.items() if abs(v) > cut} == {i for i, v in want.items() if abs(v) > cut}


def test_sync_free_selection_pads_with_no_ops_when_the_threshold_is_too_high() -> None:
    # Every sampled position holds the maximum: the threshold admits only the sample, fewer than k.
    numel, k = 100_000, 5_000
    positions = selection.sample_positions(selection.sample_plan(numel, k, 0.01, salt=0), DEVICE)
    values = torch.ones(numel, device=DEVICE)
    values[positions] = 100.0
    indices, sent = _select(values, k, "triton", salt=0)
    real = sent != 0
    assert int(real.sum()) == positions.numel() < k
    assert set(indices[real].tolist()) == set(positions.tolist())
    _assert_commit_is_lossless(values, indices, sent)


def test_sync_free_selection_survives_candidate_overflow() -> None:
    # A zero threshold admits everything: more candidates than the buffer holds.
    numel, k = 400_000, 50
    values = torch.zeros(numel, device=DEVICE)
    hot = torch.arange(13, numel, 4001)[:k]
    values[hot] = torch.linspace(1, 2, k, device=DEVICE)
    indices, sent = _select(values, k, "triton", salt=0)
    assert set(indices[sent != 0].tolist()) <= set(hot.tolist())
    _assert_commit_is_lossless(values, indices, sent)


def _bucket(numels: list[int], ratio: float, gap: int = 3) -> kernels.SegmentedTopK:
    """Segments of ``numels`` elements with ``gap`` unselected elements before each (a bucket's dense
    tensors), keeping ``ceil(ratio * n)`` each, salted by their position."""
    starts, firsts, ks, position, first = [], [], [], gap, 0
    for numel in numels:
        k = min(numel, max(1, -(-int(ratio * numel * 1e6) // 1_000_000)))
        starts.append(position)
        firsts.append(first)
        ks.append(k)
        position += numel + gap
        first += k
    return kernels.SegmentedTopK(
        tuple(starts), tuple(numels), tuple(ks), tuple(firsts), tuple(range(7, 7 + len(numels)))
    )


def _select_bucket(values: torch.Tensor, segments: kernels.SegmentedTopK, how: str, step_salt: int = 3 * 1_000_003):
    """(indices, values) of a bucket's selection: ``how`` is ``"bucket"`` (Triton, all segments at
    once), ``"each"`` (Triton, one segment at a time) or ``"torch"``."""
    indices = torch.empty(segments.total_k, dtype=torch.int64, device=values.device)
    picked = torch.empty(segments.total_k, dtype=values.dtype, device=values.device)
    arguments = dict(sample_ratio=0.01, step_salt=step_salt, scratch=None, out_indices=indices, out_values=picked)
    with kernels.use_backend("torch" if how == "torch" else "triton"):
        if how == "each":
            from lightning_gc.kernels import selection_triton

            selection.sampled_one_at_a_time(selection_triton.sampled_topk_, values, segments, **arguments)
        else:
            kernels.sampled_topk_segments_(values, segments, **arguments)
    return indices, picked


# sampled and exact segments (a 1,500-element tensor at 0.1 % keeps 2: a sample would not pay)
BUCKET_NUMELS = [120_001, 1_500, 65_536, 5_000, 30_003]


# 0.3: capacities near the sizes, one at a time
@pytest.mark.parametrize(("ratio", "dtype"), grid([0.001, 0.01, 0.3], DTYPES))
def test_bucket_selection_equals_each_tensor_selected_alone(ratio: float, dtype: torch.dtype) -> None:
    segments = _bucket(BUCKET_NUMELS, ratio)
    values = (_randn(segments.starts[-1] + segments.numels[-1], torch.float32, seed=11) ** 3).to(dtype)
    together, alone, exact = (_select_bucket(values, segments, how) for how in ("bucket", "each", "torch"))
    for start, numel, k, first in zip(segments.starts, segments.numels, segments.ks, segments.firsts):
        got, each, want = (_pairs(i[first : first + k], v[first : first + k]) for i, v in (together, alone, exact))
        assert all(start <= i < start + numel for i in got)  # bucket positions, inside the segment
        assert all(float(values[i]) == v for i, v in got.items())  # genuine (index, value) pairs
        assert sorted(map(abs, got.values())) == sorted(map(abs, each.values())) == sorted(map(abs, want.values()))
        cut = min(map(abs, want.values()))  # elements tied at the cut may be chosen either way
        assert {i for i, v in got.items() if abs(v) > cut} == {i for i, v in want.items() if abs(v) > cut}


@pytest.mark.parametrize("numels", [[], [50_000], [0, 50_000]], ids=["no tensors", "one", "an empty one"])
def test_bucket_selection_of_no_single_or_empty_tensors_equals_each_alone(numels: list[int]) -> None:
    segments = _bucket(numels, 0.001)
    values = _randn(4 + sum(numels) + 3 * len(numels), torch.float32, seed=2)
    (together_i, together_v), (alone_i, alone_v) = (_select_bucket(values, segments, how) for how in ("bucket", "each"))
    assert together_i.numel() == segments.total_k
    assert _pairs(together_i, together_v) == _pairs(alone_i, alone_v)


def test_bucket_selection_samples_where_each_tensor_alone_would() -> None:
    # |x| = position + 1 everywhere, so each sampled magnitude names the position it came from.
    from lightning_gc.kernels import selection_triton

    segments = _bucket([100_000, 4_099, 250_000], 0.001)
    table = selection_triton._segment_table(segments, 0.01, torch.device(DEVICE))
    values = torch.arange(1, segments.starts[-1] + segments.numels[-1] + 1, dtype=torch.float32, device=DEVICE)
    keys = torch.empty(table.samples, dtype=torch.int64, device=DEVICE)
    step_salt = 41 * 1_000_003
    with kernels.use_backend("triton"):
        selection_triton.launch(selection_triton._segment_sample_kernel, (-(-table.samples // 1024),), values, keys,
                                table.sample_segment, table.sample_first, table.start, table.stride, table.salt_key,
                                (step_salt * rng.FIBONACCI_MUL) & rng.MASK32, table.samples, BLOCK=1024)  # fmt: skip
    magnitude_bits = (0x7FFFFFFF - (keys & 0xFFFFFFFF)).to(torch.int32)
    sampled = magnitude_bits.view(torch.float32).long() - 1
    expected = []
    for start, numel, k, salt in zip(segments.starts, segments.numels, segments.ks, segments.salts):
        plan = selection.sample_plan(numel, k, 0.01, salt=step_salt + salt)
        if plan is not None:
            expected.append(selection.sample_positions(plan, DEVICE) + start)
    assert torch.equal(sampled, torch.cat(expected))
    assert torch.equal(keys >> 33, table.sample_segment.long())  # each sample keyed by its segment


def test_bucket_selection_pads_like_each_tensor_alone_when_the_threshold_is_too_high() -> None:
    # In the first segment every sampled position holds the maximum: fewer than k candidates.
    segments = _bucket([100_000, 200_000], 0.05)
    values = _randn(segments.starts[-1] + segments.numels[-1], torch.float32, seed=5)
    first = segments.starts[0]
    plan = selection.sample_plan(100_000, segments.ks[0], 0.01, salt=3 * 1_000_003 + segments.salts[0])
    values[first : first + 100_000] = 1.0
    values[first + selection.sample_positions(plan, DEVICE)] = 100.0
    (together_i, together_v), (alone_i, alone_v) = (_select_bucket(values, segments, how) for how in ("bucket", "each"))
    k = segments.ks[0]
    assert int((together_v[:k] != 0).sum()) == plan.samples < k
    assert torch.equal(together_i[:k][together_v[:k] == 0], torch.full_like(together_i[:k][together_v[:k] == 0], first))
    assert _pairs(together_i, together_v) == _pairs(alone_i, alone_v)
    _assert_commit_is_lossless(values, together_i, together_v)


def _assert_commit_is_lossless(values: torch.Tensor, indices: torch.Tensor, sent: torch.Tensor) -> None:
    velocity = values.clone()
    with kernels.use_backend("triton"):
        kernels.commit_sparse_(velocity, None, indices, sent)
    received = torch.zeros_like(values).index_add_(0, indices, sent)
    torch.testing.assert_close(velocity + received, values, rtol=0, atol=0)


@pytest.mark.parametrize("pairs", [0, 1, 1023, 1025, 3000])
@pytest.mark.parametrize("masking", [False, True])
def test_commit_sparse_kernel_equals_reference(pairs: int, masking: bool) -> None:
    numel = 5_000
    gen = torch.Generator().manual_seed(pairs)
    indices = torch.randint(0, numel, (pairs,), generator=gen).to(DEVICE)  # with duplicates
    velocity, momentum = _randn(numel, torch.float32, 1), _randn(numel, torch.float32, 2)
    sent = velocity[indices] / 2
    sent[::7] = 0  # no-op pairs
    results = []
    for backend in ("torch", "triton"):
        v, u = velocity.clone(), momentum.clone()
        with kernels.use_backend(backend):
            kernels.commit_sparse_(v, u if masking else None, indices, sent)
        results.append((v, u))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
    assert torch.equal(results[1][1], results[0][1])


@pytest.mark.parametrize("pairs", [0, 1, 1024, 2049])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_average_kernel_equals_reference(pairs: int, dtype: torch.dtype) -> None:
    numel = 3_000
    indices = torch.randint(0, numel, (pairs,), generator=torch.Generator().manual_seed(pairs)).to(DEVICE)
    values = _randn(pairs, dtype, 3)
    outs = []
    for backend in ("torch", "triton"):
        out = torch.zeros(numel, device=DEVICE)
        with kernels.use_backend(backend):
            kernels.scatter_average_(out, indices.to(torch.int32), values, world_size=3)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gathered_runs_add_in_rank_order_on_every_device(backend: str) -> None:
    """Four ranks' pairs meeting at the same elements, of magnitudes far apart (so the order of
    the adds shows in the bits): the dispatched decode equals adding the runs one after another in
    rank order, bit for bit. On a GPU the atomics of one scatter add three or more in any order,
    and the ranks, each decoding the same payload, would end with different bits."""
    runs, n, numel = 4, 512, 600
    generator = torch.Generator().manual_seed(0)
    indices = torch.stack([torch.randperm(numel, generator=generator)[:n] for _ in range(runs)]).reshape(-1)
    magnitudes = 10.0 ** torch.randint(-4, 5, (runs * n,), generator=generator).float()
    values = torch.randn(runs * n, generator=generator) * magnitudes
    expected = torch.zeros(numel)
    for run in range(runs):
        expected.index_add_(0, indices[run * n : (run + 1) * n], values[run * n : (run + 1) * n], alpha=1 / runs)
    out = torch.zeros(numel, device=DEVICE)
    with kernels.use_backend(backend):
        kernels.scatter_average_(out, indices.to(torch.int32).to(DEVICE), values.to(DEVICE), runs, runs=runs)
    assert torch.equal(out.cpu(), expected)


PACK_SIZES = [0, 1, 7, 8, 9, 1023, 2049]


def _on_backend(backend: str, fn, *args):
    with kernels.use_backend(backend):
        return fn(*args)


def test_counter_rng_is_uniform_and_seeded() -> None:
    offsets = torch.arange(200_000)
    u = rng.counter_uniform(7, offsets)
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.01  # neighbours independent
    assert torch.equal(u, rng.counter_uniform(7, offsets))
    other = rng.counter_uniform(2**33 + 7, offsets)  # the high seed bits matter
    assert (other != u).float().mean() > 0.99


def test_counter_rng_equals_the_hash_written_on_python_ints() -> None:
    """The tensor form (int32 arithmetic wrapping mod 2**32) against the uint32 definition on
    Python ints, for offsets across the int32 sign boundary and a seed using all 64 bits."""
    seed = 2**40 + 12345
    offsets = [0, 1, 2**16 + 3, 2**31 - 1, 2**31, 2**32 - 1]
    key = rng.seed_key(seed)
    expected = [(rng.lowbias32(rng.lowbias32(i ^ key) ^ rng.ROUND_SALT) >> 8) * 2.0**-24 for i in offsets]
    given = torch.tensor(offsets, dtype=torch.int64)
    assert rng.counter_uniform(seed, given).tolist() == expected
    assert given.tolist() == offsets  # the caller's offsets are left alone


@pytest.mark.parametrize("numel", PACK_SIZES)
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_code_packing_kernels_equal_reference_and_round_trip(numel: int, width: int) -> None:
    codes = torch.randint(0, 2**width, (numel,), generator=torch.Generator().manual_seed(numel)).to(torch.uint8)
    codes = codes.to(DEVICE)
    packed = _on_backend("triton", kernels.pack_codes, codes, width)
    assert packed.numel() == (numel * width + 7) // 8
    assert torch.equal(packed, _on_backend("torch", kernels.pack_codes, codes, width))
    assert torch.equal(_on_backend("triton", kernels.unpack_codes, packed, width, numel), codes)
    assert torch.equal(_on_backend("torch", kernels.unpack_codes, packed, width, numel), codes)
    reference = [
        sum(int(c) << (k * width) for k, c in enumerate(codes[b * (8 // width) : (b + 1) * (8 // width)]))
        for b in range(min(packed.numel(), 64))
    ]
    assert packed[:64].tolist() == reference  # code k of byte b at bits [k*width, (k+1)*width)
    shifted = torch.cat([codes.new_zeros(1), codes])[1:]  # starts one byte into its storage
    assert torch.equal(_on_backend("torch", kernels.pack_codes, shifted, width), packed)


@pytest.mark.parametrize("numel", PACK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sign_packing_kernel_equals_reference(numel: int, dtype: torch.dtype) -> None:
    values = _randn(numel, dtype, seed=numel)
    if numel:
        values[0] = 0.0  # zero counts as positive
    packed = _on_backend("triton", kernels.pack_signs, values)
    assert torch.equal(packed, _on_backend("torch", kernels.pack_signs, values))
    assert torch.equal(kernels.unpack_codes(packed, 1, numel).bool(), values < 0)


@pytest.mark.parametrize("numel", PACK_SIZES)
def test_sign_select_reads_each_bit_as_a_choice_between_two_values(numel: int) -> None:
    """The byte-table decode of sign bits: element i is ``if_negative`` exactly where ``values[i] < 0``
    (-0.0 and 0.0 count as positive), whatever ``numel`` is modulo 8."""
    values = _randn(numel, torch.float32, seed=numel + 1)
    if numel > 2:
        values[1], values[2] = 0.0, -0.0
    packed = kernels.pack_signs(values)
    if_negative, if_positive = torch.tensor([-0.75], device=DEVICE), torch.tensor([1.5], device=DEVICE)
    decoded = packing.sign_select(packed, numel, if_negative, if_positive)
    assert decoded.shape == (numel,) and decoded.dtype == torch.float32
    assert torch.equal(decoded, torch.where(values < 0, if_negative, if_positive))


@pytest.mark.parametrize("numel", [1, 9, 1000, 4097])
@pytest.mark.parametrize("block", [None, 8, 96, 100, 4097])
def test_sign_counts_and_selection_per_block_equal_elementwise_reference(numel: int, block: int | None) -> None:
    """Counting set sign bits per block from the packed bytes, and choosing each block's pair of
    values per bit, equal the element-wise definitions, for blocks that are whole bytes or not and
    a last block that is shorter."""
    values = _randn(numel, torch.float32, seed=numel + 2)
    packed = kernels.pack_signs(values)
    width = block or numel
    block_of = torch.arange(numel, device=DEVICE) // width
    negative = values < 0
    expected = torch.zeros(int(block_of[-1]) + 1, dtype=torch.int64, device=DEVICE).index_add_(
        0, block_of, negative.long()
    )
    assert torch.equal(packing.set_bits_per_block(packed, numel, block), expected)
    if_true, if_false = _randn(expected.numel(), torch.float32, seed=1), _randn(expected.numel(), torch.float32, seed=2)
    chosen = packing.select_by_block(negative, if_true, if_false, width)
    assert torch.equal(chosen, torch.where(negative, if_true[block_of], if_false[block_of]))


@pytest.mark.parametrize("numel", [0, 1, 9, 1000, 4097])
@pytest.mark.parametrize("levels", [1, 3, 7, 15, 127])
@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_quantize_kernel_equals_reference_bit_for_bit(numel: int, levels: int, dtype: torch.dtype) -> None:
    """One scale per tensor, or one per chunk of 96 elements (element i scaled by scales[i // 96])."""
    values = _randn(numel, dtype, seed=levels)
    rows = torch.nn.functional.pad(values.float(), (0, -numel % 96)).view(-1, 96)
    cases = [
        (None, torch.linalg.vector_norm(values.float())),
        (None, values.float().abs().max() if numel else torch.zeros((), device=DEVICE)),
        (96, torch.linalg.vector_norm(rows, dim=1)),
    ]
    for chunk_size, scales in cases:
        packed = _on_backend("triton", kernels.stochastic_quantize, values, scales, levels, 11, chunk_size)
        assert torch.equal(
            packed, _on_backend("torch", kernels.stochastic_quantize, values, scales, levels, 11, chunk_size)
        )
        decoded = kernels.stochastic_dequantize(packed, scales, levels, numel, chunk_size)
        steps = (scales.reshape(-1) / levels).repeat_interleave(chunk_size or max(numel, 1))[:numel]
        assert ((decoded - values.float()).abs() <= steps * (1 + 1e-5)).all()
        codes = kernels.unpack_codes(packed, kernels.code_width(levels), numel).int()
        signed_levels = torch.where(codes & 1 == 1, -(codes >> 1), codes >> 1).float()
        assert torch.equal(decoded, signed_levels * steps)  # sign * level * (scale / levels), exactly


def test_stochastic_quantization_is_reproducible_and_unbiased() -> None:
    """Mean over S seeds of the decoded values -> x. Each decode is x + e with |e| < step and
    E[e] = 0, so the mean's error has std <= step / (2 sqrt(S)); we allow 5 of those."""
    values = _randn(2000, torch.float32, seed=0)
    scale, levels, seeds = torch.linalg.vector_norm(values), 7, 1600
    with kernels.use_backend("triton"):
        first = kernels.stochastic_quantize(values, scale, levels, 3)
        assert torch.equal(first, kernels.stochastic_quantize(values, scale, levels, 3))
        assert not torch.equal(first, kernels.stochastic_quantize(values, scale, levels, 4))
    # The kernel equals its torch twin bit for bit (tested above), so draw the statistics fast:
    with kernels.use_backend("torch"):
        mean = (
            sum(
                kernels.stochastic_dequantize(
                    kernels.stochastic_quantize(values, scale, levels, s), scale, levels, 2000
                )
                for s in range(seeds)
            )
            / seeds
        )
    step = float(scale) / levels
    assert (mean - values).abs().max().item() < 5 * step / (2 * seeds**0.5)


def test_code_width_rejects_too_many_levels() -> None:
    assert [kernels.code_width(s) for s in (1, 3, 7, 127)] == [2, 4, 4, 8]
    with pytest.raises(ValueError, match=r"`levels` must be in \[1, 127\]"):
        kernels.code_width(128)
