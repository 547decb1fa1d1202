"""Compressors by name: registry, presets, argument routing, and 2-rank training with each."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from lightning_gc import GradientCompressionStrategy, available
from lightning_gc.compressors import create
from lightning_gc.compressors.base import EncodeContext
from recipes.quickstart import NUM_CLASSES, NUM_FEATURES

SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
HIDDEN = [1024, 1024]


def test_every_compressor_has_a_preset() -> None:
    expected = {
        "none",
        "fp16",
        "bf16",
        "topk",
        "randomk",
        "dgc",
        "qsgd",
        "terngrad",
        "int8",
        "onebit",
        "signsgd",
        "powersgd",
        "fft",
        "chunk_topk",
    }
    assert expected == set(available())
    for name in available():
        strategy = StrategyRegistry.get(f"{name}_ddp")
        assert isinstance(strategy, GradientCompressionStrategy) and strategy.compressor.name == name


def test_arguments_go_to_the_compressor_or_to_ddp() -> None:
    strategy = GradientCompressionStrategy("topk", compress_ratio=0.05, bucket_cap_mb=4, find_unused_parameters=True)
    assert strategy.compressor.config()["compress_ratio"] == 0.05
    assert strategy._ddp_kwargs == {"bucket_cap_mb": 4, "find_unused_parameters": True}
    obj = GradientCompressionStrategy(create("fp16"))
    assert obj.compressor.name == "fp16"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compressor": "zip"}, f"must be one of {available()}, got 'zip'"),
        ({"compressor": "topk", "levels": 2}, "unknown argument(s) {'levels': 2}"),
        ({"compressor": "fp16", "compress_ratio": 0.1}, "compressor 'fp16' takes ['exchange', 'server_feedback']"),
        ({"compressor": "topk", "bucket_cap": 4}, "DDP takes"),
        ({"compressor": "topk", "compress_ratio": 0}, "`compress_ratio` must be in (0, 1], got 0"),
        ({"compressor": 3}, "or a lightning_gc Compressor, got 3"),
        ({"compressor": "qsgd", "levels": 1}, "`levels` must be an integer in [2, 127], got 1"),
        ({"compressor": "powersgd", "rank": 0}, "`rank` must be an integer >= 1, got 0"),
        ({"compressor": "signsgd", "chunk_size": 4}, "`chunk_size` must be an integer >= 8, got 4"),
        ({"compressor": "onebit", "min_compress_numel": 0}, "`min_compress_numel` must be an integer >= 1, got 0"),
        ({"compressor": "fft", "bits": 3}, "`bits` must be one of [4, 8, 16], got 3"),
    ],
)
def test_bad_compressor_arguments_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        GradientCompressionStrategy(**kwargs)
    assert message in str(error.value)


def test_training_with_each_compressor(run_ranks) -> None:
    """2 ranks: identical parameters, falling loss, and gc/wire_ratio == dense bytes / bytes sent."""
    names = available()  # every registered compressor, at its defaults
    model = {"hidden": HIDDEN, **SGD}
    fits = [{"strategy": {"kind": "ddp"}, "model": model, "epochs": 3}]
    fits += [{"strategy": {"kind": "gc", "compressor": n}, "model": model, "epochs": 3} for n in names]
    rank0, rank1 = run_ranks({"fits": fits})
    ddp, results = rank0[0], dict(zip(names, rank0[1:]))

    widths = [NUM_FEATURES, *HIDDEN, NUM_CLASSES]
    weights = sum(a * b for a, b in zip(widths[:-1], widths[1:]))
    dense_bytes = 4 * (weights + sum(widths[1:]))
    for name, ours in results.items():
        assert torch.equal(ours["params"], rank1[1 + names.index(name)]["params"]), name
        losses = [m["train/loss_epoch"] for m in ours["epoch_metrics"]]
        assert losses[-1] < 0.5 * losses[0], (name, losses)
        metrics = ours["epoch_metrics"][-1]
        assert metrics["gc/dense_bytes"] == dense_bytes
        assert metrics["gc/wire_ratio"] == pytest.approx(dense_bytes / metrics["gc/bytes_sent"])

    # none: plain DDP through our path (error feedback of an exact send is a no-op)
    assert ((results["none"]["params"] - ddp["params"]).abs().max() / ddp["params"].abs().max()) < 1e-5
    assert results["none"]["epoch_metrics"][-1]["gc/wire_ratio"] == 1.0
    assert results["fp16"]["epoch_metrics"][-1]["gc/wire_ratio"] == 2.0
    assert results["bf16"]["epoch_metrics"][-1]["gc/wire_ratio"] == 2.0
    assert results["topk"]["epoch_metrics"][-1]["gc/wire_ratio"] >= 45  # 1 % of a 1.1 M-parameter model
    sampled = sum(-(-(a * b) // 100) for a, b in zip(widths[:-1], widths[1:]))  # one per block of 100
    assert results["randomk"]["epoch_metrics"][-1]["gc/bytes_sent"] == 4 * (sampled + sum(widths[1:]))
    assert results["onebit"]["epoch_metrics"][-1]["gc/wire_ratio"] >= 25
    assert results["signsgd"]["epoch_metrics"][-1]["gc/wire_ratio"] >= 25
    assert results["powersgd"]["epoch_metrics"][-1]["gc/wire_ratio"] >= 100  # rank 1: (n + m) of n m per matrix
    assert results["fft"]["epoch_metrics"][-1]["gc/wire_ratio"] >= 40  # 1 %: int32 index + two 8-bit parts
    assert results["terngrad"]["epoch_metrics"][-1]["gc/wire_ratio"] >= 14
    assert results["qsgd"]["epoch_metrics"][-1]["gc/wire_ratio"] >= 7  # 7 levels: 4-bit codes


# ------------------------------------------------------------------ single-process properties
def _layout_and_params(shapes: list[tuple[int, ...]]):
    from lightning_gc.common.layout import BucketLayout

    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    names = {id(p): (f"p{i}", i) for i, p in enumerate(params)}
    return BucketLayout.build(0, params, names, sum(p.numel() for p in params)), params


def _round_trip(compressor, velocity: torch.Tensor, layout, step: int) -> tuple[torch.Tensor, object, int]:
    """What a world of one rank decodes from ``velocity`` (the collectives are identities), the
    last round's ``Encoded``, and the bytes sent over all rounds."""
    out = torch.empty_like(velocity)
    encoded = compressor.encode(velocity, out, EncodeContext(layout, step=step, world_size=1, rank=0))
    bytes_sent = encoded.payload.bytes_sent
    while encoded.next_round is not None:
        encoded = encoded.next_round()
        bytes_sent += encoded.payload.bytes_sent
    if encoded.payload.gathered is not None:
        encoded.payload.gathered_out.copy_(encoded.payload.gathered)
    compressor.decode(encoded, out, world_size=1)
    return out, encoded, bytes_sent


