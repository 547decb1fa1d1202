"""The per-bucket pipeline on one process, with the local stand-in exchange (lightning_gc.exchanges.pipeline)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from torch.futures import Future

from lightning_gc.compressors import create
from lightning_gc.core.guard import StepGuard
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.core.momentum import MomentumSpec
from lightning_gc.exchanges.pipeline import BucketJob, BucketStep, RoundQueue, run_bucket
from lightning_gc.exchanges.timeline import EXCHANGE, Timeline
from lightning_gc.exchanges.transport import LocalTransport, Transport
from lightning_gc.exchanges.two_phase import TwoPhaseExchange
from lightning_gc.perfmodel.calibration import layout_of_shapes

SHAPES = [(64, 50), (50,), (30, 40)]


def _memory(momentum: float = 0.0, error_feedback: bool = True) -> CompensationMemory:
    memory = CompensationMemory(
        momentum_correction=momentum > 0, momentum_masking=True, clip_norm=None, error_feedback=error_feedback
    )
    memory.set_specs({f"t{i}": MomentumSpec(momentum=momentum) for i in range(len(SHAPES))})
    return memory


def _gradient(step: int) -> torch.Tensor:
    layout = layout_of_shapes(SHAPES)
    return torch.randn(layout.numel, generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("world_size", [1, 3])
def test_identity_codec_returns_the_average_and_keeps_nothing(world_size: int) -> None:
    """With every rank sending the same gradient, the all-reduce average is that gradient."""
    layout, memory = layout_of_shapes(SHAPES), _memory()
    grad = _gradient(0)
    expected = grad.clone()
    bucket = memory.bucket(layout, grad)
    sent = run_bucket(BucketJob(create("none"), memory, grad, layout, 0), bucket, LocalTransport(world_size))
    assert sent.averaged.wait() is grad
    torch.testing.assert_close(grad, expected)
    assert sent.bytes_sent == layout.numel * 4 and sent.elements_sent == layout.numel
    assert torch.count_nonzero(bucket.velocity) == 0


@pytest.mark.parametrize("name", ["dgc", "powersgd", "qsgd"])
def test_nothing_is_lost_through_the_pipeline(name: str) -> None:
    """Over several steps: everything decoded + what memory holds == every gradient fed in,
    whichever phases the compressor needs (PowerSGD: two rounds and a commit after decode)."""
    compressor = create(name, **({"compress_ratio": 0.05} if name == "dgc" else {}))
    layout, memory = layout_of_shapes(SHAPES), _memory(error_feedback=True)
    fed = torch.zeros(layout.numel, dtype=torch.float64)
    received = torch.zeros_like(fed)
    for step in range(6):
        grad = _gradient(step)
        fed += grad.double()
        bucket = memory.bucket(layout, grad)
        sent = run_bucket(BucketJob(compressor, memory, grad, layout, step), bucket, LocalTransport(1))
        received += sent.averaged.wait().double()
    torch.testing.assert_close(received + bucket.velocity.double(), fed, rtol=0, atol=1e-4)


def test_timeline_records_every_phase_in_order_and_rounds_as_exchange_waits() -> None:
    layout, memory = layout_of_shapes(SHAPES), _memory()
    grad = _gradient(1)
    bucket = memory.bucket(layout, grad)
    guard = StepGuard("raise", memory, create("powersgd"))
    seen: list[Timeline] = []
    timeline = Timeline()
    run_bucket(
        BucketJob(create("powersgd"), memory, grad, layout, 0, guard=guard, timeline=timeline, on_decoded=seen.append),
        bucket,
        LocalTransport(2),
    ).averaged.wait()
    names = [name for name, _ in timeline.phases]
    assert names == ["screen", "compensate", "encode", EXCHANGE, "encode", "launch", "decode", "commit after decode"]
    assert seen == [timeline]
    assert timeline.seconds() == pytest.approx(sum(s for n, s in timeline.phases if n != EXCHANGE))


def test_a_wait_between_phases_is_exchange_time_less_what_a_callback_recorded_meanwhile() -> None:
    """``Timeline.waiting``: a decode callback that runs during the wait (on the backend's thread)
    keeps its own time; the wait is charged only the rest."""
    timeline = Timeline()
    timeline.start()
    timeline.mark("encode")
    with timeline.waiting():
        time.sleep(0.02)
        decoder = threading.Thread(target=lambda: (timeline.start(), time.sleep(0.3), timeline.mark("decode")))
        decoder.start()
        decoder.join()
    assert [name for name, _ in timeline.phases] == ["encode", "decode", EXCHANGE]
    assert timeline.seconds("decode") >= 0.3 and 0.02 <= timeline.seconds(EXCHANGE) < 0.2
    assert timeline.seconds() == pytest.approx(timeline.seconds("encode", "decode"))


def test_loss_scale_is_taken_out_for_memory_and_put_back_on_the_average() -> None:
    layout, memory = layout_of_shapes(SHAPES), _memory()
    unscaled = _gradient(2)
    grad = unscaled * 1024.0
    bucket = memory.bucket(layout, grad)
    run_bucket(
        BucketJob(create("dgc", compress_ratio=0.05), memory, grad, layout, 0, loss_scale=1024.0),
        bucket,
        LocalTransport(1),
    ).averaged.wait()
    sent = grad / 1024.0
    torch.testing.assert_close(sent + bucket.velocity, unscaled)  # memory kept the unscaled remainder
    assert bucket.velocity.abs().max() <= unscaled.abs().max()


def test_absent_parameters_send_nothing_and_keep_their_state() -> None:
    layout, memory = layout_of_shapes(SHAPES), _memory(momentum=0.9)
    first = _gradient(3)
    bucket = memory.bucket(layout, first)
    run_bucket(BucketJob(create("none"), memory, first, layout, 0), bucket, LocalTransport(1)).averaged.wait()
    absent = [layout.segments[2]]
    before = [absent[0].of(t).clone() for t in bucket.state()]
    grad = _gradient(4)
    run_bucket(
        BucketJob(create("none"), memory, grad, layout, 1, absent=absent), bucket, LocalTransport(1)
    ).averaged.wait()
    assert torch.count_nonzero(absent[0].of(grad)) == 0  # nothing of it was sent
    for after, kept in zip(bucket.state(), before):
        assert torch.equal(absent[0].of(after), kept)
    assert torch.count_nonzero(layout.segments[0].of(grad)) > 0
    assert bucket.aside == []


class _Failing(Transport):
    world_size, rank = 2, 0

    def launch(self, payload):  # type: ignore[no-untyped-def]
        future: Future[object] = Future()
        future.set_exception(ConnectionError("peer gone"))
        return future


def test_a_failed_exchange_raises_the_error_the_caller_asked_for() -> None:
    layout, memory = layout_of_shapes(SHAPES), _memory()
    grad = _gradient(5)
    bucket = memory.bucket(layout, grad)
    sent = run_bucket(
        BucketJob(
            create("none"), memory, grad, layout, 7, failure=lambda error: RuntimeError(f"bucket 0 failed: {error}")
        ),
        bucket,
        _Failing(),
    )
    with pytest.raises(RuntimeError, match="bucket 0 failed: peer gone"):
        sent.averaged.wait()


def test_the_guard_stops_a_non_finite_gradient_before_memory_sees_it() -> None:
    layout, memory = layout_of_shapes(SHAPES), _memory()
    grad = _gradient(6)
    grad[layout.segments[1].start] = float("nan")
    bucket = memory.bucket(layout, grad)
    guard = StepGuard("raise", memory, create("none"))
    with pytest.raises(FloatingPointError, match=r"on rank 0 in \['t1'\]"):
        run_bucket(BucketJob(create("none"), memory, grad, layout, 0, guard=guard), bucket, LocalTransport(1))
    assert torch.count_nonzero(bucket.velocity) == 0
    # a node's sum (hierarchy="node"): the non-finite value may be any of its ranks', not this one's
    with pytest.raises(FloatingPointError, match=r"in the sum over the 2 ranks of rank 0's node \(its shard\)"):
        run_bucket(
            BucketJob(create("none"), memory, grad, layout, 0, guard=guard, summed_ranks=2), bucket, LocalTransport(1)
        )


class _FailingAllToAll(LocalTransport):
    """The local stand-in, whose all-to-all rounds fail once launched (a dead peer)."""

    def launch(self, payload):
        launched = super().launch(payload)
        if payload.scattered is None:
            return launched
        failed: Future = Future()
        failed.set_exception(ConnectionError("peer gone"))
        return failed


def _deferred_two_phase_runs(
    count: int, exchange: Transport, queue: RoundQueue, launched: Callable[[BucketStep], None]
) -> list[BucketStep]:
    """``count`` buckets of onebit's two-phase exchange on 2 ranks, each left with its all-to-all in
    flight (``defer_rounds``) and queued in ``queue``."""
    layout, runs = layout_of_shapes(SHAPES), []
    for index in range(count):
        memory, grad, codec = _memory(), _gradient(index), create("onebit", exchange="two_phase")
        sent = run_bucket(
            BucketJob(codec, memory, grad, layout, 0, defer_rounds=True),
            memory.bucket(layout, grad),
            exchange,
            TwoPhaseExchange(exchange, codec),  # the two-phase exchange's rounds
        )
        queue.add(sent, launched)
        runs.append(sent)
    return runs


def test_a_deferred_round_that_fails_raises_at_the_next_hook_and_fails_every_waiting_bucket() -> None:
    """Two buckets leave their two-phase all-to-all in flight; finishing them raises the first's
    error (as the bucket's own hook did when it waited at once), fails both futures and keeps no
    run to resume in a later step."""
    queue, launched = RoundQueue(), []
    runs = _deferred_two_phase_runs(2, _FailingAllToAll(2), queue, launched.append)
    assert all(sent.rounds is not None and sent.deferred for sent in runs)
    assert len(queue) == 2
    with pytest.raises(ConnectionError, match="peer gone"):
        queue.finish()
    assert len(queue) == 0 and launched == [] and all(run.rounds is None for run in runs)
    for run in runs:
        with pytest.raises(ConnectionError):
            run.averaged.wait()


def test_a_deferred_run_ends_as_the_run_that_waits_at_once() -> None:
    layout = layout_of_shapes(SHAPES)
    results = []
    for defer in (False, True):
        memory, grad, queue, counted = _memory(), _gradient(3), RoundQueue(), []
        codec = create("onebit", exchange="two_phase")
        sent = TwoPhaseExchange(LocalTransport(2), codec).run(
            BucketJob(codec, memory, grad, layout, 0, defer_rounds=defer)
        )
        queue.add(sent, counted.append)
        assert counted == ([] if defer else [sent])
        queue.finish()
        assert counted == [sent] and queue.deferred == int(defer)
        results.append((sent.averaged.wait().clone(), sent.bytes_sent, memory.bucket(layout, grad).velocity.clone()))
    (at_once, bytes_at_once, velocity_at_once), (deferred, bytes_deferred, velocity_deferred) = results
    assert torch.equal(at_once, deferred) and torch.equal(velocity_at_once, velocity_deferred)
    assert bytes_at_once == bytes_deferred > 0


def test_finishing_the_oldest_runs_leaves_the_newer_one_in_flight() -> None:
    """``finish(count)`` (the comm hook's call once its own bucket's first round is out) runs only
    the ``count`` oldest waiting runs to their last launch, oldest first; ``finish()`` the rest."""
    queue, counted = RoundQueue(), []
    runs = _deferred_two_phase_runs(3, LocalTransport(2), queue, counted.append)
    queue.finish(2)
    assert counted == runs[:2] and len(queue) == 1 and runs[2].rounds is not None
    queue.finish(5)  # more than are waiting: all of them
    assert counted == runs and len(queue) == 0 and queue.deferred == 3
