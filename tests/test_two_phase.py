"""The two-phase exchange (compressed all-reduce): its rule against a hand-written reference, its
bytes, its refusals, and training on real gloo process groups (tests/workers/two_phase_worker.py)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import layout_of
from torch.nn.parallel import DistributedDataParallel

import lightning_gc
from lightning_gc import GradientCompressionStrategy
from lightning_gc.common.layout import BucketLayout, Segment, chunk_segments, packed_layout
from lightning_gc.compressors import registry
from lightning_gc.compressors.base import EncodeContext, compressible
from lightning_gc.compressors.chunks import EXCHANGES, two_phase_compressors
from lightning_gc.compressors.encoded import Encoded, Payload
from lightning_gc.exchanges.transport import LocalTransport, traffic_bytes
from lightning_gc.exchanges.two_phase import TwoPhaseExchange
from lightning_gc.perfmodel.calibration import time_codec
from lightning_gc.runtime.checkpoint import IncompatibleCheckpoint

SHAPES = [(30, 20), (50,), (7, 9), (100,), (16, 16)]
ALL_2D = {"min_compress_numel": 1}  # quantise every tensor of SHAPES with more than one dimension
ACCEPTED = ["bf16", "fft", "fp16", "int8", "none", "onebit", "qsgd", "signsgd", "terngrad"]


def make_layout(shapes: list[tuple[int, ...]] = SHAPES) -> BucketLayout:
    return layout_of(shapes)


def two_phase(*arguments, **settings) -> TwoPhaseExchange:
    """A rank's two-phase exchange of the compressor ``registry.create(*arguments, **settings)``
    (its rounds are run by hand here: the transport is not used)."""
    return TwoPhaseExchange(LocalTransport(2), registry.create(*arguments, **settings))


def simulate(compressors: list, velocities: list[torch.Tensor], layout: BucketLayout, step: int) -> tuple:
    """One two-phase exchange among ``len(compressors)`` ranks in this process: each rank's
    encode, the all-to-all and all-gather done by hand, each rank's decode. Returns every rank's
    decoded average and what each rank's memory is told it sent. ``compressors``: each rank's
    :class:`TwoPhaseExchange` (its server errors kept from call to call), or codecs, each run by a
    new one."""
    n = len(compressors)
    compressors = [
        c if isinstance(c, TwoPhaseExchange) else TwoPhaseExchange(LocalTransport(n, r), c)
        for r, c in enumerate(compressors)
    ]
    first = [
        c.encode(v, torch.empty_like(v), EncodeContext(layout, step, n, r))
        for r, (c, v) in enumerate(zip(compressors, velocities))
    ]
    for to in range(n):
        for frm in range(n):
            first[to].payload.scattered_out.view(n, -1)[frm] = first[frm].payload.scattered.view(n, -1)[to]
    second: list[Encoded] = [e.next_round() for e in first]
    assert all(e.next_round is None for e in second)
    for to in range(n):
        for frm in range(n):
            second[to].payload.gathered_out.view(n, -1)[frm] = second[frm].payload.gathered
    outs = []
    for compressor, encoded, v in zip(compressors, second, velocities):
        out = torch.empty_like(v)
        compressor.decode(encoded, out, world_size=n)
        outs.append(out)
    return outs, [e.sent.dense_values for e in second], first, second


def onebit_by_piece(x: torch.Tensor, pieces: list[tuple[int, int]]) -> torch.Tensor:
    """1-bit SGD written out: in each of ``pieces``, negatives become the mean of the negatives and
    the rest the mean of the non-negatives; elements in no piece (dense tensors) stay exact."""
    out = x.clone()
    for a, b in pieces:
        run = x[a:b]
        negative = run < 0
        low = run[negative].mean() if negative.any() else run.new_zeros(())
        high = run[~negative].mean() if (~negative).any() else run.new_zeros(())
        out[a:b] = torch.where(negative, low, high)
    return out


def own_chunk_exact(encoded: torch.Tensor, values: torch.Tensor, own: list[tuple[int, int]]) -> torch.Tensor:
    """What a rank contributes: ``encoded`` everywhere but on the chunk it owns, which never leaves
    it and enters the mean as ``values``."""
    out = encoded.clone()
    for a, b in own:
        out[a:b] = values[a:b]
    return out


def pieces_of(
    layout: BucketLayout, chunk: int, chunks: int, segments: list[Segment] | None = None
) -> list[tuple[int, int]]:
    """Bucket positions of chunk ``chunk``: the ``chunk``-th of ``chunks`` pieces of
    ``ceil(numel / chunks)`` elements of every tensor (of ``segments``, default all)."""
    pieces = []
    for s in layout.segments if segments is None else segments:
        size = -(-s.numel // chunks)
        a, b = s.start + min(chunk * size, s.numel), s.start + min((chunk + 1) * size, s.numel)
        if a < b:
            pieces.append((a, b))
    return pieces


@pytest.mark.parametrize(("world_size", "server_feedback"), [(2, True), (3, True), (4, True), (3, False)])
def test_onebit_two_phase_follows_the_rule_with_worker_and_server_error_feedback(
    world_size: int, server_feedback: bool
) -> None:
    """The two-phase rule written out on a bucket of quantised tensors ((30, 20), (16, 16)) and dense
    ones (1-D, and (7, 9) under ``min_compress_numel=64``), which travel and are averaged exactly."""
    layout = make_layout()
    numel = layout.numel
    chunks = [pieces_of(layout, j, world_size) for j in range(world_size)]
    all_pieces = sorted(p for chunk in chunks for p in chunk)
    assert sum(b - a for a, b in all_pieces) == numel and all_pieces[0][0] == 0  # the chunks partition the bucket
    quantised = [s for s in layout.segments if compressible(s, 64)]
    assert [s.shape for s in quantised] == [(30, 20), (16, 16)]
    all_pieces = sorted(p for j in range(world_size) for p in pieces_of(layout, j, world_size, quantised))
    compressors = [
        two_phase("onebit", exchange="two_phase", server_feedback=server_feedback, min_compress_numel=64)
        for _ in range(world_size)
    ]
    residual = [torch.zeros(numel) for _ in range(world_size)]  # the memory's part, kept by the test
    worker_error = [torch.zeros(numel) for _ in range(world_size)]  # the reference's
    server_error = torch.zeros(numel)
    generator = torch.Generator().manual_seed(0)
    for step in range(5):
        grads = [torch.randn(numel, generator=generator) * (1 + r) for r in range(world_size)]
        velocities = [g + e for g, e in zip(grads, residual)]
        outs, sent, _, _ = simulate(compressors, [v.clone() for v in velocities], layout, step)
        residual = [v - s for v, s in zip(velocities, sent)]

        reference_v = [g + e for g, e in zip(grads, worker_error)]
        reference_sent = [
            own_chunk_exact(onebit_by_piece(v, all_pieces), v, chunks[r]) for r, v in enumerate(reference_v)
        ]
        worker_error = [v - s for v, s in zip(reference_v, reference_sent)]
        mean_plus_error = sum(reference_sent) / world_size + server_error
        expected = onebit_by_piece(mean_plus_error, all_pieces)
        if server_feedback:  # without it the next mean is re-encoded alone
            server_error = mean_plus_error - expected
        for out in outs:
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        for got, want in zip(sent, reference_sent):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if not server_feedback:
        assert all(c.state_dict() == {} for c in compressors)  # nothing to keep, nothing in a checkpoint
        return
    # each rank keeps the error of the chunk it owns, and only that: one piece of each tensor by name
    state = [c.state_dict()["server"] for c in compressors]
    rebuilt = torch.full((numel,), math.nan)
    for rank, chunk in enumerate(chunks):
        owned = [s for s in layout.segments if any(s.start <= a < s.stop for a, _ in chunk)]
        assert sorted(state[rank]) == sorted(s.name for s in owned)
        for s, (a, b) in zip(owned, chunk):
            assert state[rank][s.name]["server"].shape == (b - a,)
            rebuilt[a:b] = state[rank][s.name]["server"]
    torch.testing.assert_close(rebuilt, server_error, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["onebit", "qsgd"])
def test_the_result_does_not_depend_on_how_ddp_buckets_the_parameters(name: str) -> None:
    """One bucket of five tensors, or the same tensors in two buckets (DDP's rebuild, or a resume):
    the same chunks own the same elements and every rank decodes the same average."""
    world_size, whole = 3, make_layout()
    generator = torch.Generator().manual_seed(2)
    velocities = [torch.randn(whole.numel, generator=generator) for _ in range(world_size)]
    one = simulate(
        [registry.create(name, exchange="two_phase") for _ in range(world_size)],
        [v.clone() for v in velocities],
        whole,
        4,
    )[0][0]
    split = whole.segments[2].start
    first = BucketLayout(0, whole.segments[:2], (0, 1))
    second = BucketLayout(
        1, tuple(Segment(s.name, s.order, s.start - split, s.shape) for s in whole.segments[2:]), (2, 3, 4)
    )
    compressors = [registry.create(name, exchange="two_phase") for _ in range(world_size)]
    a = simulate(compressors, [v[:split].clone() for v in velocities], first, 4)[0][0]
    b = simulate(compressors, [v[split:].clone() for v in velocities], second, 4)[0][0]
    assert torch.equal(torch.cat([a, b]), one)


@pytest.mark.parametrize("name", ACCEPTED)
def test_every_accepted_compressor_agrees_on_every_rank_and_averages(name: str) -> None:
    layout, world_size = make_layout(), 4
    compressors = [registry.create(name, exchange="two_phase") for _ in range(world_size)]
    generator = torch.Generator().manual_seed(1)
    velocities = [torch.randn(layout.numel, generator=generator) for _ in range(world_size)]
    mean = sum(velocities) / world_size
    outs, sent, _, _ = simulate(compressors, [v.clone() for v in velocities], layout, step=3)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])  # every rank decodes the same bytes
    error = (outs[0] - mean).norm() / mean.norm()
    bound = {"none": 1e-6, "fp16": 1e-3, "bf16": 1e-2}.get(name, 3.0)
    assert error < bound, f"{name}: relative error {error:.3g}"
    if name == "none":
        assert all(torch.equal(s, v) for s, v in zip(sent, velocities))


def test_none_through_two_phase_is_the_exact_mean() -> None:
    layout = make_layout()
    compressors = [registry.create("none", exchange="two_phase") for _ in range(3)]
    velocities = [torch.randn(layout.numel, dtype=torch.float64) for _ in range(3)]
    outs, _, _, _ = simulate(compressors, [v.clone() for v in velocities], layout, step=0)
    # in float64's precision: the owner sums a float64 chunk in float64, not float32
    torch.testing.assert_close(outs[0], sum(velocities) / 3, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_the_owner_keeps_its_chunk_in_runs_of_the_chunk_size(dtype: torch.dtype) -> None:
    """What the owner computes on its chunk (sum, mean, re-encoded mean, server error) lives in
    runs of its chunk's size, 1/N of the bucket; a float32 or float64 chunk sums where its mean
    goes and decode sums into ``out``, so the only bucket-sized buffer is this rank's decoded
    contribution (which the memory needs whole). float16 sums in float32 buffers of its own. Phase 2's rows
    land in phase 1's received rows (read whole before it), never in the rows being sent."""
    layout, world_size = make_layout(), 3
    compressors = [
        registry.create("onebit", exchange="two_phase", server_feedback=True, min_compress_numel=64)
        for _ in range(world_size)
    ]
    velocities = [torch.randn(layout.numel, dtype=dtype) for _ in range(world_size)]
    outs, _, _, second = simulate(compressors, [v.clone() for v in velocities], layout, step=0)
    for rank, encoded in enumerate(second):
        plan = encoded.context
        chunk = sum(b - a for a, b in pieces_of(layout, rank, world_size))
        assert 0 < chunk < layout.numel / 2
        for run in (plan.owned_values, plan.owned_decoded, plan.owned_total, plan.server):
            assert run.shape == (chunk,)
        assert plan.own_decoded.shape == (layout.numel,)
        assert plan.gathered.data_ptr() == plan.received.data_ptr() != plan.scattered.data_ptr()
        in_place = dtype != torch.float16
        assert (plan.owned_total.data_ptr() == plan.owned_values.data_ptr()) is in_place
        assert plan.owned_total.dtype == (dtype if in_place else torch.float32)
        if in_place:
            assert plan.decode_total is None
        else:
            assert plan.decode_total.dtype == torch.float32 and plan.decode_total.shape == (layout.numel,)
    assert outs[0].dtype == dtype and all(torch.equal(outs[0], out) for out in outs)
    mean = sum(velocities) / world_size
    assert (outs[0] - mean).norm() / mean.norm() < 3.0


@pytest.mark.parametrize("name", ACCEPTED)
def test_a_chunk_encodes_alike_at_its_bucket_positions_and_packed(name: str) -> None:
    """The codec contract the owner's runs rest on: a chunk's payload depends on its pieces' names,
    orders and shapes, not on where they start, and decodes to the same values either way."""
    quantised_above = {} if name in ("bf16", "fp16", "none") else {"min_compress_numel": 64}  # (7, 9) dense
    layout, compressor = make_layout(), registry.create(name, exchange="two_phase", **quantised_above)
    values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(5))
    for chunk in range(3):
        pieces = chunk_segments(layout, chunk, 3)
        packed = packed_layout(layout, pieces)
        at_bucket, in_run = (
            compressor.chunk_format(pieces, torch.float32),
            compressor.chunk_format(packed.segments, torch.float32),
        )
        assert at_bucket.nbytes == in_run.nbytes
        run = torch.cat([piece.of(values) for piece in pieces])
        payloads = [torch.zeros(at_bucket.nbytes, dtype=torch.uint8) for _ in range(2)]
        decoded_bucket, decoded_run = torch.zeros(layout.numel), torch.zeros(packed.numel)
        compressor.encode_chunk(values, at_bucket, payloads[0], decoded_bucket, seed=11)
        compressor.encode_chunk(run, in_run, payloads[1], decoded_run, seed=11)
        assert torch.equal(payloads[0], payloads[1])
        assert torch.equal(torch.cat([piece.of(decoded_bucket) for piece in pieces]), decoded_run)
        total = torch.zeros(packed.numel)
        compressor.add_decoded_chunk(payloads[0], in_run, total, torch.float32)
        assert torch.equal(total, decoded_run)