@pytest.mark.parametrize("chunk_size", [512, 100, None])
@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_unbiased_compressors_average_to_their_input(name: str, chunk_size: int | None) -> None:
    """Mean of S decodes -> x. Each decode errs by less than one level step (its chunk's scale /
    levels) per element with mean 0, so the mean's error has std <= step / (2 sqrt(S)); the
    tolerance is 5 of those."""
    compressor = create(name, chunk_size=chunk_size)
    assert not compressor.biased
    layout, _ = _layout_and_params([(40, 30), (7,)])
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    samples = 800
    mean = sum(_round_trip(compressor, x, layout, step)[0] for step in range(samples)) / samples
    for segment in layout.segments:
        part, width = segment.of(x), chunk_size or segment.numel
        for start in range(0, segment.numel, width):
            chunk = part[start : start + width]
            scale = chunk.norm() if name == "qsgd" else chunk.abs().max()
            step_size = float(scale) / compressor.levels
            error = (segment.of(mean)[start : start + width] - chunk).abs().max().item()
            assert error < 5 * step_size / (2 * samples**0.5), (segment.name, start, error, step_size)


@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_unbiased_quantisers_default_to_chunks_whose_noise_does_not_grow_with_the_tensor(name: str) -> None:
    """QSGD's bound E||Q(x) - x||^2 <= sqrt(d)/s ||x||^2 holds for the d = 512 elements sharing a
    norm; one norm for a 512x512 tensor puts ~56x its energy in noise, which made QSGD diverge.
    TernGrad's noise grows with max|x| / mean|x|: slowly for a Gaussian (sqrt(log d)), fast with outliers."""
    layout, _ = _layout_and_params([(512, 512)])
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))

    def noise(compressor) -> float:
        decoded = _round_trip(compressor, x, layout, step=0)[0]
        return float((decoded - x).norm() ** 2 / x.norm() ** 2)

    chunked, whole = noise(create(name)), noise(create(name, chunk_size=None))
    assert create(name).chunk_size == 512
    if name == "qsgd":
        assert chunked <= 512**0.5 / 7  # Alistarh et al. 2017, Lemma 3.1
    assert whole > (10 if name == "qsgd" else 1.5) * chunked, (chunked, whole)


