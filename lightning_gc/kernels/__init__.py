"""The compression hot path: selection, compensation and decompression primitives.

Today these are the torch implementations in :mod:`lightning_gc.kernels.reference`, which run on
any device; Triton kernels for CUDA tensors will sit behind the same names.
"""

from lightning_gc.kernels.reference import (
    MIN_SAMPLE_HITS,
    SelectionScratch,
    sample_size,
    sampled_topk_indices,
    topk_indices,
)

__all__ = ["MIN_SAMPLE_HITS", "SelectionScratch", "sample_size", "sampled_topk_indices", "topk_indices"]
