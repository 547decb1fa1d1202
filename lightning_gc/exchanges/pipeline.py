"""One bucket through one step: screen -> compensate -> encode -> exchange -> decode -> commit.

The one implementation of the per-bucket pipeline, driven by the comm hook with real collectives
(:class:`~lightning_gc.exchanges.transport.GroupTransport`) and by calibration and the benchmarks with a
local stand-in (:class:`~lightning_gc.exchanges.transport.LocalTransport`)::

    guard.screen(g)                              non-finite policy (lightning_gc.core.guard)
    v   = memory.compensate(g)                   DGC's momentum correction, clipping (lightning_gc.core.memory)
    enc = compressor.encode(v)                   what this rank sends (lightning_gc.compressors)
    memory.commit(enc.sent)                      v (and u) forget what was sent; momentum masking
    transport.launch(enc.payload)                the collectives, from the caller, in bucket order
    on completion: compressor.decode(enc)        -> the bucket's averaged gradient

Each reader gets its part of the :class:`~lightning_gc.compressors.encoded.Encoded` round: memory its
``sent``, the transport its ``payload``; the round control (``next_round``, ``commit_after_decode``)
is read here, and ``context`` by the codec's decode alone.

Multi-round compressors (PowerSGD, global top-k's merges) and exchanges that build rounds from a
codec's capability (the two-phase exchange: ``rounds``) return their
first round with ``next_round`` set: an earlier round's exchange must complete before the next is
encoded. By default that happens here, before :func:`run_bucket` returns. With ``defer_rounds`` the
bucket's run stops after launching an earlier round that leaves collectives in flight and is
finished by its caller (:class:`RoundQueue`): the comm hook finishes it in the next bucket's
hook, once that bucket's first round is launched, so the round travels while backward computes
and the next bucket encodes instead of blocking them, and the last bucket's hook finishes every
run. Each rank launches exactly the collectives it would waiting at once, in one order shared by
every rank (bucket ``b + 1``'s first round, then bucket ``b``'s later rounds), only later. Every
bucket's rounds read and write only that bucket's buffers and state, and random rounding is
salted by step, rank and tensor, so the order changes nothing: the result is the same bit for
bit. (Point-to-point rounds block in their launch and are not deferred.) Compressors whose
residual depends on the aggregate set ``commit_after_decode``; memory is then told after decode.

Time per phase is recorded in a :class:`Timeline` (without device syncs in the hook; with them for
calibration and benchmarks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch.futures import Future

from lightning_gc.common.layout import BucketLayout, Segment
from lightning_gc.compressors.base import Compressor, EncodeContext
from lightning_gc.compressors.encoded import Encoded, Payload
from lightning_gc.core.guard import StepGuard
from lightning_gc.core.memory import BucketMemory, CompensationMemory
from lightning_gc.exchanges.timeline import COMMIT_AFTER_DECODE, EXCHANGE, Timeline
from lightning_gc.exchanges.transport import Transport


@dataclass
class BucketStep:
    """What one bucket's step sent, and the future of its averaged gradient.

    ``finish``, when set, is work left for the caller's thread (it launches a collective, so it
    must run where the hook runs, on every rank in bucket order) before ``averaged`` can resolve:
    a delayed two-level bucket's intra-node all-gather (:mod:`lightning_gc.exchanges.hierarchy`)."""

    averaged: Future[torch.Tensor]
    bytes_sent: int
    elements_sent: int
    finish: Callable[[], None] | None = None
    rounds: Generator[None, None, None] | None = None
    """With ``defer_rounds``: the rest of the bucket's run (each ``next()`` waits for the round in
    flight and launches the next); ``None`` once the last round is launched. ``bytes_sent`` and
    ``elements_sent`` grow as rounds are encoded."""
    deferred: bool = False
    """Whether :func:`run_bucket` returned before the last round's launch (``averaged`` is then its
    own future, resolved from the last round's decode)."""
    handed: Future[torch.Tensor] | None = None
    """A delayed exchange (:class:`~lightning_gc.exchanges.delay.DelayedExchange`): what the caller
    hands on now, an earlier step's average, while ``averaged`` is this step's own, in flight."""