@pytest.mark.parametrize(("name", "mantissa_bits"), [("fp16", 10), ("bf16", 7)])
def test_half_precision_casts_round_within_their_precision(name: str, mantissa_bits: int) -> None:
    layout, _ = _layout_and_params([(50, 40), (40,)])
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    compressor, out = create(name), torch.empty_like(x)
    encoded = compressor.encode(x, out, EncodeContext(layout, step=0, world_size=1, rank=0))
    # what memory subtracts (before the collective): the wire's values, widened on CPU into the
    # free output buffer so that the subtraction runs in one dtype
    committed = encoded.sent.dense_values.clone()
    assert committed.dtype == x.dtype and encoded.payload.summed.dtype == compressor.wire_dtype
    assert torch.equal(committed, encoded.payload.summed.to(x.dtype))
    compressor.decode(encoded, out, world_size=1)
    relative = ((out - x).abs() / x.abs()).max().item()
    assert 0 < relative <= 2.0 ** -(mantissa_bits + 1)  # round to nearest: half an ulp
    assert encoded.payload.bytes_sent == 2 * layout.numel
    assert torch.equal(committed, out)  # memory keeps exactly the rounding


def test_signsgd_sends_scaled_signs_per_tensor_or_chunk() -> None:
    layout, _ = _layout_and_params([(33, 3)])
    x = torch.randn(layout.numel)
    x[0] = 0.0
    decoded, _, _ = _round_trip(create("signsgd", min_compress_numel=99), x, layout, step=0)
    torch.testing.assert_close(decoded, torch.where(x < 0, -x.abs().mean(), x.abs().mean()))
    decoded, _, sent = _round_trip(create("signsgd", chunk_size=16, min_compress_numel=99), x, layout, step=0)
    for start in range(0, 99, 16):  # 6 full chunks and a tail of 3
        part = x[start : start + 16]
        torch.testing.assert_close(
            decoded[start : start + 16], torch.where(part < 0, -part.abs().mean(), part.abs().mean())
        )
    assert sent == 4 * 7 + 13 + 3  # 7 scales, 99 bits in 13 bytes, padded to 4


def test_onebit_rebuilds_each_sign_from_the_mean_of_its_side() -> None:
    layout, _ = _layout_and_params([(10, 10)])
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(3))
    x[5] = 0.0  # zero counts as non-negative
    for chunk in (None, 32):
        decoded, _, _ = _round_trip(create("onebit", chunk_size=chunk, min_compress_numel=1), x, layout, step=0)
        size = chunk or layout.numel
        for start in range(0, layout.numel, size):
            part = x[start : start + size]
            expected = torch.where(part < 0, part[part < 0].mean(), part[part >= 0].mean())
            torch.testing.assert_close(decoded[start : start + size], expected)


