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


def _implementation(tensor: torch.Tensor) -> ModuleType:
    if backend_for(tensor) == "triton":
        from lightning_gc.kernels import triton_kernels

        return triton_kernels
    return reference


__all__ = [
    "MIN_SAMPLE_HITS",
    "SelectionScratch",
    "backend_for",
    "compensate_",
    "sample_size",
    "sampled_topk_indices",
    "topk_indices",
    "use_backend",
]
