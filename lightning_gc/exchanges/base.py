"""The exchange interface: one flat tensor's step (a :class:`~lightning_gc.exchanges.pipeline.BucketJob`)
run over one or more transports, returning a future of the average.

An :class:`Exchange` decides *where* a job's rounds go; the codec decides *what* they carry
(its payload kinds and rounds), the memory what stays behind, a
:class:`~lightning_gc.exchanges.transport.Transport` how bytes move. Implementations:

* :class:`FlatExchange`: every round over one transport among all ranks. The codec's own round
  protocol picks the collectives: all-reduce of summable payloads (fp16, random-k, PowerSGD's P
  and Q), all-gather of the rest (top-k/DGC pairs, quantised codes), the two-phase form
  (all-to-all, then all-gather) and global top-k's pairwise merges.
* :class:`~lightning_gc.exchanges.hierarchy.NodeHierarchy` (``hierarchy="node"``): a dense sum
  within each node, the job's shard compressed across nodes, a dense all-gather within the node.
* :class:`~lightning_gc.exchanges.hierarchy_sparse.SparseNodeHierarchy` (``"node_sparse"``):
  global top-k within the node, the node's pairs gathered across nodes.

Delay (:mod:`lightning_gc.exchanges.delay`) hands a job a slot (``out``, ``own``) and takes the
result a step later; it works with every exchange.

Invariants for every exchange: with the identity codec the result equals DDP's all-reduce; what is
not sent stays in the memory of the rank that owns it; every rank ends with the same bits; its
collectives are launched from the caller's thread in the same order on every rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from lightning_gc.exchanges.pipeline import BucketJob, BucketStep, run_bucket
from lightning_gc.exchanges.transport import Transport


class Exchange(ABC):
    """Runs one flat tensor's step among the ranks (module docstring)."""

    knows_own_contribution: bool = True
    """Whether a job's ``own`` receives this rank's contribution as decoded (what ``local_update``
    needs); false where a rank's part is a piece of its node's sum."""

    @abstractmethod
    def run(self, job: BucketJob) -> BucketStep:
        """Run ``job`` (its collectives launched from this thread); the returned step's
        ``averaged`` resolves to the average, in ``job.out`` (default ``job.grad``)."""

    @property
    def state_shape(self) -> tuple[int, ...]:
        """What each rank's compression state depends on besides the world size, recorded in
        checkpoints (a resume must match it); empty: every rank keeps whole residuals."""
        return ()

    @property
    def seed_view(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What of a whole parameter's flattened momentum this rank's memory holds when one is
        handed over (Adam's first moment); ``None``: all of it."""
        return None


class FlatExchange(Exchange):
    """Every round of a job over one transport among all its ranks (module docstring)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def run(self, job: BucketJob) -> BucketStep:
        return run_bucket(job, job.memory.bucket(job.layout, job.grad), self.transport)
