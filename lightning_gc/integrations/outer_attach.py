"""The outer loop's plain-PyTorch front end and its checkpoint helpers (the arguments every front
end shares are in :mod:`lightning_gc.integrations.outer_arguments`, re-exported here).

Imports no Lightning: :func:`outer_loop` serves a hand-written loop (torchrun, SLURM) over any
process group; the Trainer strategy (:class:`~lightning_gc.integrations.outer.OuterLoopStrategy`)
takes the same preset names and arguments through :func:`outer_arguments`::

    model = Net().to(device)                                 # same weights on every rank (seeded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = lightning_gc.integrations.outer_attach.outer_loop(model, "diloco", sync_every=100)
    for x, y in loader:                                      # no DistributedDataParallel wrapper
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()                      # local gradient: nothing is sent
        optimizer.step()
        outer.inner_step_done()                              # syncs every `sync_every` steps
    outer.finish()                                           # lands and sends what remains (if any)

Checkpoints: :func:`gather_outer_entry` (every rank calls it; rank 0's copy is complete) holds every
rank's outer-loop state, own weights and inner optimizer state; to resume, build the outer loop
again on the saved ``theta_g`` weights, then on every rank::

    own = outer_rank_state(entry, source=path, rank=rank, world_size=world_size)
    resume_outer(outer, own)                                 # theta_g, residuals, counters, theta_r
    optimizer.load_state_dict(own["optimizers"][0])

The maths are in :mod:`lightning_gc.runtime.outer`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_gc.common.errors import IncompatibleCheckpoint
from lightning_gc.exchanges.comm import ProcessGroup
from lightning_gc.integrations.outer_arguments import (
    OUTER_ARGUMENTS,
    OUTER_PRESETS,
    STREAMING_DEFAULTS,
    OuterArguments,
    outer_arguments,
)
from lightning_gc.runtime.outer import LocalWeights, OuterLoop

__all__ = [
    "OUTER_ARGUMENTS", "OUTER_CHECKPOINT_KEY", "OUTER_PRESETS", "STREAMING_DEFAULTS", "OuterArguments",
    "gather_outer_entry", "outer_arguments", "outer_loop", "outer_rank_state", "resume_outer",
]  # fmt: skip

OUTER_CHECKPOINT_KEY = "lightning_gc_outer"
"""Where the Trainer strategy keeps :func:`gather_outer_entry`'s entry in a checkpoint."""
OUTER_CHECKPOINT_FORMAT = 3  # 2: the outer loop's state per fragment (streaming); 3: its settings, buffers_g, precision


def outer_loop(
    model: torch.nn.Module, preset: str = "diloco", *, group: ProcessGroup = None, **kwargs: Any
) -> OuterLoop:
    """The outer loop of ``model`` for a hand-written training loop (module docstring).

    Call it on every rank of ``group`` (default: the default process group) once the model is on
    its device with the same weights everywhere, then ``inner_step_done()`` after every inner
    ``optimizer.step()``, and ``finish()`` at the end (a final ``sync()`` if steps remain since the
    last sync or an exchange is in flight). ``global_parameters`` (``theta_g``) is what to evaluate
    and keep; between syncs the model holds this rank's own ``theta_r``.

    Args:
        model: the model (not wrapped in ``DistributedDataParallel``: the inner steps send nothing).
        preset: ``"diloco"``, ``"diloco_int8"`` or ``"sparseloco"`` (:data:`OUTER_PRESETS`).
        group: the process group to sync over.
        **kwargs: ``sync_every``, ``compressor``, ``error_decay``, ``outer_lr``,
            ``outer_momentum``, ``outer_nesterov``, the streaming settings ``fragments``,
            ``sync_delay`` and ``mix`` (:mod:`lightning_gc.runtime.outer_fragments`), and the
            compressor's own arguments (e.g. ``compress_ratio``); they override the preset's.

    Raises:
        ValueError: an unknown preset or argument, or a bad value, in one line naming it.
    """
    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "outer_loop takes the model itself, not a DistributedDataParallel wrapper (which averages gradients)"
        )
    return outer_arguments(preset, kwargs, owner="outer_loop").build(model, group)