@pytest.mark.parametrize("name", ["onebit", "qsgd"])
def test_two_phase_traffic_per_rank_is_flat_in_the_world_size(name: str) -> None:
    """Bytes on the wire per rank: two-phase within 5 % of 2 (N-1)/N M/c, gather (N-1) M/c."""
    layout = make_layout([(128, 256), (256,), (64, 128)])
    dense = layout.numel * 4
    gathered_payload = registry.create(name).wire_bytes(layout, 4)
    ratio = dense / gathered_payload
    traffic = {}
    for world_size in (2, 4, 8):
        compressors = [registry.create(name, exchange="two_phase") for _ in range(world_size)]
        velocities = [torch.randn(layout.numel) for _ in range(world_size)]
        _, _, first, second = simulate(compressors, velocities, layout, step=0)
        traffic[world_size] = traffic_bytes(first[0].payload, world_size) + traffic_bytes(second[0].payload, world_size)
        ideal = 2 * (world_size - 1) / world_size * dense / ratio
        assert abs(traffic[world_size] - ideal) <= 0.05 * ideal, (world_size, traffic[world_size], ideal)
        gather = traffic_bytes(
            Payload(gathered=torch.empty(gathered_payload, dtype=torch.uint8), bytes_sent=0, elements_sent=0),
            world_size,
        )
        if world_size > 2:
            assert traffic[world_size] < gather
    assert traffic[8] < 2 * dense / ratio * 1.05  # bounded by 2 M/c whatever N