def test_randomk_with_rescaling_is_unbiased_and_ranks_agree_on_indices() -> None:
    """Decoded element i is x_i * s_i with probability 1 / s_i (s_i: its block size), else 0, so the
    mean of S decodes has std |x_i| sqrt(s_i - 1) / sqrt(S); the tolerance is 5 of those."""
    compressor = create("randomk", compress_ratio=0.1, rescale=True)
    assert not compressor.biased and create("randomk").biased
    layout, _ = _layout_and_params([(41, 30)])
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    samples = 2000
    mean = sum(_round_trip(compressor, x, layout, step)[0] for step in range(samples)) / samples
    assert ((mean - x).abs() <= 5 * x.abs() * (10 - 1) ** 0.5 / samples**0.5 + 1e-6).all()
    # The draw depends on the step and tensor only, never on the rank: all-reducible.
    out = torch.empty_like(x)
    first = compressor.encode(x, out, EncodeContext(layout, step=3, world_size=2, rank=0)).sent.indices.clone()
    assert torch.equal(
        first, compressor.encode(x, out, EncodeContext(layout, step=3, world_size=2, rank=1)).sent.indices
    )
    assert first.unique().numel() == first.numel() == 123  # one per block of 10 (1230 elements), distinct


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_randomk_draws_the_same_indices_in_half_precision_buckets(dtype: torch.dtype) -> None:
    """Block sizes such as 3333 are not representable in bf16 (3328) or fp16 (3332): kept exact,
    the draw covers every block's whole range and never leaves it, whatever the bucket's dtype."""
    layout, _ = _layout_and_params([(100, 100)])  # blocks of 3333, 3333, 3333 and 1
    wide_codec, narrow_codec = create("randomk", compress_ratio=0.0003), create("randomk", compress_ratio=0.0003)
    x = torch.randn(layout.numel)
    for step in range(300):
        wide = wide_codec.encode(x, torch.empty_like(x), EncodeContext(layout, step=step, world_size=1)).sent.indices
        narrow = narrow_codec.encode(x.to(dtype), x.to(dtype), EncodeContext(layout, step=step, world_size=1))
        assert torch.equal(narrow.sent.indices, wide)
        assert (wide[:3] >= torch.tensor([0, 3333, 6666])).all() and (wide[:3] < torch.tensor([3333, 6666, 9999])).all()


def test_randomk_wire_ratio_on_a_large_tensor() -> None:
    layout, _ = _layout_and_params([(1000, 1000)])
    _, encoded, _ = _round_trip(create("randomk", compress_ratio=0.01), torch.randn(layout.numel), layout, 0)
    assert 4 * layout.numel / encoded.payload.bytes_sent == 100.0  # values only: no indices on the wire


NARROW_WIRE = {"index_encoding": "elias_fano", "value_dtype": "float16", "dense_dtype": "float16"}


