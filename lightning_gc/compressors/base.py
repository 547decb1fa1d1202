"""The compressor interface the comm hook drives.

A compressor turns one bucket's compensated velocity into what this rank hands to the
collectives, and turns what came back into the averaged dense gradient. It never calls a
collective itself (see :mod:`lightning_gc.exchanges.comm`) and never touches memory: it reports what it
sent, and the hook tells the memory.

Payloads come in two kinds, and one bucket may use both:

* ``summed`` -- a floating tensor whose element-wise sum over ranks is meaningful (dense
  values): all-reduced;
* ``gathered`` -- a byte buffer of the same size on every rank (e.g. sparse values + indices):
  all-gathered into ``gathered_out`` without a size exchange;
* ``scattered`` -- ``world_size`` equal rows, row ``j`` for rank ``j``: exchanged all-to-all into
  ``scattered_out``, whose row ``i`` is what rank ``i`` sent to this rank (the first phase of the
  two-phase exchange, :mod:`lightning_gc.compressors.two_phase`);
* ``peer`` -- a :class:`PeerTransfer`: a payload sent to one rank and/or one received from one
  rank, point to point (the rounds of the global top-k selection,
  :mod:`lightning_gc.compressors.global_topk`).

A compressor may need several rounds of communication per bucket (PowerSGD all-reduces P, then
Q computed from the reduced P). Its :meth:`Compressor.encode` then returns the first round with
``next_round`` set; the hook completes each round's collectives *from the hook itself* before
asking for the next, so every rank issues every collective in the same order (see
:mod:`lightning_gc.exchanges.comm`). Only the last round is left in flight for DDP to overlap.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from lightning_gc.common.layout import BucketLayout, Segment, segment_positions
from lightning_gc.common.validation import check_range


@dataclass(frozen=True)
class PeerTransfer:
    """One round of point-to-point traffic (ranks are ranks of the exchange's group).

    ``payload`` is this rank's message of the round, sent to rank ``to`` unless that is ``None``;
    when ``source`` is set, rank ``source``'s message (of the same size) is received into ``into``.
    Neither: this rank sits the round out. Both ends of every transfer are in the same round on
    their two ranks, so a round is a set of matched pairs and cannot deadlock.
    """

    payload: torch.Tensor
    to: int | None = None
    into: torch.Tensor | None = None
    source: int | None = None

    def __post_init__(self) -> None:
        if (self.into is None) != (self.source is None):
            raise ValueError("PeerTransfer receives with both `into` and `source`, or neither")


@dataclass(kw_only=True)
class Encoded:
    """One rank's contribution for one bucket, and what it means for memory.

    Attributes:
        bytes_sent: bytes this rank hands to the collectives.
        elements_sent: number of gradient values this rank sends.
        summed: all-reduced in place (sum over ranks), or ``None``.
        gathered: all-gathered into ``gathered_out`` (``world_size`` x its size), or ``None``.
        scattered: exchanged all-to-all: ``world_size`` equal rows, row ``j`` goes to rank ``j``
            and row ``i`` of ``scattered_out`` comes from rank ``i``; or ``None``.
        peer: a point-to-point round (:class:`PeerTransfer`), or ``None``.
        sent_indices: bucket positions (int64) of the pairs sent sparsely, or ``None``.
        sent_values: the values of those pairs as receivers decode them; a pair with value 0
            is a no-op (the Triton selection pads with such pairs).
        dense_positions: bucket positions (int64) whose velocity left whole; ``None`` when the
            whole bucket did (``dense_all``) or nothing did.
        dense_all: every element of the bucket left this rank (exactly, or as ``dense_sent``).
        dense_sent: the dense values as receivers decode them, when the wire rounds them (e.g.
            fp16); ``None`` means they left exactly. Valid until decode, which may overwrite it
            (see :func:`widened_for_commit`).
        context: compressor-private data needed by :meth:`Compressor.decode`.
        next_round: for multi-round compressors, called once this round's collectives have
            completed; returns the next round. ``None`` on the last round.
        commit_after_decode: memory learns what was sent only after :meth:`Compressor.decode`
            (``dense_sent`` is filled there), for compressors whose residual depends on the
            aggregate (PowerSGD's ``e = M - P Q_avg^T``).
        stand_in: for exchanges without collectives (:class:`~lightning_gc.exchanges.transport.LocalExchange`):
            fills ``gathered_out`` / ``scattered_out`` with what ranks holding this rank's velocity
            would send, where a copy of this rank's own payload is no valid message (a two-phase
            round's rows each have their chunk's format); ``None``: the copy is one.
    """

    bytes_sent: int
    elements_sent: int
    summed: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    gathered_out: torch.Tensor | None = None
    scattered: torch.Tensor | None = None
    scattered_out: torch.Tensor | None = None
    peer: PeerTransfer | None = None
    sent_indices: torch.Tensor | None = None
    sent_values: torch.Tensor | None = None
    dense_positions: torch.Tensor | None = None
    dense_all: bool = False
    dense_sent: torch.Tensor | None = None
    context: Any = None
    next_round: Callable[[], Encoded] | None = None
    commit_after_decode: bool = False
    stand_in: Callable[[], None] | None = None


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


WIRE_ALIGNMENT = 4
"""Bytes every field of a gathered payload is padded to, so the next one can be viewed as int32/fp32."""


def aligned(size: int) -> int:
    """``size`` rounded up to a multiple of :data:`WIRE_ALIGNMENT`."""
    return -(-size // WIRE_ALIGNMENT) * WIRE_ALIGNMENT


@functools.cache
def saturation_limit(dtype: torch.dtype, summands: int) -> float:
    """The largest value of ``dtype`` whose ``summands``-fold sum, accumulated in ``dtype`` one term
    at a time (as a ring all-reduce adds), stays finite: ``finfo(dtype).max / summands`` rounded
    toward zero in ``dtype`` (rounding to nearest can land above it: fp16 at 3 ranks gives 21840,
    and 3 * 21840 overflows), then lowered while the accumulated sum still overflows."""
    limit = torch.tensor(torch.finfo(dtype).max / summands, dtype=torch.float64).to(dtype)
    toward_zero = torch.zeros((), dtype=dtype)
    while True:
        total = torch.zeros((), dtype=dtype)
        for _ in range(summands):
            total = total + limit
        if limit.double() * summands <= torch.finfo(dtype).max and torch.isfinite(total):
            return float(limit)
        limit = torch.nextafter(limit, toward_zero)


def saturating_copy_(wire: torch.Tensor, values: torch.Tensor, summands: int = 1) -> torch.Tensor:
    """``wire <- values``, clamped to ``+-saturation_limit(wire.dtype, summands)`` (about
    ``finfo(wire.dtype).max / summands``); returns ``wire``.

    A narrow wire dtype (fp16: largest finite 65504) turns large values into ``inf``, and a
    collective summing ``summands`` of them can overflow even when each is finite. Clamping
    instead keeps every value and every sum finite; with error feedback the clipped excess stays
    in memory (memory subtracts what receivers decode), so it is delayed, not lost. NaN stays NaN.
    A wire dtype at least as wide as the values' is a plain copy.
    """
    wire.copy_(values)
    if torch.finfo(wire.dtype).max < torch.finfo(values.dtype).max:
        limit = saturation_limit(wire.dtype, summands)
        wire.clamp_(-limit, limit)
    return wire


def widened_for_commit(wire: torch.Tensor, velocity: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """What memory should subtract from ``velocity`` for the narrow ``wire`` values (its
    ``Encoded.dense_sent``): on CPU a copy of ``wire`` in ``velocity``'s dtype, written into
    ``scratch`` (a bucket-sized buffer free until decode) when the dtypes match; else ``wire``.

    Why: CPU kernels for in-place arithmetic across dtypes (``v -= fp16``) are not vectorised and
    run about 4x slower than a widening copy plus a same-dtype subtraction (22 vs 6 ms for ResNet-18's
    11.2 M gradients on one core). On GPUs the mixed-dtype subtraction is one fused kernel that
    reads less, so ``wire`` is returned as it is.
    """
    if velocity.device.type != "cpu" or scratch.dtype != velocity.dtype or scratch.numel() < wire.numel():
        return wire
    return scratch[: wire.numel()].copy_(wire)


def summing_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ranks' decoded values are summed in for a bucket of ``dtype``: float32 for
    the narrower floats (their sum over ranks could overflow before it is divided), the bucket's
    own dtype from float32 up (a float64 bucket keeps float64's precision)."""
    return torch.promote_types(dtype, torch.float32)


def mean_into(out: torch.Tensor, summed: torch.Tensor, world_size: int) -> torch.Tensor:
    """``out <- summed / world_size``, divided in the wider of the two dtypes: a sum over ranks
    that ``out``'s dtype cannot hold (fp16: 2 x 40000) can still have a mean that it can.
    ``summed`` may be ``out`` itself, and may be overwritten; returns ``out``."""
    if summed is out:
        return out.div_(world_size)
    if torch.finfo(summed.dtype).max > torch.finfo(out.dtype).max:
        return out.copy_(summed.div_(world_size))
    return out.copy_(summed).div_(world_size)


@dataclass
class DensePart:
    """The tensors of a bucket sent whole (through an all-reduce) while the rest is compressed.

    ``values`` is the send buffer: :meth:`gather` fills it from the velocity, the collective sums
    it over ranks in place, :meth:`write_mean` writes the mean back into the bucket. A send buffer
    narrower than the velocity (e.g. fp16) is summed in that dtype; as with the ``fp16``
    compressor, :attr:`sent` then hands memory the rounded values so the rounding stays in the
    residual. ``staging`` is the velocity-dtype scratch such a buffer needs (else ``None``).
    """

    positions: torch.Tensor  # int64 bucket positions, in segment order
    values: torch.Tensor
    staging: torch.Tensor | None = None

    @staticmethod
    def of(
        segments: Sequence[Segment],
        like: torch.Tensor,
        values: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> DensePart | None:
        """The dense part made of ``segments`` (``None`` if there are none); ``values`` may be a
        caller-owned buffer of their total size (e.g. the tail of a larger send buffer), ``dtype``
        the wire dtype of a buffer made here (default: ``like``'s)."""
        if not segments:
            return None
        return DensePart.over(segment_positions(segments, like.device), like, values, dtype)

    @staticmethod
    def over(
        positions: torch.Tensor,
        like: torch.Tensor,
        values: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> DensePart:
        """The dense part at the distinct bucket ``positions`` (int64; the caller may rewrite them
        in place between steps, e.g. the positions a global top-k agreed on); ``values`` and
        ``dtype`` as for :meth:`of`."""
        if values is None:
            values = torch.empty(positions.numel(), dtype=dtype or like.dtype, device=like.device)
        elif values.numel() != positions.numel():
            raise ValueError(f"dense buffer holds {values.numel()} elements, the positions {positions.numel()}")
        staging = None if values.dtype == like.dtype else like.new_empty(positions.numel())
        return DensePart(positions=positions, values=values, staging=staging)

    @property
    def sent(self) -> torch.Tensor | None:
        """What receivers decode when the wire dtype differs from the velocity's (``Encoded.dense_sent``:
        memory subtracts it before the collective overwrites it); ``None`` when the values leave exactly."""
        return None if self.staging is None else self.values

    def gather(self, velocity: torch.Tensor, world_size: int = 1) -> torch.Tensor:
        """Copy the dense positions of ``velocity`` into the send buffer and return it; a narrow
        buffer saturates so that the sum over ``world_size`` ranks stays finite."""
        if self.staging is None:
            return torch.index_select(velocity, 0, self.positions, out=self.values)
        exact = torch.index_select(velocity, 0, self.positions, out=self.staging)
        return saturating_copy_(self.values, exact, world_size)

    def write_mean(self, out: torch.Tensor, world_size: int) -> None:
        """After the all-reduce: ``out[positions] = summed values / world_size``."""
        mean = mean_into(self.values if self.staging is None else self.staging, self.values, world_size)
        out.index_copy_(0, self.positions, mean)


GATHER_BELOW = 4096
"""Tensors of a :class:`DenseBlock` with fewer elements move in one gather for all of them; larger
ones are copied one by one, at full bandwidth (a gather also reads an int64 position per value)."""


@dataclass(frozen=True)
class DenseBlock:
    """Whole tensors carried inside a payload as one block of values in the wire ``dtype``, from
    byte ``start`` (a multiple of the dtype's size): first the values of each tensor of at least
    :data:`GATHER_BELOW` elements, then those of the smaller ones, each group in segment order.

    In float32 (the default) every fp16, bf16 and float32 value leaves exactly: what receivers
    decode equals the velocity, and error feedback keeps nothing of it. A narrower wire dtype
    saturates (:func:`saturating_copy_`) and rounds, and the decoded values say so. Each large
    tensor is one copy; all the small ones together are one gather on encode and one scatter-add on
    decode, however many there are (a model's dozens of biases and norms would otherwise cost a few
    ops each, which on a GPU are kernel launches). The gather's positions are built once per device.
    """

    segments: tuple[Segment, ...]
    start: int
    dtype: torch.dtype = torch.float32
    numel: int = field(init=False)
    copied: tuple[Segment, ...] = field(init=False)
    gathered: tuple[Segment, ...] = field(init=False)
    _positions: dict[torch.device, torch.Tensor] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", sum(segment.numel for segment in self.segments))
        object.__setattr__(self, "copied", tuple(s for s in self.segments if s.numel >= GATHER_BELOW))
        object.__setattr__(self, "gathered", tuple(s for s in self.segments if s.numel < GATHER_BELOW))

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def positions(self, device: torch.device) -> torch.Tensor:
        """The bucket positions (int64) of the gathered tensors' values, in block order."""
        cached = self._positions.get(device)
        if cached is None:
            cached = self._positions[device] = segment_positions(self.gathered, device)
        return cached

    def values_in(self, payload: torch.Tensor) -> torch.Tensor:
        """The block's view inside ``payload`` (uint8), in the wire dtype."""
        return payload[self.start : self.start + self.nbytes].view(self.dtype)

    def encode(self, values: torch.Tensor, payload: torch.Tensor, decoded: torch.Tensor) -> None:
        """Copy the segments of ``values`` (bucket-sized) into the block of ``payload``, and what
        receivers will read (the wire values, in ``decoded``'s dtype) into ``decoded``."""
        block, offset = self.values_in(payload), 0
        for segment in self.copied:
            wire = block[offset : offset + segment.numel]
            segment.of(decoded).copy_(saturating_copy_(wire, segment.of(values)))
            offset += segment.numel
        if not self.gathered:
            return
        tail, positions = block[offset:], self.positions(values.device)
        if values.dtype == self.dtype:
            torch.index_select(values, 0, positions, out=tail)
        else:
            saturating_copy_(tail, values.index_select(0, positions))
        decoded.index_copy_(0, positions, tail.to(decoded.dtype))

    def add_into(self, payload: torch.Tensor, total: torch.Tensor) -> None:
        """``total[segments] += `` the block's values (``total`` bucket-sized)."""
        block, offset = self.values_in(payload), 0
        for segment in self.copied:
            segment.of(total).add_(block[offset : offset + segment.numel])
            offset += segment.numel
        if self.gathered:
            total.index_add_(0, self.positions(total.device), block[offset:].to(total.dtype))


def encode_whole_bucket(velocity: torch.Tensor, out: torch.Tensor) -> Encoded:
    """The bucket's velocity, sent whole and exactly through one all-reduce in ``out``; the
    compressor's decode finishes it with :func:`decode_whole_bucket`."""
    return Encoded(
        summed=out.copy_(velocity),
        dense_all=True,
        bytes_sent=velocity.numel() * velocity.element_size(),
        elements_sent=velocity.numel(),
    )


def decode_whole_bucket(encoded: Encoded, out: torch.Tensor, world_size: int) -> bool:
    """Finish a bucket from :func:`encode_whole_bucket` (``out`` was the all-reduce buffer, so the
    mean is ``out / N``) and return ``True``; return ``False`` for any other encoding."""
    if encoded.summed is not out:
        return False
    out.div_(world_size)
    return True


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
        for gradients of ``element_size`` bytes (what :meth:`encode` reports as ``bytes_sent``)."""

    def config(self) -> dict[str, Any]:
        """Plain-data description, recorded in checkpoints: ``{"name": name, argument: value, ...}``
        for each of :attr:`arguments`; ``create(**config)`` builds an equal compressor."""
        return {"name": self.name, **{argument: getattr(self, argument) for argument in self.arguments}}

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