def test_auto_uses_two_phase_from_three_ranks_and_gather_is_unchanged() -> None:
    layout = make_layout()
    velocity = torch.randn(layout.numel)
    auto = registry.create("qsgd", exchange="auto")
    gather = registry.create("qsgd")
    for world_size, two_phase in [(1, False), (2, False), (3, True), (8, True)]:
        assert auto.two_phase_at(world_size) is two_phase
        assert registry.create("qsgd", exchange="two_phase").two_phase_at(world_size) is (world_size > 1)
    # off unless asked, but for fft: its re-encoded mean keeps a few bins, the feedback the rest
    assert [name for name in ACCEPTED if registry.create(name, exchange="two_phase").server_feedback] == ["fft"]
    assert not registry.create("fft").server_feedback  # gathered: no chunk owner to keep it
    assert not registry.create("fft", exchange="two_phase", server_feedback=False).server_feedback
    assert registry.create("qsgd", exchange="auto", server_feedback=True).server_feedback
    a = auto.encode(velocity.clone(), torch.empty_like(velocity), EncodeContext(layout, 2, 2, 1))
    b = gather.encode(velocity.clone(), torch.empty_like(velocity), EncodeContext(layout, 2, 2, 1))
    assert a.payload.scattered is None and torch.equal(a.payload.gathered, b.payload.gathered)