@pytest.mark.parametrize(
    ("name", "wire"),
    [(name, {}) for name in ["onebit", "signsgd", "topk", "randomk", "fp16", "bf16", "dgc", "powersgd", "fft"]]
    + [("dgc", NARROW_WIRE), ("topk", {**NARROW_WIRE, "dense_dtype": "bfloat16"})],
)
def test_error_feedback_loses_nothing(name: str, wire: dict) -> None:
    """Over many steps: everything decoded + what memory still holds == every gradient fed in."""
    from lightning_gc.core.memory import CompensationMemory

    ratio = {"compress_ratio": 0.05} if name in ("topk", "dgc", "randomk", "fft") else {}
    compressor = create(name, **ratio, **wire)
    assert compressor.biased
    layout, params = _layout_and_params([(64, 50), (50,), (30, 40)])
    memory = CompensationMemory(momentum_correction=False, momentum_masking=True, clip_norm=None)
    gen = torch.Generator().manual_seed(1)
    fed, received = torch.zeros(layout.numel, dtype=torch.float64), torch.zeros(layout.numel, dtype=torch.float64)
    for step in range(12):
        g = torch.randn(layout.numel, generator=gen)
        fed += g.double()
        state = memory.bucket(layout, g)
        velocity = memory.compensate(state, g.clone(), params, world_size=1)
        decoded, encoded, _ = _round_trip(compressor, velocity, layout, step)
        memory.commit(state, encoded.sent)
        received += decoded.double()
    torch.testing.assert_close(received + state.velocity.double(), fed, rtol=0, atol=1e-4)


def test_every_compressor_predicts_its_wire_bytes() -> None:
    layout, _ = _layout_and_params([(64, 50), (50,), (30, 40), (3, 3)])
    velocity = torch.randn(layout.numel)
    for name in available():
        _, _, bytes_sent = _round_trip(create(name), velocity, layout, step=0)
        assert create(name).wire_bytes(layout, 4) == bytes_sent, name
    for name in ("dgc", "topk"):
        for wire in ({"index_encoding": "elias_fano"}, NARROW_WIRE):
            _, _, bytes_sent = _round_trip(create(name, **wire), velocity, layout, step=0)
            assert create(name, **wire).wire_bytes(layout, 4) == bytes_sent < create(name).wire_bytes(layout, 4)


def test_selective_compression_rule() -> None:
    from lightning_gc.runtime.hook import reaches_wire_ratio

    big, _ = _layout_and_params([(1000, 100)])
    tiny, _ = _layout_and_params([(40, 40), (40,)])  # topk 1 % of 1,600: 16 pairs + 40 dense biases
    topk = create("topk", compress_ratio=0.01)
    assert reaches_wire_ratio(topk, big, 4, 40) and not reaches_wire_ratio(topk, big, 4, 60)  # 50x
    ratio = tiny.numel * 4 / topk.wire_bytes(tiny, 4)
    assert 1 < ratio < 40 and not reaches_wire_ratio(topk, tiny, 4, 40)


def test_buckets_below_the_threshold_go_through_exact_all_reduce(run_ranks) -> None:
    model = {"hidden": [256], **SGD}
    fits = [
        {"strategy": {"kind": "gc", "compressor": "none"}, "model": model, "epochs": 1},
        {"strategy": {"kind": "gc", "compressor": "topk", "min_wire_ratio": 1000}, "model": model, "epochs": 1},
    ]
    (plain, selective), _ = run_ranks({"fits": fits})
    assert selective["epoch_metrics"][-1]["gc/wire_ratio"] == 1.0
    assert torch.equal(selective["params"], plain["params"])  # exactly DDP: nothing compressed


