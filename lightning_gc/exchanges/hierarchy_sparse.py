"""Two-level exchange whose traffic inside the node is sparse too (``hierarchy="node_sparse"``).

``hierarchy="node"`` (:mod:`lightning_gc.exchanges.hierarchy`) sums each node's gradients densely: a
reduce-scatter and an all-gather of the whole bucket over the node's link. That is what an
NVLink-class link is for; over PCIe without peer access, on CPU nodes, or wherever the node's link
is not much faster than the network, moving the dense bucket twice costs more than the compressed
exchange it saves. Here no message carries the dense bucket. For a sparse compressor (``topk``,
``dgc``) over ``N = K`` nodes x ``L`` devices, rank ``r = k L + l`` (node ``k``, local rank ``l``),
one bucket with velocity ``v_r`` goes::

    1. within node k (fast link): global top-k among its L ranks (lightning_gc.exchanges.global_topk):
       each rank's own selection of v_r, merged pairwise in log2 L rounds, agrees on the positions
       G_k (k per compressed tensor); then one all-reduce of the velocities there and of the dense
       tensors' values (positions D):
           A_k = (1/L) sum_l v_(k,l)[G_k + D] ;   v_(k,l)[G_k + D] <- 0     (memory.commit)
    2. the node's pairs P_k = (G_k + D, A_k), the same on its L ranks, each part cut into L equal
       slices: local rank l all-gathers slice l of P_k among the K ranks of local rank l (slow
       link); G_k's positions travel with their values, D's values alone (D is every node's)
    3. within node k, all-gather of what step 2 received: every rank holds every node's pairs
    4. out = (1/K) sum_k scatter(P_k)                    (the mean over all N ranks)

Slow-link traffic per node and bucket: one node's pairs, ``sum k`` positions and values and
``|D|`` values, whatever ``L`` is: one flat rank's payload (the flat exchange sends ``L`` of them),
each local rank carrying ``1/L`` of it so that every local rank's link is busy. Fast-link traffic:
the merge rounds' ``k`` pairs, the all-reduce of ``sum k + |D|`` values and the all-gather of ``K``
nodes' pairs; never the dense bucket, which is written once, in step 4 (step 1 reads the node mean
where the all-reduce left it).

**Nothing is lost, and memory is the flat exchange's.** Step 1 is global top-k's rule within a
node: the values applied are the exact node mean of every rank's velocity at ``G_k``, and every
other position stays in each rank's own velocity (and momentum) for later steps; steps 2 to 4 drop
nothing. So each rank keeps its whole residual, as in the flat exchange (not a piece, as
``hierarchy="node"`` does): a checkpoint written flat resumes here and the other way round. Local
clipping is on each rank's own gradient with the flat threshold ``clip_norm / sqrt(N)``.

Equalities the maths gives: at ``compress_ratio=1`` it is DDP's mean (float summation order aside).
Below 1 the update differs from the flat one (``k`` positions per tensor per node instead of up to
``L k``), as global top-k's does from the gather.

Steps 1 and 2 are launched from the bucket's comm hook; step 1 completes there (the merge
rounds are blocking point-to-point swaps). Step 2 is left in flight and steps 3 and 4 run at the
next bucket's hook (the comm hook's :class:`~lightning_gc.exchanges.pipeline.RoundQueue`, as the two-phase
exchange's second phase does), so the slow-link all-gather travels while backward computes; the
last bucket's hook finishes every bucket. Every rank launches the same collectives in the same
order. With a delayed exchange (``delay >= 1``) steps 3 and 4 run instead when the delay line next
waits for the bucket (:class:`~lightning_gc.exchanges.pipeline.BucketStep` ``finish``), as in
:mod:`lightning_gc.exchanges.hierarchy`.

A bucket whose compressor is not sparse (a dense one chosen by ``compress_when``) goes through
the comm hook's flat exchange (:meth:`SparseNodeHierarchy.takes`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from functools import partial

import torch
from torch.futures import Future

from lightning_gc import kernels
from lightning_gc.common.layout import BucketLayout, piece_bounds
from lightning_gc.compressors.base import Compressor, EncodeContext
from lightning_gc.compressors.encoded import Encoded
from lightning_gc.compressors.numerics import mean_into
from lightning_gc.compressors.sparse import SparseCompressor
from lightning_gc.compressors.wire import check_int32_positions
from lightning_gc.exchanges import comm
from lightning_gc.exchanges.base import FlatExchange
from lightning_gc.exchanges.global_topk import GlobalTopKPlan, GlobalTopKRounds
from lightning_gc.exchanges.hierarchy import NodeHierarchy, NodeTopology, delayed_finisher
from lightning_gc.exchanges.pipeline import (
    EXCHANGE,
    BucketJob,
    BucketStep,
    Timeline,
    pending_like,
    reported,
    run_bucket,
    settle,
    wait,
)
from lightning_gc.exchanges.transport import GroupTransport

_ALIGN = 4  # slots per slice rounded up to this: the values (2, 4 or 8 bytes) then the int32 positions stay aligned


def two_level_exchange(hierarchy: str, topology: NodeTopology, codec: Compressor | None = None) -> NodeHierarchy:
    """The two-level exchange ``hierarchy`` names (``"node_sparse"``: this module's; ``"node"``
    and ``"auto"``: the dense sum within the node, ``codec``'s chosen exchange across nodes) on
    ``topology``; builds process groups, so every rank calls it in the same order."""
    return SparseNodeHierarchy(topology) if hierarchy == "node_sparse" else NodeHierarchy(topology, codec)


def check_sparse_hierarchy(compressor: Compressor) -> None:
    """``ValueError`` unless ``compressor`` can run ``hierarchy="node_sparse"``: a sparse compressor
    gathering its pairs (the nodes' pairs are gathered across nodes)."""
    from lightning_gc.compressors.registry import available, compressor_class  # registered after this module

    if not isinstance(compressor, SparseCompressor):
        sparse = sorted(name for name in available() if issubclass(compressor_class(name), SparseCompressor))
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


class AgreedWithinNode:
    """Global top-k within the node: the rounds of :class:`~lightning_gc.exchanges.global_topk.GlobalTopKRounds`
    over the node's ranks for a sparse compressor, whatever its own ``exchange`` (which says how
    nodes exchange). Decode leaves the agreed positions' sums where they are (:meth:`node_mean`
    reads them) instead of zeroing the bucket and writing them; it records the plan each bucket
    last encoded with, for the agreed positions."""

    name = "global top-k within the node"

    def __init__(self, agreement: GlobalTopKRounds) -> None:
        self.agreement = agreement
        self.sparse = agreement.sparse
        self.used: dict[int, GlobalTopKPlan | None] = {}
        self._every: dict[int, torch.Tensor] = {}

    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        self.used[context.layout.index] = self.agreement.plan(context, velocity).rounds
        return self.agreement.encode(velocity, out, context)

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        """Nothing for agreed positions; a wholly dense bucket's mean."""
        if not isinstance(encoded.context, GlobalTopKPlan):
            self.agreement.decode(encoded, out, world_size=world_size)

    def node_mean(self, layout: BucketLayout, decoded: torch.Tensor, per_node: int) -> NodeMean:
        """The node's pairs after the last exchange of ``layout`` within the node: the agreed
        positions with the node mean there, then the dense tensors' positions and means; for a
        bucket sent wholly dense (decoded into ``decoded``), every position."""
        rounds = self.used[layout.index]
        if rounds is None:
            every = self._every.get(layout.index)
            if every is None or every.numel() != layout.numel or every.device != decoded.device:
                every = self._every[layout.index] = torch.arange(layout.numel, device=decoded.device)
            return NodeMean(every, decoded, agreed=0, scaled=True)
        agreed = rounds.agreed
        mean = mean_into(agreed.values if agreed.staging is None else agreed.staging, agreed.values, per_node)
        return NodeMean(agreed.positions, mean, agreed=rounds.slots.total, scaled=False)


@dataclass(frozen=True)
class NodeMean:
    """A node's pairs: ``means[i]`` at bucket position ``positions[i]``; the first ``agreed`` are
    the agreed positions (new every step), the rest the dense tensors' (fixed for the plan).
    ``scaled``: the means carry a grad scaler's scale already (a wholly dense bucket's decode)."""

    positions: torch.Tensor
    means: torch.Tensor
    agreed: int
    scaled: bool


def _padded(count: int, per_node: int) -> int:
    """Slots of one local rank's slice of ``count`` values: ``ceil(count / L)``, rounded up to
    :data:`_ALIGN`."""
    slots = -(-count // per_node)
    return -(-slots // _ALIGN) * _ALIGN


@dataclass
class _NodePairs:
    """One bucket's buffers for steps 2-4. A row is this local rank's slice of its node's pairs:
    ``agreed_width`` values of agreed positions and ``dense_width`` of dense ones (the gradient's
    dtype), then the agreed positions (int32). The dense positions are the same on every node and
    step, so they do not travel: :attr:`dense_targets` holds them for every row of
    :attr:`everyone`, built once. Slots past a slice's end hold position 0 and value 0 (adding
    nothing)."""

    positions: torch.Tensor  # the node's positions (NodeMean.positions), the plan's buffer
    dtype: torch.dtype  # of the values: the gradient's
    agreed: tuple[int, int]  # this rank's slice [low, high) of the agreed positions
    dense: tuple[int, int]  # and of the dense ones (counted from the first dense position)
    agreed_width: int
    dense_width: int
    dense_targets: torch.Tensor  # int64, L x K x dense_width flat: the dense positions of each row of `everyone`
    mine: torch.Tensor  # uint8 row
    across: torch.Tensor  # uint8, K rows: slice l of every node's pairs
    everyone: torch.Tensor  # uint8, L x K rows (local rank-major): every node's pairs

    @staticmethod
    def build(node: NodeMean, topology: NodeTopology, like: torch.Tensor) -> _NodePairs:
        per_node, local, device = topology.per_node, topology.local, like.device
        dense_count = node.positions.numel() - node.agreed
        agreed_width, dense_width = _padded(node.agreed, per_node), _padded(dense_count, per_node)
        dense_rows = torch.zeros(per_node, dense_width, dtype=torch.int64, device=device)
        for other in range(per_node):
            low, high = piece_bounds(dense_count, other, per_node)
            dense_rows[other, : high - low] = node.positions[node.agreed + low : node.agreed + high]
        nodes = topology.nodes  # the rows of `everyone`: local rank-major, then node
        dense_targets = dense_rows[:, None, :].expand(per_node, nodes, dense_width).reshape(-1)
        row = (agreed_width + dense_width) * like.element_size() + agreed_width * 4
        return _NodePairs(
            positions=node.positions,
            dtype=like.dtype,
            agreed=piece_bounds(node.agreed, local, per_node),
            dense=piece_bounds(dense_count, local, per_node),
            agreed_width=agreed_width,
            dense_width=dense_width,
            dense_targets=dense_targets,
            mine=torch.zeros(row, dtype=torch.uint8, device=device),
            across=torch.zeros(topology.nodes * row, dtype=torch.uint8, device=device),
            everyone=torch.zeros(per_node * topology.nodes * row, dtype=torch.uint8, device=device),
        )

    def fits(self, node: NodeMean, like: torch.Tensor) -> bool:
        """Whether these buffers are for ``node``'s positions buffer and ``like``'s dtype."""
        return self.positions is node.positions and self.dtype == like.dtype

    def _fields(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(agreed values, dense values, agreed positions) of ``rows`` (uint8, whole rows), each
        rows x its width."""
        table = rows.view(-1, self.mine.numel())
        values_end = (self.agreed_width + self.dense_width) * dtype.itemsize
        values = table[:, :values_end].view(dtype)
        return values[:, : self.agreed_width], values[:, self.agreed_width :], table[:, values_end:].view(torch.int32)

    def stage(self, node: NodeMean, scale: float | None) -> None:
        """This rank's slice of the node's pairs into :attr:`mine`, times ``scale`` if given."""
        agreed_values, dense_values, agreed_positions = self._fields(self.mine, self.dtype)
        (low, high), (dense_low, dense_high) = self.agreed, self.dense
        agreed_positions[0, : high - low].copy_(node.positions[low:high])
        agreed_values[0, : high - low].copy_(node.means[low:high])
        dense_values[0, : dense_high - dense_low].copy_(node.means[node.agreed + dense_low : node.agreed + dense_high])
        if scale is not None:
            agreed_values.mul_(scale)
            dense_values.mul_(scale)

    def scatter_mean(self, out: torch.Tensor, nodes: int) -> None:
        """``out <- (1/K) sum_k scatter(P_k)`` from :attr:`everyone`."""
        agreed_values, dense_values, agreed_positions = self._fields(self.everyone, out.dtype)
        out.zero_()
        rows = agreed_positions.shape[0]  # each row's positions are distinct; rows of other nodes meet
        kernels.scatter_average_(out, agreed_positions.reshape(-1), agreed_values.reshape(-1), nodes, runs=rows)
        kernels.scatter_average_(out, self.dense_targets, dense_values.reshape(-1), nodes, runs=rows)


class SparseNodeHierarchy(NodeHierarchy):
    """The groups of a two-level exchange (:class:`NodeHierarchy`) run as the module docstring says."""

    def __init__(self, topology: NodeTopology) -> None:
        super().__init__(topology)
        self.node_transport = GroupTransport(self.node_group)
        self.flat = FlatExchange(GroupTransport())
        self._agreement: AgreedWithinNode | None = None  # of the one sparse compressor the hook runs
        self._pairs: dict[int, _NodePairs] = {}

    @property
    def state_shape(self) -> tuple[int, ...]:
        return ()  # every rank keeps its whole residual, as the flat exchange does

    @property
    def seed_view(self) -> None:
        return None  # a momentum handed over is this rank's own, as in the flat exchange

    def _agreement_of(self, compressor: SparseCompressor) -> AgreedWithinNode:
        if self._agreement is None or self._agreement.sparse is not compressor:
            self._agreement = AgreedWithinNode(GlobalTopKRounds(compressor))
        return self._agreement

    def _node_pairs(self, layout: BucketLayout, node: NodeMean, like: torch.Tensor) -> _NodePairs:
        pairs = self._pairs.get(layout.index)
        if pairs is None or not pairs.fits(node, like):
            check_int32_positions(layout.numel)  # the rows carry int32 positions, whatever the encoding
            pairs = self._pairs[layout.index] = _NodePairs.build(node, self.topology, like)
        return pairs

    def run(self, job: BucketJob) -> BucketStep:
        """One bucket through steps 1-4; ``averaged`` resolves to ``job.grad`` holding the mean once
        the returned step's ``rounds`` are completed (:func:`lightning_gc.exchanges.pipeline.complete`;
        the comm hook's :class:`~lightning_gc.exchanges.pipeline.RoundQueue` does it at the next
        bucket's hook, so the cross-node all-gather travels while backward goes on). With ``job.out``
        (a delayed exchange's slot) the mean is left there unscaled, after the returned step's
        ``finish``. A bucket without a sparse compressor (a dense one, chosen by ``compress_when``)
        goes flat, which keeps the whole-residual memory this exchange keeps too."""
        compressor = job.compressor
        if not isinstance(compressor, SparseCompressor):
            return self.flat.run(job)
        grad, layout, out, failure, timeline = job.grad, job.layout, job.out, job.failure, job.timeline
        memory, loss_scale, on_decoded = job.memory, job.loss_scale, job.on_decoded
        topology = self.topology
        bucket_memory = memory.bucket(layout, grad)
        agreement = self._agreement_of(compressor)
        memory.clip_local_(grad, layout, topology.world_size, loss_scale)
        node_job = job.but(clip=False, own=None, on_decoded=None, defer_rounds=False)
        node = run_bucket(node_job, bucket_memory, self.node_transport, rounds=agreement)
        with timeline.waiting():
            wait(node.averaged, failure)
        target = grad if out is None else out
        timeline.start()
        mean = agreement.node_mean(layout, target, topology.per_node)
        pairs = self._node_pairs(layout, mean, target)
        # the decode restores a grad scaler's scale (out is None), which the agreed means do not carry yet
        pairs.stage(mean, loss_scale if out is None and not mean.scaled else None)
        timeline.mark("stage")
        with reported(failure):
            across = comm.allgather_fixed(pairs.mine, pairs.across, self.cross_transport.group)
        timeline.mark(EXCHANGE)
        elements = pairs.agreed[1] - pairs.agreed[0] + pairs.dense[1] - pairs.dense[0]
        sent = {"bytes_sent": pairs.mine.numel(), "elements_sent": elements}
        if out is None:  # steps 3 and 4 at the next bucket's hook: step 2 crosses while backward goes on
            averaged = pending_like(grad)

            def later() -> Generator[None, None, None]:
                yield
                with timeline.waiting():
                    wait(across, failure)
                spread = self._spread(pairs, target, timeline, on_decoded, failure)
                spread.then(lambda done: settle(averaged, done))

            rounds = later()
            next(rounds)  # to its pause: the caller's next step waits for step 2 and launches step 3
            return BucketStep(averaged=averaged, rounds=rounds, deferred=True, **sent)
        done: Future[torch.Tensor] = Future()
        spread = partial(self._spread, pairs, target, timeline, on_decoded, failure)
        return BucketStep(averaged=done, finish=delayed_finisher(across, spread, target, done, failure), **sent)

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
