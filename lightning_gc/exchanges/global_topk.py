"""Global top-k: sparse aggregation whose traffic per rank grows as ``O(k log N)``, not ``O(k N)``.

Gathering sparse pairs hands every rank the other ``N-1`` ranks' ``k`` pairs each step, so the
bytes received grow with the world size (the all-gather is DGC's scaling limit). gTop-k (Shi, Wang,
Chu and Li, "A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification for Low
Bandwidth Networks", ICDCS 2019) instead merges candidate sets pairwise in ``log2 N`` rounds and
applies only the ``k`` largest entries of the *sum*. Here (:class:`GlobalTopKExchange`, chosen by
``exchange="global_topk"`` on the sparse compressors) the merges choose the positions and one
exact all-reduce moves the values::

    C  <- this rank's k pairs of each compressed tensor (the compressor's own selection of v)
    for j = 0 .. log2(P) - 1:        (recursive doubling among P = 2^floor(log2 N) ranks)
        swap C with rank (r XOR 2^j);  C <- merge(C, C_partner)
    merge(A, B): pairs at the same position add; per tensor keep the k of largest |value|
                 (ties: the lower position), positions sorted within the bucket
    G  <- the positions of C: per tensor exactly k distinct positions, the same on every rank
    all-reduce of v_r[G] (with the dense tensors):   out[G] = (1/N) sum_r v_r[G],  0 elsewhere
    memory: v_r[G] <- 0 (and u_r[G] <- 0 with momentum masking)

When ``N`` is not a power of two, each rank ``r >= P`` first hands its ``C`` to rank ``r - P``,
which merges it in, and gets the agreed ``C`` back after the ``P``-rank rounds. ``merge`` is
symmetric (two floats add the same either way; the result is ordered by value and position, not by
who sent what), so both ranks of a swap hold the same set afterwards, and after the last round every
rank holds the same ``G`` (the ranks of each ``2^(j+1)``-subcube agree after round ``j``). The
candidate values travel in the compressor's wire format (``value_dtype``, ``index_encoding``); a
rank merges its own values as its partner decodes them, so rounding cannot split the ranks.

**Nothing is lost.** The merged values only *choose* ``G``; the values applied are the exact
average of every rank's velocity on ``G`` (DGC's rule with one index set for all ranks), and every
position outside ``G``, including a rank's candidates dropped in a merge, stays in its velocity for
later steps. (The paper applies the merged sums and puts each rank's candidates outside ``G`` back
into its residual; a contribution dropped in an intermediate merge at a position that still made
``G`` is then lost.) With ``G`` covering every element the step is DDP's all-reduce exactly.

Traffic per rank and bucket, for a payload of ``p`` bytes (``k`` pairs) and ``d`` bytes of agreed
and dense values: ``log2 P`` messages of ``p`` from the ranks below ``P`` (one more, the
hand-back, from ranks ``r < N - P``; the ranks from ``P`` on send one) plus a ring all-reduce of
``d``, ``2 (N-1)/N d``, against ``(N-1) p`` for the gathered pairs. The rounds run in sequence:
``log2 P`` of them, two more when ``N`` is not a power of two. With int32
indices and fp32 values (``p = 2d``) the global form sends fewer bytes from ``N = 4`` on (3 vs 3.5
payloads at ``N = 4``; 3.9 vs 7 at 8; 6 vs 31 at 32). The applied update has ``k`` positions per
tensor, where the gathered one has up to ``N k``.

What the exchange asks of the codec (a :class:`~lightning_gc.compressors.sparse.SparseCompressor`):
its selection (:meth:`~lightning_gc.compressors.sparse.SparseCompressor.select_into` on a plan of
:meth:`~lightning_gc.compressors.sparse.SparseCompressor.plan_with`, ``gathered=False``: no pair
buffers), how a bucket splits into compressed tensors with their ``k`` and dense ones
(:meth:`~lightning_gc.compressors.sparse.SparseCompressor.split_layout`), its wire format and the
dtype of its all-reduced values. The rounds, the merges and the agreed all-reduce are this module's.

The cost: the rounds complete inside the comm hook, one after the other (each a blocking
point-to-point swap, so unlike PowerSGD's first round they are not left in flight to the next
bucket's hook), and a merge uses ``torch.unique`` (a device-to-host sync on GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lightning_gc.common.layout import BucketLayout, Segment, segment_positions
from lightning_gc.compressors.base import Compressor, EncodeContext, PlanCache
from lightning_gc.compressors.dense import DensePart, decode_whole_bucket, encode_whole_bucket
from lightning_gc.compressors.encoded import Encoded, Payload, PeerTransfer, Sent
from lightning_gc.compressors.sparse import SparseCompressor, SparsePlan
from lightning_gc.compressors.wire import SparseWireFormat
from lightning_gc.exchanges.base import CodecRounds, RoundsExchange
from lightning_gc.exchanges.transport import Transport


@dataclass(frozen=True)
class SelectionRound:
    """One rank's part in one round of the selection: send its set to rank ``to`` and/or receive
    rank ``source``'s; ``adopt`` takes the received set as the agreed one instead of merging it."""

    to: int | None = None
    source: int | None = None
    adopt: bool = False