@pytest.mark.parametrize("ratio", ["0.07", "0.1", "0.3", "0.001", "0.0625"])
def test_k_is_the_ceiling_of_the_decimal_ratio_times_the_size(ratio: str) -> None:
    """0.07 is not exact in binary (0.07 * 100 = 7.000000000000001): k must still be 7, not 8."""
    import math
    from fractions import Fraction

    topk, fft = create("topk", compress_ratio=float(ratio)), create("fft", compress_ratio=float(ratio))
    for numel in range(1, 3001):
        assert topk.k_for(numel) == math.ceil(Fraction(ratio) * numel), numel
        assert fft.k_for(numel) == min(numel // 2 + 1, math.ceil(Fraction(ratio) * numel / 2)), numel


@pytest.mark.parametrize("name", ["bf16", "terngrad", "signsgd", "onebit", "qsgd"])
def test_half_precision_buckets_decode_a_mean_whose_sum_overflows(name: str) -> None:
    """fp16 bucket, 2 ranks at 40000: the sum (80000) does not fit fp16, the mean does; what this
    rank sent (for memory) is finite too, though QSGD's decoded values can reach the norm (80000)."""
    from lightning_gc.exchanges.transport import LocalTransport

    layout, _ = _layout_and_params([(4, 4)])
    velocity = torch.full((layout.numel,), 40_000.0, dtype=torch.float16)
    compressor = create(name) if name == "bf16" else create(name, min_compress_numel=1)  # quantised, not dense
    out = torch.empty_like(velocity)
    encoded = compressor.encode(velocity, out, EncodeContext(layout, step=0, world_size=2, rank=0))
    assert encoded.sent.dense_values is None or encoded.sent.dense_values.isfinite().all()
    LocalTransport(2).launch(encoded.payload)
    compressor.decode(encoded, out, world_size=2)
    assert out.isfinite().all()
    if name != "qsgd":  # QSGD is stochastic: unbiased, not exact
        assert torch.allclose(out.float(), torch.full((layout.numel,), 40_000.0), rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_gathered_quantisers_hold_a_float32_sum_buffer_only_for_narrower_buckets(dtype: torch.dtype) -> None:
    """A float32 or float64 bucket sums every rank's decoded values in the bucket itself, in its own
    precision: its plan holds no bucket-sized sum buffer of its own (device memory on a GPU); an
    fp16 bucket's plan holds a float32 one."""
    layout, _ = _layout_and_params([(64, 64)])
    compressor = create("onebit")
    context = EncodeContext(layout, step=0, world_size=2, rank=0)
    velocity = torch.randn(layout.numel).to(dtype)
    compressor.encode(velocity, torch.empty_like(velocity), context)
    total = compressor.plan(context, velocity).total
    if dtype != torch.float16:
        assert total is None
    else:
        assert total is not None and total.dtype == torch.float32 and total.numel() == layout.numel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", ["onebit", "signsgd", "qsgd", "terngrad"])
def test_gathered_quantisers_average_every_row_alike_on_every_rank(name: str, dtype: torch.dtype) -> None:
    """Each rank adds its own row from what it kept at encode (no second decode), in its place in
    the sum: every rank's average is bit for bit the mean of every row decoded, summed in rank
    order in float32, with signed zeros kept."""
    layout, _ = _layout_and_params([(40, 30), (30,), (20, 20)])
    world_size, generator = 3, torch.Generator().manual_seed(6)
    compressors = [create(name, min_compress_numel=400) for _ in range(world_size)]
    velocities = [(torch.randn(layout.numel, generator=generator) * 1e3).to(dtype) for _ in range(world_size)]
    encoded = [
        c.encode(v, torch.empty_like(v), EncodeContext(layout, step=2, world_size=world_size, rank=r))
        for r, (c, v) in enumerate(zip(compressors, velocities))
    ]
    rows = torch.cat([e.payload.gathered for e in encoded])
    expected = torch.zeros(layout.numel)
    for row in rows.view(world_size, -1):
        compressors[0].add_decoded_chunk(
            row,
            compressors[0].plan(EncodeContext(layout, step=2, world_size=world_size), velocities[0]).fmt,
            expected,
            dtype,
        )
    expected = (expected / world_size).to(dtype)
    for compressor, e, v in zip(compressors, encoded, velocities):
        e.payload.gathered_out.copy_(rows)
        out = torch.empty_like(v)
        compressor.decode(e, out, world_size=world_size)
        assert torch.equal(out, expected) and torch.equal(out.signbit(), expected.signbit())


def test_qsgd_scales_by_a_norm_beyond_float32_without_decoding_nan() -> None:
    layout, _ = _layout_and_params([(2, 2)])
    velocity = torch.tensor([3e19, 3e19, -1.5e19, 0.0])  # ||x||^2 overflows float32
    out, encoded, _ = _round_trip(create("qsgd", min_compress_numel=1), velocity, layout, 0)
    assert out.isfinite().all() and encoded.sent.dense_values.isfinite().all()  # not 0 * inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", ["onebit", "signsgd", "qsgd", "terngrad"])
def test_quantisers_send_one_dimensional_and_small_tensors_exactly(name: str, dtype: torch.dtype) -> None:
    """Biases and norms (1-D) and tensors under ``min_compress_numel`` travel as float32 values after
    the codes: decoded exactly, and memory keeps nothing of them. The other tensors are quantised
    as when every tensor is, and the payload is their codes plus 4 bytes per dense element."""
    shapes = [(40, 30), (30,), (5, 6), (20, 20), (7,)]
    layout, _ = _layout_and_params(shapes)
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(4)).to(dtype)
    compressor = create(name, min_compress_numel=400)  # quantises (40, 30) and (20, 20)
    out, encoded, sent = _round_trip(compressor, x.clone(), layout, step=3)
    every_2d, _, _ = _round_trip(create(name, min_compress_numel=1), x.clone(), layout, step=3)
    for segment, shape in zip(layout.segments, shapes):
        if len(shape) == 1 or segment.numel < 400:
            assert torch.equal(segment.of(out), segment.of(x)), shape
            assert torch.equal(segment.of(encoded.sent.dense_values), segment.of(x)), shape
        else:
            assert torch.equal(segment.of(out), segment.of(every_2d)), shape  # the same codes and seeds
            assert not torch.equal(segment.of(out), segment.of(x)), shape
    quantised_only, _ = _layout_and_params([(40, 30), (20, 20)])
    dense_numel = 30 + 30 + 7
    assert sent == create(name, min_compress_numel=1).wire_bytes(quantised_only, 4) + 4 * dense_numel
    assert sent == compressor.wire_bytes(layout, x.element_size())


# ------------------------------------------------------------------ plans: rebuilt whenever what they depend on changes
PLAN_SHAPES = [(64, 50), (50,), (30, 40), (7,), (3, 3)]


def _local_trip(compressor, velocity: torch.Tensor, layout, world: int, step: int = 0) -> tuple[torch.Tensor, int]:
    """What ``compressor`` decodes when ``world`` ranks all send what it sends (every round's
    collectives by :class:`~lightning_gc.exchanges.transport.LocalTransport`), and the bytes it sent."""
    from lightning_gc.exchanges.transport import LocalTransport

    out = torch.empty_like(velocity)
    encoded = compressor.encode(velocity, out, EncodeContext(layout, step=step, world_size=world))
    bytes_sent = encoded.payload.bytes_sent
    LocalTransport(world).launch(encoded.payload)
    while encoded.next_round is not None:
        encoded = encoded.next_round()
        bytes_sent += encoded.payload.bytes_sent
        LocalTransport(world).launch(encoded.payload)
    compressor.decode(encoded, out, world_size=world)
    return out, bytes_sent


def _same_as_fresh(used, name: str, velocity: torch.Tensor, layout, world: int, **arguments) -> None:
    """``used`` (after other encodes) decodes and sends exactly what a fresh compressor with
    ``arguments`` and ``used``'s state does."""
    fresh = create(name, **arguments)
    fresh.load_state_dict(used.state_dict())
    expected, expected_bytes = _local_trip(fresh, velocity, layout, world, step=1)
    got, got_bytes = _local_trip(used, velocity, layout, world, step=1)
    assert got_bytes == expected_bytes == fresh.wire_bytes(layout, velocity.element_size())
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    ("name", "before", "after"),
    [
        ("topk", {"compress_ratio": 0.1}, {"compress_ratio": 0.02}),  # SparsityWarmup's change
        ("dgc", {"compress_ratio": 0.1}, {"compress_ratio": 0.02}),
        ("fft", {"compress_ratio": 0.1}, {"compress_ratio": 0.02}),
        ("randomk", {"compress_ratio": 0.1}, {"compress_ratio": 0.02}),
        ("topk", {"min_compress_numel": 1024}, {"min_compress_numel": 8}),  # was ignored by the sparse plan
        ("signsgd", {"chunk_size": 16}, {"chunk_size": 64}),  # was ignored by the quantisers' plan
        ("onebit", {"chunk_size": None}, {"chunk_size": 8}),
        ("qsgd", {"min_compress_numel": 1024}, {"min_compress_numel": 8}),
        ("powersgd", {"rank": 1}, {"rank": 2}),  # was ignored by PowerSGD's plan
        ("powersgd", {"min_compression_rate": 2.0}, {"min_compression_rate": 100.0}),
    ],
)
def test_a_changed_setting_plans_afresh(name: str, before: dict, after: dict) -> None:
    layout, _ = _layout_and_params(PLAN_SHAPES)
    velocity = torch.randn(layout.numel, generator=torch.Generator().manual_seed(5))
    compressor = create(name, **before)
    _local_trip(compressor, velocity, layout, world=2)
    for attribute, value in after.items():
        setattr(compressor, attribute, value)
    _same_as_fresh(compressor, name, velocity, layout, world=2, **after)


