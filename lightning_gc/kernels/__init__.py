"""The compression hot path: selection, compensation and decompression primitives.

Each op has a torch implementation in :mod:`lightning_gc.kernels.reference` (any device) and, where
written, a Triton kernel in :mod:`lightning_gc.kernels.triton_kernels`; :mod:`.dispatch` picks
Triton for CUDA tensors and torch otherwise (overridable for tests).
"""

from __future__ import annotations

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


def momentum_compensate_(
    grad: torch.Tensor, momentum_buf: torch.Tensor, velocity: torch.Tensor, momentum: float, nesterov: bool
) -> None:
    """DGC momentum correction in place (see :func:`reference.momentum_compensate_`), dispatched."""
    if backend_for(grad) == "triton":
        from lightning_gc.kernels import triton_kernels

        triton_kernels.momentum_compensate_(grad, momentum_buf, velocity, momentum, nesterov)
    else:
        reference.momentum_compensate_(grad, momentum_buf, velocity, momentum, nesterov)


__all__ = [
    "MIN_SAMPLE_HITS",
    "SelectionScratch",
    "backend_for",
    "momentum_compensate_",
    "sample_size",
    "sampled_topk_indices",
    "topk_indices",
    "use_backend",
]