def selection_rounds(world_size: int, rank: int) -> list[SelectionRound]:
    """Rank ``rank``'s rounds of the selection among ``world_size`` ranks (module docstring), in
    order; rounds it sits out are left out. Every send has its receive in the partner's list at
    the same position among the rounds the two share."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of {world_size} ranks")
    power = 1 << (world_size.bit_length() - 1)  # P: the largest power of two <= N
    if rank >= power:
        return [SelectionRound(to=rank - power), SelectionRound(source=rank - power, adopt=True)]
    extra = rank + power < world_size
    rounds = [SelectionRound(source=rank + power)] if extra else []
    rounds += [SelectionRound(to=rank ^ bit, source=rank ^ bit) for bit in _bits_below(power)]
    return rounds + ([SelectionRound(to=rank + power)] if extra else [])


def _bits_below(power: int) -> list[int]:
    return [1 << j for j in range(power.bit_length() - 1)]


@dataclass(frozen=True)
class CandidateSlots:
    """Where each compressed tensor's ``k`` candidates sit in a bucket's candidate set.

    ``starts`` (int64, ascending) are the tensors' first bucket positions, ``ks`` their ``k``,
    ``firsts`` their first slot, ``pads`` the position an empty slot holds (its tensor's start,
    with value 0: a no-op that merges may keep).
    """

    starts: torch.Tensor
    stops: torch.Tensor
    ks: torch.Tensor
    firsts: torch.Tensor
    pads: torch.Tensor

    @staticmethod
    def of(compressed: Sequence[tuple[Segment, int, int]], device: torch.device) -> CandidateSlots:
        """The slots of ``compressed``: ``(segment, k, first slot)`` in bucket order."""

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        pads = [segment.start for segment, k, _ in compressed for _ in range(k)]
        return CandidateSlots(
            starts=tensor([s.start for s, _, _ in compressed]),
            stops=tensor([s.stop for s, _, _ in compressed]),
            ks=tensor([k for _, k, _ in compressed]),
            firsts=tensor([first for _, _, first in compressed]),
            pads=tensor(pads),
        )

    @property
    def total(self) -> int:
        return self.pads.numel()


def merge_candidates(
    slots: CandidateSlots,
    first: tuple[torch.Tensor, torch.Tensor],
    second: tuple[torch.Tensor, torch.Tensor],
    out: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """``out <- merge(first, second)`` for two candidate sets of ``(positions, values)``: values
    at the same position add (in float32), and each tensor keeps its ``k`` entries of largest
    magnitude, ties to the lower position, in that order in its slots; slots left over hold
    ``(pad, 0)``. Symmetric: ``merge(a, b)`` and ``merge(b, a)`` are equal bit for bit.
    ``out`` may share storage with neither input."""
    positions = torch.cat([first[0].to(torch.int64), second[0].to(torch.int64)])
    values = torch.cat([first[1].to(torch.float32), second[1].to(torch.float32)])
    unique, inverse = torch.unique(positions, sorted=True, return_inverse=True)
    summed = torch.zeros(unique.numel(), dtype=torch.float32, device=values.device).index_add_(0, inverse, values)
    tensor = torch.searchsorted(slots.starts, unique, right=True) - 1
    by_size = torch.argsort(summed.abs(), descending=True, stable=True)  # stable: ties keep position order
    order = by_size[torch.argsort(tensor[by_size], stable=True)]
    owner = tensor[order]
    rank_in_tensor = torch.arange(order.numel(), device=order.device) - torch.searchsorted(owner, owner)
    keep = rank_in_tensor < slots.ks[owner]
    slot = (slots.firsts[owner] + rank_in_tensor)[keep]
    out[0].copy_(slots.pads)
    out[1].zero_()
    out[0][slot] = unique[order[keep]].to(out[0].dtype)
    out[1][slot] = summed[order[keep]].to(out[1].dtype)


def agreed_positions(slots: CandidateSlots, positions: torch.Tensor) -> torch.Tensor:
    """The sorted agreed positions of a final candidate set: its distinct positions, and where a
    tensor has fewer than ``k`` (its ranks' candidates were fewer distinct positions), its lowest
    positions not among them, so that every tensor has exactly ``k``. A function of the set alone,
    so every rank holding it gets the same tensor."""
    distinct = torch.unique(positions.to(torch.int64), sorted=True)
    if distinct.numel() == slots.total:
        return distinct
    counts = torch.bincount(torch.searchsorted(slots.starts, distinct, right=True) - 1, minlength=slots.ks.numel())
    extra = []
    for index in torch.nonzero(counts < slots.ks).flatten().tolist():
        start, stop = int(slots.starts[index]), int(slots.stops[index])
        free = torch.ones(stop - start, dtype=torch.bool, device=positions.device)
        free[distinct[(distinct >= start) & (distinct < stop)] - start] = False
        need = int(slots.ks[index] - counts[index])
        extra.append(torch.nonzero(free).flatten()[:need] + start)
    return torch.sort(torch.cat([distinct, *extra])).values


@dataclass
class GlobalTopKPlan:
    """One bucket's buffers for the global top-k exchange (built with the sparse plan)."""

    slots: CandidateSlots
    wire: SparseWireFormat
    universe: int
    payload: torch.Tensor  # uint8: this rank's candidate set on the wire
    received: torch.Tensor  # uint8: a peer's
    positions: torch.Tensor  # int64 K: this rank's candidate set
    values: torch.Tensor  # float32 K
    merged: tuple[torch.Tensor, torch.Tensor]  # the next set, written by merge
    agreed: DensePart  # [G | dense positions]: the all-reduced values (G rewritten every step)

    @staticmethod
    def build(
        compressed: Sequence[tuple[Segment, int, int]],
        dense: Sequence[Segment],
        universe: int,
        wire: SparseWireFormat,
        like: torch.Tensor,
        dense_dtype: torch.dtype | None,
    ) -> GlobalTopKPlan:
        """The plan of a bucket of ``universe`` elements whose ``compressed`` tensors send ``k``
        pairs each (``(segment, k, first slot)``) and whose ``dense`` tensors go whole; the
        all-reduced values are of ``dense_dtype`` (default: the gradient's)."""
        device = like.device
        slots = CandidateSlots.of(compressed, device)
        total = slots.total
        nbytes = wire.payload_bytes(total, universe)
        positions = torch.cat([torch.zeros(total, dtype=torch.int64, device=device), segment_positions(dense, device)])
        return GlobalTopKPlan(
            slots=slots,
            wire=wire,
            universe=universe,
            payload=torch.zeros(nbytes, dtype=torch.uint8, device=device),
            received=torch.zeros(nbytes, dtype=torch.uint8, device=device),
            positions=torch.empty(total, dtype=torch.int64, device=device),
            values=torch.empty(total, dtype=torch.float32, device=device),
            merged=(
                torch.empty(total, dtype=torch.int64, device=device),
                torch.empty(total, dtype=torch.float32, device=device),
            ),
            agreed=DensePart.over(positions, like, dtype=dense_dtype),
        )

    # ------------------------------------------------------------------ the rounds
    def first_round(
        self, velocity: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, context: EncodeContext
    ) -> Encoded:
        """The exchange's first round, from this rank's selection ``(indices, values)`` of
        ``velocity``; each round's ``next_round`` leads to the next, the last is the all-reduce."""
        self.positions.copy_(indices)
        self.values.copy_(values)
        rounds = selection_rounds(context.world_size, context.rank)
        return self._round(velocity, rounds, context)

    def _round(self, velocity: torch.Tensor, rounds: list[SelectionRound], context: EncodeContext) -> Encoded:
        if not rounds:
            return self._agreed_round(velocity, context)
        current, rest = rounds[0], rounds[1:]
        if current.to is not None:
            decoded = self.wire.pack(self.payload, self.positions, self.values, self.universe)
            self.values.copy_(decoded)  # merge what the partner decodes, as it does: the two stay equal
        receives = current.source is not None
        peer = PeerTransfer(
            self.payload, to=current.to, into=self.received if receives else None, source=current.source
        )
        return Encoded(
            Payload(
                peer=peer,
                bytes_sent=0 if current.to is None else self.payload.numel(),
                elements_sent=0,  # the values sent are counted once, in the all-reduce
            ),
            next_round=self._after(current, velocity, rest, context),
        )

    def _after(
        self, current: SelectionRound, velocity: torch.Tensor, rest: list[SelectionRound], context: EncodeContext
    ) -> Callable[[], Encoded]:
        def next_round() -> Encoded:
            if current.source is not None:
                theirs = self.wire.unpack(self.received, 1, self.slots.total, self.universe)
                if current.adopt:
                    self.positions.copy_(theirs[0])
                else:
                    merge_candidates(self.slots, (self.positions, self.values), theirs, self.merged)
                    self.positions.copy_(self.merged[0])
                    self.values.copy_(self.merged[1])
            return self._round(velocity, rest, context)

        return next_round

    def _agreed_round(self, velocity: torch.Tensor, context: EncodeContext) -> Encoded:
        """All-reduce every rank's velocity at the agreed positions ``G`` and the dense ones."""
        total = self.slots.total
        self.agreed.positions[:total] = agreed_positions(self.slots, self.positions)
        summed = self.agreed.gather(velocity, context.world_size)
        sent = self.agreed.sent if self.agreed.sent is not None else summed
        dense = self.agreed.positions.numel() > total
        return Encoded(
            Payload.all_reduce(summed),
            Sent(
                indices=self.agreed.positions[:total],
                values=sent[:total],
                dense_positions=self.agreed.positions[total:] if dense else None,
                dense_values=sent[total:] if dense and self.agreed.sent is not None else None,
            ),
            context=self,
        )

    def decode(self, out: torch.Tensor, world_size: int) -> None:
        """``out <- 0`` but the agreed and dense positions, which get the mean over ranks."""
        out.zero_()
        self.agreed.write_mean(out, world_size)


@dataclass
class _Plan:
    """One bucket's plan: the codec's selection (no pair buffers), and the rounds' buffers
    (``None`` for a bucket sent wholly dense, ``compress_ratio == 1``)."""

    selection: SparsePlan
    rounds: GlobalTopKPlan | None


class GlobalTopKExchange(RoundsExchange):
    """Global top-k over ``transport`` for a sparse codec (module docstring; its rounds:
    :class:`GlobalTopKRounds`); the codec's own rounds (its pairs gathered) for a job whose codec
    does not ask for it (the hook's exact fallback).

    Raises:
        ValueError: ``codec`` has no selection to merge (named, with the codecs that have one).
    """

    form = "global_topk"
    rounds: GlobalTopKRounds

    def __init__(self, transport: Transport, codec: Compressor) -> None:
        if not isinstance(codec, SparseCompressor):
            from lightning_gc.compressors.registry import available, compressor_class  # registered after

            sparse = sorted(name for name in available() if issubclass(compressor_class(name), SparseCompressor))
            raise ValueError(
                f"exchange='global_topk' merges the ranks' sparse selections, which compressor {codec.name!r} "
                f"does not make; use one of {sparse}"
            )
        super().__init__(transport, GlobalTopKRounds(codec))


class GlobalTopKRounds(CodecRounds):
    """The global top-k rounds of one sparse codec at one rank (module docstring)."""

    def __init__(self, codec: SparseCompressor) -> None:
        super().__init__(codec)
        self.sparse = codec
        self._plans: PlanCache[_Plan] = PlanCache()

    def plan(self, context: EncodeContext, like: torch.Tensor) -> _Plan:
        """The plan of ``context``'s bucket (rebuilt whenever the codec's settings, the layout, the
        world size, the device or dtype changed)."""
        return self._plans.get(self.codec, context, like, self._build)

    def _build(self, layout: BucketLayout, like: torch.Tensor, world_size: int) -> _Plan:
        sparse = self.sparse
        selection = sparse.plan_with(layout, like, world_size, gathered=False)
        compressed, dense, _ = sparse.split_layout(layout)
        if not compressed:
            return _Plan(selection, None)
        rounds = GlobalTopKPlan.build(compressed, dense, layout.numel, sparse.wire, like, sparse.dense_wire_dtype)
        return _Plan(selection, rounds)

    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        """The first round: this rank's selection, as the codec makes it, to merge."""
        plan = self.plan(context, velocity)
        if plan.rounds is None:
            return encode_whole_bucket(velocity, out)
        self.sparse.select_into(velocity, plan.selection, context.step)
        return plan.rounds.first_round(velocity, plan.selection.sent_indices, plan.selection.sent_values, context)

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        if not decode_whole_bucket(encoded, out, world_size):
            encoded.context.decode(out, world_size)
