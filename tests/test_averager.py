"""CompressedAverager: any flat tensor compressed and averaged over a process group, with error
feedback (lightning_gc.exchanges.averager)."""

from __future__ import annotations

import pytest
import torch
from conftest import launch_ranks

from lightning_gc.compressors.registry import create
from lightning_gc.exchanges.averager import CompressedAverager, flat_layout
from lightning_gc.exchanges.transport import LocalTransport

SHAPES = [("w", (48, 40)), ("b", (40,)), ("v", (3000,))]


def local(compressor: str, world_size: int = 3, **arguments) -> CompressedAverager:
    """An averager in a stand-in world where every rank sends what this one sends."""
    return CompressedAverager(compressor, SHAPES, via=LocalTransport(world_size), **arguments)


def series(n: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=generator) for _ in range(n)]


def test_layout_concatenates_named_tensors():
    layout = flat_layout(SHAPES)
    assert [(s.name, s.start, s.stop) for s in layout.segments] == [
        ("w", 0, 1920),
        ("b", 1920, 1960),
        ("v", 1960, 4960),
    ]
    with pytest.raises(ValueError, match="unique"):
        flat_layout([("w", (2,)), ("w", (3,))])


def test_identity_codec_averages_exactly():
    averager = local("none")
    for x in series(3, averager.numel):
        # N equal contributions: their mean (x * 3 / 3 rounds)
        torch.testing.assert_close(averager.average(x.clone()).wait(), x, rtol=1e-6, atol=0)
    assert torch.count_nonzero(averager.residual()) == 0


@pytest.mark.parametrize(
    "compressor, arguments",
    [
        ("topk", {"compress_ratio": 0.05}),
        ("dgc", {"compress_ratio": 0.02}),
        ("onebit", {}),
        ("randomk", {"compress_ratio": 0.1}),
    ],
)
def test_nothing_is_lost_with_error_feedback(compressor, arguments):
    """e + sum of what was sent == sum of the inputs, element by element."""
    averager = local(compressor, error_feedback=True, **arguments)
    xs = series(5, averager.numel)
    sent = sum(averager.average(x.clone()).wait().clone() for x in xs)
    torch.testing.assert_close(averager.residual() + sent, sum(xs), rtol=0, atol=1e-5)
    assert 0 < averager.bytes_sent < 5 * averager.numel * 4


def test_sparse_codec_sends_exactly_k_per_compressed_tensor():
    averager = local("topk", compress_ratio=0.05)
    y = averager.average(series(1, averager.numel)[0]).wait()
    w, v = y[:1920], y[1960:]
    assert torch.count_nonzero(w) == 96  # ceil(0.05 * numel) of the 2-D tensor
    assert torch.count_nonzero(y[1920:1960]) == 40 and torch.count_nonzero(v) == 3000  # 1-D: sent whole


def test_error_decay_fades_the_unsent_residual():
    beta = 0.5
    averager = local("topk", compress_ratio=0.05, error_decay=beta)
    x1, x2 = series(2, averager.numel)
    s1 = averager.average(x1.clone()).wait().clone()
    s2 = averager.average(x2.clone()).wait().clone()
    torch.testing.assert_close(averager.residual(), beta * (x1 - s1) + x2 - s2, rtol=0, atol=1e-6)


def test_unbiased_codec_keeps_no_residual_by_default():
    averager = local("qsgd")
    averager.average(series(1, averager.numel)[0])
    assert torch.count_nonzero(averager.residual()) == 0


def test_resumes_bit_for_bit():
    xs = series(4, flat_layout(SHAPES).numel)
    straight = local("dgc", compress_ratio=0.02)
    expected = [straight.average(x.clone()).wait().clone() for x in xs]
    first = local("dgc", compress_ratio=0.02)
    for x in xs[:2]:
        first.average(x.clone())
    resumed = local("dgc", compress_ratio=0.02)
    resumed.load_state_dict(first.state_dict())
    for x, want in zip(xs[2:], expected[2:]):
        assert torch.equal(resumed.average(x.clone()).wait(), want)
    assert torch.equal(resumed.residual(), straight.residual())


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(ValueError, match="compressor.*'nope'"):
        CompressedAverager("nope", SHAPES)
    with pytest.raises(ValueError, match="`group` or `via`"):
        CompressedAverager("topk", SHAPES, group=object(), via=LocalTransport(2))
    with pytest.raises(ValueError, match="error_decay"):
        local("topk", error_decay=0.0)
    with pytest.raises(ValueError, match="go with a compressor name"):
        CompressedAverager(create("topk"), SHAPES, via=LocalTransport(2), compress_ratio=0.1)
    averager = local("topk")
    with pytest.raises(ValueError, match="flat tensor of 4960 elements"):
        averager.average(torch.zeros(10))
    other = local("topk", compress_ratio=0.5)
    with pytest.raises(ValueError, match="same codec settings"):
        other.load_state_dict(averager.state_dict())


CASES = [
    {"id": "none", "compressor": "none"},
    {"id": "topk", "compressor": "topk", "arguments": {"compress_ratio": 0.05}},
    {"id": "dgc_global", "compressor": "dgc", "arguments": {"compress_ratio": 0.05, "exchange": "global_topk"}},
    {"id": "onebit_two_phase", "compressor": "onebit", "arguments": {"exchange": "two_phase"}},
    {"id": "powersgd", "compressor": "powersgd", "arguments": {"rank": 2, "start_iter": 0}},
]


def test_ranks_agree_and_conserve_over_a_real_group(tmp_path):
    calls = 3
    ranks = launch_ranks("averager_worker.py", {"cases": CASES, "calls": calls}, tmp_path, world_size=2)
    for case in CASES:
        mine, theirs = ranks[0][case["id"]], ranks[1][case["id"]]
        for a, b in zip(mine["averages"], theirs["averages"]):
            assert torch.equal(a, b), case["id"]  # every rank decodes the same bits
        mean_inputs = sum(sum(r[case["id"]]["inputs"]) for r in ranks) / 2
        if case["id"] == "none":
            for t in range(calls):
                exact = (mine["inputs"][t] + theirs["inputs"][t]) / 2
                torch.testing.assert_close(mine["averages"][t], exact, rtol=0, atol=1e-6)
        elif case["id"] in ("topk", "dgc_global", "powersgd"):
            # sum of averages + mean residual == mean of all inputs (global top-k returns what
            # its merge dropped to the residuals; PowerSGD commits after decode)
            kept = (mine["residual"] + theirs["residual"]) / 2
            torch.testing.assert_close(sum(mine["averages"]) + kept, mean_inputs, rtol=0, atol=1e-4)
        assert mine["bytes_sent"] > 0