def test_exchange_is_refused_for_compressors_that_cannot_and_bad_values_are_named() -> None:
    assert two_phase_compressors() == ACCEPTED
    for name in ("dgc", "topk", "randomk", "powersgd"):
        with pytest.raises(ValueError, match=r"exchange='two_phase'.*" + re.escape(str(ACCEPTED)[:-1])):
            GradientCompressionStrategy(name, exchange="two_phase")
    with pytest.raises(ValueError, match=r"exchange.*" + ".*".join(EXCHANGES) + ".*'twophase'"):
        GradientCompressionStrategy("onebit", exchange="twophase")
    with pytest.raises(ValueError, match="server_feedback"):
        registry.create("qsgd", exchange="two_phase", server_feedback="yes")
    with pytest.raises(ValueError, match=r"server_feedback=True needs exchange='two_phase' or 'auto'.*'gather'"):
        GradientCompressionStrategy("onebit", server_feedback=True)  # the gathered form has no chunk owners


def test_server_error_survives_a_state_round_trip_and_a_new_plan() -> None:
    layout, world_size = make_layout(), 2
    compressors = [
        two_phase("signsgd", exchange="two_phase", server_feedback=True, **ALL_2D) for _ in range(world_size)
    ]
    velocities = [torch.randn(layout.numel) for _ in range(world_size)]
    simulate(compressors, [v.clone() for v in velocities], layout, step=0)
    saved = [c.state_dict() for c in compressors]
    assert any(t["server"].abs().sum() > 0 for entry in saved[0]["server"].values() for t in [entry])
    assert all(state["exchange"] == "two_phase" for state in saved)
    # a run that would not add it back refuses it, on every rank: without the feedback, or with
    # another exchange (auto runs the gathered form on two ranks)
    for state in saved:
        for dropping in ({"exchange": "two_phase"}, {"exchange": "auto", "server_feedback": True}):
            with pytest.raises(IncompatibleCheckpoint, match=r"'signsgd'.*exchange='two_phase', server_feedback=True"):
                two_phase("signsgd", **dropping).load_state_dict(state)
    resumed = [two_phase("signsgd", exchange="two_phase", server_feedback=True, **ALL_2D) for _ in range(world_size)]
    for compressor, state in zip(resumed, saved):
        compressor.load_state_dict(state)
    rebuilt = make_layout()  # DDP's rebuild: a new layout object, the same names
    a, _, _, _ = simulate(compressors, [v.clone() for v in velocities], layout, step=1)
    b, _, _, _ = simulate(resumed, [v.clone() for v in velocities], rebuilt, step=1)
    assert torch.equal(a[0], b[0])
    with pytest.raises(ValueError, match="server"):
        resumed[0].load_state_dict({"residual": {}})
    # a rank keeps only its piece of each tensor: the form before (whole tensors, no form named) is
    # refused at load, on every rank, not misread; a piece of the wrong size is refused by name
    stale = two_phase("signsgd", exchange="two_phase", server_feedback=True, **ALL_2D)
    with pytest.raises(IncompatibleCheckpoint, match="as whole tensors"):
        stale.load_state_dict({"exchange": "two_phase", "server": {"p0": {"server": torch.zeros(600)}}})
    stale.load_state_dict(
        {"exchange": "two_phase", "server_form": "pieces", "server": {"p0": {"server": torch.ones(600)}}}
    )
    with pytest.raises(RuntimeError, match=r"'server' for 'p0' has 600 elements, this run keeps 300"):
        stale.encode(velocities[0], torch.empty_like(velocities[0]), EncodeContext(layout, 2, world_size, 0))
    # older checkpoints held zeros, whole, where the feedback was off: no one's correction, so a run
    # takes them as nothing; what it saves then (and its step guard's snapshot) loads back
    zeros = {"server": {"p0": {"server": torch.zeros(600)}}}
    for feedback in (False, True):
        kept = two_phase("signsgd", exchange="two_phase", server_feedback=feedback, **ALL_2D)
        kept.load_state_dict(zeros)
        kept.encode(velocities[0], torch.empty_like(velocities[0]), EncodeContext(layout, 2, world_size, 0))
        assert (kept.state_dict() == {}) is (not feedback)
        two_phase("signsgd", exchange="two_phase", server_feedback=feedback, **ALL_2D).load_state_dict(
            kept.state_dict()
        )
        kept.load_state_dict(kept.state_dict())


