"""Checks that every rank trains the same thing: configuration and model layout at setup, and
(optionally, periodically) the parameters themselves.

Compressed training keeps per-rank state, so a rank launched with another compressor setting or a
slightly different model does not fail loudly by itself: it silently desynchronises. These checks
turn that into an error on every rank that names the difference.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist

from lightning_gc.exchanges import comm


def _first_difference(mine: Any, theirs: Any, path: str = "") -> str | None:
    """A readable path to the first place where two plain-data descriptions differ."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in sorted(set(mine) | set(theirs), key=str):
            if key not in mine or key not in theirs:
                return f"{path}.{key}: present on one rank only"
            found = _first_difference(mine[key], theirs[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple)):
        for index, (a, b) in enumerate(zip(mine, theirs)):
            found = _first_difference(a, b, f"{path}[{index}]")
            if found:
                return found
        if len(mine) != len(theirs):
            return f"{path}: {len(mine)} entries vs {len(theirs)}"
        return None
    return None if mine == theirs else f"{path}: {mine!r} vs {theirs!r}"


def verify_same_setup(description: dict[str, Any], group: dist.ProcessGroup | None = None) -> None:
    """Called on every rank: raise ``ValueError`` on every rank if the descriptions differ.

    Ranks first exchange a SHA-256 of their description; only on a mismatch are the full
    descriptions gathered, to name the first difference.
    """
    canonical = json.loads(json.dumps(description, sort_keys=True, default=str))
    digest = hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()
    world_size = dist.get_world_size(group)
    digests: list[Any] = [None] * world_size
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    descriptions: list[Any] = [None] * world_size
    dist.all_gather_object(descriptions, canonical, group=group)
    for rank, other in enumerate(descriptions[1:], start=1):
        difference = _first_difference(descriptions[0], other)
        if difference:
            raise ValueError(
                f"lightning_gc: rank 0 and rank {rank} are set up differently at {difference.lstrip('.')}; "
                "every rank must use the same compressor settings and model"
            )


def parameter_checksums(module: torch.nn.Module) -> torch.Tensor:
    """Per parameter ``(sum p, sum p^2)`` in float64: equal bit for bit on ranks with equal parameters."""
    return torch.stack(
        [torch.stack([p.detach().double().sum(), p.detach().double().square().sum()]) for p in module.parameters()]
    )


def verify_same_parameters(module: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Called on every rank: raise ``RuntimeError`` naming the first parameter whose checksum differs."""
    local = parameter_checksums(module)
    world_size = dist.get_world_size(group)
    gathered = local.new_empty((world_size * local.shape[0], *local.shape[1:]))
    comm.all_gather_single(gathered, local, group=group)
    gathered = gathered.view(world_size, *local.shape)
    bits = gathered.view(torch.int64)  # bitwise: identical NaN parameters are not a divergence
    differs = (bits != bits[0]).any(dim=2).any(dim=0)
    if bool(differs.any()):
        names = [name for name, _ in module.named_parameters()]
        first = int(differs.nonzero()[0])
        raise RuntimeError(
            f"lightning_gc: parameters differ between ranks, first at {names[first]!r} "
            f"({int(differs.sum())} of {len(names)} parameters differ); ranks have diverged"
        )
