"""The compression hot path: selection, compensation and decompression primitives.

Each op has a torch implementation in :mod:`lightning_gc.kernels.reference` (any device) and, where
written, a Triton kernel in :mod:`lightning_gc.kernels.triton_kernels`; :mod:`.dispatch` picks
Triton for CUDA tensors and torch otherwise (overridable for tests).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from lightning_gc.kernels import reference
from lightning_gc.kernels.dispatch import backend_for, use_backend
from lightning_gc.kernels.reference import (
    MIN_SAMPLE_HITS,
    SelectionScratch,
    sample_size,
    sampled_topk_indices,
    topk_indices,
)


def compensate_(
    grad: torch.Tensor,
    velocity: torch.Tensor,
    momentum_buf: torch.Tensor | None = None,
    **kwargs: Any,
) -> None:
    """DGC compensation of one slice in place (see :func:`reference.compensate_`), dispatched."""
    _implementation(grad).compensate_(grad, velocity, momentum_buf, **kwargs)


def sampled_topk_(values: torch.Tensor, k: int, **kwargs: Any) -> None:
    """Top-k (index, value) pairs via a sampled threshold (see :func:`reference.sampled_topk_`), dispatched."""
    _implementation(values).sampled_topk_(values, k, **kwargs)


def commit_sparse_(
    velocity: torch.Tensor, momentum_buf: torch.Tensor | None, indices: torch.Tensor, sent: torch.Tensor
) -> None:
    """Remove sent pairs from memory, masking momentum (see :func:`reference.commit_sparse_`), dispatched."""
    _implementation(velocity).commit_sparse_(velocity, momentum_buf, indices, sent)


def scatter_average_(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, world_size: int) -> None:
    """Scatter-add gathered pairs divided by the world size (see :func:`reference.scatter_average_`), dispatched."""
    _implementation(out).scatter_average_(out, indices, values, world_size)


def _implementation(tensor: torch.Tensor) -> ModuleType:
    if backend_for(tensor) == "triton":
        from lightning_gc.kernels import triton_kernels

        return triton_kernels
    return reference


__all__ = [
    "MIN_SAMPLE_HITS",
    "SelectionScratch",
    "backend_for",
    "commit_sparse_",
    "compensate_",
    "sample_size",
    "sampled_topk_",
    "sampled_topk_indices",
    "scatter_average_",
    "topk_indices",
    "use_backend",
]
