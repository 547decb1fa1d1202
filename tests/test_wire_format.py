"""Sparse wire formats (int32, Elias--Fano), narrow dense tensors, dense blocks inside payloads, and
ResNet-50's bytes on the wire."""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_gc.common.layout import BucketLayout, Segment
from lightning_gc.compressors import DGCCompressor, TopKCompressor, create
from lightning_gc.compressors.base import EncodeContext
from lightning_gc.compressors.dense import GATHER_BELOW, DenseBlock
from lightning_gc.compressors.wire import (
    INDEX_ENCODINGS,
    EliasFanoIndices,
    Int32Indices,
    elias_fano_bits,
    low_bits,
)
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.core.momentum import MomentumSpec

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NARROW = {"index_encoding": "elias_fano", "value_dtype": "float16", "dense_dtype": "float16"}


def _send(wire, world: int, n: int, universe: int, draw) -> tuple[list, torch.Tensor]:
    """Pack every rank's pairs from ``draw(rank) -> (indices, values)`` into one gathered buffer;
    per rank (indices, values as decoded, in the caller's order) and the buffer."""
    size = wire.payload_bytes(n, universe)
    gathered = torch.full((world * size,), 0xAB, dtype=torch.uint8)  # garbage: pack must overwrite it all
    sent = []
    for rank in range(world):
        indices, values = draw(rank)
        decoded = wire.pack(gathered[rank * size : (rank + 1) * size], indices, values, universe)
        sent.append((indices, decoded))
    return sent, gathered


def _expected(wire, sent: list) -> tuple[torch.Tensor, torch.Tensor]:
    """What unpack must return: int32 keeps each rank's order, Elias--Fano sorts by index (stably)."""
    indices, values = [], []
    sorts = isinstance(wire, EliasFanoIndices)
    for idx, val in sent:
        order = torch.sort(idx, stable=True).indices if sorts else torch.arange(idx.numel())
        indices.append(idx[order])
        values.append(val[order])
    return torch.cat(indices), torch.cat(values)


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("encoding", sorted(INDEX_ENCODINGS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 1000])
def test_gathered_payloads_unpack_to_every_ranks_pairs(encoding: str, dtype: torch.dtype, n: int) -> None:
    wire = INDEX_ENCODINGS[encoding](dtype)
    world, universe = 3, 50_000
    size = wire.payload_bytes(n, universe)
    assert size % 4 == 0
    gen = torch.Generator().manual_seed(n)
    sent, gathered = _send(
        wire, world, n, universe, lambda r: (torch.randperm(universe, generator=gen)[:n], torch.randn(n, generator=gen))
    )
    for _, decoded in sent:  # values as receivers decode them, in the caller's order
        assert decoded.dtype == torch.float32
    got_indices, got_values = wire.unpack(gathered, world, n, universe)
    want_indices, want_values = _expected(wire, sent)
    assert torch.equal(got_indices.long(), want_indices)
    assert got_values.dtype == dtype and torch.equal(got_values.float(), want_values)
    for _, decoded in sent:
        assert torch.equal(decoded, decoded.to(dtype).float())  # already rounded: memory keeps the rest


