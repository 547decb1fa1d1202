"""Two-level exchange for multi-device nodes: dense within a node, compressed across nodes, sharded.

A flat compressed exchange treats ``N`` ranks alike, so the slow link between nodes carries every
device's payload: with ``L`` devices per node, ``L`` times what one node's gradient needs. With
``N = K`` nodes x ``L`` devices and rank ``r = k L + l`` (node ``k``, local rank ``l``: Lightning's
and torchrun's numbering), one bucket with local gradient ``g_r`` goes::

    1. local rank l owns shard l: the l-th of L pieces of every tensor of the bucket
       (lightning_gc.common.layout.chunk_segments, as the two-phase exchange's chunks)
    2. within node k (fast link), reduce-scatter: local rank l gets S_k[shard l], S_k = sum_l g_(k,l)
    3. the pipeline on the shard (lightning_gc.exchanges.pipeline), among the K ranks of local rank l:
           v <- compensate(S_k[shard l]) ; enc = encode(v) ; memory.commit(enc.sent)
           exchange enc.payload across nodes (slow link) ; decode -> (1/K) sum_k decode(enc_k)
           divide by L                          -> the mean over all N ranks, on shard l
    4. within node k, all-gather of the L shards: every rank holds the whole averaged bucket

Slow-link traffic: each rank sends its shard's payload, ``~1/L`` of a bucket's, so a node sends
one bucket's payload across instead of ``L``, and all ``L`` local ranks keep their links busy
(application-level flow splitting). The fast link carries a dense reduce-scatter and all-gather,
``2 (L-1)/L`` of the bucket, what a ring all-reduce would; shards are padded to the largest.

Memory is exact: the residual and momentum of shard ``l`` live on local rank ``l`` only, by parameter
name (each rank holds its piece of each tensor), and what a shard did not send stays there; the
invariant of :mod:`lightning_gc.core.memory` holds for node sums, to which weight decay (added once
per rank) is added ``L`` times, and a momentum handed over (Adam's first moment) is seeded as ``L``
times this rank's piece. Local clipping happens where DGC puts it, on each rank's own gradient per
tensor before the node sum, so it is the flat exchange's exactly.

Equalities the maths gives (and the tests check): with a dense codec the result is DDP's mean up
to float summation order; DGC at ``compress_ratio=1`` is DDP + momentum SGD. A compressor's selection
on a node sum differs from the flat one's on each rank's gradient, so sparse results differ from flat.

The shard's encode and exchange complete inside the comm hook (as the two-phase exchange's first
phase does): only the final intra-node all-gather runs while backward goes on, so every collective is
launched from the hook in bucket order on every rank (:mod:`lightning_gc.exchanges.comm`).

With a delayed exchange (``delay >= 1``, :mod:`lightning_gc.exchanges.delay`) the shard's cross-node
exchange is left in flight instead, overlapping the next step's compute, and steps 3's division and
4 run when the delay line next waits for the bucket: at the bucket's next hook call, or when the
line drains (a checkpoint, the end of training, a bucket rebuild). Both happen on the hook's
thread on every rank in bucket order, so the all-gather keeps the collective order.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from lightning_gc.common.layout import BucketLayout, Shard, piece_bounds
from lightning_gc.common.log import warn_on_rank_zero
from lightning_gc.common.validation import check_choice
from lightning_gc.compressors.base import Compressor
from lightning_gc.compressors.simple import NoCompressor
from lightning_gc.exchanges import comm
from lightning_gc.exchanges.base import Exchange, FlatExchange
from lightning_gc.exchanges.pipeline import BucketJob, BucketStep, reported, wait
from lightning_gc.exchanges.select import exchange_for
from lightning_gc.exchanges.transport import GroupTransport

HIERARCHIES = ("flat", "node", "node_sparse", "auto")
"""``hierarchy`` choices: one flat exchange over all ranks; two levels (nodes, then devices) with
a dense sum within the node; two levels with a sparse reduction within the node
(:mod:`lightning_gc.exchanges.hierarchy_sparse`, sparse compressors); or ``"node"`` when there is more than
one node and more than one device per node."""


@dataclass(frozen=True)
class NodeTopology:
    """Where this rank sits: ``nodes`` x ``per_node`` ranks, rank = ``node * per_node + local``."""

    nodes: int
    per_node: int
    node: int
    local: int

    @staticmethod
    def of(world_size: int, rank: int, devices_per_node: int) -> NodeTopology:
        if not isinstance(devices_per_node, int) or devices_per_node < 1 or world_size % devices_per_node:
            raise ValueError(
                f"devices_per_node={devices_per_node!r} does not divide the world size {world_size}: a two-level "
                "exchange needs the same number of ranks on every node"
            )
        return NodeTopology(world_size // devices_per_node, devices_per_node, *divmod(rank, devices_per_node))

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    def describe(self) -> tuple[int, int]:
        """(nodes, devices per node): what a checkpoint's per-rank state depends on."""
        return self.nodes, self.per_node


