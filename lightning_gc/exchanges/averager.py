"""Compress-and-average any flat tensor over any process group: the entry point below the front ends.

A :class:`CompressedAverager` holds one flat tensor's layout (named segments, e.g. a fragment of
a model's parameters), a codec, its error-feedback memory and an exchange. Each call to
:meth:`CompressedAverager.average`, made on every rank of the group in the same order, runs the
exchange (by default the one pipeline, :func:`~lightning_gc.exchanges.pipeline.run_bucket`) on that tensor::

    e_r <- beta * e_r + x_r          memory (beta = error_decay; e_r = 0 without error feedback)
    s_r  = C(e_r)                    the codec: what rank r sends (exactly k values, quantised codes, ...)
    e_r <- e_r - s_r                 what was not sent stays for the next call
    y    = (1/N) sum_r s_r           the exchange and decode: every rank gets the same y

Invariant (``error_decay=1``, error feedback on): for every element, on every rank,
``e_r + sum over calls of s_r == sum over calls of x_r``, so
``sum over calls of y + mean_r e_r == mean_r sum over calls of x_r``: nothing is lost, only late.
With the identity codec (``"none"``) ``y`` is the exact mean.

The DDP comm hook runs the same pipeline per bucket with the hook's own additions (DGC's momentum
correction, the step guard, delay, the node hierarchy); this class is what code outside DDP uses,
e.g. to average pseudo-gradients in an outer loop, over the default group or any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.futures import Future

from lightning_gc.common.layout import BucketLayout, Segment
from lightning_gc.common.validation import check_int
from lightning_gc.compressors.base import Compressor
from lightning_gc.compressors.registry import create
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.exchanges.base import Exchange
from lightning_gc.exchanges.comm import ProcessGroup
from lightning_gc.exchanges.pipeline import BucketJob
from lightning_gc.exchanges.select import exchange_of
from lightning_gc.exchanges.transport import GroupTransport, Transport
from lightning_gc.exchanges.two_phase import split_server_state

STATE_FORMAT = 2
"""2: the exchange's state (two-phase server errors) under ``exchange_state``; 1 held it in
``compressor_state`` (read, converted)."""
READABLE_STATE_FORMATS = (1, 2)


def flat_layout(shapes: Sequence[tuple[str, Sequence[int]]], index: int = 0, first_order: int = 0) -> BucketLayout:
    """The layout of a flat tensor that concatenates tensors of these ``(name, shape)`` in order;
    names must be unique (state is kept by name). Segment ``i`` gets order ``first_order + i``:
    stochastic codecs salt their rounding with it, so layouts of disjoint parts of one model
    (the outer loop's fragments) draw independent noise when each starts at its first tensor's index."""
    names = [name for name, _ in shapes]
    if len(set(names)) != len(names):
        raise ValueError(f"segment names must be unique, got {names}")
    segments, start = [], 0
    for order, (name, shape) in enumerate(shapes, start=first_order):
        segment = Segment(name=name, order=order, start=start, shape=tuple(int(d) for d in shape))
        segments.append(segment)
        start = segment.stop
    return BucketLayout(index=index, segments=tuple(segments), param_ids=())


class CompressedAverager:
    """Average a flat tensor over the ranks of a process group through a codec with error feedback
    (module docstring for the maths).

    Args:
        compressor: a registered compressor name (its arguments in ``compressor_arguments``) or a
            :class:`~lightning_gc.compressors.base.Compressor`; its ``exchange`` argument picks the
            exchange where it has one (``"gather"``, ``"two_phase"``, ``"global_topk"``, ...).
        shapes: ``(name, shape)`` of each tensor in the flat tensor, in order.
        group: the process group to average over (``None``: the default group).
        error_feedback: keep what was not sent; ``None`` (default): on for biased codecs.
        error_decay: ``beta`` in ``e <- beta e + x``, in (0, 1].
        first_order: the order (rounding-noise salt) of the first tensor, the next ones following
            (default 0); the outer loop's fragments pass their first parameter's index, so that
            fragments with equal values do not draw equal rounding noise.
        via: the :class:`~lightning_gc.exchanges.base.Exchange` the rounds go through, or a
            :class:`~lightning_gc.exchanges.transport.Transport` (e.g. ``LocalTransport(4)`` to time
            or test without peers) over which the codec's ``exchange`` argument chooses one
            (:func:`~lightning_gc.exchanges.select.exchange_of`); default: that choice over
            ``group``. (Not ``exchange``: that is the codec's own argument, e.g. ``"two_phase"``.)
        **compressor_arguments: the named compressor's arguments (e.g. ``compress_ratio``).

    Raises:
        ValueError: an unknown compressor or argument, or a bad value, naming it.
    """

    def __init__(
        self,
        compressor: str | Compressor,
        shapes: Sequence[tuple[str, Sequence[int]]],
        *,
        group: ProcessGroup = None,
        error_feedback: bool | None = None,
        error_decay: float = 1.0,
        first_order: int = 0,
        via: Exchange | Transport | None = None,
        **compressor_arguments: Any,
    ) -> None:
        if isinstance(compressor, str):
            compressor = create(compressor, **compressor_arguments)
        elif compressor_arguments:
            raise ValueError(
                f"compressor arguments {sorted(compressor_arguments)} go with a compressor name, "
                f"not with the built compressor {compressor.name!r}"
            )
        self.compressor = compressor
        self.layout = flat_layout(shapes, first_order=check_int("first_order", first_order, 0))
        self.memory = CompensationMemory(
            momentum_correction=False,
            momentum_masking=False,
            clip_norm=None,
            error_feedback=compressor.biased if error_feedback is None else error_feedback,
            error_decay=error_decay,
        )
        self.group = group
        if via is not None and group is not None:
            raise ValueError("give `group` or `via` (an exchange, which knows its ranks), not both")
        self.exchange = exchange_of(compressor, via if via is not None else GroupTransport(group))
        self.calls = 0
        self.bytes_sent = 0
        """Payload bytes this rank handed to the transport over all calls (indices included)."""

    @property
    def numel(self) -> int:
        """Elements of the flat tensor."""
        return self.layout.numel

    def average(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Future[torch.Tensor]:
        """Fold ``tensor`` (flat, :attr:`numel` elements; it is overwritten) into memory, send what
        the codec picks and return a future of the average over ranks, written into ``out``
        (default: ``tensor``). Every rank of the group calls this in the same order."""
        if tensor.dim() != 1 or tensor.numel() != self.numel:
            raise ValueError(f"expected a flat tensor of {self.numel} elements, got shape {tuple(tensor.shape)}")
        job = BucketJob(self.compressor, self.memory, tensor, self.layout, self.calls, out=out)
        sent = self.exchange.run(job)
        self.calls += 1
        self.bytes_sent += sent.bytes_sent
        return sent.averaged

    def residual(self) -> torch.Tensor:
        """This rank's error-feedback memory ``e_r`` as one flat tensor (a copy; zeros before the
        first call)."""
        state = self.memory.state_dict()
        return torch.cat(
            [
                state[s.name]["velocity"].reshape(-1) if s.name in state else torch.zeros(s.numel)
                for s in self.layout.segments
            ]
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's resumable state (residuals differ per rank: save every rank's)."""
        return {
            "format": STATE_FORMAT,
            "calls": self.calls,
            "bytes_sent": self.bytes_sent,
            "compressor": self.compressor.config(),
            "compressor_state": self.compressor.state_dict(),
            "exchange_state": self.exchange.state_dict(),
            "memory": self.memory.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output, which must come from the same codec settings."""
        if state.get("format") not in READABLE_STATE_FORMATS:
            raise ValueError(f"averager state format {state.get('format')!r} is not one of {READABLE_STATE_FORMATS}")
        if state["compressor"] != self.compressor.config():
            raise ValueError(
                f"the state was written by compressor {state['compressor']}, this averager has "
                f"{self.compressor.config()}: residuals only resume under the same codec settings"
            )
        self.calls = int(state["calls"])
        self.bytes_sent = int(state["bytes_sent"])
        codec, exchange = state["compressor_state"], state.get("exchange_state")
        if exchange is None:  # written before the server errors moved from the codec to the exchange
            codec, exchange = split_server_state(codec)
        self.compressor.load_state_dict(codec)
        self.exchange.load_state_dict(exchange)
        self.memory.load_state_dict(state["memory"])
