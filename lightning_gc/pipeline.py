"""One bucket through one step: screen -> compensate -> encode -> exchange -> decode -> commit.

The one implementation of the per-bucket pipeline, driven by the comm hook with real collectives
(:class:`~lightning_gc.exchange.CollectiveExchange`) and by calibration and the benchmarks with a
local stand-in (:class:`~lightning_gc.exchange.LocalExchange`)::

    guard.screen(g)                              non-finite policy (lightning_gc.guard)
    v   = memory.compensate(g)                   DGC's momentum correction, clipping (lightning_gc.memory)
    enc = compressor.encode(v)                   what this rank sends (lightning_gc.compressors)
    memory.commit(enc)                           v (and u) forget what was sent; momentum masking
    exchange.launch(enc)                         the collectives, from the caller, in bucket order
    on completion: compressor.decode(enc)        -> the bucket's averaged gradient

Multi-round compressors (PowerSGD) return their first round with ``next_round`` set: each earlier
round's exchange completes here before the next is encoded, so the only exchanges in flight across
buckets are last rounds, launched in bucket order on every rank. Compressors whose residual depends
on the aggregate set ``commit_after_decode``; memory is then told after decode.

Time per phase is recorded in a :class:`Timeline` (without device syncs in the hook; with them for
calibration and benchmarks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.futures import Future

from lightning_gc.compressors.base import Compressor, EncodeContext, Encoded
from lightning_gc.exchange import Exchange
from lightning_gc.guard import StepGuard
from lightning_gc.layout import BucketLayout, Segment
from lightning_gc.memory import BucketMemory, CompensationMemory

EXCHANGE = "exchange"
"""The phase of waiting for an earlier round's collectives: not the codec's own work."""
ENCODE_SIDE = ("screen", "compensate", "encode", "commit")
"""The phases before the last round's launch that are the codec's work on this rank."""
COMMIT_AFTER_DECODE = "commit after decode"
DECODE_SIDE = ("decode", COMMIT_AFTER_DECODE)
"""The phases after the exchange completed."""


@dataclass
class Timeline:
    """Seconds per phase of one bucket, in the order the phases ran.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each reading, so that asynchronous
    device work is charged to the phase that launched it; the hook passes none (no host syncs in
    the hot path) and so measures host time.
    """

    sync: Callable[[], None] | None = None
    phases: list[tuple[str, float]] = field(default_factory=list)
    _last: float = 0.0

    def start(self) -> None:
        """Start (or restart, e.g. when decode begins on another thread) the clock."""
        if self.sync is not None:
            self.sync()
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Charge the time since the last reading to ``phase``."""
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self.phases.append((phase, now - self._last))
        self._last = now

    def seconds(self, *phases: str) -> float:
        """Total seconds of ``phases`` (all phases but :data:`EXCHANGE` waits when none are named)."""
        return sum(s for name, s in self.phases if (name in phases if phases else name != EXCHANGE))


@dataclass
class BucketStep:
    """What one bucket's step sent, and the future of its averaged gradient.

    ``finish``, when set, is work left for the caller's thread (it launches a collective, so it
    must run where the hook runs, on every rank in bucket order) before ``averaged`` can resolve:
    a delayed two-level bucket's intra-node all-gather (:mod:`lightning_gc.hierarchy`)."""

    averaged: Future[torch.Tensor]
    bytes_sent: int
    elements_sent: int
    finish: Callable[[], None] | None = None


def run_bucket(
    compressor: Compressor,
    memory: CompensationMemory,
    bucket: BucketMemory,
    grad: torch.Tensor,
    layout: BucketLayout,
    exchange: Exchange,
    *,
    step: int,
    world_size: int,
    rank: int = 0,
    params: list[torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    own: torch.Tensor | None = None,
    absent: list[Segment] | None = None,
    loss_scale: float | None = None,
    guard: StepGuard | None = None,
    timeline: Timeline | None = None,
    on_decoded: Callable[[Timeline], None] | None = None,
    failure: Callable[[Exception], Exception] | None = None,
    summed_ranks: int = 1,
    clip: bool = True,
) -> BucketStep:
    """Run the pipeline (module docstring) on one bucket whose local gradient is ``grad``.

    The averaged gradient is written into ``out`` (default ``grad``) and the returned future
    resolves to it.

    Args:
        params: the bucket's parameters, in layout order (weight decay reads them).
        out: a bucket-sized buffer other than ``grad`` for the encoder's scratch and the average
            (delayed exchanges); it keeps the average unscaled (see ``loss_scale``).
        own: receives this rank's own contribution as decoded (see :meth:`CompensationMemory.commit`);
            not for compressors that commit after decode.
        absent: segments whose parameter got a gradient on no rank: sent as nothing, their state
            kept as it was (see :meth:`CompensationMemory.set_aside`).
        loss_scale: the grad scaler's scale (mixed precision): memory works on unscaled
            gradients, the average is scaled back.
        guard: screens ``grad`` for non-finite values first.
        timeline: records the phases; ``on_decoded`` is called with it after decode (on the
            thread that completes the exchange), when every phase is in.
        failure: turns an exchange's exception into the one to raise (e.g. naming the bucket).
        summed_ranks, clip: ``grad`` is the sum of that many ranks' gradients (a node's), which
            were clipped before summing when ``clip`` is false; see :meth:`CompensationMemory.compensate`.
    """
    timeline = timeline if timeline is not None else Timeline()
    target = grad if out is None else out
    timeline.start()
    if guard is not None:
        guard.screen(grad, layout, bucket, step=step, loss_scaled=loss_scale is not None)
        timeline.mark("screen")
    velocity = memory.compensate(
        bucket,
        grad,
        params or [],
        world_size,
        absent=absent,
        loss_scale=loss_scale,
        summed_ranks=summed_ranks,
        clip=clip,
    )
    timeline.mark("compensate")
    unused = frozenset(segment.name for segment in absent or ())
    context = EncodeContext(layout, step=step, world_size=world_size, rank=rank, unused=unused)
    encoded = compressor.encode(velocity, target, context)
    timeline.mark("encode")
    bytes_sent, elements_sent = 0, 0
    while encoded.next_round is not None:  # earlier rounds complete here, so launch order is bucket order
        bytes_sent, elements_sent = bytes_sent + encoded.bytes_sent, elements_sent + encoded.elements_sent
        wait(exchange.launch(encoded), failure)
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
        memory.commit(bucket, encoded, own)
        timeline.mark("commit")
    launched = exchange.launch(encoded)
    timeline.mark("launch")  # before `.then` below: decode may run on another thread once attached

    def decode(done: Future[Encoded]) -> torch.Tensor:
        wait(done, failure)
        received = done.value()
        timeline.start()
        compressor.decode(received, target, world_size=world_size)
        timeline.mark("decode")
        if received.commit_after_decode:
            memory.commit(bucket, received)
            timeline.mark(COMMIT_AFTER_DECODE)
        if out is None:
            memory.restore_loss_scale(grad, loss_scale)
        if on_decoded is not None:
            on_decoded(timeline)
        return target

    return BucketStep(
        averaged=launched.then(decode),
        bytes_sent=bytes_sent + encoded.bytes_sent,
        elements_sent=elements_sent + encoded.elements_sent,
    )


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