def resolve_hierarchy(hierarchy: str, world_size: int, rank: int, devices_per_node: int | None) -> NodeTopology | None:
    """The topology of a two-level exchange, or ``None`` for a flat one.

    ``devices_per_node``: ranks per node (Lightning's devices; torchrun's ``LOCAL_WORLD_SIZE``);
    ``None`` reads ``LOCAL_WORLD_SIZE``, and is an error for ``"node"`` and ``"node_sparse"`` when
    that is unset too."""
    check_choice("hierarchy", hierarchy, HIERARCHIES)
    if hierarchy == "flat":
        return None
    if devices_per_node is None and "LOCAL_WORLD_SIZE" in os.environ:
        devices_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    if devices_per_node is None:
        if hierarchy == "auto":
            return None
        raise ValueError(
            f"hierarchy={hierarchy!r} needs the number of devices per node: pass devices_per_node, or launch with "
            "torchrun (which sets LOCAL_WORLD_SIZE)"
        )
    topology = NodeTopology.of(world_size, rank, devices_per_node)
    if topology.nodes == 1 or topology.per_node == 1:
        if hierarchy == "auto":
            return None
        warn_on_rank_zero(
            f"lightning_gc: hierarchy={hierarchy!r} on {topology.nodes} node(s) x {topology.per_node} device(s): "
            + (
                (
                    "with one node this is exchange='global_topk' among its devices"
                    if hierarchy == "node_sparse"
                    else "with one node every gradient is averaged exactly within it and nothing is compressed"
                )
                if topology.nodes == 1
                else "with one device per node the two levels add nothing to the flat exchange"
            )
            + "; hierarchy='auto' picks two levels only for several nodes of several devices"
        )
    return topology