@pytest.mark.parametrize(("world", "dtype"), [(3, torch.float32), (2, torch.float64)])
@pytest.mark.parametrize("name", sorted(available()))
def test_a_changed_world_size_or_dtype_plans_afresh(name: str, world: int, dtype: torch.dtype) -> None:
    """After a bucket of float32 on 2 ranks: gathered buffers hold one payload per rank (world
    size 3), and buffers of gradient values take the velocity's dtype (float64)."""
    layout, _ = _layout_and_params(PLAN_SHAPES)
    velocity = torch.randn(layout.numel, generator=torch.Generator().manual_seed(6))
    compressor = create(name)
    _local_trip(compressor, velocity, layout, world=2)
    _same_as_fresh(compressor, name, velocity.to(dtype), layout, world=world)


def test_a_plan_is_reused_until_its_layout_object_changes() -> None:
    """Allocate once, reuse forever; a rebuilt bucket (a new layout object, even an equal one) gets its own."""
    from dataclasses import replace

    layout, _ = _layout_and_params(PLAN_SHAPES)
    velocity = torch.randn(layout.numel)
    compressor = create("topk")
    context = EncodeContext(layout, step=0, world_size=2)
    plan = compressor.plan(context, velocity)
    assert compressor.plan(EncodeContext(layout, step=9, world_size=2, rank=1), velocity) is plan
    rebuilt = replace(layout)
    assert rebuilt == layout and compressor.plan(EncodeContext(rebuilt, step=0, world_size=2), velocity) is not plan


def test_random_k_rescaled_into_float16_saturates_instead_of_overflowing() -> None:
    """``rescale=True`` multiplies a sent value by its block size (1000 at ratio 0.001): in a
    float16 bucket 70 x 1000 was ``inf`` in the decoded gradient and in what memory is told left;
    both now saturate at float16's largest finite value, as the narrow wire formats do."""
    from lightning_gc.perfmodel.calibration import layout_of_shapes

    layout = layout_of_shapes([(64, 1024)])
    compressor = create("randomk", compress_ratio=0.001, rescale=True)
    velocity = torch.full((layout.numel,), 70.0, dtype=torch.float16)
    out = torch.empty_like(velocity)
    encoded = compressor.encode(velocity, out, EncodeContext(layout, 0, 2, 0))
    encoded.payload.summed.mul_(2)  # the all-reduce over 2 ranks holding the same velocity
    compressor.decode(encoded, out, world_size=2)
    assert torch.isfinite(out).all() and torch.isfinite(encoded.sent.values).all()
    assert out.max() == torch.finfo(torch.float16).max
