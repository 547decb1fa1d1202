"""Two-level exchange whose traffic inside the node is sparse too (``hierarchy="node_sparse"``).

``hierarchy="node"`` (:mod:`lightning_gc.hierarchy`) sums each node's gradients densely: a
reduce-scatter and an all-gather of the whole bucket over the node's link. That is what an
NVLink-class link is for; over PCIe without peer access, on CPU nodes, or wherever the node's link
is not much faster than the network, moving the dense bucket twice costs more than the compressed
exchange it saves. Here no message carries the dense bucket. For a sparse compressor (``topk``,
``dgc``) over ``N = K`` nodes x ``L`` devices, rank ``r = k L + l`` (node ``k``, local rank ``l``),
one bucket with velocity ``v_r`` goes::

    1. within node k (fast link): global top-k among its L ranks (lightning_gc.compressors.global_topk):
       each rank's own selection of v_r, merged pairwise in log2 L rounds, agrees on the positions
       G_k (k per compressed tensor); then one all-reduce of the velocities there and of the dense
       tensors' values (positions D):
           A_k = (1/L) sum_l v_(k,l)[G_k + D] ;   v_(k,l)[G_k + D] <- 0     (memory.commit)
    2. the node's pairs P_k = (G_k + D, A_k), the same on its L ranks, cut into L equal slices:
       local rank l all-gathers slice l of P_k among the K ranks of local rank l (slow link)
    3. within node k, all-gather of what step 2 received: every rank holds every node's pairs
    4. out = (1/K) sum_k scatter(P_k)                    (the mean over all N ranks)

Slow-link traffic per node and bucket: one node's pairs, ``T = sum k + |D|`` positions and values,
whatever ``L`` is (the flat exchange: ``L T``), each local rank carrying ``T / L`` of it so that
every local rank's link is busy. Fast-link traffic: the merge rounds' ``k`` pairs, the all-reduce
of ``T`` values and the all-gather of ``K T`` pairs, never the dense bucket.

**Nothing is lost, and memory is the flat exchange's.** Step 1 is global top-k's rule within a
node: the values applied are the exact node mean of every rank's velocity at ``G_k``, and every
other position stays in each rank's own velocity (and momentum) for later steps; steps 2 to 4 drop
nothing. So each rank keeps its whole residual, as in the flat exchange (not a piece, as
``hierarchy="node"`` does): a checkpoint written flat resumes here and the other way round. Local
clipping is on each rank's own gradient with the flat threshold ``clip_norm / sqrt(N)``.

Equalities the maths gives: at ``compress_ratio=1`` it is DDP's mean (float summation order aside).
Below 1 the update differs from the flat one (``k`` positions per tensor per node instead of up to
``L k``), as global top-k's does from the gather.

A bucket whose compressor is not sparse (a dense one chosen by ``compress_when``) goes flat.
With a delayed exchange (``delay >= 1``) step 2 is left in flight and steps 3 and 4 run when the
delay line next waits for the bucket (:class:`~lightning_gc.pipeline.BucketStep` ``finish``), as
in :mod:`lightning_gc.hierarchy`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from lightning_gc import comm, kernels
from lightning_gc.compressors.base import Compressor, EncodeContext, Encoded, PlannedCompressor
from lightning_gc.compressors.sparse import SparseCompressor, SparsePlan
from lightning_gc.exchange import CollectiveExchange
from lightning_gc.guard import StepGuard
from lightning_gc.hierarchy import NodeHierarchy, NodeTopology
from lightning_gc.layout import BucketLayout, Segment, piece_bounds
from lightning_gc.memory import CompensationMemory
from lightning_gc.pipeline import EXCHANGE, BucketStep, Timeline, reported, run_bucket, wait

_ALIGN = 4  # slots per slice rounded up to this: the values (2, 4 or 8 bytes) then the int32 positions stay aligned


def two_level_exchange(hierarchy: str, topology: NodeTopology) -> NodeHierarchy:
    """The two-level exchange ``hierarchy`` names (``"node_sparse"``: this module's; ``"node"``
    and ``"auto"``: the dense sum within the node) on ``topology``; builds process groups, so every
    rank calls it in the same order."""
    return SparseNodeHierarchy(topology) if hierarchy == "node_sparse" else NodeHierarchy(topology)


def check_sparse_hierarchy(compressor: Compressor) -> None:
    """``ValueError`` unless ``compressor`` can run ``hierarchy="node_sparse"``: a sparse compressor
    gathering its pairs (the nodes' pairs are gathered across nodes)."""
    from lightning_gc.compressors.registry import available, compressor_class  # registered after this module

    sparse = sorted(name for name in available() if issubclass(compressor_class(name), SparseCompressor))
    if not isinstance(compressor, SparseCompressor):
        raise ValueError(
            f"`hierarchy='node_sparse'` agrees sparse positions within each node, which compressor "
            f"{compressor.name!r} does not send; use one of {sparse}, or hierarchy='node' (a dense sum within the node)"
        )
    if compressor.exchange != "gather":
        raise ValueError(
            f"`hierarchy='node_sparse'` runs global top-k within each node and gathers the nodes' pairs across "
            f"nodes, so it takes exchange='gather', got exchange={compressor.exchange!r}; for global top-k "
            "across nodes use hierarchy='node'"
        )


class AgreedWithinNode(PlannedCompressor[SparsePlan]):
    """A sparse compressor's selection with its positions agreed by global top-k, whatever its own
    ``exchange`` (which says how nodes exchange). Its settings are read live from ``sparse``
    (a ratio set by :class:`~lightning_gc.SparsityWarmup` counts); it records the plan each
    bucket last encoded with, for the agreed positions."""

    name = "global top-k within the node"

    def __init__(self, sparse: SparseCompressor) -> None:
        super().__init__()
        self.sparse = sparse
        self.used: dict[int, SparsePlan] = {}
        self._every: dict[int, torch.Tensor] = {}

    def config(self) -> dict[str, Any]:
        return {**self.sparse.config(), "exchange": "global_topk"}

    def wire_bytes(self, layout: BucketLayout, element_size: int) -> int:
        return self.sparse.wire_bytes(layout, element_size, exchange="global_topk")

    def build_plan(self, layout: BucketLayout, like: torch.Tensor, world_size: int) -> SparsePlan:
        return self.sparse.plan_with(layout, like, world_size, exchange="global_topk")

    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        plan = self.plan(context, velocity)
        self.used[context.layout.index] = plan
        return self.sparse.encode_planned(plan, velocity, out, context)

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        self.sparse.decode(encoded, out, world_size=world_size)

    def positions(self, layout: BucketLayout) -> torch.Tensor:
        """The positions the last encode of ``layout`` set (the agreed ones, then the dense
        tensors'): every position when nothing of the bucket was compressed."""
        plan = self.used[layout.index]
        if plan.global_topk is not None:
            return plan.global_topk.agreed.positions
        every = self._every.get(layout.index)
        if every is None or every.numel() != layout.numel or every.device != plan.sent_indices.device:
            every = self._every[layout.index] = torch.arange(layout.numel, device=plan.sent_indices.device)
        return every


@dataclass
class _NodePairs:
    """One bucket's buffers for steps 2-4: this rank's slice of the node's pairs and what the two
    all-gathers receive, each a row of ``width`` values (the gradient's dtype) then ``width``
    int32 positions; slots past the end hold position 0 and value 0 (adding nothing)."""

    positions: torch.Tensor  # the node's T positions (step 1's), read every step
    low: int
    high: int
    width: int
    mine: torch.Tensor  # uint8 row
    across: torch.Tensor  # uint8, K rows: slice l of every node's pairs
    everyone: torch.Tensor  # uint8, L x K rows: every node's pairs

    @staticmethod
    def build(positions: torch.Tensor, topology: NodeTopology, like: torch.Tensor) -> _NodePairs:
        total, local, per_node = positions.numel(), topology.local, topology.per_node
        width = -(-total // per_node)
        width = -(-width // _ALIGN) * _ALIGN
        low, high = piece_bounds(total, local, per_node)
        row = width * (like.element_size() + 4)
        device = like.device
        return _NodePairs(
            positions=positions,
            low=low,
            high=high,
            width=width,
            mine=torch.zeros(row, dtype=torch.uint8, device=device),
            across=torch.zeros(topology.nodes * row, dtype=torch.uint8, device=device),
            everyone=torch.zeros(per_node * topology.nodes * row, dtype=torch.uint8, device=device),
        )

    def fits(self, positions: torch.Tensor, like: torch.Tensor) -> bool:
        return self.positions is positions and self.mine.numel() == self.width * (like.element_size() + 4)

    def _fields(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, positions) of ``rows`` (uint8, whole rows), each rows x width."""
        split = self.width * dtype.itemsize
        table = rows.view(-1, self.mine.numel())
        return table[:, :split].view(dtype), table[:, split:].view(torch.int32)

    def stage(self, node_mean: torch.Tensor) -> None:
        """This rank's slice of the node's pairs into :attr:`mine`."""
        values, positions = self._fields(self.mine, node_mean.dtype)
        count = self.high - self.low
        mine = self.positions[self.low : self.high]
        positions[0, :count].copy_(mine)
        torch.index_select(node_mean, 0, mine, out=values[0, :count])

    def scatter_mean(self, out: torch.Tensor, nodes: int) -> None:
        """``out <- (1/K) sum_k scatter(P_k)`` from :attr:`everyone`."""
        values, positions = self._fields(self.everyone, out.dtype)
        out.zero_()
        kernels.scatter_average_(out, positions.reshape(-1), values.reshape(-1), nodes)


class SparseNodeHierarchy(NodeHierarchy):
    """The groups of a two-level exchange (:class:`NodeHierarchy`) run as the module docstring says."""

    def __init__(self, topology: NodeTopology) -> None:
        super().__init__(topology)
        self.node_exchange = CollectiveExchange(self.node_group)
        self.flat_exchange = CollectiveExchange(None)
        self._agreements: dict[int, AgreedWithinNode] = {}
        self._pairs: dict[int, _NodePairs] = {}

    @property
    def state_shape(self) -> tuple[int, ...]:
        return ()  # every rank keeps its whole residual, as the flat exchange does

    @property
    def seed_view(self) -> None:
        return None  # a momentum handed over is this rank's own, as in the flat exchange

    def _agreement(self, compressor: SparseCompressor) -> AgreedWithinNode:
        agreement = self._agreements.get(id(compressor))
        if agreement is None or agreement.sparse is not compressor:
            agreement = self._agreements[id(compressor)] = AgreedWithinNode(compressor)
        return agreement

    def _node_pairs(self, layout: BucketLayout, positions: torch.Tensor, like: torch.Tensor) -> _NodePairs:
        pairs = self._pairs.get(layout.index)
        if pairs is None or not pairs.fits(positions, like):
            pairs = self._pairs[layout.index] = _NodePairs.build(positions, self.topology, like)
        return pairs

    def run(
        self,
        compressor: Compressor,
        memory: CompensationMemory,
        grad: torch.Tensor,
        layout: BucketLayout,
        *,
        step: int,
        params: list[torch.Tensor],
        absent: list[Segment],
        loss_scale: float | None,
        guard: StepGuard | None,
        timeline: Timeline,
        on_decoded: Callable[[Timeline], None] | None,
        failure: Callable[[Exception], Exception] | None,
        out: torch.Tensor | None = None,
    ) -> BucketStep:
        """One bucket through steps 1-4; ``averaged`` resolves to ``grad`` (or ``out``, a delayed
        exchange's slot, left unscaled, after the returned step's ``finish``) holding the mean."""
        topology = self.topology
        common: dict[str, Any] = {
            "step": step,
            "params": params,
            "absent": absent,
            "loss_scale": loss_scale,
            "guard": guard,
            "timeline": timeline,
            "failure": failure,
            "out": out,
        }
        bucket_memory = memory.bucket(layout, grad)
        if not isinstance(compressor, SparseCompressor):
            flat = run_bucket(
                compressor,
                memory,
                bucket_memory,
                grad,
                layout,
                self.flat_exchange,
                world_size=topology.world_size,
                rank=dist.get_rank(),
                on_decoded=on_decoded,
                **common,
            )
            return flat
        agreement = self._agreement(compressor)
        memory.clip_local_(grad, layout, topology.world_size, loss_scale)
        node = run_bucket(
            agreement,
            memory,
            bucket_memory,
            grad,
            layout,
            self.node_exchange,
            world_size=topology.per_node,
            rank=topology.local,
            clip=False,
            **common,
        )
        wait(node.averaged, failure)
        target = grad if out is None else out
        timeline.start()
        pairs = self._node_pairs(layout, agreement.positions(layout), target)
        pairs.stage(target)
        timeline.mark("stage")
        with reported(failure):
            across = comm.allgather_fixed(pairs.mine, pairs.across, self.cross_exchange.group)
        timeline.mark(EXCHANGE)
        sent = {"bytes_sent": pairs.mine.numel(), "elements_sent": pairs.high - pairs.low}
        if out is None:
            wait(across, failure)
            timeline.mark(EXCHANGE)
            return BucketStep(averaged=self._spread(pairs, target, timeline, on_decoded, failure), **sent)
        done: Future[torch.Tensor] = Future()

        def finish() -> None:
            try:
                wait(across, failure)
                wait(self._spread(pairs, target, timeline, on_decoded, failure), failure)
            except Exception as error:  # whoever waits on `done` next must see it, not hang
                done.set_exception(error)
                raise
            done.set_result(target)

        return BucketStep(averaged=done, finish=finish, **sent)

    def _spread(
        self,
        pairs: _NodePairs,
        target: torch.Tensor,
        timeline: Timeline,
        on_decoded: Callable[[Timeline], None] | None,
        failure: Callable[[Exception], Exception] | None,
    ) -> Future[torch.Tensor]:
        """Steps 3 and 4: the all-gather within the node, then the mean into ``target``."""
        gathered = comm.allgather_fixed(pairs.across, pairs.everyone, self.node_group)
        return gathered.then(_decoding_into(target, pairs, self.topology.nodes, timeline, on_decoded, failure))


def _decoding_into(
    target: torch.Tensor,
    pairs: _NodePairs,
    nodes: int,
    timeline: Timeline,
    on_decoded: Callable[[Timeline], None] | None,
    failure: Callable[[Exception], Exception] | None,
) -> Callable[[Future[torch.Tensor]], torch.Tensor]:
    """A ``.then`` callback for step 4 (holds neither the hook state nor a process group: it runs
    on the backend's thread)."""

    def decode(done: Future[torch.Tensor]) -> torch.Tensor:
        wait(done, failure)
        timeline.start()
        pairs.scatter_mean(target, nodes)
        timeline.mark("decode")
        if on_decoded is not None:
            on_decoded(timeline)
        return target

    return decode
