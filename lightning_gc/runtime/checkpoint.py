"""Every rank's compression state in one checkpoint entry, and back.

Lightning (and Fabric, and a user's own ``torch.save``) writes rank 0's checkpoint, but residuals,
momenta, warm-start factors and delayed averages differ per rank. :func:`gather_entry` collects
each rank's state on rank 0 (a collective: every rank calls it), and :func:`rank_state` hands a
resumed rank its own part after checking that the entry can be resumed here (re-sharded when it was
written by another number of ranks: :mod:`lightning_gc.runtime.reshard`).

Entry layout (plain data, under :data:`CHECKPOINT_KEY` of the checkpoint)::

    {"format": CHECKPOINT_FORMAT, "world_size": N, "compressor": {...config},
     "ranks": [state of rank 0, ..., state of rank N-1], "totals": {...running sums}}
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_gc.common.errors import IncompatibleCheckpoint
from lightning_gc.runtime.reshard import reshard

CHECKPOINT_KEY = "lightning_gc"
CHECKPOINT_FORMAT = 3
READABLE_FORMATS = (1, 2, 3)
"""Formats this version resumes. Format 1 kept a Nesterov parameter's momentum as ``m`` times
``torch.optim.SGD``'s buffer (DGC's paper form); format 2 keeps the buffer itself, and a format 1
entry is converted when the fit starts (:meth:`~lightning_gc.runtime.session.CompressionSession.start_fit`).
Format 3 keeps the two-phase server errors as the exchange's state (each rank's ``"exchange"``)
where formats 1 and 2 kept them in the compressor's state; those are converted on load. A version
that reads only formats 1 and 2 refuses format 3 instead of dropping the server errors."""


def no_entry_notice(source: Any) -> str:
    """What a front end says when it resumes from a checkpoint without compression state (one
    written by dense DDP, say): the weights and optimizer load, residuals and momenta start empty."""
    return f"lightning_gc: checkpoint {source} holds no compression state; memory starts empty"


def gather_entry(
    local: dict[str, Any],
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    world_size: int,
    compressor: dict[str, Any],
    totals: dict[str, Any],
) -> dict[str, Any]:
    """The checkpoint entry with every rank's ``local`` state (complete on rank 0, ``ranks`` is
    ``None`` elsewhere). A collective: every rank of ``group`` must call it."""
    ranks: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(local, ranks, dst=0, group=group)
    return {
        "format": CHECKPOINT_FORMAT,
        "world_size": world_size,
        "compressor": compressor,
        "ranks": ranks,
        "totals": dict(totals),
    }


def rank_state(entry: dict[str, Any], *, source: Any, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's part of ``entry`` (read from ``source``, named in errors); an entry written by
    another number of ranks is re-sharded first (:func:`~lightning_gc.runtime.reshard.reshard`: every
    rank takes the saved ranks' mean residuals, so what the next updates owe is kept).

    Raises:
        IncompatibleCheckpoint: an entry of another format, or one whose per-rank state cannot be
            re-sharded (named: ``hierarchy="node"``, a compressor's unknown per-rank state).
    """
    if entry.get("format") not in READABLE_FORMATS:
        raise IncompatibleCheckpoint(
            f"checkpoint {source} holds compression state in format {entry.get('format')!r}; this "
            f"version of lightning_gc reads formats {list(READABLE_FORMATS)}"
        )
    if entry["world_size"] != world_size:
        entry = reshard(entry, world_size, source=source)
    return entry["ranks"][rank]
