"""The compressor interface the comm hook drives.

A compressor turns one bucket's compensated velocity into what this rank hands to the
collectives, and turns what came back into the averaged dense gradient. It never calls a
collective itself (see :mod:`lightning_gc.exchanges.comm`) and never touches memory: it reports what it
sent, and the pipeline tells the memory. What :meth:`Compressor.encode` returns, an
:class:`~lightning_gc.compressors.encoded.Encoded` round (what travels, what memory commits, and
round control), is in :mod:`lightning_gc.compressors.encoded`.

This module holds the interface only (and the per-bucket plan cache compressors build on); the
arithmetic of wire values is in :mod:`lightning_gc.compressors.numerics`, the tensors that leave
whole (biases, norms, small tensors, uncompressed buckets) in :mod:`lightning_gc.compressors.dense`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from lightning_gc.common.layout import BucketLayout, Segment
from lightning_gc.common.validation import check_range
from lightning_gc.compressors.encoded import Encoded


@dataclass(frozen=True)
class EncodeContext:
    """Where one bucket's encode happens.

    Attributes:
        layout: the bucket's tensors (names, shapes, positions in the flat buffer).
        step: the optimizer step; seeds and salts random and sampled selections, so that a step's
            choice depends on (step, parameter) only, never on DDP's bucketing.
        world_size: ranks whose payloads are summed or gathered.
        rank: this rank, for compressors that draw independently on every rank.
        unused: names of the bucket's parameters that got a gradient on no rank this step (sent
            as zeros, and DDP will not apply what is decoded for them).
    """

    layout: BucketLayout
    step: int
    world_size: int
    rank: int = 0
    unused: frozenset[str] = frozenset()


def compressible(segment: Segment, min_numel: int) -> bool:
    """The rule every compressor shares for which tensors it compresses (DGC §3): those of more
    than one dimension with at least ``min_numel`` elements. Biases, norms and small tensors go
    dense: they are a small part of the bytes and sensitive to compression. A piece of a tensor
    (a hierarchical exchange's shard) follows its whole tensor."""
    shape = segment.tensor_shape
    return len(shape) > 1 and int(torch.Size(shape).numel()) >= min_numel


def split_segments(segments: Sequence[Segment], min_numel: int) -> tuple[list[Segment], list[Segment]]:
    """``(compressed, dense)``: ``segments`` split by :func:`compressible`, each in buffer order."""
    compressed = [s for s in segments if compressible(s, min_numel)]
    dense = [s for s in segments if not compressible(s, min_numel)]
    return compressed, dense


class AdjustableRatio:
    """Mixin and interface of compressors with a ``compress_ratio`` in (0, 1] (or (0, 1) where
    :attr:`sends_all_at_one` is false), validated on every assignment, so that
    :class:`~lightning_gc.SparsityWarmup` can change it between steps through the strategy."""

    _compress_ratio: float
    sends_all_at_one: ClassVar[bool] = True
    """Whether ``compress_ratio=1`` is allowed (it sends every value)."""

    @property
    def compress_ratio(self) -> float:
        """The fraction of each compressed tensor's values sent (or their worth)."""
        return self._compress_ratio

    @compress_ratio.setter
    def compress_ratio(self, value: float) -> None:
        self._compress_ratio = check_range(
            "compress_ratio", value, 0.0, 1.0, low_inclusive=False, high_inclusive=self.sends_all_at_one
        )

    def ratio_of(self, count: float) -> int:
        """``ceil(compress_ratio * count)``, where a product within ``1e-9`` (relative) of an integer
        is that integer: a decimal ratio is not exact in binary (``0.07 * 100 = 7.000000000000001``),
        and the user meant 7, not 8."""
        product = self._compress_ratio * count
        nearest = round(product)
        return nearest if abs(product - nearest) <= 1e-9 * max(1.0, abs(product)) else math.ceil(product)


class Compressor(ABC):
    """Encodes a bucket's velocity for the wire and decodes the aggregate."""

    name: ClassVar[str]
    biased: ClassVar[bool] = True
    """Whether E[decoded] != input; biased compressors get error feedback by default."""
    commits_after_decode: ClassVar[bool] = False
    """Whether what this rank sent is known only from the average (its :class:`Encoded` sets
    ``commit_after_decode``, e.g. PowerSGD's residual ``M - P Q^T``)."""
    decodes_own_row: ClassVar[bool] = True
    """Whether a gathered decode decodes this rank's own row too (``N`` rows); ``False``: it adds
    the row from what encode kept (float32 buckets), ``N - 1`` decodes (calibration scales by it)."""
    needs_whole_tensors: ClassVar[bool] = False
    """Whether encoding needs each tensor whole, in its shape (PowerSGD's matrices), so that it
    cannot work on the 1-D pieces a hierarchical exchange cuts (:mod:`lightning_gc.exchanges.hierarchy`)."""
    arguments: ClassVar[tuple[str, ...]] = ()
    """The constructor arguments :meth:`config` records, each read back from the attribute of
    that name (in this order, after ``name``)."""

    @abstractmethod
    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        """Choose what to send from ``velocity`` (the bucket's flat compensated values).

        ``out`` is the bucket's gradient buffer: its content has already been folded into
        ``velocity``, so it may serve as a send buffer; :meth:`decode` writes the result into it.
        ``context`` says which bucket, step, world size and rank (see :class:`EncodeContext`).
        """

    @abstractmethod
    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        """Write the mean over ranks into ``out`` once the collectives of ``encoded`` completed."""

    @abstractmethod
    def wire_bytes(self, layout: BucketLayout, element_size: int) -> int:
        """Bytes one rank would hand to the collectives for ``layout`` at the current settings,
        for gradients of ``element_size`` bytes (what :meth:`encode`'s rounds report as their payloads'
        ``bytes_sent``, together)."""

    def config(self) -> dict[str, Any]:
        """Plain-data description, recorded in checkpoints: ``{"name": name, argument: value, ...}``
        for each of :attr:`arguments`; ``create(**config)`` builds an equal compressor."""
        return {"name": self.name, **{argument: getattr(self, argument) for argument in self.arguments}}

    def exchange_form(self, world_size: int) -> str:
        """The exchange the user's arguments ask to run this codec at ``world_size`` ranks:
        ``"gather"`` (the default) is the codec's own rounds over one transport (all-gather or
        all-reduce, PowerSGD's two); ``"two_phase"`` or ``"global_topk"`` name an exchange of
        :mod:`lightning_gc.exchanges` that runs the codec through a capability it asks of it
        (:func:`lightning_gc.exchanges.select.exchange_for` picks it)."""
        return "gather"

    def inert_settings(self, world_size: int) -> list[str]:
        """Settings asked for that do nothing at ``world_size`` ranks, each as a sentence for a
        warning (none by default)."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """State that must survive a resume (e.g. PowerSGD's warm-start factors), as CPU tensors.

        Stateless compressors (the default) have none: their buffers are scratch space.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        if state:
            raise ValueError(f"compressor {self.name!r} keeps no state, got entries {sorted(state)}")

    def snapshot(self, previous: Any = None) -> Any:
        """The state :meth:`restore` rolls back to (a skipped step; the step guard takes one at every
        guarded step's first bucket, and every mixed-precision step is guarded). By default
        :meth:`state_dict`; a stateful compressor keeps copies on its state's own device instead, in
        ``previous``'s buffers (the snapshot it returned before) where they fit: no host copy, no
        device sync and, once warm, no allocation."""
        return self.state_dict()

    def restore(self, snapshot: Any) -> None:
        """Return to what :meth:`snapshot` took, in place: buffers that plans hold stay valid."""
        self.load_state_dict(snapshot)


PlanT = TypeVar("PlanT")


@dataclass(frozen=True)
class PlanKey:
    """Everything a bucket's plan depends on; a cached plan is reused only under an equal key.

    The layout counts by identity (``layout_id``), not by value: DDP's rebuild makes a new
    layout object, and a plan may hold views tied to the old one. The key keeps the layout alive
    (``layout``, not compared), so its ``id`` cannot be reused by another layout while cached.
    """

    layout: BucketLayout = field(compare=False)
    layout_id: int
    settings: tuple[tuple[str, Any], ...]
    world_size: int
    rank: int | None
    device: torch.device
    dtype: torch.dtype

    @staticmethod
    def of(compressor: Compressor, context: EncodeContext, like: torch.Tensor, *, by_rank: bool = False) -> PlanKey:
        """The key of ``compressor``'s plan for ``context`` and values like ``like``: its settings
        are every argument in its :meth:`~Compressor.config`; the rank only ``by_rank``."""
        return PlanKey(
            layout=context.layout,
            layout_id=id(context.layout),
            settings=tuple(compressor.config().items()),
            world_size=context.world_size,
            rank=context.rank if by_rank else None,
            device=like.device,
            dtype=like.dtype,
        )


class PlanCache(Generic[PlanT]):
    """One plan per bucket index, rebuilt whenever its :class:`PlanKey` changed (see
    :class:`PlannedCompressor`; the two-phase exchange keeps a second cache of its own plans, which
    depend on the rank: ``by_rank``)."""

    def __init__(self, *, by_rank: bool = False) -> None:
        self.by_rank = by_rank
        self._plans: dict[int, tuple[PlanKey, PlanT]] = {}

    def get(
        self,
        compressor: Compressor,
        context: EncodeContext,
        like: torch.Tensor,
        build: Callable[[BucketLayout, torch.Tensor, int], PlanT],
    ) -> PlanT:
        """The cached plan for ``context.layout`` and ``like``, or ``build(layout, like, world_size)``
        (a builder that needs the rank takes it from ``context`` in a cache ``by_rank``)."""
        key = PlanKey.of(compressor, context, like, by_rank=self.by_rank)
        cached = self._plans.get(context.layout.index)
        if cached is not None and cached[0] == key:
            return cached[1]
        plan = build(context.layout, like, context.world_size)
        self._plans[context.layout.index] = (key, plan)
        return plan

    def clear(self) -> None:
        """Forget every plan (e.g. their buffers were replaced)."""
        self._plans.clear()


class PlannedCompressor(Compressor, Generic[PlanT]):
    """A compressor whose per-bucket sizes and buffers (its *plan*) are built once and reused.

    Subclasses say only how to build a plan (:meth:`build_plan`). :meth:`plan` keeps one plan per
    bucket index and rebuilds it whenever anything it depends on changed: the layout object, any
    setting (every argument in :meth:`~Compressor.config`, so a ratio set
    by :class:`~lightning_gc.SparsityWarmup` counts), the world size, or the velocity's device or
    dtype. Invariant: an encode never sees a plan built for other sizes or buffers than its own.
    """

    def __init__(self) -> None:
        self._plans: PlanCache[PlanT] = PlanCache()

    @abstractmethod
    def build_plan(self, layout: BucketLayout, like: torch.Tensor, world_size: int) -> PlanT:
        """A fresh plan for ``layout`` at the current settings, with buffers on ``like``'s device
        (and of its dtype where they hold gradient values), for ``world_size`` ranks."""

    def plan(self, context: EncodeContext, like: torch.Tensor) -> PlanT:
        """The plan for ``context.layout`` and ``like`` (the velocity), built on first use and
        rebuilt whenever its :class:`PlanKey` changed."""
        return self._plans.get(self, context, like, self.build_plan)
