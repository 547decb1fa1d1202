"""Where each parameter's gradient sits inside a DDP bucket.

DDP packs the gradients of a bucket's parameters back to back, in ``bucket.parameters()`` order,
into one flat buffer (``bucket.buffer()``). A :class:`BucketLayout` records that packing once per
distinct bucket so the hook can address each parameter's slice without recomputing offsets.

DDP rebuilds its buckets after the first iteration, so the layout behind a given
``bucket.index()`` can change; :meth:`BucketLayout.matches` detects that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    """One parameter's slice ``[start, stop)`` of a bucket's flat gradient buffer.

    ``order`` is the parameter's position in the module's ``named_parameters()``; it is stable
    across bucket rebuilds and across processes, unlike the bucket index.
    """

    name: str
    order: int
    start: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def stop(self) -> int:
        return self.start + self.numel

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """The view of this segment inside a bucket-sized flat tensor."""
        return flat[self.start : self.stop]


@dataclass(frozen=True)
class BucketLayout:
    """The segments of one DDP bucket, in buffer order."""

    index: int
    segments: tuple[Segment, ...]
    param_ids: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.segments[-1].stop if self.segments else 0

    @staticmethod
    def build(
        index: int, params: list[torch.Tensor], names: dict[int, tuple[str, int]], buffer_numel: int
    ) -> BucketLayout:
        """Describe a bucket from its parameters; ``names`` maps ``id(param)`` to (name, order)."""
        segments, start = [], 0
        for param in params:
            name, order = names[id(param)]
            segment = Segment(name=name, order=order, start=start, shape=tuple(param.shape))
            segments.append(segment)
            start = segment.stop
        if start != buffer_numel:
            raise RuntimeError(
                f"DDP bucket {index} holds {buffer_numel} elements but its parameters add up to {start}; "
                "lightning_gc expects DDP's contiguous bucket packing (sparse or strided gradients are not supported)"
            )
        return BucketLayout(index=index, segments=tuple(segments), param_ids=tuple(id(p) for p in params))

    def matches(self, params: list[torch.Tensor]) -> bool:
        """Whether ``params`` are exactly this layout's parameters, in the same order."""
        return len(params) == len(self.param_ids) and all(id(p) == i for p, i in zip(params, self.param_ids))