@dataclass(frozen=True)
class BucketJob:
    """One flat tensor's step: what the pipeline (and every :class:`~lightning_gc.exchanges.base.Exchange`)
    runs it with. ``grad`` is the tensor (a DDP bucket's local gradient, a fragment, a node's
    shard); the average is written into ``out`` (default ``grad``).

    Attributes:
        compressor, memory: the codec and this rank's compensation memory.
        layout: ``grad``'s segments; ``step``: the step counter (salts sampling and rounding).
        params: the bucket's parameters, in layout order (weight decay reads them).
        out: a bucket-sized buffer other than ``grad`` for the encoder's scratch and the average
            (delayed exchanges); it keeps the average unscaled (see ``loss_scale``).
        own: receives this rank's own contribution as decoded (see
            :meth:`~lightning_gc.core.memory.CompensationMemory.commit`); not for compressors that
            commit after decode.
        absent: segments whose parameter got a gradient on no rank: sent as nothing, their state
            kept as it was (see :meth:`~lightning_gc.core.memory.CompensationMemory.set_aside`).
        loss_scale: the grad scaler's scale (mixed precision): memory works on unscaled
            gradients, the average is scaled back.
        guard: screens ``grad`` for non-finite values first.
        timeline: records the phases; ``on_decoded`` is called with it after decode (on the
            thread that completes the exchange), when every phase is in.
        failure: turns an exchange's exception into the one to raise (e.g. naming the bucket).
        summed_ranks, clip: ``grad`` is the sum of that many ranks' gradients (a node's), which
            were clipped before summing when ``clip`` is false; see
            :meth:`~lightning_gc.core.memory.CompensationMemory.compensate`.
        defer_rounds: return after launching a multi-round compressor's first round, leaving the
            rest in :attr:`BucketStep.rounds` (module docstring).
    """

    compressor: Compressor
    memory: CompensationMemory
    grad: torch.Tensor
    layout: BucketLayout
    step: int
    params: Sequence[torch.Tensor] = ()
    out: torch.Tensor | None = None
    own: torch.Tensor | None = None
    absent: Sequence[Segment] = ()
    loss_scale: float | None = None
    guard: StepGuard | None = None
    timeline: Timeline = field(default_factory=Timeline)
    on_decoded: Callable[[Timeline], None] | None = None
    failure: Callable[[Exception], Exception] | None = None
    summed_ranks: int = 1
    clip: bool = True
    defer_rounds: bool = False

    def but(self, **changes: Any) -> BucketJob:
        """This job with ``changes`` (e.g. a node's shard of it)."""
        return replace(self, **changes)


class Rounds(Protocol):
    """What runs a job's rounds: the codec itself (its own round protocol), or an exchange that
    builds rounds from a capability of the codec (the two-phase exchange's chunks)."""

    @property
    def name(self) -> str: ...

    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded: ...

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None: ...