def test_two_phase_and_auto_resume_each_other_where_both_run_the_two_phase_form() -> None:
    """A server error saved by ``exchange="two_phase"`` at three ranks resumes under ``"auto"``
    (which runs the two-phase form there) and back; at two ranks ``"auto"`` gathers and refuses
    it. A checkpoint that does not say its world size resumes only with the same exchange."""
    layout = make_layout()

    def trained(exchange: str, world_size: int) -> list[dict]:
        ranks = [two_phase("signsgd", exchange=exchange, server_feedback=True, **ALL_2D) for _ in range(world_size)]
        simulate(ranks, [torch.randn(layout.numel) for _ in range(world_size)], layout, step=0)
        return [rank.state_dict() for rank in ranks]

    for saved_by, resumed_by in (("two_phase", "auto"), ("auto", "two_phase")):
        saved = trained(saved_by, 3)
        assert all(state["world_size"] == 3 for state in saved)
        for state in saved:
            resumed = two_phase("signsgd", exchange=resumed_by, server_feedback=True, **ALL_2D)
            resumed.load_state_dict(state)
            assert resumed.state_dict()["server"].keys() == state["server"].keys()
            for name, entry in state["server"].items():
                assert torch.equal(resumed.state_dict()["server"][name]["server"], entry["server"])
    for state in trained("two_phase", 2):
        with pytest.raises(IncompatibleCheckpoint, match=r"exchange='two_phase'.*this run has exchange='auto'"):
            two_phase("signsgd", exchange="auto", server_feedback=True).load_state_dict(state)
    unsized = {key: value for key, value in trained("two_phase", 3)[0].items() if key != "world_size"}
    with pytest.raises(IncompatibleCheckpoint, match=r"exchange='two_phase'.*this run has exchange='auto'"):
        two_phase("signsgd", exchange="auto", server_feedback=True).load_state_dict(unsized)