@pytest.mark.parametrize("encoding", sorted(INDEX_ENCODINGS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_payload_byte_is_written_including_the_padding(encoding: str, dtype: torch.dtype) -> None:
    """Whatever the buffer held before, the same pairs give the same bytes (n = 3 leaves padding)."""
    wire = INDEX_ENCODINGS[encoding](dtype)
    indices, values = torch.tensor([7, 900, 31]), torch.tensor([0.5, -1.25, 3.0])
    payloads = []
    for garbage in (0x00, 0xAB, 0xFF):
        payload = torch.full((wire.payload_bytes(3, 1000),), garbage, dtype=torch.uint8)
        wire.pack(payload, indices, values, 1000)
        payloads.append(payload)
    assert torch.equal(payloads[0], payloads[1]) and torch.equal(payloads[0], payloads[2])


def _edge_cases() -> list[tuple[str, torch.Tensor, int]]:
    cases = [
        ("n=1 u=1", torch.tensor([0]), 1),
        ("n=1 last", torch.tensor([999]), 1000),
        ("n=u all", torch.arange(37), 37),
        ("n=u shuffled", torch.randperm(64, generator=torch.Generator().manual_seed(3)), 64),
        ("all equal", torch.full((50,), 17), 1000),
        ("all zero", torch.zeros(9, dtype=torch.int64), 10),
        ("all last", torch.full((9,), 9), 10),
        ("first and last", torch.tensor([0, 12_344, 0, 12_344]), 12_345),
        ("duplicates", torch.tensor([5, 5, 5, 2, 2, 9, 0, 0]), 10),
        ("n>u (duplicates, l=0)", torch.tensor([3, 1, 3, 0, 2, 2, 1, 3, 0]), 4),
        ("u not a power of 2", torch.tensor([0, 1, 2, 999_999, 500_000, 333_333]), 1_000_003),
        ("u power of 2", torch.tensor([0, 1023, 512, 511]), 1024),
        ("l=0 dense", torch.tensor([0, 2, 4, 1]), 6),
        ("dense run", torch.arange(100, 140), 1 << 20),
    ]
    return cases


@pytest.mark.parametrize(("indices", "universe"), [c[1:] for c in _edge_cases()], ids=[c[0] for c in _edge_cases()])
@pytest.mark.parametrize("world", [1, 2])
def test_elias_fano_edge_cases_round_trip_bit_exactly(indices: torch.Tensor, universe: int, world: int) -> None:
    wire = EliasFanoIndices(torch.float32)
    n = indices.numel()
    values = torch.arange(1, n + 1, dtype=torch.float32)  # distinct: shows that values follow their index
    sent, gathered = _send(wire, world, n, universe, lambda r: (indices.flip(0) if r else indices, values * (r + 1)))
    got_indices, got_values = wire.unpack(gathered, world, n, universe)
    want_indices, want_values = _expected(wire, sent)
    assert torch.equal(got_indices, want_indices) and torch.equal(got_values, want_values)


def _random_pairs(
    gen: torch.Generator, n: int, universe: int, distinct: bool, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if distinct:
        return torch.randperm(universe, generator=gen)[:n], torch.randn(n, generator=gen)
    return torch.randint(0, universe, (n,), generator=gen), torch.randn(n, generator=gen)


def test_elias_fano_round_trips_many_random_sequences() -> None:
    gen = torch.Generator().manual_seed(0)
    for case in range(300):
        universe = int(torch.randint(1, 1 << (1 + case % 20), (1,), generator=gen))
        distinct = case % 2 == 1  # as the exact top-k sends; else repeats, as no-op padding sends
        most = min(universe, 2000) if distinct or case % 5 else 3 * universe + 1
        n = int(torch.randint(1, most + 1, (1,), generator=gen))
        world = 1 + case % 3
        wire = EliasFanoIndices(DTYPES[case % 3])
        draw = functools.partial(_random_pairs, gen, n, universe, distinct)
        sent, gathered = _send(wire, world, n, universe, draw)
        got_indices, got_values = wire.unpack(gathered, world, n, universe)
        want_indices, want_values = _expected(wire, sent)
        assert torch.equal(got_indices, want_indices), (case, n, universe)
        assert torch.equal(got_values.float(), want_values), (case, n, universe)


@pytest.mark.parametrize(
    ("n", "universe"), [(1, 1), (1, 2), (5, 5), (9, 4), (3, 100), (25_533, 25_557_032), (1000, 1_000_000), (7, 1 << 30)]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_payload_size_is_the_formula_and_holds_exactly_the_code(n: int, universe: int, dtype: torch.dtype) -> None:
    wire = EliasFanoIndices(dtype)
    width = max(0, math.floor(math.log2(universe / n)))
    assert low_bits(n, universe) == width
    code_bits = n * width + n + (universe >> width) + 1
    assert elias_fano_bits(n, universe) == code_bits
    value_bytes = n * dtype.itemsize
    size = wire.payload_bytes(n, universe)
    assert size == 4 * math.ceil((value_bytes + math.ceil(code_bits / 8)) / 4)
    assert Int32Indices(dtype).payload_bytes(n, universe) == 4 * math.ceil(n * (4 + dtype.itemsize) / 4)
    if n <= universe:  # at most 2 + log2(u / n) bits per index, plus one
        assert code_bits <= n * (2 + math.log2(universe / n)) + 1

    # the code fills exactly its bits: the last set bit is the high part's last, the rest is zero
    gen = torch.Generator().manual_seed(n)
    indices = torch.randint(0, universe, (n,), generator=gen)
    indices[0] = universe - 1  # forces the last possible position of the last set bit
    payload = torch.full((size,), 0xFF, dtype=torch.uint8)
    wire.pack(payload, indices, torch.randn(n, generator=gen), universe)
    code = payload[value_bytes:]
    bits = ((code.long().unsqueeze(1) >> torch.arange(8)) & 1).reshape(-1)
    assert int(bits.nonzero().max()) == n * width + ((universe - 1) >> width) + n - 1 < code_bits
    assert int(bits[n * width :].sum()) == n  # one set bit per element in the high part


def test_elias_fano_bytes_are_the_same_through_the_triton_bit_packer() -> None:
    """On CUDA the bit packing runs as Triton kernels; here in Triton's CPU interpreter."""
    pytest.importorskip("triton")
    from lightning_gc import kernels

    wire, world, n, universe = EliasFanoIndices(torch.float16), 2, 300, 1_000_003
    gen = torch.Generator().manual_seed(5)
    draws = [(torch.randint(0, universe, (n,), generator=gen), torch.randn(n, generator=gen)) for _ in range(world)]
    results = {}
    for backend in ("torch", "triton"):
        with kernels.use_backend(backend):
            sent, gathered = _send(wire, world, n, universe, lambda r: draws[r])
            results[backend] = (gathered, *wire.unpack(gathered, world, n, universe))
    for a, b in zip(results["torch"], results["triton"]):
        assert torch.equal(a, b)
    assert torch.equal(results["torch"][1], _expected(wire, sent)[0])


def test_pack_returns_the_decoded_values_in_the_callers_order() -> None:
    wire = EliasFanoIndices(torch.float16)
    indices = torch.tensor([40, 3, 17, 3])
    values = torch.tensor([1.0001, -2.0002, 3.0003, 0.0])
    payload = torch.empty(wire.payload_bytes(4, 50), dtype=torch.uint8)
    decoded = wire.pack(payload, indices, values, 50)
    assert torch.equal(decoded, values.half().float())
    same = EliasFanoIndices(torch.float32)
    assert same.pack(torch.empty(same.payload_bytes(4, 50), dtype=torch.uint8), indices, values, 50) is values


def test_triton_no_op_pairs_lie_inside_the_bucket() -> None:
    """The Triton selection pads with (segment-local index 0, value 0): the bucket index is the
    segment's start, inside ``[0, bucket numel)``; such repeats round-trip as no-ops."""
    source = (Path(__file__).parents[1] / "lightning_gc" / "kernels" / "selection_triton.py").read_text()
    assert "cand_index = torch.zeros(capacity" in source  # unfilled candidates are index 0
    layout = _layout([(30, 40), (20,), (50, 20)])
    wire = EliasFanoIndices(torch.float32)
    start = layout.segments[2].start
    indices = torch.tensor([start + 7, start, start, start + 999])
    values = torch.tensor([1.5, 0.0, 0.0, -2.5])
    sent, gathered = _send(wire, 1, 4, layout.numel, lambda r: (indices, values))
    out = torch.zeros(layout.numel)
    got_indices, got_values = wire.unpack(gathered, 1, 4, layout.numel)
    out.index_add_(0, got_indices, got_values)
    want = torch.zeros(layout.numel)
    want[start + 7], want[start + 999] = 1.5, -2.5
    assert torch.equal(out, want)


# ------------------------------------------------------------------ the compressors
def _layout(shapes: list[tuple[int, ...]]) -> BucketLayout:
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    names = {id(p): (f"p{i}", i) for i, p in enumerate(params)}
    return BucketLayout.build(0, params, names, sum(p.numel() for p in params))


def _exchange(compressors: list, velocities: list[torch.Tensor], layout: BucketLayout, step: int = 0) -> list:
    """One bucket exchanged by ``len(compressors)`` simulated ranks: collectives done by hand.
    Returns per rank (decoded output, Encoded)."""
    world = len(compressors)
    outs = [torch.empty_like(v) for v in velocities]
    encoded = [c.encode(v, o, EncodeContext(layout, step=step, world_size=world, rank=r))
               for r, (c, v, o) in enumerate(zip(compressors, velocities, outs))]  # fmt: skip
    for e in encoded:
        e.payload.gathered_out.copy_(torch.cat([f.payload.gathered for f in encoded]))
    if encoded[0].payload.summed is not None:
        total = sum(f.payload.summed for f in encoded[1:]) + encoded[0].payload.summed  # in the summed buffers' dtype
        sent = [None if f.sent.dense_values is None else f.sent.dense_values.clone() for f in encoded]
        for e, s in zip(encoded, sent):
            e.payload.summed.copy_(total)
            e.sent = replace(e.sent, dense_values=s)  # memory is told before the collective overwrites the send buffer
    for c, e, o in zip(compressors, encoded, outs):
        c.decode(e, o, world_size=world)
    return list(zip(outs, encoded))


SHAPES = [(64, 50), (50,), (30, 40), (7,), (3, 3)]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("value_dtype", ["float32", "float16"])
@pytest.mark.parametrize("cls", [DGCCompressor, TopKCompressor])
def test_elias_fano_decodes_exactly_what_int32_decodes(cls: type, value_dtype: str, world: int) -> None:
    layout = _layout(SHAPES)
    gen = torch.Generator().manual_seed(world)
    velocities = [torch.randn(layout.numel, generator=gen) for _ in range(world)]
    results = {}
    for encoding in ("int32", "elias_fano"):
        compressors = [cls(0.05, value_dtype=value_dtype, index_encoding=encoding) for _ in range(world)]
        results[encoding] = _exchange(compressors, [v.clone() for v in velocities], layout, step=3)
        assert [e.payload.bytes_sent for _, e in results[encoding]] == [compressors[0].wire_bytes(layout, 4)] * world
    for (out_a, enc_a), (out_b, enc_b) in zip(results["int32"], results["elias_fano"]):
        assert torch.equal(out_a, out_b)
        assert torch.equal(enc_a.sent.indices, enc_b.sent.indices)  # memory commits the same pairs
        assert torch.equal(enc_a.sent.values, enc_b.sent.values)
    assert results["elias_fano"][0][1].payload.bytes_sent < results["int32"][0][1].payload.bytes_sent


@pytest.mark.parametrize("encoding", sorted(INDEX_ENCODINGS))
def test_one_pair_per_rank_decodes_the_same_through_the_triton_kernels(encoding: str) -> None:
    """With one pair per rank every field of the gathered rows is a strided column; the Triton
    decode reads its inputs as flat arrays, so they must reach it contiguous."""
    pytest.importorskip("triton")
    from lightning_gc import kernels

    layout, world = _layout([(64, 64)]), 3  # k = ceil(1e-4 * 4096) = 1
    velocities = [torch.zeros(layout.numel) for _ in range(world)]
    for rank, velocity in enumerate(velocities):
        velocity[100 + rank] = 1.0 + rank
    outs = {}
    for backend in ("torch", "triton"):
        with kernels.use_backend(backend):
            compressors = [DGCCompressor(1e-4, index_encoding=encoding) for _ in range(world)]
            outs[backend] = _exchange(compressors, [v.clone() for v in velocities], layout)[0][0]
    want = torch.zeros(layout.numel)
    want[100:103] = torch.tensor([1.0, 2.0, 3.0]) / world
    assert torch.equal(outs["torch"], want)
    assert torch.equal(outs["triton"], want)


def test_triton_kernels_refuse_strided_tensors() -> None:
    pytest.importorskip("triton")
    from lightning_gc.kernels import packing_triton

    with pytest.raises(ValueError, match="not contiguous"):
        packing_triton.pack_signs(torch.randn(64)[::2])


@pytest.mark.parametrize("dense_dtype", ["float16", "bfloat16"])
def test_narrow_dense_tensors_keep_their_rounding_error_in_memory(dense_dtype: str) -> None:
    """Dense tensors of a partly compressed bucket go out in ``dense_dtype``: the all-reduce sums
    the rounded values, bytes count 2 per element, and memory keeps ``v - rounded(v)`` there
    (instead of 0) while the sparse part commits as before."""
    layout = _layout(SHAPES)
    dense = [s for s in layout.segments if len(s.shape) == 1 or s.numel < 1024]
    world = 2
    wire_dtype = getattr(torch, dense_dtype)
    memories, states, velocities = [], [], []
    gen = torch.Generator().manual_seed(0)
    for _ in range(world):
        memory = CompensationMemory(momentum_correction=True, momentum_masking=True, clip_norm=None)
        memory.set_specs({s.name: MomentumSpec(0.9) for s in layout.segments})
        state = memory.bucket(layout, torch.empty(layout.numel))
        g = torch.randn(layout.numel, generator=gen)
        velocities.append(memory.compensate(state, g, [], world_size=world).clone())
        memories.append(memory)
        states.append(state)
    compressors = [DGCCompressor(0.05, **{**NARROW, "dense_dtype": dense_dtype}) for _ in range(world)]
    exchanged = _exchange(compressors, [state.velocity for state in states], layout)
    dense_numel = sum(s.numel for s in dense)
    summed = exchanged[0][1].payload.summed
    assert compressors[0].wire_bytes(layout, 4) == exchanged[0][1].payload.bytes_sent
    assert summed.dtype == wire_dtype and summed.numel() == dense_numel

    rounded = [v.to(wire_dtype) for v in velocities]
    for rank, ((out, encoded), memory, state) in enumerate(zip(exchanged, memories, states)):
        momentum_before = state.momentum.clone()
        memory.commit(state, encoded.sent)
        for segment in dense:
            v = segment.of(velocities[rank])
            residual = v - segment.of(rounded[rank]).float()
            assert torch.equal(segment.of(state.velocity), residual)  # the rounding error stays
            assert residual.abs().max() > 0
            assert torch.equal(segment.of(state.momentum), segment.of(momentum_before))  # dense: momentum kept
            want = (segment.of(rounded[0]) + segment.of(rounded[1])).float() / world  # summed in the wire dtype
            assert torch.equal(segment.of(out), want)
        sent = torch.zeros(layout.numel).index_add_(0, encoded.sent.indices, encoded.sent.values)
        chosen = encoded.sent.indices
        assert torch.equal(state.velocity[chosen], velocities[rank][chosen] - sent[chosen])
        assert (state.momentum[chosen] == 0).all()  # masking as before


def test_default_dense_dtype_is_unchanged_and_wide_dense_parts_send_exactly() -> None:
    layout = _layout(SHAPES)
    velocity = torch.randn(layout.numel)
    ((_, encoded),) = _exchange([DGCCompressor(0.05)], [velocity.clone()], layout)
    assert encoded.sent.dense_values is None and encoded.payload.summed.dtype == torch.float32
    ((_, encoded),) = _exchange([DGCCompressor(0.05, dense_dtype="float32")], [velocity.clone()], layout)
    assert encoded.sent.dense_values is None


def test_options_reach_config_and_accept_torch_dtypes() -> None:
    compressor = DGCCompressor(0.01, index_encoding="elias_fano", value_dtype="float16", dense_dtype=torch.bfloat16)
    config = compressor.config()
    wire = [config[k] for k in ("index_encoding", "value_dtype", "dense_dtype")]
    assert wire == ["elias_fano", "float16", "bfloat16"]
    assert create("topk").config()["index_encoding"] == "int32" and create("topk").config()["dense_dtype"] is None
    rebuilt = create(config.pop("name"), **config)
    assert rebuilt.config() == compressor.config()


# ------------------------------------------------------------------ ResNet-50 on the wire
@pytest.fixture(scope="module")
def resnet50_layout() -> BucketLayout:
    torchvision = pytest.importorskip("torchvision")
    from lightning_gc.perfmodel.calibration import layout_of_shapes, module_shapes

    with torch.device("meta"):
        model = torchvision.models.resnet50()
    return layout_of_shapes(module_shapes(model))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_resnet50_gradient_at_0_1_percent_fits_in_0_2_megabytes(resnet50_layout: BucketLayout, dtype: str) -> None:
    layout = resnet50_layout
    compressor = DGCCompressor(0.001, index_encoding="elias_fano", value_dtype=dtype, dense_dtype=dtype)
    compressed, dense, total_k = compressor._split(layout)
    assert layout.numel == 25_557_032 and len(compressed) == 54 and total_k == 25_533
    assert sum(s.numel for s, _, _ in compressed) == 25_502_912 and sum(s.numel for s in dense) == 54_120
    assert DGCCompressor(0.001).wire_bytes(layout, 4) == 420_744  # int32 + fp32, dense fp32: before
    assert compressor.wire_bytes(layout, 4) == 197_464 <= 200_000
    # and what was measured is what is sent: one (simulated) step on the real layout's sizes
    velocity = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    ((_, encoded),) = _exchange([compressor], [velocity], layout)
    assert encoded.payload.bytes_sent == 197_464


# ------------------------------------------------------------------ real training, 2 gloo processes
def test_elias_fano_trains_bit_identically_and_fp16_dense_keeps_its_residual(run_ranks) -> None:
    base = {"kind": "dgc", "compress_ratio": 0.01}
    model = {"hidden": [128, 128], "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
    fits = [
        {"strategy": {**base, "index_encoding": "int32"}, "model": model, "epochs": 2, "seed": 7},
        {"strategy": {**base, "index_encoding": "elias_fano"}, "model": model, "epochs": 2, "seed": 7},
        {"strategy": {**base, **NARROW}, "model": model, "epochs": 2, "seed": 7},
    ]
    rank0, rank1 = run_ranks({"fits": fits})
    int32, elias_fano, narrow = rank0
    assert int32["global_step"] >= 20
    assert torch.equal(int32["params"], elias_fano["params"])  # bit-identical training
    assert elias_fano["totals"]["bytes_sent"] < int32["totals"]["bytes_sent"]
    assert narrow["totals"]["bytes_sent"] < elias_fano["totals"]["bytes_sent"]
    for rank in (rank0, rank1):
        assert torch.equal(rank[2]["params"], narrow["params"])  # ranks agree
    losses = [m["train/loss_epoch"] for m in narrow["epoch_metrics"]]
    assert losses[-1] < 0.8 * losses[0], losses
    # biases go dense: exactly sent in fp32 (velocity 0), in fp16 their rounding error stays
    bias = "net.0.bias"
    assert torch.count_nonzero(int32["memory"][bias]["velocity"]) == 0
    residual = narrow["memory"][bias]["velocity"]
    assert 0 < residual.abs().max() < 1e-2 * narrow["memory"][bias]["momentum"].abs().max()


def test_the_resnet50_recipe_uses_the_narrow_wire(resnet50_layout: BucketLayout) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(str(Path(__file__).parents[1] / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["+recipe=resnet50_dgc"])
    compressor = instantiate(cfg.strategy).compressor
    assert compressor.config()["index_encoding"] == "elias_fano"
    assert compressor.wire_bytes(resnet50_layout, 4) <= 200_000


# ------------------------------------------------------------------ saturation of narrow wires
def test_saturating_copy_clamps_to_what_a_sum_of_summands_can_hold() -> None:
    from lightning_gc.compressors.numerics import saturating_copy_

    values = torch.tensor([1e6, -1e6, 1.5, 40_000.0, float("nan")])
    wire = saturating_copy_(torch.empty(5, dtype=torch.float16), values, summands=2)
    assert wire[:4].tolist() == [32752.0, -32752.0, 1.5, 32752.0] and wire[4].isnan()
    assert (wire[:4].float() * 2).isfinite().all()  # the all-reduce of two ranks cannot overflow
    huge = torch.tensor([3e38, -3e38])
    assert torch.equal(saturating_copy_(torch.empty(2), huge, summands=2), huge)  # same dtype: a plain copy


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_saturated_values_summed_over_any_world_size_stay_finite(dtype: torch.dtype) -> None:
    """max / N rounded to nearest can lie above max / N (fp16, N = 3: 21840, and 3 * 21840 = inf);
    the limit is rounded down, so N saturated values summed one by one in the wire dtype stay finite."""
    from lightning_gc.compressors.numerics import saturating_copy_, saturation_limit

    huge = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max])
    for world in range(1, 65):
        wire = saturating_copy_(torch.empty(2, dtype=dtype), huge, summands=world)
        total = torch.zeros(2, dtype=dtype)
        for _ in range(world):
            total = total + wire
        assert total.isfinite().all(), (world, wire)
        assert wire[0].item() == saturation_limit(dtype, world) == -wire[1].item()
        # not needlessly low: within the rounding the N partial sums can accumulate
        assert saturation_limit(dtype, world) >= (1 - world * torch.finfo(dtype).eps) * torch.finfo(dtype).max / world


def test_a_dense_part_wider_than_the_gradient_divides_before_narrowing() -> None:
    """fp16 gradients, dense parts on an fp32 wire: two ranks at 40000 sum to 80000, which fp16
    cannot hold; the mean (40000) can, so the division happens in the wire dtype first."""
    layout = _layout([(8, 8), (4,)])
    compressors = [DGCCompressor(0.1, min_compress_numel=1, dense_dtype="float32") for _ in range(2)]
    velocities = [torch.full((layout.numel,), 40_000.0, dtype=torch.float16) for _ in range(2)]
    for out, _ in _exchange(compressors, velocities, layout):
        assert torch.equal(out[64:], torch.full((4,), 40_000.0, dtype=torch.float16))


@pytest.mark.parametrize("encoding", ["int32", "elias_fano"])
def test_values_beyond_fp16_range_saturate_and_the_excess_stays_in_memory(encoding: str) -> None:
    """A velocity of 1e6 (fp16 holds at most 65504) goes out as 65504 on a float16 wire; memory
    keeps the rest, so it leaves over the next steps instead of reaching the model as inf. The
    dense part (float16, 2 ranks) saturates at 65504 / 2, so the all-reduce stays finite."""
    layout = _layout(SHAPES)
    world = 2
    memories, states = [], []
    for _ in range(world):
        memory = CompensationMemory(momentum_correction=False, momentum_masking=False, clip_norm=None)
        state = memory.bucket(layout, torch.empty(layout.numel))
        grad = torch.zeros(layout.numel)
        big = layout.segments[0].start + 17
        dense_position = layout.segments[1].start + 3
        grad[big], grad[dense_position] = 1e6, -1e6
        memory.compensate(state, grad, [], world_size=world)
        memories.append(memory)
        states.append(state)
    compressors = [
        DGCCompressor(0.05, value_dtype="float16", dense_dtype="float16", index_encoding=encoding) for _ in range(world)
    ]
    delivered = torch.zeros(layout.numel)
    for step in range(40):  # the dense -1e6 leaves in 31 steps of 65504 / 2
        exchanged = _exchange(compressors, [state.velocity for state in states], layout, step=step)
        for (out, encoded), memory, state in zip(exchanged, memories, states):
            assert out.isfinite().all()
            memory.commit(state, encoded.sent)
        delivered += exchanged[0][0]
    assert delivered[big] == pytest.approx(1e6) and delivered[dense_position] == pytest.approx(-1e6)
    assert all(state.velocity.abs().max() < 1 for state in states)  # nothing left behind, nothing lost


@pytest.mark.parametrize("wire", [torch.float32, torch.float16])
@pytest.mark.parametrize("values_dtype", [torch.float32, torch.bfloat16])
def test_a_dense_block_moves_large_tensors_by_copy_and_small_ones_by_one_gather(
    wire: torch.dtype, values_dtype: torch.dtype
) -> None:
    """Large tensors first, then the small ones, each group in segment order; what receivers add
    is what the decoded values say (exact in float32, saturated and rounded in fp16)."""
    sizes = [3, GATHER_BELOW, 7, GATHER_BELOW + 5, 1]
    segments, start = [], 0
    for order, numel in enumerate(sizes):
        segments.append(Segment(name=f"p{order}", order=order, start=start, shape=(numel,)))
        start += numel
    numel = start
    block = DenseBlock(tuple(segments[1:]), start=8, dtype=wire)  # the first tensor is not in it
    assert [s.name for s in block.copied] == ["p1", "p3"] and [s.name for s in block.gathered] == ["p2", "p4"]
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(values_dtype)
    values[start - 1] = 1e6  # beyond fp16: saturates to its largest finite value
    payload = torch.zeros(8 + block.nbytes, dtype=torch.uint8)
    decoded = torch.zeros(numel, dtype=values_dtype)
    block.encode(values, payload, decoded)
    in_block = [s.of(values) for s in (*block.copied, *block.gathered)]
    expected_wire = torch.cat(in_block).float().clamp(-torch.finfo(wire).max, torch.finfo(wire).max).to(wire)
    assert torch.equal(block.values_in(payload), expected_wire)
    assert payload[:8].eq(0).all() and not decoded[: sizes[0]].any()  # nothing outside the block
    positions = torch.cat([torch.arange(s.start, s.stop) for s in (*block.copied, *block.gathered)])
    assert torch.equal(decoded[positions], expected_wire.to(values_dtype))  # what memory is told left
    if wire == torch.float32:
        assert torch.equal(decoded[sizes[0] :], values[sizes[0] :])  # float32 holds bf16 and float32 exactly
    total = torch.ones(numel)
    block.add_into(payload, total)
    expected_total = torch.ones(numel)
    expected_total[positions] += expected_wire.float()
    assert torch.equal(total, expected_total)


def test_int32_positions_past_a_bucket_of_two_to_the_31_are_refused_naming_the_way_out() -> None:
    """A bucket (or one tensor) of more than 2^31 elements: int32 positions would wrap to negative
    ones (an out-of-bounds write on a GPU); the plan refuses it, naming Elias--Fano, which codes
    any position."""
    wire = create("dgc", compress_ratio=0.001).wire
    assert wire.payload_bytes(10, 2**31) > 0  # positions up to 2^31 - 1 fit
    with pytest.raises(ValueError, match=r"2147483649 elements .* index_encoding='elias_fano'"):
        wire.payload_bytes(10, 2**31 + 1)
    create("dgc", compress_ratio=0.001, index_encoding="elias_fano").wire.payload_bytes(10, 2**31 + 1)
