"""chunk_topk (SparseLoCo's codec): top-k per 64x64 chunk, 2-bit values, packed in-chunk indices;
checked against a chunk-by-chunk reference written out plainly here, and over a real gloo group."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import launch_ranks

from lightning_gc.compressors import available, create
from lightning_gc.compressors.base import EncodeContext
from lightning_gc.compressors.chunk_topk import ChunkTopKCompressor
from lightning_gc.exchanges.averager import CompressedAverager
from lightning_gc.exchanges.transport import LocalTransport

# ragged in both directions: 130 = 64 + 64 + 2 rows, 70 = 64 + 6 columns; a conv weight read as
# [8, 3*5*5] (below 1024 elements: dense), a bias (1-D: dense) and a square 128x128 (four full chunks)
SHAPES = [("w", (130, 70)), ("conv", (8, 3, 5, 5)), ("b", (70,)), ("sq", (128, 128))]


WORKER_SHAPES = [("w", (48, 40)), ("b", (40,)), ("v", (3000,))]
"""The tensors of ``workers/averager_worker.py``: one ragged 48x40 chunk and two dense tensors."""


def alone(ratio: float = 0.02, **arguments) -> CompressedAverager:
    """An averager in a world of one rank: its average is exactly its own decoded message."""
    return CompressedAverager("chunk_topk", SHAPES, via=LocalTransport(1), compress_ratio=ratio, **arguments)


def reference(x: torch.Tensor, ratio: float, side: int = 64) -> torch.Tensor:
    """What one rank's message decodes to, chunk by chunk, as the module docstring states it."""
    out = torch.zeros_like(x)
    start = 0
    for _, shape in SHAPES:
        numel = math.prod(shape)
        if len(shape) > 1 and numel >= 1024:
            matrix = x[start : start + numel].view(shape[0], -1)
            decoded = out[start : start + numel].view(shape[0], -1)
            for i in range(0, matrix.shape[0], side):
                for j in range(0, matrix.shape[1], side):
                    chunk = matrix[i : i + side, j : j + side]
                    n = chunk.numel()
                    k = min(n, math.ceil(ratio * n))
                    flat = chunk.reshape(-1)
                    chosen = torch.topk(flat.abs(), k).indices
                    a = flat[chosen].abs()
                    high = a >= a.mean()
                    levels = [a[~high].mean() if (~high).any() else 0.0, a[high].mean()]
                    levels = [torch.tensor(float(v)).to(torch.bfloat16).float() for v in levels]
                    values = torch.stack([levels[int(h)] for h in high]) * torch.sign(flat[chosen])
                    block = torch.zeros(n)
                    block[chosen] = values
                    decoded[i : i + side, j : j + side] = block.view(chunk.shape)
        else:
            out[start : start + numel] = x[start : start + numel]  # dense, exactly
        start += numel
    return out


def test_registered_with_sparseloco_defaults_and_refuses_bad_input():
    assert "chunk_topk" in available()
    codec = create("chunk_topk")
    assert (codec.compress_ratio, codec.chunk_side, codec.biased) == (0.02, 64, True)
    assert codec.config() == {
        "name": "chunk_topk",
        "compress_ratio": 0.02,
        "chunk_side": 64,
        "min_compress_numel": 1024,
    }
    with pytest.raises(ValueError, match="chunk_side"):
        ChunkTopKCompressor(chunk_side=0)
    with pytest.raises(ValueError, match="compress_ratio"):
        ChunkTopKCompressor(compress_ratio=0.0)


@pytest.mark.parametrize("ratio", [0.02, 0.1])
def test_round_trip_is_top_k_of_every_chunk_in_two_bits(ratio):
    averager = alone(ratio)
    x = torch.randn(averager.numel, generator=torch.Generator().manual_seed(3))
    y = averager.average(x.clone()).wait()
    expected = reference(x, ratio)
    assert torch.equal(y != 0, expected != 0)  # the same positions: exactly k per chunk
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=0)
    w = y[: 130 * 70].view(130, 70)
    assert torch.count_nonzero(w[128:, 64:]) == math.ceil(ratio * 12)  # the 2x6 corner chunk
    for chunk in (w[:64, :64], y[-128 * 128 :].view(128, 128)[64:, 64:]):
        assert len(chunk[chunk != 0].abs().unique()) <= 2  # two magnitude levels per chunk


def test_error_feedback_keeps_exactly_what_was_not_decoded():
    """e_after == (beta e_before + x) - decode(sent), bit for bit, call after call."""
    beta = 0.9
    averager = alone(error_decay=beta)
    generator = torch.Generator().manual_seed(0)
    residual = torch.zeros(averager.numel)
    for _ in range(4):
        x = torch.randn(averager.numel, generator=generator)
        folded = residual * beta + x
        sent = averager.average(x.clone()).wait().clone()
        residual = averager.residual()
        assert torch.equal(residual, folded - sent)
        torch.testing.assert_close(residual + sent, folded, rtol=0, atol=1e-6)
    assert residual.abs().sum() > 0  # something is always left for later


