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
    code_width,
    counter_uniform,
    sample_size,
    sampled_topk_indices,
    stochastic_dequantize,
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


def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Pack ``width``-bit uint8 codes into bytes (see :func:`reference.pack_codes`), dispatched."""
    return _implementation(codes).pack_codes(codes, width)


def unpack_codes(packed: torch.Tensor, width: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`, dispatched."""
    return _implementation(packed).unpack_codes(packed, width, numel)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """Sign bits, 8 per byte (see :func:`reference.pack_signs`), dispatched."""
    return _implementation(values).pack_signs(values)


def stochastic_quantize(
    values: torch.Tensor, scales: torch.Tensor, levels: int, seed: int, chunk_size: int | None = None
) -> torch.Tensor:
    """Unbiased, reproducible stochastic rounding to packed level codes (QSGD, TernGrad), one scale
    per tensor or per ``chunk_size`` elements, dispatched."""
    return _implementation(values).stochastic_quantize(values, scales, levels, seed, chunk_size)


def _implementation(tensor: torch.Tensor) -> ModuleType:
    if backend_for(tensor) == "triton":
        from lightning_gc.kernels import triton_kernels

        return triton_kernels
    return reference


__all__ = [
    "MIN_SAMPLE_HITS",
    "SelectionScratch",
    "backend_for",
    "code_width",
    "commit_sparse_",
    "counter_uniform",
    "compensate_",
    "pack_codes",
    "pack_signs",
    "sample_size",
    "sampled_topk_",
    "sampled_topk_indices",
    "scatter_average_",
    "stochastic_dequantize",
    "stochastic_quantize",
    "unpack_codes",
    "topk_indices",
    "use_backend",
]
