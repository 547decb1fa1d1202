"""Where each parameter's gradient sits inside a DDP bucket.

DDP packs the gradients of a bucket's parameters back to back, in ``bucket.parameters()`` order,
into one flat buffer (``bucket.buffer()``). A :class:`BucketLayout` records that packing once per
distinct bucket so the hook can address each parameter's slice without recomputing offsets.

DDP rebuilds its buckets after the first iteration, so the layout behind a given
``bucket.index()`` can change; :meth:`BucketLayout.matches` detects that.

A parameter's slice holds its gradient in the parameter's own memory order: DDP makes the
gradient a view of the bucket with the parameter's strides when the parameter is dense and
non-overlapping (a ``channels_last`` convolution weight's slice runs N, H, W, C), and row-major
otherwise. :func:`bucket_order` and :func:`shaped_like` convert between that order and a tensor
shaped like the parameter; ``reshape(-1)`` and ``view_as`` would pair the wrong elements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _memory_permutation(tensor: torch.Tensor) -> list[int] | None:
    """The dimensions of ``tensor`` from outermost to innermost in memory, when the tensor is dense
    and non-overlapping (the permuted tensor is contiguous); ``None`` otherwise."""
    outermost_first = sorted(range(tensor.dim()), key=tensor.stride, reverse=True)
    return outermost_first if tensor.permute(outermost_first).is_contiguous() else None


def bucket_order(tensor: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """``tensor``'s elements, 1-D, in the order DDP's bucket holds the gradient of ``like`` (a
    parameter of ``tensor``'s shape; default ``tensor`` itself): its memory order when it is dense
    and non-overlapping, else row-major. A view of ``tensor`` when ``tensor`` has ``like``'s
    strides (writes reach it), a copy otherwise."""
    like = tensor if like is None else like
    if tensor.is_contiguous() and like.is_contiguous():
        return tensor.view(-1)
    if tensor.stride() != like.stride():
        tensor = torch.empty_like(like, dtype=tensor.dtype, device=tensor.device).copy_(tensor)
    order = _memory_permutation(tensor)
    return tensor.reshape(-1) if order is None else tensor.permute(order).view(-1)


def bucket_view(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A view of ``flat`` (1-D, in bucket order: :func:`bucket_order`) shaped and strided like
    ``like``, as DDP makes a parameter's gradient a view of its bucket slice."""
    if like.is_contiguous() or _memory_permutation(like) is None:
        return flat.view(like.shape)
    return flat.as_strided(like.shape, like.stride(), flat.storage_offset())


def shaped_like(flat: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new tensor shaped and strided like ``like`` whose elements, in bucket order, are ``flat``'s
    (cast to ``dtype``): e.g. a gradient for ``like`` from a slice of a bucket."""
    return bucket_view(flat, like).to(dtype=dtype or flat.dtype, copy=True)  # keeps the strides: one copy


@dataclass(frozen=True)
class Segment:
    """One parameter's slice ``[start, stop)`` of a bucket's flat gradient buffer.

    ``order`` is the parameter's position in the module's ``named_parameters()``; it is stable
    across bucket rebuilds and across processes, unlike the bucket index. A 1-D piece of a tensor
    (:func:`chunk_segments`) keeps the tensor's shape in ``whole_shape``.
    """

    name: str
    order: int
    start: int
    shape: tuple[int, ...]
    whole_shape: tuple[int, ...] | None = None

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        """The shape of the parameter this segment is (a piece of)."""
        return self.shape if self.whole_shape is None else self.whole_shape

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


def segment_positions(segments: Sequence[Segment], device: torch.device) -> torch.Tensor:
    """The bucket positions (int64) of every element of ``segments``, in segment order."""
    if not segments:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.cat([torch.arange(s.start, s.stop, device=device) for s in segments])


def piece_bounds(numel: int, chunk: int, chunks: int) -> tuple[int, int]:
    """``[low, high)`` of piece ``chunk`` of ``chunks`` of a tensor of ``numel`` elements: pieces of
    ``ceil(numel / chunks)`` elements, the last ones shorter or empty."""
    size = -(-numel // chunks)
    return min(chunk * size, numel), min((chunk + 1) * size, numel)


def chunk_segments(layout: BucketLayout, chunk: int, chunks: int) -> tuple[Segment, ...]:
    """Chunk ``chunk`` of ``chunks`` of ``layout``: the ``chunk``-th of ``chunks`` pieces of
    ``ceil(numel / chunks)`` elements of every tensor (fewer or none at a tensor's end), as 1-D
    segments at their bucket positions (name and order kept: seeds and state refer to them).

    Chunks made of per-tensor pieces depend only on the tensors, not on how DDP packed them into
    buckets: who owns an element is the same before and after a bucket rebuild and across a resume."""
    pieces = []
    for segment in layout.segments:
        low, high = piece_bounds(segment.numel, chunk, chunks)
        if low < high:
            pieces.append(
                Segment(
                    name=segment.name,
                    order=segment.order,
                    start=segment.start + low,
                    shape=(high - low,),
                    whole_shape=segment.tensor_shape,
                )
            )
    return tuple(pieces)


def packed_layout(layout: BucketLayout, pieces: Sequence[Segment]) -> BucketLayout:
    """``pieces`` of ``layout`` (e.g. a :func:`chunk_segments` chunk) packed back to back from 0, as
    the layout of a contiguous buffer of their own: same index, names, orders and shapes, so seeds,
    state by name and payload formats built from it are those of the pieces in the bucket."""
    segments, start = [], 0
    for piece in pieces:
        segments.append(
            Segment(name=piece.name, order=piece.order, start=start, shape=piece.shape, whole_shape=piece.whole_shape)
        )
        start += piece.numel
    return BucketLayout(index=layout.index, segments=tuple(segments), param_ids=layout.param_ids)


@dataclass(frozen=True)
class Shard:
    """One chunk of a bucket (:func:`chunk_segments`) gathered into a contiguous buffer of its own.

    ``layout`` describes the shard buffer as if it were a bucket (same index, one 1-D segment per
    piece, packed back to back, names kept), so the whole pipeline (memory, compressors) runs on it
    unchanged; ``positions`` are the bucket positions of the shard's elements, in shard order, and
    ``sources[i]`` is (position in the bucket layout of the tensor the shard's ``i``-th segment was
    cut from, offset of the piece inside that tensor)."""

    layout: BucketLayout
    positions: torch.Tensor
    sources: tuple[tuple[int, int], ...]

    @staticmethod
    def build(layout: BucketLayout, chunk: int, chunks: int, device: torch.device) -> Shard:
        where = {segment.name: i for i, segment in enumerate(layout.segments)}
        pieces = chunk_segments(layout, chunk, chunks)
        sources = tuple((where[p.name], p.start - layout.segments[where[p.name]].start) for p in pieces)
        return Shard(layout=packed_layout(layout, pieces), positions=segment_positions(pieces, device), sources=sources)

    @property
    def numel(self) -> int:
        return self.layout.numel

    def pieces_of(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """This shard's piece of each of the bucket's tensors (e.g. its parameters, in bucket layout
        order), as 1-D views, one per shard segment."""
        return [
            bucket_order(tensors[source].detach())[offset : offset + segment.numel]
            for (source, offset), segment in zip(self.sources, self.layout.segments)
        ]

    def segments_of(self, names: set[str]) -> list[Segment]:
        """The shard's segments cut from the tensors named ``names``."""
        return [segment for segment in self.layout.segments if segment.name in names]
