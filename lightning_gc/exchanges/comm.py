"""The collectives a bucket needs, as futures that resolve to the output tensor.

Every collective of a bucket is *launched from the comm hook itself*, never from a future's
callback: DDP calls the hook for buckets in the same order on every rank, so launches happen in
the same order everywhere. (A collective launched from a ``.then`` callback can run in a different
order on different ranks when several buckets are in flight; torch's PowerSGD hook fails that way
on gloo.)

On gloo the future of ``all_gather_single`` (``all_gather_into_tensor``) holds a list of chunks rather than the output
tensor, so the output buffer is captured and returned explicitly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

ProcessGroup = dist.ProcessGroup | None

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""Every rank's equally sized tensor concatenated into one output: torch >= 2.10 names it
``all_gather_single`` and deprecates ``all_gather_into_tensor``, which older versions only have."""

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""Each rank's row of a sum of equally sized tensors, under torch >= 2.10's name (older versions
have only ``reduce_scatter_tensor``, which newer ones deprecate)."""


def _resolving_to(tensor: torch.Tensor) -> Callable[[Future[Any]], torch.Tensor]:
    """A ``.then`` callback returning ``tensor``; it reads the collective's result first, so a
    failed collective (a dead peer, a timeout) fails the chained future instead of passing on
    whatever the buffer holds."""

    def done(future: Future[Any]) -> torch.Tensor:
        future.value()
        return tensor

    return done


def allreduce_sum(tensor: torch.Tensor, group: ProcessGroup) -> Future[torch.Tensor]:
    """Sum ``tensor`` over ranks, in place; the future resolves to ``tensor``."""
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work.get_future().then(_resolving_to(tensor))


def allgather_fixed(payload: torch.Tensor, out: torch.Tensor, group: ProcessGroup) -> Future[torch.Tensor]:
    """Concatenate every rank's equally sized ``payload`` into ``out`` (rank order); resolves to ``out``."""
    work = all_gather_single(out, payload, group=group, async_op=True)
    return work.get_future().then(_resolving_to(out))


def reduce_scatter_sum(staged: torch.Tensor, out: torch.Tensor, group: ProcessGroup) -> None:
    """Sum ``staged`` (``world_size`` equal rows, flat) over ranks and leave row ``rank`` of the sum
    in ``out``. Blocking: gloo's reduce-scatter has no future (``Work::getFuture`` is not
    implemented there), and its callers need the sum before they go on anyway."""
    reduce_scatter_single(out, staged, op=dist.ReduceOp.SUM, group=group)


def alltoall_fixed(payload: torch.Tensor, out: torch.Tensor, group: ProcessGroup) -> Future[torch.Tensor]:
    """All-to-all of equal rows: ``payload``'s row ``j`` goes to rank ``j``, ``out``'s row ``i``
    comes from rank ``i`` (both ``world_size`` equal rows, flat); resolves to ``out``."""
    work = dist.all_to_all_single(out, payload, group=group, async_op=True)
    return work.get_future().then(_resolving_to(out))


def transfer(
    payload: torch.Tensor,
    to: int | None,
    into: torch.Tensor | None,
    source: int | None,
    group: ProcessGroup,
) -> None:
    """Send ``payload`` to group rank ``to`` and/or receive group rank ``source``'s message into
    ``into`` (either may be ``None``); returns once both are done (on NCCL: once the current
    stream is ordered after them). The two are posted as one batch: NCCL deadlocks on a send and a
    receive between the same two ranks posted separately. Gloo moves only CPU tensors point to
    point, so device tensors are staged through host memory there."""
    staged = _needs_host(payload, group)
    send = payload.cpu() if staged else payload
    receive = into.cpu() if staged and into is not None else into
    operations = []
    if to is not None:
        operations.append(dist.P2POp(dist.isend, send, _global_rank(group, to), group))
    if source is not None:
        assert receive is not None
        operations.append(dist.P2POp(dist.irecv, receive, _global_rank(group, source), group))
    for request in dist.batch_isend_irecv(operations) if operations else []:
        request.wait()
    if staged and into is not None:  # receive is into's host copy
        into.copy_(receive)


def _needs_host(tensor: torch.Tensor, group: ProcessGroup) -> bool:
    return tensor.device.type != "cpu" and dist.get_backend(group) == dist.Backend.GLOO


def _global_rank(group: ProcessGroup, rank: int) -> int:
    """The default group's rank of ``group``'s rank ``rank`` (point-to-point calls take those)."""
    return rank if group is None or group is dist.GroupMember.WORLD else dist.get_global_rank(group, rank)


def any_rank(flag: torch.Tensor, group: ProcessGroup) -> bool:
    """Whether ``flag`` (a boolean 0-d tensor) is true on any rank; blocking, called on every rank."""
    value = flag.to(torch.int32).reshape(1)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())
