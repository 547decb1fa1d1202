"""FFT sparsification and range-based floats: error bounds, exact packing, linear decoding."""

from __future__ import annotations

import pytest
import torch

from lightning_gc.common.layout import BucketLayout
from lightning_gc.compressors import FFTCompressor, rangefloat
from lightning_gc.compressors.base import EncodeContext


@pytest.mark.parametrize("bits", rangefloat.CODE_BITS)
@pytest.mark.parametrize("spread", [1.0, 1e3])
def test_range_based_floats_round_within_their_mantissa(bits: int, spread: float) -> None:
    generator = torch.Generator().manual_seed(bits)
    x = torch.randn(5000, generator=generator) * torch.exp(
        torch.rand(5000, generator=generator) * torch.log(torch.tensor(spread))
    )
    x[:3] = torch.tensor([0.0, -x.abs().max() * 0.999999, 1e-30])
    head = rangefloat.header(x, bits)
    emax, width = head.tolist()
    assert emax == int(torch.floor(torch.log2(x.abs().max())))
    assert 1 <= width <= bits - 2
    codes = rangefloat.encode(x, head, bits)
    assert 0 <= int(codes.min()) and int(codes.max()) < 2**bits
    y = rangefloat.decode(codes, head, bits)
    normal = x.abs() >= 2.0 ** (emax - 2**width + 2)  # the smallest normal magnitude
    bound = 2.0 ** -(bits - 1 - width + 1)  # half a mantissa step, relative
    assert ((y[normal] - x[normal]).abs() <= bound * x[normal].abs() * (1 + 1e-6)).all()
    assert (torch.sign(y[normal]) == torch.sign(x[normal])).all()
    smallest = 2.0 ** (emax - 2**width + 2)
    assert ((y[~normal] == 0) | (y[~normal].abs() == smallest)).all() and y[0] == 0  # flushed, or rounded up
    packed = rangefloat.pack(codes, bits)
    assert packed.numel() == rangefloat.packed_size(codes.numel(), bits)
    assert torch.equal(rangefloat.unpack(packed, bits, codes.numel()), codes)


def test_exponent_width_follows_the_range() -> None:
    narrow = torch.tensor([1.0, 1.5, 1.9])  # one octave: E = ceil(log2(0 + 2)) = 1
    wide = torch.tensor([1.0, 2.0**-20])  # 20 octaves: E = ceil(log2(22)) = 5
    assert rangefloat.header(narrow, 8).tolist() == [0, 1]
    assert rangefloat.header(wide, 8).tolist() == [0, 5]
    assert rangefloat.header(wide, 4).tolist() == [0, 2]  # clamped: one mantissa bit stays


def _layout(*shapes: tuple[int, ...]) -> BucketLayout:
    params = [torch.empty(shape) for shape in shapes]
    names = {id(p): (f"p{i}", i) for i, p in enumerate(params)}
    return BucketLayout.build(0, params, names, sum(p.numel() for p in params))


def _encode(compressor: FFTCompressor, layout: BucketLayout, velocity: torch.Tensor, world_size: int = 1):
    return compressor.encode(velocity, torch.empty_like(velocity), EncodeContext(layout, step=0, world_size=world_size))


def test_all_coefficients_at_16_bits_reproduce_the_tensor() -> None:
    layout = _layout((32, 50), (50,))
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    compressor = FFTCompressor(1.0, bits=16)
    encoded = _encode(compressor, layout, x)
    encoded.payload.gathered_out.copy_(encoded.payload.gathered)
    out = torch.empty_like(x)
    compressor.decode(encoded, out, world_size=1)
    torch.testing.assert_close(out, x, rtol=0, atol=2e-3 * x.abs().max().item())
    assert torch.equal(out[1600:], x[1600:])  # the bias went dense, exactly


def test_a_smooth_tensor_survives_heavy_sparsification() -> None:
    layout = _layout((100, 100))
    t = torch.linspace(0, 6.28, layout.numel)
    x = torch.sin(3 * t) + 0.5 * torch.cos(40 * t)
    compressor = FFTCompressor(0.001, bits=8)  # 5 coefficients of 5001
    encoded = _encode(compressor, layout, x)
    assert 4 * layout.numel / encoded.payload.bytes_sent > 200
    local = encoded.sent.dense_values
    assert (local - x).norm() < 0.1 * x.norm()


def test_decoding_sums_the_ranks_spectra() -> None:
    """Two ranks' payloads, gathered, decode to the mean of what each rank reconstructs alone."""
    layout = _layout((40, 60), (60,))
    compressor = FFTCompressor(0.05)
    generator = torch.Generator().manual_seed(1)
    xs = [torch.randn(layout.numel, generator=generator) for _ in range(2)]
    payloads, locals_, dense = [], [], []
    for x in xs:
        encoded = _encode(compressor, layout, x, world_size=2)
        payloads.append(encoded.payload.gathered.clone())
        locals_.append(encoded.sent.dense_values.clone())
        dense.append(encoded.payload.summed.clone())
    encoded.payload.gathered_out.copy_(torch.cat(payloads))
    encoded.payload.summed.copy_(dense[0] + dense[1])
    out = torch.empty_like(xs[0])
    compressor.decode(encoded, out, world_size=2)
    torch.testing.assert_close(out, (locals_[0] + locals_[1]) / 2, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[2400:], (xs[0][2400:] + xs[1][2400:]) / 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 5}, "`bits` must be one of [4, 8, 16], got 5"),
        ({"compress_ratio": 1.5}, "`compress_ratio` must be in (0, 1], got 1.5"),
        ({"min_compress_numel": 1}, "`min_compress_numel` must be an integer >= 2, got 1"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        FFTCompressor(**kwargs)
    assert message in str(error.value)