def run_bucket(job: BucketJob, bucket: BucketMemory, transport: Transport, rounds: Rounds | None = None) -> BucketStep:
    """Run the pipeline (module docstring) on ``job`` with its memory's ``bucket`` state, among the
    ranks of ``transport``; the returned step's future resolves to the average (in ``job.out``,
    default ``job.grad``). ``rounds``: what encodes and decodes the rounds (default the job's
    codec, which must then ask for its own rounds: :meth:`~lightning_gc.compressors.base.Compressor.exchange_form`
    ``"gather"``; a codec whose arguments name another exchange runs through that exchange,
    :func:`lightning_gc.exchanges.select.exchange_for`, never silently gathered)."""
    if rounds is None:
        form = job.compressor.exchange_form(transport.world_size)
        if form != "gather":
            raise ValueError(
                f"compressor {job.compressor.name!r} asks for exchange={form!r} at {transport.world_size} ranks, "
                "which the flat pipeline does not run; build the exchange with "
                "lightning_gc.exchanges.select.exchange_for(compressor, transport)"
            )
        rounds = job.compressor
    compressor, memory, grad, layout, step = rounds, job.memory, job.grad, job.layout, job.step
    out, own, loss_scale, guard, failure = job.out, job.own, job.loss_scale, job.guard, job.failure
    world_size, rank = transport.world_size, transport.rank
    absent, timeline, on_decoded = list(job.absent), job.timeline, job.on_decoded
    target = grad if out is None else out
    sent = BucketStep(averaged=Future(), bytes_sent=0, elements_sent=0)

    def pipeline() -> Generator[None, None, None]:
        """The pipeline, pausing once after launching each earlier round that leaves collectives
        in flight and returning after launching the last, counting what it sends into ``sent``.
        Its last round's decode becomes ``sent.averaged`` when the run ends inside this call (the
        future chained on the collective's, as DDP expects), or resolves the future returned."""
        timeline.start()
        if guard is not None:
            guard.screen(
                grad, layout, bucket, step=step, loss_scaled=loss_scale is not None, summed_ranks=job.summed_ranks
            )
            timeline.mark("screen")
        velocity = memory.compensate(
            bucket,
            grad,
            list(job.params),
            world_size,
            absent=absent,
            loss_scale=loss_scale,
            summed_ranks=job.summed_ranks,
            clip=job.clip,
        )
        timeline.mark("compensate")
        unused = frozenset(segment.name for segment in absent)
        context = EncodeContext(layout, step=step, world_size=world_size, rank=rank, unused=unused)
        encoded = compressor.encode(velocity, target, context)
        timeline.mark("encode")
        while encoded.next_round is not None:  # an earlier round completes before the next is encoded
            sent.bytes_sent += encoded.payload.bytes_sent
            sent.elements_sent += encoded.payload.elements_sent
            launched = transport.launch(encoded.payload)
            timeline.mark(EXCHANGE)
            if _in_flight(encoded.payload):
                yield  # the caller resumes when it is ready to wait (at once, or at the next bucket's hook)
                timeline.start()  # what ran in between was not this bucket's
            wait(launched, failure)
            timeline.mark(EXCHANGE)
            encoded = encoded.next_round()
            timeline.mark("encode")
        if encoded.commit_after_decode:
            if own is not None:
                raise ValueError(
                    f"compressor {compressor.name!r} learns what it sent only from the average (it commits after "
                    "decode), so this rank's own contribution is not known before the exchange"
                )
        else:
            memory.commit(bucket, encoded.sent, own)
            timeline.mark("commit")
        last = encoded
        launched = transport.launch(last.payload)
        timeline.mark("launch")  # before `.then` below: decode may run on another thread once attached

        def decode(done: Future[Payload]) -> torch.Tensor:
            wait(done, failure)  # the payload's receive buffers, which the round's decode reads, are filled
            timeline.start()
            compressor.decode(last, target, world_size=world_size)
            timeline.mark("decode")
            if last.commit_after_decode:
                memory.commit(bucket, last.sent)
                timeline.mark(COMMIT_AFTER_DECODE)
            if out is None:
                memory.restore_loss_scale(grad, loss_scale)
            if on_decoded is not None:
                on_decoded(timeline)
            return target

        sent.bytes_sent += last.payload.bytes_sent
        sent.elements_sent += last.payload.elements_sent
        decoded = launched.then(decode)
        if sent.deferred:
            placeholder = sent.averaged
            decoded.then(lambda done: settle(placeholder, done))
        else:
            sent.averaged = decoded

    sent.rounds = pipeline()
    _step(sent)  # up to the first round in flight, or to the end
    if not job.defer_rounds:
        complete(sent)
    elif sent.rounds is not None:  # resolved later, from the last round's decode
        sent.averaged = pending_like(grad)
        sent.deferred = True
    return sent


def _step(sent: BucketStep) -> None:
    """Wait for ``sent``'s round in flight and launch its next (the last one ends the run)."""
    assert sent.rounds is not None
    try:
        next(sent.rounds)
    except StopIteration:
        sent.rounds = None


