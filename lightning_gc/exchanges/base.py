"""The exchange interface: one flat tensor's step (a :class:`~lightning_gc.exchanges.pipeline.BucketJob`)
run over one or more transports, returning a future of the average.

An :class:`Exchange` decides *where* a job's rounds go; the codec decides *what* they carry
(its payload kinds and rounds), the memory what stays behind, a
:class:`~lightning_gc.exchanges.transport.Transport` how bytes move. Implementations:

* :class:`FlatExchange`: every round over one transport among all ranks. The codec's own round
  protocol picks the collectives: all-reduce of summable payloads (fp16, random-k, PowerSGD's P
  and Q), all-gather of the rest (top-k/DGC pairs, quantised codes).
* :class:`~lightning_gc.exchanges.two_phase.TwoPhaseExchange` (``exchange="two_phase"``/``"auto"``):
  a compressed all-reduce over one transport (all-to-all of chunks, the owners' averages
  re-encoded, all-gather) that asks the codec for its chunk capability and keeps the server errors.
* :class:`~lightning_gc.exchanges.global_topk.GlobalTopKExchange` (``exchange="global_topk"``):
  the ranks' sparse selections merged pairwise into agreed positions, then their values
  all-reduced; asks the sparse codec for its selection.
* :class:`~lightning_gc.exchanges.hierarchy.NodeHierarchy` (``hierarchy="node"``): a dense sum
  within each node, the job's shard compressed across nodes by the exchange the codec chooses,
  a dense all-gather within the node.
* :class:`~lightning_gc.exchanges.hierarchy_sparse.SparseNodeHierarchy` (``"node_sparse"``):
  global top-k within the node, the node's pairs gathered across nodes.

:func:`lightning_gc.exchanges.select.exchange_for` picks the one a codec's ``exchange`` argument
names over one transport.

Delay (:mod:`lightning_gc.exchanges.delay`) hands a job a slot (``out``, ``own``) and takes the
result a step later; it works with every exchange.

Invariants for every exchange: with the identity codec the result equals DDP's all-reduce; what is
not sent stays in the memory of the rank that owns it; every rank ends with the same bits; its
collectives are launched from the caller's thread in the same order on every rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from lightning_gc.common.errors import IncompatibleCheckpoint
from lightning_gc.compressors.base import Compressor, EncodeContext
from lightning_gc.compressors.encoded import Encoded
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

    def state_dict(self) -> dict[str, Any]:
        """This rank's state of the exchange itself (the two-phase server errors), checkpointed per
        rank beside the memory's; empty by default (and then left out of checkpoints)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; an exchange without state refuses state, which a run
        of another exchange owed (it would be dropped)."""
        if state:
            saved = state.get("exchange")
            raise IncompatibleCheckpoint(
                f"the checkpoint holds exchange state {sorted(state)} of a run with exchange={saved!r} (the "
                f"two-phase server error feedback) and this run's exchange ({type(self).__name__}) keeps none, "
                f"which would drop it; resume with exchange={saved!r}"
            )

    def snapshot(self, previous: Any = None) -> Any:
        """What :meth:`restore` rolls back to when a step is skipped (see
        :meth:`~lightning_gc.compressors.base.Compressor.snapshot`); ``None`` without state."""
        return None

    def restore(self, snapshot: Any) -> None:
        """Return to :meth:`snapshot`'s state, in place."""
        del snapshot  # nothing kept


class CodecRounds(ABC):
    """A codec's rounds as an exchange builds them from a capability it asks of the codec, with
    the state they keep (the two-phase server errors): what the pipeline runs in the codec's place
    (:class:`~lightning_gc.exchanges.pipeline.Rounds`). It holds no transport: the pipeline's
    decode callback, which runs on the backend's thread, holds it, and a thread that drops a
    process group's last reference joins itself in the group's destructor (the process aborts)."""

    def __init__(self, codec: Compressor) -> None:
        self.codec = codec

    @property
    def name(self) -> str:
        """The codec's name (errors of the pipeline name what runs the rounds)."""
        return self.codec.name

    @abstractmethod
    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        """The first round of a job (the next ones by ``next_round``), in the codec's place."""

    @abstractmethod
    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        """The last round's average into ``out``, in the codec's place."""


class RoundsExchange(Exchange):
    """An exchange over one transport that runs its codec's :class:`CodecRounds` (the two-phase and
    global top-k exchanges). A job whose codec's arguments do not ask for :attr:`form` at this
    world size (``"auto"`` below three ranks, the hook's exact fallback for a bucket where
    compression does not pay) runs the codec's own rounds."""

    form: ClassVar[str]
    """The :meth:`~lightning_gc.compressors.base.Compressor.exchange_form` this exchange runs."""

    def __init__(self, transport: Transport, rounds: CodecRounds) -> None:
        self.transport, self.rounds = transport, rounds

    @property
    def codec(self) -> Compressor:
        return self.rounds.codec

    def run(self, job: BucketJob) -> BucketStep:
        bucket = job.memory.bucket(job.layout, job.grad)
        if job.compressor.exchange_form(self.transport.world_size) != self.form:
            return run_bucket(job, bucket, self.transport)
        if job.compressor is not self.codec:  # its plans (and state) are its codec's
            raise ValueError(
                f"this {self.form} exchange runs compressor {self.codec.name!r}, got a job of {job.compressor.name!r}"
            )
        return run_bucket(job, bucket, self.transport, rounds=self.rounds)

    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        """:meth:`CodecRounds.encode` (for driving the rounds by hand, as tests do)."""
        return self.rounds.encode(velocity, out, context)

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        """:meth:`CodecRounds.decode`."""
        self.rounds.decode(encoded, out, world_size=world_size)


class FlatExchange(Exchange):
    """Every round of a job over one transport among all its ranks (module docstring)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def run(self, job: BucketJob) -> BucketStep:
        return run_bucket(job, job.memory.bucket(job.layout, job.grad), self.transport)
