"""The compression hot path: selection, compensation and decompression primitives.

One module per operation, each torch implementation (any device) beside its Triton twin, which
must compute the same (``tests/test_kernels.py`` compares them; packing and rng bit for bit)::

    selection     sampled-threshold top-k (DGC §3.1)            selection_triton
    compensation  momentum correction / error feedback          compensation_triton
    sparse        commit sent pairs to memory; scatter-average  sparse_triton
    packing       bit packing, stochastic quantisation          packing_triton
    rng           counter-based uniforms and their constants    rng_triton

:mod:`.dispatch` picks Triton for CUDA tensors and torch otherwise (overridable for tests). The
``*_triton`` modules (and :mod:`.launch`, through which they launch) are imported only when the
Triton backend is chosen, so CPU users never import Triton.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from lightning_gc.kernels import compensation, packing, selection, sparse
from lightning_gc.kernels.dispatch import backend_for, use_backend
from lightning_gc.kernels.packing import code_width, stochastic_dequantize
from lightning_gc.kernels.rng import counter_uniform
from lightning_gc.kernels.selection import (
    MIN_SAMPLE_HITS,
    SegmentedTopK,
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
    """DGC compensation of one slice in place (see :func:`.compensation.compensate_`), dispatched."""
    _implementation(grad, compensation).compensate_(grad, velocity, momentum_buf, **kwargs)


def sampled_topk_(values: torch.Tensor, k: int, **kwargs: Any) -> None:
    """Top-k (index, value) pairs via a sampled threshold (see :func:`.selection.sampled_topk_`), dispatched."""
    _implementation(values, selection).sampled_topk_(values, k, **kwargs)


def sampled_topk_segments_(values: torch.Tensor, segments: SegmentedTopK, **kwargs: Any) -> None:
    """:func:`sampled_topk_` for every segment of a bucket, indices as bucket positions (see
    :func:`.selection.sampled_topk_segments_`), dispatched: on Triton one launch per kernel for all."""
    _implementation(values, selection).sampled_topk_segments_(values, segments, **kwargs)


def commit_sparse_(
    velocity: torch.Tensor, momentum_buf: torch.Tensor | None, indices: torch.Tensor, sent: torch.Tensor
) -> None:
    """Remove sent pairs from memory, masking momentum (see :func:`.sparse.commit_sparse_`), dispatched."""
    _implementation(velocity, sparse).commit_sparse_(velocity, momentum_buf, indices, sent)


def scatter_average_(
    out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, world_size: int, runs: int = 1
) -> None:
    """Scatter-add gathered pairs divided by the world size (see :func:`.sparse.scatter_average_`), dispatched.

    ``indices`` and ``values`` are ``runs`` equal runs (one per rank whose pairs were gathered),
    each with distinct indices but for zero-valued padding. Every rank decodes the same payload and
    must get the same bits, so pairs that meet at one element must add in one order everywhere. A
    GPU's scatter-adds are atomic, in whatever order the threads arrive: from a zeroed ``out`` two
    runs still commute, three or more do not, so there each run is added alone, one after the
    other (its indices distinct: one add per element). On the CPU the adds run in order anyway.
    """
    if out.is_cuda and runs > 2:
        scatter_average_runs_in_order_(out, indices, values, world_size, runs)
        return
    _implementation(out, sparse).scatter_average_(out, indices, values, world_size)


def scatter_average_runs_in_order_(
    out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, world_size: int, runs: int
) -> None:
    """:func:`scatter_average_` one run at a time, in run order (deterministic on any device)."""
    for run_indices, run_values in zip(indices.view(runs, -1), values.view(runs, -1)):
        sparse.scatter_average_(out, run_indices, run_values, world_size)


def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Pack ``width``-bit uint8 codes into bytes (see :func:`.packing.pack_codes`), dispatched."""
    return _implementation(codes, packing).pack_codes(codes, width)


def unpack_codes(packed: torch.Tensor, width: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`, dispatched."""
    return _implementation(packed, packing).unpack_codes(packed, width, numel)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """Sign bits, 8 per byte (see :func:`.packing.pack_signs`), dispatched."""
    return _implementation(values, packing).pack_signs(values)


def stochastic_quantize(
    values: torch.Tensor, scales: torch.Tensor, levels: int, seed: int, chunk_size: int | None = None
) -> torch.Tensor:
    """Unbiased, reproducible stochastic rounding to packed level codes (QSGD, TernGrad), one scale
    per tensor or per ``chunk_size`` elements, dispatched."""
    return _implementation(values, packing).stochastic_quantize(values, scales, levels, seed, chunk_size)


def _implementation(tensor: torch.Tensor, torch_module: ModuleType) -> ModuleType:
    """``torch_module`` (e.g. :mod:`.packing`) or, when Triton runs ``tensor``'s ops, its twin
    ``<module>_triton``, imported on first use."""
    if backend_for(tensor) == "triton":
        return importlib.import_module(f"{torch_module.__name__}_triton")
    return torch_module


__all__ = [
    "MIN_SAMPLE_HITS",
    "SegmentedTopK",
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
    "sampled_topk_segments_",
    "sampled_topk_indices",
    "scatter_average_",
    "stochastic_dequantize",
    "stochastic_quantize",
    "unpack_codes",
    "topk_indices",
    "use_backend",
]