def test_a_snapshot_rolls_the_server_error_back_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step guard's snapshot of the server errors stays on their device (no ``state_dict``, whose
    copies go to the host) and a roll-back writes it back into the runs the plans hold: the step
    retried decodes what it decoded the first time, bit for bit."""
    layout, world_size = make_layout(), 3
    ranks = [two_phase("signsgd", exchange="two_phase", server_feedback=True, **ALL_2D) for _ in range(world_size)]
    velocities = [torch.randn(layout.numel) for _ in range(world_size)]
    simulate(ranks, [v.clone() for v in velocities], layout, step=0)
    for rank in ranks:
        monkeypatch.setattr(rank.rounds, "state_dict", lambda: pytest.fail("a snapshot must not copy to the host"))
    snapshots = [rank.snapshot() for rank in ranks]
    servers = [next(iter(rank.rounds._plans._plans.values()))[1].server for rank in ranks]
    held = [server.clone() for server in servers]
    first, _, _, _ = simulate(ranks, [v.clone() for v in velocities], layout, step=1)
    assert not all(torch.equal(server, kept) for server, kept in zip(servers, held))
    for rank, taken in zip(ranks, snapshots):
        rank.restore(taken)
    assert all(torch.equal(server, kept) for server, kept in zip(servers, held))  # the plans' own runs
    retried, _, _, _ = simulate(ranks, [v.clone() for v in velocities], layout, step=1)
    assert all(torch.equal(a, b) for a, b in zip(first, retried))
    for rank, taken in zip(ranks, snapshots):  # taken again into the same buffers
        again = rank.snapshot(taken)[0]
        assert again and all(again[n][k] is taken[0][n][k] for n in again for k in again[n])


def test_server_feedback_asked_where_auto_gathers_is_named_as_doing_nothing(world_of_one) -> None:
    """``server_feedback=True`` with ``exchange="auto"`` below three ranks runs the gathered form,
    which has no chunk owner to keep it: the run says so once at attach (fft's own default is
    not asked for, and says nothing)."""
    for world_size, inert in ((1, True), (2, True), (3, False)):
        asked = registry.create("qsgd", exchange="auto", server_feedback=True)
        assert bool(asked.inert_settings(world_size)) is inert
    assert registry.create("fft", exchange="auto").inert_settings(2) == []
    assert registry.create("qsgd", exchange="two_phase", server_feedback=True).inert_settings(2) == []
    net = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"'qsgd': server_feedback=True does nothing at world size 1.*'two_phase'"):
        lightning_gc.attach(DistributedDataParallel(net), optimizer, "qsgd", exchange="auto", server_feedback=True)


@pytest.mark.parametrize("name", ACCEPTED)
def test_a_compressor_rebuilt_from_its_config_is_configured_alike(name: str) -> None:
    """``create(**config())`` round-trips for every exchange; a codec whose server feedback is on
    by default (fft) has it off in the gathered form, which has no chunk owner to keep it."""
    for exchange in EXCHANGES:
        config = registry.create(name, exchange=exchange).config()
        assert registry.create(**config).config() == config
        assert config["server_feedback"] is (exchange != "gather" and name == "fft")


@pytest.mark.parametrize("name", ACCEPTED)
def test_a_rank_whose_chunk_holds_no_piece_still_takes_part(name: str) -> None:
    """Four ranks, tensors of 3 and 2 elements: chunk 3 holds nothing (pieces of one element go to
    chunks 0-2). That rank sends and owns nothing of its own, and every rank decodes the mean."""
    layout, world_size = make_layout([(3,), (2,)]), 4
    assert [len(pieces_of(layout, j, world_size)) for j in range(world_size)] == [2, 2, 1, 0]
    feedback = {"server_feedback": True} if name not in ("fp16", "bf16", "none") else {}
    compressors = [two_phase(name, exchange="two_phase", **feedback) for _ in range(world_size)]
    velocities = [torch.randn(layout.numel, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    outs, _, _, _ = simulate(compressors, [v.clone() for v in velocities], layout, step=0)
    tolerance = {"fp16": 1e-3, "bf16": 1e-2}.get(name, 1e-6)  # the others send 1-D tensors exactly
    for out in outs:
        torch.testing.assert_close(out, sum(velocities) / world_size, rtol=tolerance, atol=tolerance)
    if feedback:  # every rank, the one that owns nothing too, refuses a resume that drops the errors
        for compressor in compressors:
            with pytest.raises(IncompatibleCheckpoint, match="server_feedback=True"):
                two_phase(name, exchange="two_phase", server_feedback=False).load_state_dict(compressor.state_dict())


def test_two_phase_bytes_sent_count_what_leaves_in_both_phases() -> None:
    layout, world_size = make_layout(), 4
    compressors = [registry.create("terngrad", exchange="two_phase") for _ in range(world_size)]
    _, _, first, second = simulate(compressors, [torch.randn(layout.numel) for _ in range(world_size)], layout, 0)
    first_payload, second_payload = first[0].payload, second[0].payload
    row = second_payload.gathered.numel()  # each rank sends its other rows, then its re-encoded row: N rows
    assert first_payload.bytes_sent == (world_size - 1) * row and second_payload.bytes_sent == row
    assert first_payload.elements_sent == layout.numel and second_payload.elements_sent == 0
    assert math.isclose(traffic_bytes(first_payload, world_size), (world_size - 1) * row)


# ---------------------------------------------------------------------------------------------- gloo
def two_phase_runs(tmp_path, runs: list[dict], world_size: int, bucket_cap_mb: float = 0.25) -> list[dict]:
    from conftest import launch_ranks

    plan = {"runs": runs, "lr": 0.5, "bucket_cap_mb": bucket_cap_mb}
    return launch_ranks("two_phase_worker.py", plan, tmp_path / "runs", world_size=world_size)


def test_none_two_phase_equals_ddp_and_every_accepted_compressor_trains_on_four_ranks(tmp_path) -> None:
    """4 gloo ranks, several buckets (so several two-phase exchanges are in flight): ``none``
    through the two-phase exchange equals DDP's all-reduce; every accepted compressor's loss falls
    by at least 20 % with it; ranks end bitwise identical."""
    # terngrad two-phase with exact biases is at 15 % after 24 steps, then 31 % after 32 and 73 % after 48
    # (quantised biases: 25 %, 42 %); 24 steps caught it between two drops
    steps = 32
    runs = [{"label": "ddp", "compressor": None, "steps": steps}]
    # fft at its 1 % falls too slowly for 24 steps in either form (gather 10 %, two-phase 6 %); at 10 % both 24 %
    settings = {"fft": {"compress_ratio": 0.1}}
    runs += [
        {"label": n, "compressor": n, "arguments": {"exchange": "two_phase", **settings.get(n, {})}, "steps": steps}
        for n in ACCEPTED
    ]
    fed = "onebit, server feedback"
    arguments = {"exchange": "two_phase", "server_feedback": True}
    runs.append({"label": fed, "compressor": "onebit", "arguments": arguments, "steps": steps})
    ranks = two_phase_runs(tmp_path, runs, world_size=4)
    for got, want in zip(ranks[0]["none"]["params"], ranks[0]["ddp"]["params"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name in [*ACCEPTED, fed]:
        for other in ranks[1:]:
            assert all(torch.equal(a, b) for a, b in zip(ranks[0][name]["params"], other[name]["params"])), name
        first = sum(sum(rank[name]["losses"][:4]) for rank in ranks) / (4 * len(ranks))
        last = sum(sum(rank[name]["losses"][-4:]) for rank in ranks) / (4 * len(ranks))
        assert last <= 0.8 * first, f"{name}: loss {first:.3f} -> {last:.3f}"
        # the server error is kept by parameter name, only where asked for
        assert (ranks[0][name]["server_error_entries"] > 0) is (name in (fed, "fft")), name


def _deferred_and_at_once(tmp_path, cases: dict[str, dict], world_size: int) -> list[dict]:
    runs = [
        {"label": f"{label} {mode}", **case, "steps": 6, "defer_rounds": defer}
        for label, case in cases.items()
        for mode, defer in (("deferred", True), ("at once", False))
    ]
    return two_phase_runs(tmp_path, runs, world_size=world_size, bucket_cap_mb=0.25)


def _assert_same(ranks: list[dict], label: str) -> dict:
    for rank in ranks:
        deferred, at_once = rank[f"{label} deferred"], rank[f"{label} at once"]
        assert at_once["deferred_rounds"] == 0, label
        assert deferred["losses"] == at_once["losses"], label
        assert all(torch.equal(a, b) for a, b in zip(deferred["params"], at_once["params"])), label
        assert deferred["bytes_sent"] == at_once["bytes_sent"] > 0, label
    return {name: ranks[0][f"{name} deferred"]["deferred_rounds"] for name in [label]}


def test_earlier_rounds_waited_for_at_the_next_buckets_hook_change_nothing(tmp_path) -> None:
    """With several buckets, a multi-round compressor's earlier round (the two-phase all-to-all,
    PowerSGD's first all-reduce) is left in flight to the next bucket's hook by default, finished
    there after that bucket's first round goes out: the run equals the one that waits at once, bit
    for bit, bytes included, with a delay too (whose re-bucketing drain must finish the deferred
    runs first, or it waits for a future only this thread resolves). OD-SGD's
    local update reads this rank's contribution at once, so it is not deferred (and still equal)."""
    two_phase = {"compressor": "onebit", "arguments": {"exchange": "two_phase"}}
    cases = {
        "onebit": two_phase,
        "powersgd": {"compressor": "powersgd", "arguments": {"rank": 2}},
        "onebit delay": {**two_phase, "delay": 1},
        "onebit local update": {**two_phase, "delay": 1, "local_update": True},
    }
    ranks = _deferred_and_at_once(tmp_path, cases, world_size=2)
    deferred = {label: _assert_same(ranks, label)[label] for label in cases}
    assert deferred["onebit"] > 0 and deferred["powersgd"] > 0 and deferred["onebit delay"] > 0
    assert deferred["onebit local update"] == 0
    # the order: bucket b + 1's all-to-all goes out before bucket b's all-gather, on every rank
    buckets = 1 + max(bucket for _, bucket in ranks[0]["onebit at once"]["last_step_launches"])
    assert buckets >= 2
    at_once = [(kind, b) for b in range(buckets) for kind in ("all-to-all", "all-gather")]
    overlapped = [("all-to-all", 0)] + [
        launch for b in range(1, buckets) for launch in (("all-to-all", b), ("all-gather", b - 1))
    ]
    overlapped.append(("all-gather", buckets - 1))
    for rank in ranks:
        assert rank["onebit at once"]["last_step_launches"] == at_once
        assert rank["onebit deferred"]["last_step_launches"] == overlapped