def complete(sent: BucketStep) -> None:
    """Run ``sent``'s remaining rounds, each waited for before the next is launched."""
    while sent.rounds is not None:
        _step(sent)


def _in_flight(payload: Payload) -> bool:
    """Whether a launched round leaves collectives in flight: a point-to-point round alone (global
    top-k's merges) completes inside the launch (:func:`lightning_gc.exchanges.comm.transfer` blocks)."""
    return payload.summed is not None or payload.gathered is not None or payload.scattered is not None


def pending_like(tensor: torch.Tensor) -> Future[torch.Tensor]:
    """An unresolved future that will hold ``tensor``: on CUDA it records ``tensor``'s device, so
    that DDP's wait on it synchronises with the stream work of whoever resolves it."""
    return Future(devices=[tensor.device]) if tensor.device.type == "cuda" else Future()


def settle(target: Future[torch.Tensor], done: Future[torch.Tensor]) -> None:
    """Resolve ``target`` as ``done`` resolved."""
    try:
        target.set_result(done.value())
    except Exception as error:
        target.set_exception(error)


class RoundQueue:
    """Buckets whose runs wait for an earlier round in flight (``defer_rounds``), in launch order.

    The comm hook calls :meth:`finish` in every bucket's hook once that bucket's first round is
    launched, for the runs queued before it, and at the end of the last bucket's for all: every
    rank then launches its collectives in the same order (bucket ``b + 1``'s first round, then
    bucket ``b``'s later rounds), and no run outlives its backward pass."""

    def __init__(self) -> None:
        self._waiting: deque[tuple[BucketStep, Callable[[BucketStep], None]]] = deque()
        self.deferred = 0  # runs finished by a later hook than their own (a count, for tests)

    def add(self, sent: BucketStep, launched: Callable[[BucketStep], None]) -> None:
        """Queue ``sent`` if it has rounds left; ``launched(sent)`` runs once its last round is
        launched (at once if it already is), when its byte counts are complete."""
        if sent.rounds is None:
            launched(sent)
        else:
            self._waiting.append((sent, launched))

    def finish(self, count: int | None = None) -> None:
        """Run the ``count`` oldest waiting runs (all when ``None``) to their last round's launch,
        oldest first: each rank then launches exactly what it would have launched waiting at once,
        in an order every rank shares, only later.

        An error (a failed earlier round) fails that bucket's future and every later waiting one,
        and is raised here, in the hook, as it would have been in the bucket's own."""
        runs = len(self._waiting) if count is None else min(count, len(self._waiting))
        for _ in range(runs):
            sent, launched = self._waiting.popleft()
            self.deferred += 1
            try:
                complete(sent)
            except Exception as error:
                sent.rounds = None
                sent.averaged.set_exception(error)
                self.abandon(error)
                raise
            launched(sent)

    def abandon(self, error: BaseException) -> None:
        """Fail every waiting run's future with ``error`` (an interrupt as a ``RuntimeError``) and
        drop the runs (a hook raised: nothing may be resumed in a later step, and nothing may keep
        their buffers and groups alive)."""
        if not isinstance(error, Exception):
            error = RuntimeError(f"the backward pass was interrupted: {error!r}")
        while self._waiting:
            sent, _ = self._waiting.popleft()
            if sent.rounds is not None:
                sent.rounds.close()
                sent.rounds = None
            sent.averaged.set_exception(error)

    def __len__(self) -> int:
        return len(self._waiting)


@contextmanager
def reported(failure: Callable[[Exception], Exception] | None) -> Iterator[None]:
    """An error inside becomes ``failure(error)`` (e.g. naming the bucket) when ``failure`` is given."""
    try:
        yield
    except Exception as error:
        if failure is None:
            raise
        raise failure(error) from error


def wait(future: Future[Any], failure: Callable[[Exception], Exception] | None) -> None:
    """Wait for ``future``; its error becomes ``failure(error)`` when given (see :func:`reported`)."""
    with reported(failure):
        future.wait()