# ---------------------------------------------------------------------- checkpoints
def gather_outer_entry(
    outer: OuterLoop,
    *,
    local: LocalWeights | None = None,
    optimizer_states: list[dict[str, Any]] | None = None,
    precision: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every rank's state in one checkpoint entry, complete on rank 0 (``ranks`` is ``None``
    elsewhere); a collective over ``outer.group``: every rank calls it. Per rank: the outer loop's
    :meth:`~lightning_gc.runtime.outer.OuterLoop.state_dict`, its own weights ``theta_r`` and
    floating-point buffers (``local``, what :meth:`~lightning_gc.runtime.outer.OuterLoop.global_weights`
    set aside; default the module's), ``optimizer_states`` (the inner
    optimizers', which differ per rank) and ``precision`` (e.g. a GradScaler's state: its scale
    follows this rank's own overflows), all copied to the CPU."""
    if local is None:
        named = dict(outer.module.named_parameters())
        buffers = {name: b for name, b in outer.module.named_buffers() if b.is_floating_point()}
        local = LocalWeights({name: named[name] for name in outer.global_parameters}, buffers)
    mine = _to_cpu(
        {
            "outer": outer.state_dict(),
            "local": local.parameters,
            "buffers": local.buffers,
            "optimizers": optimizer_states or [],
            "precision": precision or {},
        }
    )
    world_size = dist.get_world_size(outer.group) if dist.is_initialized() else 1
    ranks: list[Any] | None = [mine]
    if world_size > 1:
        first = 0 if outer.group is None else dist.get_global_rank(outer.group, 0)
        ranks = [None] * world_size if dist.get_rank() == first else None
        dist.gather_object(mine, ranks, dst=first, group=outer.group)
    compressor = outer.compressor.config()
    return {"format": OUTER_CHECKPOINT_FORMAT, "world_size": world_size, "compressor": compressor, "ranks": ranks}


def outer_rank_state(entry: dict[str, Any], *, source: Any, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's part of :func:`gather_outer_entry`'s ``entry`` (read from ``source``, named in errors).

    Raises:
        IncompatibleCheckpoint: another format, or another number of ranks (each rank's weights and
            residuals are its own).
    """
    if entry.get("format") != OUTER_CHECKPOINT_FORMAT:
        raise IncompatibleCheckpoint(
            f"checkpoint {source} holds outer-loop state in format {entry.get('format')!r}; "
            f"this version reads format {OUTER_CHECKPOINT_FORMAT}"
        )
    if entry["world_size"] != world_size:
        raise IncompatibleCheckpoint(
            f"checkpoint {source} holds outer-loop state of {entry['world_size']} ranks but this run has "
            f"world_size={world_size}; each rank's weights and residuals are its own, so resume with "
            f"{entry['world_size']} processes"
        )
    return entry["ranks"][rank]


def resume_outer(outer: OuterLoop, own: dict[str, Any]) -> None:
    """Continue from this rank's part of an entry: the outer loop's state, and the module's own
    weights ``theta_r`` and buffers. The caller restores the inner optimizers from
    ``own["optimizers"]`` (in the order given to :func:`gather_outer_entry`).

    Raises:
        ValueError: the checkpoint's parameter or floating-point buffer names are not this
            module's, in one line naming those missing on either side.
    """
    buffers = {name for name, b in outer.module.named_buffers() if b.is_floating_point()}
    _same_names("parameters", set(own["local"]), set(outer.global_parameters))
    _same_names("buffers", set(own["buffers"]), buffers)
    outer.load_state_dict(own["outer"])
    with torch.no_grad():
        for name, p in outer.module.named_parameters():
            if name in own["local"]:
                p.copy_(own["local"][name])
        for name, b in outer.module.named_buffers():
            if name in own["buffers"]:
                b.copy_(own["buffers"][name])


def _same_names(what: str, saved: set[str], here: set[str]) -> None:
    if saved != here:
        raise ValueError(
            f"the checkpoint's {what} are not this module's: missing here {sorted(saved - here)}, "
            f"not in the checkpoint {sorted(here - saved)}; resume the same model"
        )


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor copied to the CPU (gathered objects must not name a peer's GPU)."""
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