def test_deferred_rounds_keep_three_ranks_in_step(tmp_path) -> None:
    """Three ranks (global top-k's ranks then take different numbers of merge rounds, which block
    and are never deferred; the two-phase exchange's all-to-all is): no hang, the same result."""
    cases = {
        "dgc global top-k": {"compressor": "dgc", "arguments": {"compress_ratio": 0.01, "exchange": "global_topk"}},
        "onebit": {"compressor": "onebit", "arguments": {"exchange": "two_phase"}},
    }
    ranks = _deferred_and_at_once(tmp_path, cases, world_size=3)
    assert _assert_same(ranks, "dgc global top-k")["dgc global top-k"] == 0
    assert _assert_same(ranks, "onebit")["onebit"] > 0


def test_onebit_two_phase_resumes_exactly_from_its_state(tmp_path) -> None:
    """Parameters, optimizer and the hook's state (worker residuals and server errors) saved at
    step 5 and loaded into a fresh model, DDP and hook: the run continues bit for bit."""
    arguments = {"exchange": "two_phase", "server_feedback": True}
    runs = [
        {"label": "straight", "compressor": "onebit", "arguments": arguments, "steps": 10},
        {"label": "resumed", "compressor": "onebit", "arguments": arguments, "steps": 10, "resume_at": 5},
    ]
    ranks = two_phase_runs(tmp_path, runs, world_size=2)
    for rank in ranks:
        assert rank["straight"]["losses"] == rank["resumed"]["losses"]
        assert all(torch.equal(a, b) for a, b in zip(rank["straight"]["params"], rank["resumed"]["params"]))


def test_the_server_error_of_a_parameter_no_rank_used_is_kept() -> None:
    """DDP drops what is decoded for a parameter without a gradient anywhere; its server error
    must then neither be sent nor forgotten."""
    layout, world_size = make_layout(), 2
    compressors = [two_phase("onebit", exchange="two_phase", server_feedback=True, **ALL_2D) for _ in range(world_size)]
    simulate(compressors, [torch.randn(layout.numel) for _ in range(world_size)], layout, step=0)
    before = [c.state_dict()["server"]["p2"]["server"].clone() for c in compressors]
    assert any(b.abs().sum() > 0 for b in before)
    unused = layout.segments[2]
    velocities = [torch.randn(layout.numel) for _ in range(world_size)]
    for v in velocities:
        unused.of(v).zero_()  # what the memory sends for it
    n = world_size
    first = [
        c.encode(v, torch.empty_like(v), EncodeContext(layout, 1, n, r, unused=frozenset({unused.name})))
        for r, (c, v) in enumerate(zip(compressors, velocities))
    ]
    for to in range(n):
        for frm in range(n):
            first[to].payload.scattered_out.view(n, -1)[frm] = first[frm].payload.scattered.view(n, -1)[to]
    for encoded in first:
        encoded.next_round()
    after = [c.state_dict()["server"]["p2"]["server"] for c in compressors]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert not all(not c.state_dict()["server"]["p0"]["server"].any() for c in compressors)


