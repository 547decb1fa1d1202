"""How one bucket's compensation is cut into kernel calls: its pieces, and the parameters they read.

:class:`~lightning_gc.core.memory.CompensationMemory` runs the DGC update of a bucket (the maths:
:mod:`lightning_gc.core.memory`) as one kernel call per :class:`CompensationPiece`. The pieces
cover the bucket's segments in order, each segment in exactly one piece, and a piece's segments
share one momentum recurrence ``(m, nesterov, dampening, wd)``: so every element gets the same
update however the bucket is cut, and the cut only decides how many launches a step takes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lightning_gc.common.layout import Segment, bucket_view
from lightning_gc.core.momentum import MomentumSpec


@dataclass
class CompensationPiece:
    """A slice ``[start, stop)`` of a bucket compensated by one kernel call.

    Consecutive segments share a piece when they share the momentum recurrence (``recurrence``,
    weight decay included) and need no clipping factor of their own. With weight decay the kernel reads the parameters:
    from the segment's own parameter when the piece is one segment (``segment``, its position in
    the layout), else from a bucket-shaped copy of the parameters of its ``positions``
    (:class:`ParamsCopy`), refreshed before each call. Only the Triton backend merges decayed
    segments: there a launch costs far more than the copy, on the CPU the copy is the cost.
    """

    start: int
    stop: int
    recurrence: MomentumSpec
    segment: int | None = None
    positions: list[int] = field(default_factory=list)  # the layout positions of a shared piece's segments


def plan_pieces(
    segments: Sequence[Segment], spec_of: Callable[[str], MomentumSpec], *, clipping: bool, merges_decay: bool
) -> list[CompensationPiece]:
    """The pieces of a bucket of ``segments`` (in layout order), ``spec_of`` giving each segment's
    recurrence by parameter name. A segment stands alone when ``clipping`` (each tensor has its own
    clipping factor) or when it has weight decay and decayed segments do not merge (``merges_decay``
    false); the others join the previous shared piece when their recurrence is the same."""
    pieces: list[CompensationPiece] = []
    for position, segment in enumerate(segments):
        spec = spec_of(segment.name)
        alone = clipping or (spec.weight_decay != 0.0 and not merges_decay)
        last = pieces[-1] if pieces else None
        if not alone and last is not None and last.segment is None and last.recurrence == spec:
            last.stop = segment.stop
            last.positions.append(position)
        elif alone:
            pieces.append(CompensationPiece(segment.start, segment.stop, spec, segment=position))
        else:
            pieces.append(CompensationPiece(segment.start, segment.stop, spec, positions=[position]))
    return pieces


class ParamsCopy:
    """The bucket-shaped copy of the parameters that shared pieces with weight decay read (see
    :class:`CompensationPiece`): bucket-sized, one more model's worth of parameters in device memory."""

    def __init__(self, like: torch.Tensor) -> None:
        self.buffer = torch.zeros_like(like)
        self._targets: dict[int, list[torch.Tensor]] = {}  # the buffer's views per piece, by piece start

    def refresh(
        self, piece: CompensationPiece, segments: Sequence[Segment], params: list[torch.Tensor]
    ) -> torch.Tensor:
        """The parameters of ``piece``'s segments, copied (one multi-tensor copy) into the buffer at
        their segments' places; the piece's slice of the buffer."""
        targets = self._targets.get(piece.start)
        if targets is None:  # strided like the parameters, so the copy reads them as they are: no per-step views
            targets = [bucket_view(segments[i].of(self.buffer), params[i]) for i in piece.positions]
            self._targets[piece.start] = targets
        with torch.no_grad():
            torch._foreach_copy_(targets, [params[i] for i in piece.positions])
        return self.buffer[piece.start : piece.stop]
