"""A fault-tolerant transport: one round of a payload over torchft's reconfigured process group.

torchft (``pip install -e ".[ft]"``) runs a quorum of *replica groups* through a lighthouse; its
:class:`torchft.Manager` reconfigures a process group (``torchft.process_group.ProcessGroupGloo``
or ``ProcessGroupNCCL``) whenever the quorum changes, and decides per step whether the step is
committed (:meth:`~torchft.Manager.should_commit`). :class:`ManagerTransport` launches a round's
collectives over that group, like :class:`~lightning_gc.exchanges.transport.GroupTransport` over a
torch.distributed group, with three differences:

* **World size and rank are the quorum's**, read when a round is launched: the number of replicas
  taking part in this step (``manager.num_participants()``) and this replica's place among them.
  They may change from one step to the next; a codec's plan follows them (plans are keyed by world
  size), and per-replica state (residuals) is this replica's own whatever the count.
* **A failed collective is reported to the manager** (``manager.wrap_future``, which also bounds
  it by the manager's timeout), so that ``should_commit()`` is false for the step; the round's
  future then fails too (decode never reads what a broken collective left in the buffers). Once
  the manager has an error for the step, later rounds fail at once without touching the group.
* **No point-to-point rounds**: torchft's groups are rebuilt per quorum and peers come and go, so a
  codec that needs ``peer`` rounds (global top-k's pairwise merges) is refused with one line.

Invariant, as for every transport: with the identity codec a round equals the sum over the
quorum's replicas (``summed``), every replica's payload in quorum-rank order (``gathered_out``).

Importing this module imports torchft: nothing else of the package imports it at import time.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions, ReduceOp
from torch.futures import Future, collect_all
from torchft import Manager
from torchft.process_group import ProcessGroup as FTProcessGroup

from lightning_gc.compressors.encoded import Payload
from lightning_gc.exchanges.transport import Transport

_FAILED = object()
"""What ``manager.wrap_future`` hands back in place of a failed collective's value."""


class ManagerTransport(Transport):
    """One round over the quorum of a :class:`torchft.Manager` (module docstring).

    Args:
        manager: the replica's manager; build it with ``use_async_quorum=False`` so that a
            recovering replica has healed before it sends (with an asynchronous quorum it would
            take part only from its next step, which this transport does not model).
        group: the torchft process group given to ``manager`` as ``pg`` (the manager keeps it
            private, so it is passed here too).

    Call ``manager.start_quorum()`` before the first round of each step; every replica of the
    quorum launches the same rounds in the same order.
    """

    def __init__(self, manager: Manager, group: FTProcessGroup) -> None:
        if not isinstance(manager, Manager):
            raise ValueError(f"ManagerTransport needs a torchft.Manager, got {type(manager).__name__}")
        if not isinstance(group, FTProcessGroup):
            raise ValueError(
                f"ManagerTransport needs the torchft process group given to the manager, got {type(group).__name__}"
            )
        self.manager = manager
        self.group = group

    @property
    def world_size(self) -> int:  # type: ignore[override]
        """Replicas taking part in the current step (blocks until the quorum is known)."""
        return self.manager.num_participants()

    @property
    def rank(self) -> int:  # type: ignore[override]
        """This replica's place among them."""
        rank = self.manager.participating_rank()
        if rank is None:
            raise RuntimeError(
                "this replica does not take part in the current step (a spare, or healing under an asynchronous "
                "quorum): build its torchft.Manager with use_async_quorum=False and the default world_size_mode"
            )
        return rank

    def launch(self, payload: Payload) -> Future[Payload]:
        _check(payload)
        failed = self.manager.errored()
        if failed is not None:  # the step is lost already: the group may be broken, send nothing
            return _failed(RuntimeError(f"the step already failed: {failed.original_exception}"))
        try:
            futures = self._start(payload)
        except Exception as error:  # a broken group can fail the launch itself
            self.manager.report_error(error)
            return _failed(error)
        joined = futures[0] if len(futures) == 1 else collect_all(futures).then(_values)
        return joined.then(lambda done: self._completed(done, payload))

    def _start(self, payload: Payload) -> list[Future[Any]]:
        futures = []
        if payload.summed is not None:
            options = AllreduceOptions()
            options.reduceOp = ReduceOp.SUM
            futures.append(self._guarded(self.group.allreduce([payload.summed], options)))
        if payload.gathered is not None:
            assert payload.gathered_out is not None
            rows = list(payload.gathered_out.view(self.world_size, -1).unbind(0))
            futures.append(self._guarded(self.group.allgather([rows], [payload.gathered], AllgatherOptions())))
        if payload.scattered is not None:
            assert payload.scattered_out is not None
            work = self.group.alltoall_base(payload.scattered_out, payload.scattered, [], [], AllToAllOptions())
            futures.append(self._guarded(work))
        return futures

    def _guarded(self, work: Any) -> Future[Any]:
        """The work's future, bounded by the manager's timeout; a failure is reported to the
        manager (the step will not commit) and resolves to ``_FAILED``."""
        return self.manager.wrap_future(work.get_future(), _FAILED)

    def _completed(self, done: Future[Any], payload: Payload) -> Payload:
        values = done.value()
        if any(value is _FAILED for value in (values if isinstance(values, list) else [values])):
            error = self.manager.errored()
            raise RuntimeError(f"a collective of the quorum failed: {error.original_exception if error else 'unknown'}")
        return payload


def _check(payload: Payload) -> None:
    if payload.peer is not None:
        raise ValueError(
            "ManagerTransport runs no point-to-point rounds (torchft's groups change per quorum): use a compressor "
            "whose exchange is 'gather', 'two_phase' or an all-reduce, not 'global_topk'"
        )
    if payload.summed is None and payload.gathered is None and payload.scattered is None:
        raise RuntimeError("a compressor round sends nothing: Payload needs `summed`, `gathered` or `scattered`")
    if payload.gathered is not None and payload.gathered_out is None:
        raise RuntimeError("Payload.gathered needs `gathered_out` to receive every replica's payload")
    if payload.scattered is not None and payload.scattered_out is None:
        raise RuntimeError("Payload.scattered needs `scattered_out` to receive every replica's row")


def _values(done: Future[list[Future[Any]]]) -> list[Any]:
    return [future.value() for future in done.value()]


def _failed(error: Exception) -> Future[Payload]:
    future: Future[Payload] = Future()
    future.set_exception(error)
    return future
