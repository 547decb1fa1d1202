"""The ``int8`` codec: max-abs scaled, unbiased stochastic 8-bit codes per chunk of 512 (INTELLECT-1-style)."""

from __future__ import annotations

import torch

from lightning_gc.common.layout import BucketLayout
from lightning_gc.compressors import create
from lightning_gc.compressors.base import EncodeContext


def _layout(shapes: list[tuple[int, ...]]) -> BucketLayout:
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    names = {id(p): (f"p{i}", i) for i, p in enumerate(params)}
    return BucketLayout.build(0, params, names, sum(p.numel() for p in params))


def _round_trip(compressor, x: torch.Tensor, layout: BucketLayout, step: int) -> tuple[torch.Tensor, int]:
    """What a world of one rank decodes from ``x``, and the bytes it sent."""
    out = torch.empty_like(x)
    encoded = compressor.encode(x, out, EncodeContext(layout, step=step, world_size=1, rank=0))
    sent = encoded.payload.bytes_sent
    while encoded.next_round is not None:
        encoded = encoded.next_round()
        sent += encoded.payload.bytes_sent
    if encoded.payload.gathered is not None:
        encoded.payload.gathered_out.copy_(encoded.payload.gathered)
    compressor.decode(encoded, out, world_size=1)
    return out, sent


def _gaussian(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def test_every_element_lies_within_a_level_step_of_max_abs_over_127() -> None:
    layout = _layout([(40, 30)])
    x = _gaussian(layout.numel)
    decoded, _ = _round_trip(create("int8"), x, layout, step=0)
    for start in range(0, layout.numel, 512):
        chunk, back = x[start : start + 512], decoded[start : start + 512]
        step = chunk.abs().max() / 127
        assert ((back - chunk).abs() <= step * (1 + 1e-5)).all(), start
        assert torch.equal(back.sign()[back != 0], chunk.sign()[back != 0])  # rounding keeps the sign


def test_stochastic_rounding_is_unbiased_over_many_draws() -> None:
    """Each decode errs by < step = max|x| / 127 per element with mean 0: the mean of S decodes
    errs by at most step / (2 sqrt S) in std; the tolerance is 5 of those."""
    compressor = create("int8")
    assert not compressor.biased
    layout = _layout([(32, 48)])
    x = _gaussian(layout.numel, seed=1)
    samples = 400
    mean = sum(_round_trip(compressor, x, layout, step)[0] for step in range(samples)) / samples
    for start in range(0, layout.numel, 512):
        step = float(x[start : start + 512].abs().max()) / 127
        error = float((mean[start : start + 512] - x[start : start + 512]).abs().max())
        assert error < 5 * step / (2 * samples**0.5), (start, error, step)
    # one draw is not the mean: the rounding is random, not round-to-nearest
    assert not torch.equal(_round_trip(compressor, x, layout, 0)[0], _round_trip(compressor, x, layout, 1)[0])


def test_a_gaussian_chunk_uses_far_more_levels_than_qsgd_at_127() -> None:
    """|x| / max|x| spreads over the 127 levels (measured: 89 distinct per chunk of 512); |x| / ||x||_2
    (QSGD) stays below ~3.5 / sqrt(512), i.e. level ~20 (measured: 19 distinct)."""
    layout = _layout([(512, 8)])
    x = _gaussian(layout.numel, seed=2)

    def levels_used(name: str, **arguments) -> float:
        compressor = create(name, **arguments)
        decoded, _ = _round_trip(compressor, x, layout, step=0)
        counts = []
        for start in range(0, layout.numel, 512):
            chunk, back = x[start : start + 512], decoded[start : start + 512]
            scale = chunk.abs().max() if name == "int8" else chunk.norm()
            counts.append(len(torch.unique(torch.round(back.abs() / scale * 127))))
        return sum(counts) / len(counts)

    int8, qsgd = levels_used("int8"), levels_used("qsgd", levels=127)
    assert int8 > 80 and qsgd < 25 and int8 > 4 * qsgd, (int8, qsgd)


def test_wire_bytes_are_one_byte_per_element_plus_a_float32_scale_per_chunk() -> None:
    layout = _layout([(64, 64), (1000, 3), (10,)])  # 4096 + 3000 compressed (8 + 6 chunks), 10 dense
    compressor = create("int8")
    expected = (4096 + 3000) + 4 * (8 + 6) + 4 * 10
    assert compressor.wire_bytes(layout, 4) == expected
    assert _round_trip(compressor, _gaussian(layout.numel), layout, step=0)[1] == expected
    assert create("int8").code_bits == 8 and create("int8").chunk_size == 512


def test_the_diloco_int8_preset_runs_two_phase_from_three_ranks_and_gathers_below() -> None:
    """exchange="auto" in the preset: from 3 ranks the outer loop's averager reduce-scatters the
    codes (phase 1) and gathers the re-encoded chunk means (phase 2): each rank receives ~2 M (N-1)/N
    instead of the (N-1) M of an all-gather of payloads of M bytes; at 2 ranks it all-gathers."""
    from lightning_gc.common.outer_presets import OUTER_PRESETS
    from lightning_gc.exchanges.averager import CompressedAverager
    from lightning_gc.exchanges.transport import LocalTransport

    preset = OUTER_PRESETS["diloco_int8"]
    arguments = {key: preset[key] for key in ("chunk_size", "exchange")}
    assert preset["compressor"] == "int8" and arguments == {"chunk_size": 512, "exchange": "auto"}
    for world_size, two_phase in ((2, False), (3, True), (8, True)):
        transport = LocalTransport(world_size)
        averager = CompressedAverager("int8", [("w", (256, 256))], via=transport, **arguments)
        averager.average(_gaussian(256 * 256)).wait()
        assert (transport.scattered_bytes > 0) == two_phase and (transport.gathered_bytes > 0), world_size
        if two_phase:  # phase 2 gathers one chunk's codes per rank: ~M / N, not M
            assert transport.gathered_bytes < 1.1 * (256 * 256 + 4 * 128) / world_size, world_size