def agreed_topology(
    hierarchy: str, devices_per_node: int | None, group: dist.ProcessGroup | None = None
) -> NodeTopology | None:
    """:func:`resolve_hierarchy` on every rank of ``group``, checked to agree before any group is
    built: a rank that sees another ``LOCAL_WORLD_SIZE`` or ``devices_per_node`` raises the same
    ``ValueError`` on every rank instead of leaving the others waiting in ``new_group``."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    try:
        topology = resolve_hierarchy(hierarchy, world_size, rank, devices_per_node)
        mine: object = None if topology is None else topology.describe()
    except ValueError as error:
        topology, mine = None, f"error: {error}"
    every: list[object] = [None] * world_size
    dist.all_gather_object(every, mine, group=group)
    failed = [f"rank {r}: {seen}" for r, seen in enumerate(every) if isinstance(seen, str)]
    if failed:
        raise ValueError(f"hierarchy={hierarchy!r} could not be set up: " + "; ".join(failed))
    if any(seen != every[0] for seen in every):
        raise ValueError(
            f"the ranks disagree on hierarchy={hierarchy!r}: (nodes, devices per node) per rank {every}; give every "
            "rank the same devices_per_node (or LOCAL_WORLD_SIZE)"
        )
    return topology


@dataclass
class _ShardPlan:
    """One bucket layout's shards (every local rank's, for the final all-gather) and buffers."""

    mine: Shard
    positions: list[torch.Tensor]  # every local rank's shard positions in the bucket
    rows: torch.Tensor  # L x P: row l for shard l, padded with zeros (reduce-scatter in, all-gather out)
    row: torch.Tensor  # P: this rank's row of the node sum, then of the average
    averaged: torch.Tensor  # P: a delayed exchange's shard average, unscaled (run_bucket's `out`)


class NodeHierarchy(Exchange):
    """The process groups and per-bucket shards of a two-level exchange (module docstring).

    Construction creates ``nodes + per_node`` process groups and must run on every rank in the
    same order (as ``torch.distributed.new_group`` requires): the ranks of each node, then the
    ranks of each local rank across nodes."""

    knows_own_contribution = False  # a rank's part is a piece of its node's sum

    def __init__(self, topology: NodeTopology, codec: Compressor | None = None) -> None:
        if dist.get_world_size() != topology.world_size:
            raise ValueError(
                f"the topology {topology.nodes} nodes x {topology.per_node} devices does not match the "
                f"world size {dist.get_world_size()}"
            )
        self.topology = topology
        nodes, per_node = topology.nodes, topology.per_node
        node_groups = [dist.new_group([node * per_node + j for j in range(per_node)]) for node in range(nodes)]
        cross_groups = [dist.new_group([node * per_node + j for node in range(nodes)]) for j in range(per_node)]
        self.node_group = node_groups[topology.node]
        self.cross_transport = GroupTransport(cross_groups[topology.local])
        # across nodes, the exchange the codec's arguments choose (e.g. two-phase among the nodes)
        self.cross = FlatExchange(self.cross_transport) if codec is None else exchange_for(codec, self.cross_transport)
        self._plans: dict[int, tuple[BucketLayout, _ShardPlan]] = {}
        # one node: nothing crosses a slower link, so each shard's node sum goes exact (as warned)
        self._exact = NoCompressor() if nodes == 1 else None

    @property
    def state_shape(self) -> tuple[int, ...]:
        """What each rank's compression state depends on, recorded in a checkpoint: (nodes,
        devices per node), since each rank holds its piece of every tensor's residual."""
        return self.topology.describe()

    @property
    def seed_view(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """How the memory seeds a momentum handed over (Adam's first moment): :meth:`node_sum_piece`."""
        return self.node_sum_piece

    def state_dict(self) -> dict[str, Any]:
        """The cross-node exchange's state (two-phase server errors among the nodes)."""
        return self.cross.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cross.load_state_dict(state)

    def snapshot(self, previous: Any = None) -> Any:
        return self.cross.snapshot(previous)

    def restore(self, snapshot: Any) -> None:
        self.cross.restore(snapshot)

    def node_sum_piece(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a whole parameter's flattened per-rank quantity, in node-sum units
        (times the devices per node): what the memory holds of a momentum handed over."""
        low, high = piece_bounds(flat.numel(), self.topology.local, self.topology.per_node)
        return flat[low:high] * self.topology.per_node

    def plan(self, layout: BucketLayout, like: torch.Tensor) -> _ShardPlan:
        """The shards of ``layout`` (built once per layout)."""
        cached = self._plans.get(layout.index)
        if cached is not None and cached[0] is layout:
            return cached[1]
        per_node = self.topology.per_node
        shards = [Shard.build(layout, local, per_node, like.device) for local in range(per_node)]
        mine = shards[self.topology.local]
        positions = [shard.positions for shard in shards]
        widest = max(shard.numel for shard in shards)
        plan = _ShardPlan(
            mine=mine,
            positions=positions,
            rows=torch.zeros(per_node, widest, dtype=like.dtype, device=like.device),
            row=torch.zeros(widest, dtype=like.dtype, device=like.device),
            averaged=torch.zeros(widest, dtype=like.dtype, device=like.device),
        )
        self._plans[layout.index] = (layout, plan)
        return plan

    def run(self, job: BucketJob) -> BucketStep:
        """One bucket through the two levels; ``averaged`` resolves to ``job.grad`` holding the mean.

        With ``job.out`` (a delayed exchange's slot, bucket-sized) the mean is left unscaled in
        ``out`` instead: the cross-node exchange is left in flight, and the returned step's
        ``finish`` completes the bucket, after which ``averaged`` resolves (see the module docstring)."""
        grad, layout, out, failure = job.grad, job.layout, job.out, job.failure
        memory, guard, step, loss_scale, timeline = job.memory, job.guard, job.step, job.loss_scale, job.timeline
        topology = self.topology
        compressor = job.compressor if self._exact is None else self._exact
        plan = self.plan(layout, grad)
        memory.clip_local_(grad, layout, topology.world_size, loss_scale)
        for positions, row in zip(plan.positions, plan.rows):
            torch.index_select(grad, 0, positions, out=row[: positions.numel()])  # padding stays 0
        with reported(failure), timeline.waiting():
            comm.reduce_scatter_sum(plan.rows.view(-1), plan.row, self.node_group)
        shard = plan.mine
        local = plan.row[: shard.numel]  # this node's sum on shard l
        bytes_sent = elements_sent = 0
        averaged = local if out is None else plan.averaged[: shard.numel]
        in_flight: Future[torch.Tensor] | None = None
        if shard.numel:  # every rank of this local rank has the same (empty) shard: none exchanges
            shard_job = job.but(
                compressor=compressor,
                grad=local,
                layout=shard.layout,
                out=None if out is None else averaged,
                params=shard.pieces_of(list(job.params)),
                absent=shard.segments_of({segment.name for segment in job.absent}),
                on_decoded=job.on_decoded if out is not None else None,  # waiting here, it reports below
                summed_ranks=topology.per_node,
                clip=False,
                own=None,
                defer_rounds=False,
            )
            sent = self.cross.run(shard_job)
            in_flight = sent.averaged
            bytes_sent, elements_sent = sent.bytes_sent, sent.elements_sent
        elif guard is not None:  # still take part in the step's settling, as every rank must
            guard.screen(
                local, shard.layout, memory.bucket(shard.layout, local), step=step, loss_scaled=loss_scale is not None
            )
        if out is not None:
            done: Future[torch.Tensor] = Future()
            finish = delayed_finisher(in_flight, lambda: self._gather(plan, averaged, out, failure), out, done, failure)
            return BucketStep(averaged=done, bytes_sent=bytes_sent, elements_sent=elements_sent, finish=finish)
        if in_flight is not None:
            with timeline.waiting():
                wait(in_flight, failure)
            if job.on_decoded is not None:
                job.on_decoded(timeline)
        return BucketStep(
            averaged=self._gather(plan, local, grad, failure),
            bytes_sent=bytes_sent,
            elements_sent=elements_sent,
        )

    def _gather(
        self,
        plan: _ShardPlan,
        averaged: torch.Tensor,
        into: torch.Tensor,
        failure: Callable[[Exception], Exception] | None,
    ) -> Future[torch.Tensor]:
        """Steps 3's division and 4: this rank's shard mean (``averaged``, the node sum's average
        over nodes) divided by ``L`` into its row, the rows all-gathered within the node and
        written into ``into``; the future resolves to ``into``."""
        local = plan.row[: averaged.numel()]
        torch.div(averaged, self.topology.per_node, out=local)
        gathered = comm.allgather_fixed(plan.row, plan.rows.view(-1), self.node_group)
        return gathered.then(_scattering_into(into, plan, failure))


def delayed_finisher(
    in_flight: Future[torch.Tensor] | None,
    spread: Callable[[], Future[torch.Tensor]],
    slot: torch.Tensor,
    done: Future[torch.Tensor],
    failure: Callable[[Exception], Exception] | None,
) -> Callable[[], None]:
    """What finishes a delayed two-level bucket once its cross-node exchange is ``in_flight``: wait
    for it, then for ``spread()`` (which launches the intra-node all-gather writing the mean into
    ``slot``), and resolve ``done`` with ``slot``. It launches a collective, so it runs on the hook's
    thread, on every rank in bucket order (``BucketStep.finish``)."""

    def finish() -> None:
        try:
            if in_flight is not None:
                wait(in_flight, failure)
            wait(spread(), failure)
        except Exception as error:  # whoever waits on `done` next must see it, not hang
            done.set_exception(error)
            raise
        done.set_result(slot)

    return finish


def _scattering_into(
    grad: torch.Tensor, plan: _ShardPlan, failure: Callable[[Exception], Exception] | None
) -> Callable[[Future[torch.Tensor]], torch.Tensor]:
    """A ``.then`` callback writing every local rank's averaged shard into the bucket (holds neither
    the hook state nor a process group: it runs on the backend's thread)."""

    def scatter(done: Future[torch.Tensor]) -> torch.Tensor:
        wait(done, failure)
        for positions, row in zip(plan.positions, plan.rows):
            grad.index_copy_(0, positions, row[: positions.numel()])
        return grad

    return scatter