def test_fft_two_phase_transforms_each_piece_and_is_near_exact_when_it_keeps_every_bin() -> None:
    """fft's pieces are transformed on their own: with odd-sized pieces every bin is kept at
    ``compress_ratio=1`` and 16-bit codes leave only rounding, so the two-phase average is the mean
    to 1e-3; the bias's pieces travel as float32, exactly. At 10 % both forms approximate alike."""
    layout, world_size = make_layout([(9, 7), (15,), (3, 45)]), 3  # pieces of 21, 5 and 45 elements
    generator = torch.Generator().manual_seed(2)
    velocities = [torch.randn(layout.numel, generator=generator) for _ in range(world_size)]
    mean = sum(velocities) / world_size
    settings = {"min_compress_numel": 2, "exchange": "two_phase"}
    exact = [registry.create("fft", compress_ratio=1.0, bits=16, **settings) for _ in range(world_size)]
    outs, _, _, _ = simulate(exact, [v.clone() for v in velocities], layout, step=0)
    assert (outs[0] - mean).norm() / mean.norm() < 1e-3
    bias = layout.segments[1]
    torch.testing.assert_close(bias.of(outs[0]), bias.of(mean), rtol=1e-6, atol=1e-6)
    errors = {}
    for exchange in ("gather", "two_phase"):
        sparse = [
            registry.create("fft", compress_ratio=0.1, min_compress_numel=2, exchange=exchange)
            for _ in range(world_size)
        ]
        if exchange == "two_phase":
            out = simulate(sparse, [v.clone() for v in velocities], layout, step=0)[0][0]
        else:
            encoded = [
                c.encode(v.clone(), torch.empty_like(v), EncodeContext(layout, 0, world_size, r))
                for r, (c, v) in enumerate(zip(sparse, velocities))
            ]
            payloads = [e.payload for e in encoded]
            gathered, summed = torch.cat([p.gathered for p in payloads]), sum(p.summed for p in payloads)
            payloads[0].gathered_out.copy_(gathered)
            payloads[0].summed.copy_(summed)  # rank 0's collectives, by hand
            out = torch.empty(layout.numel)
            sparse[0].decode(encoded[0], out, world_size=world_size)
        errors[exchange] = ((out - mean).norm() / mean.norm()).item()
    assert 0 < errors["two_phase"] < 1.5 * errors["gather"], errors


def local_round_trip(compressor, velocity: torch.Tensor, layout: BucketLayout, world_size: int, rank: int):
    """One bucket through :class:`LocalTransport` (no collectives: every rank holds ``velocity``)."""
    exchange, out = LocalTransport(world_size, rank), torch.empty_like(velocity)
    compressor = TwoPhaseExchange(exchange, compressor)  # its rounds, over the stand-in by hand
    encoded = compressor.encode(velocity, out, EncodeContext(layout, 0, world_size, rank))
    while encoded.next_round is not None:
        exchange.launch(encoded.payload).wait()
        encoded = encoded.next_round()
    exchange.launch(encoded.payload).wait()
    compressor.decode(encoded, out, world_size=world_size)
    return out


@pytest.mark.parametrize("world_size", [3, 4])
def test_the_local_stand_in_sends_what_ranks_holding_this_velocity_would(world_size: int) -> None:
    """Calibration and the benchmarks run the two-phase rounds through :class:`LocalTransport`, a
    world of ranks that hold this rank's velocity: each row must be a message of its own chunk's
    format, so the average is that velocity (exactly with `none`, to the codec's rounding with a
    near-exact fft), at every rank, and fft's timing runs on chunks of unequal sizes. A copy of
    this rank's own payload in every row gave zeros for chunks this rank keeps exact, and made fft
    read one chunk's bins with another's format (an index error)."""
    shapes = [(10, 1024), (1000,), (7, 1001)]  # tensors that split into unequal pieces
    layout = make_layout(shapes)
    velocity = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    near_exact = {"compress_ratio": 1.0, "bits": 16, "min_compress_numel": 2}
    for rank in range(world_size):
        out = local_round_trip(registry.create("none", exchange="two_phase"), velocity, layout, world_size, rank)
        torch.testing.assert_close(out, velocity, rtol=1e-6, atol=1e-7)
        fft = registry.create("fft", exchange="two_phase", **near_exact)
        out = local_round_trip(fft, velocity, layout, world_size, rank)
        assert (out - velocity).norm() / velocity.norm() < 1e-3
    cost = time_codec(registry.create("fft", exchange="two_phase", compress_ratio=0.5), shapes, world_size=world_size)
    assert cost.two_phase_bytes > 0 and cost.decode_s > 0


def test_a_state_written_before_the_server_errors_moved_to_the_exchange_loads_and_continues_exactly() -> None:
    """Server errors used to be the compressor's state; now they are the two-phase exchange's. An
    averager's state in the old form (errors inside ``compressor_state``) loads, converted, and the
    run continues bit for bit as the one that saved it; the codec itself keeps no state."""
    from lightning_gc.exchanges.averager import CompressedAverager

    shapes, arguments = [("w", (40, 30)), ("b", (30,))], {"exchange": "two_phase", "server_feedback": True}

    def averager() -> CompressedAverager:
        return CompressedAverager("onebit", shapes, via=LocalTransport(3), min_compress_numel=1, **arguments)

    generator = torch.Generator().manual_seed(7)
    inputs = [torch.randn(1230, generator=generator) for _ in range(4)]
    first = averager()
    assert isinstance(first.exchange, TwoPhaseExchange) and first.compressor.state_dict() == {}
    for x in inputs[:2]:
        first.average(x.clone()).wait()
    state = first.state_dict()
    assert state["exchange_state"]["server"] and state["compressor_state"] == {}
    legacy = {k: v for k, v in state.items() if k != "exchange_state"}
    legacy["compressor_state"] = dict(state["exchange_state"])  # the form before the move
    legacy["format"] = 1
    resumed = averager()
    resumed.load_state_dict(legacy)
    for x in inputs[2:]:
        assert torch.equal(first.average(x.clone()).wait(), resumed.average(x.clone()).wait())
    gathered = CompressedAverager("onebit", shapes, via=LocalTransport(3), min_compress_numel=1)
    with pytest.raises(IncompatibleCheckpoint, match=r"exchange='two_phase', server_feedback=True.*'gather'"):
        gathered.load_state_dict({**legacy, "compressor": gathered.compressor.config()})
