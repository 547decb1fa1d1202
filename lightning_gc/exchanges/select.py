"""Which exchange runs a codec: the user's ``exchange`` argument (a codec's, as the front ends take
it) chooses among the implementations of :class:`~lightning_gc.exchanges.base.Exchange`.

==================  ================================================================  ==============
``exchange``         implementation over one transport                                 asks the codec
==================  ================================================================  ==============
``"gather"``         :class:`~lightning_gc.exchanges.base.FlatExchange`: the codec's    nothing
                     own rounds (all-gather, all-reduce, PowerSGD's two)
``"two_phase"``      :class:`~lightning_gc.exchanges.two_phase.TwoPhaseExchange`        its chunks
``"auto"``           the two-phase exchange, which runs the codec's own rounds below    its chunks
                     three ranks
``"global_topk"``    :class:`~lightning_gc.exchanges.global_topk.GlobalTopKExchange`    its selection
==================  ================================================================  ==============

A codec that cannot run the exchange asked for is refused when it is built (its ``exchange``
argument lists only the exchanges whose capability it has), in one line naming the value and the
choices. ``hierarchy=`` and ``delay=`` compose on top: a node hierarchy runs the chosen exchange
across nodes, :class:`~lightning_gc.exchanges.delay.DelayedExchange` wraps any of them.
"""

from __future__ import annotations

from typing import Any

from lightning_gc.compressors.base import Compressor
from lightning_gc.compressors.chunks import ExchangeChoice
from lightning_gc.exchanges.base import CodecRounds, Exchange, FlatExchange, RoundsExchange
from lightning_gc.exchanges.global_topk import GlobalTopKExchange
from lightning_gc.exchanges.transport import Transport
from lightning_gc.exchanges.two_phase import TwoPhaseExchange


def exchange_for(codec: Compressor, transport: Transport) -> Exchange:
    """The exchange ``codec``'s arguments choose, over ``transport`` (module docstring). A codec
    that takes ``exchange="two_phase"`` gets the two-phase exchange whatever it asked, which runs
    its own rounds where the two-phase form is not asked for: a checkpoint's server errors are then
    checked against the codec's arguments in one place."""
    if isinstance(codec, ExchangeChoice):
        return TwoPhaseExchange(transport, codec)
    if codec.exchange_form(transport.world_size) == "global_topk":
        return GlobalTopKExchange(transport, codec)
    return FlatExchange(transport)


def rounds_for(codec: Compressor, transport: Transport) -> CodecRounds | None:
    """What runs ``codec``'s rounds in its place over ``transport`` (the pipeline's ``rounds``) where
    its arguments ask for an exchange that builds them (two-phase, global top-k); ``None`` where the
    codec runs its own. For callers that drive :func:`~lightning_gc.exchanges.pipeline.run_bucket`
    themselves (calibration, benchmarks): keep it across steps, it holds the plans (and server errors)."""
    if codec.exchange_form(transport.world_size) == "gather":
        return None
    chosen = exchange_for(codec, transport)
    assert isinstance(chosen, RoundsExchange)
    return chosen.rounds


def exchange_of(codec: Compressor, via: Exchange | Transport) -> Exchange:
    """The exchange that runs ``codec``: ``via`` itself when it is one (a node hierarchy, a flat
    exchange forced on purpose, one of the user's), else the one the codec's arguments choose over
    the transport ``via`` (:func:`exchange_for`)."""
    return via if isinstance(via, Exchange) else exchange_for(codec, via)


class CodecAndExchange:
    """A codec's state and its exchange's as one, for the step guard's snapshot and rollback of a
    skipped step (:class:`~lightning_gc.core.guard.StepGuard` takes any object with ``snapshot`` and
    ``restore``): the codec's (PowerSGD's Q) and the exchange's (two-phase server errors)."""

    def __init__(self, codec: Compressor, exchange: Exchange) -> None:
        self.codec, self.exchange = codec, exchange

    def snapshot(self, previous: Any = None) -> Any:
        kept = previous if isinstance(previous, tuple) else (None, None)
        return self.codec.snapshot(kept[0]), self.exchange.snapshot(kept[1])

    def restore(self, snapshot: Any) -> None:
        self.codec.restore(snapshot[0])
        self.exchange.restore(snapshot[1])