def test_bytes_follow_the_documented_formula_and_the_payload():
    averager = alone()
    codec, layout = averager.compressor, averager.layout
    chunks = [
        min(64, r) * min(64, c)
        for rows, cols in ((130, 70), (128, 128))
        for r in range(rows, 0, -64)
        for c in range(cols, 0, -64)
    ]
    pairs = sum(math.ceil(0.02 * n) for n in chunks)
    aligned = lambda n: -(-n // 4) * 4  # noqa: E731
    dense = 8 * 75 + 70
    formula = aligned(4 * len(chunks)) + aligned(math.ceil(pairs / 4)) + aligned(math.ceil(12 * pairs / 8)) + 4 * dense
    assert codec.wire_bytes(layout, 4) == formula
    averager.average(torch.randn(averager.numel))
    assert averager.bytes_sent == formula  # what the payload tensors held
    assert plan_of(averager).payload.numel() + 4 * dense == formula
    assert formula < averager.numel * 4 / 10


def plan_of(averager: CompressedAverager) -> Any:
    """The codec's plan for the averager's flat tensor, through the public ``plan`` (cached: the
    one the last call used)."""
    like = torch.zeros(averager.numel)
    return averager.compressor.plan(EncodeContext(averager.layout, step=0, world_size=1), like)


def test_same_input_same_bytes():
    x = torch.randn(alone().numel, generator=torch.Generator().manual_seed(5))
    payloads, decoded, sent = [], [], []
    for _ in range(2):
        averager = alone()
        decoded.append(averager.average(x.clone()).wait().clone())
        payloads.append(plan_of(averager).payload.clone())  # padding included: the bytes on the wire
        sent.append(averager.bytes_sent)
    assert torch.equal(*payloads) and torch.equal(*decoded) and sent[0] == sent[1]


def test_two_gloo_ranks_average_their_decodes(tmp_path):
    """Over a real group: both ranks get the same bits, the mean of what each decodes alone."""
    cases = [{"id": "chunk_topk", "compressor": "chunk_topk", "arguments": {"compress_ratio": 0.05}}]
    ranks = launch_ranks("averager_worker.py", {"cases": cases, "calls": 2}, tmp_path, world_size=2)
    mine, theirs = ranks[0]["chunk_topk"], ranks[1]["chunk_topk"]
    singles = [
        CompressedAverager("chunk_topk", WORKER_SHAPES, via=LocalTransport(1), compress_ratio=0.05) for _ in range(2)
    ]
    for call in range(2):
        assert torch.equal(mine["averages"][call], theirs["averages"][call])
        decodes = [
            single.average(rank["chunk_topk"]["inputs"][call].clone()).wait().clone()
            for single, rank in zip(singles, ranks)
        ]
        torch.testing.assert_close(mine["averages"][call], (decodes[0] + decodes[1]) / 2, rtol=1e-6, atol=1e-7)
    for single, rank in zip(singles, ranks):
        assert torch.equal(single.residual(), rank["chunk_topk"]["residual"])  # each rank's own memory
    assert mine["bytes_sent"] == 2 * singles[0].compressor.wire_bytes(singles[0].layout, 4)


def test_a_float16_chunk_near_the_top_of_its_range_stays_finite():
    """Half of a 64x64 chunk of float16 values up to 65,000: the levels are computed in float32
    (their sum is far past float16's 65,504) and decode finite; the residual is still exact."""
    averager = CompressedAverager("chunk_topk", [("w", (64, 64))], via=LocalTransport(1), compress_ratio=0.5)
    x = ((torch.rand(4096, generator=torch.Generator().manual_seed(2)) * 2 - 1) * 65000).half()
    y = averager.average(x.clone()).wait()
    assert y.dtype == torch.float16 and bool(torch.isfinite(y).all()) and torch.count_nonzero(y) == 2048
    sent = y[y != 0].abs()
    assert len(sent.unique()) == 2 and sent.max() <= x.abs().max()  # two means of sent magnitudes, not a clamp
    assert torch.equal(averager.residual(), x - y)


@pytest.mark.parametrize("width", [12, 6])
@pytest.mark.parametrize("pairs", [1, 2, 5, 82, 1001])
def test_12_bit_indices_pack_three_bytes_per_two_as_the_bit_stream(pairs, width):
    """The 64x64 fast path (two slots in 3 bytes, int32 shifts) writes the documented bit stream
    (bit j of slot i at bit i*12 + j, little-end first) and reads it back; K = 5 fills its aligned
    field exactly (8 bytes), so the last half-triple must not spill. Other widths (6: 8x8 chunks)
    take the general path to the same stream."""
    from lightning_gc import kernels
    from lightning_gc.compressors.chunk_topk import ChunkWire, pack_slots, unpack_slots

    generator = torch.Generator().manual_seed(pairs)
    slots = torch.randint(0, 2**width, (pairs,), generator=generator, dtype=torch.int32)
    bits = ((slots.long().unsqueeze(1) >> torch.arange(width)) & 1).to(torch.uint8).reshape(-1)
    stream = kernels.pack_codes(bits, 1)
    wire = ChunkWire(1, pairs, width)
    field = torch.zeros(wire.index_bytes, dtype=torch.uint8)
    pack_slots(slots, width, field)
    assert torch.equal(field[: stream.numel()], stream) and not field[stream.numel() :].any()
    rows = torch.stack([field, field.flip(0) * 0])  # two ranks' fields; the second sends slot 0 everywhere
    unpacked = unpack_slots(rows, pairs, width)
    assert unpacked.dtype == torch.int32 and torch.equal(unpacked[0], slots) and not unpacked[1].any()


def test_the_plan_keeps_slot_positions_in_int32():
    averager = alone(0.05)
    averager.average(torch.randn(averager.numel)).wait()
    assert plan_of(averager).slots.dtype == torch.int32  # [B, 4096] per chunk: half the bytes of int64
