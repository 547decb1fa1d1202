"""Stochastic codecs salt their rounding with each tensor's order: the outer loop's fragments
number their tensors from their first parameter's global index, so they draw independent noise."""

from __future__ import annotations

import pytest
import torch

from lightning_gc.exchanges.averager import CompressedAverager, flat_layout
from lightning_gc.exchanges.transport import LocalTransport
from lightning_gc.runtime.outer import OuterLoop, Streaming

SHAPES = [("w", (64, 64))]


def _local(first_order: int = 0, **arguments) -> CompressedAverager:
    return CompressedAverager("qsgd", SHAPES, via=LocalTransport(1), first_order=first_order, **arguments)


def test_the_first_order_numbers_the_segments_and_salts_the_rounding():
    assert [s.order for s in flat_layout([("a", (2,)), ("b", (3,))], first_order=5).segments] == [5, 6]
    x = torch.randn(64 * 64, generator=torch.Generator().manual_seed(0))
    default, zero, shifted = _local(), _local(0), _local(1)
    a, b, c = (averager.average(x.clone()).wait().clone() for averager in (default, zero, shifted))
    assert torch.equal(a, b)  # the default is order 0: single-fragment results are unchanged
    assert not torch.equal(a, c)
    with pytest.raises(ValueError, match="first_order"):
        _local(-1)


def test_two_fragments_with_equal_pseudo_gradients_draw_different_rounding(world_of_one):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    outer = OuterLoop(model, sync_every=2, streaming=Streaming(fragments=2), compressor="qsgd")
    assert [f.averager.layout.segments[0].order for f in outer.fragments] == [0, 1]
    piece = torch.randn(64 * 64, generator=torch.Generator().manual_seed(1))
    first, second = (f.averager.average(piece.clone()).wait().clone() for f in outer.fragments)
    assert not torch.equal(first, second)
    for decoded in (first, second):  # both still QSGD of the piece: within a level step of 7 (chunk norm / 7)
        assert (decoded - piece).abs().max() <= piece.norm() / 7
