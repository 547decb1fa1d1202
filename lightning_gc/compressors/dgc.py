"""Deep Gradient Compression's sparsifier: top-k chosen through a sampled threshold (Lin et al., 2018).

Momentum correction, momentum factor masking and local clipping live in
:class:`lightning_gc.core.memory.CompensationMemory`; this module only decides *which* values leave.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_gc import kernels
from lightning_gc.common.validation import check_range
from lightning_gc.compressors.registry import register
from lightning_gc.compressors.sparse import SparseCompressor, SparsePlan
from lightning_gc.kernels import SelectionScratch


@register
class DGCCompressor(SparseCompressor):
    """Exactly ``k`` largest magnitudes per compressed tensor, found via a sampled threshold.

    Args:
        compress_ratio: fraction of elements sent, in (0, 1]; 0.001 is DGC's 99.9 % sparsity.
        sample_ratio: fraction of each tensor sampled to estimate the threshold, in (0, 1].
        **settings: the other arguments of :class:`~lightning_gc.compressors.sparse.SparseCompressor`
            (``min_compress_numel``, ``value_dtype``, ``index_encoding``, ``dense_dtype``).
    """

    name = "dgc"
    arguments = (*SparseCompressor.arguments, "sample_ratio")

    def __init__(self, compress_ratio: float = 0.001, *, sample_ratio: float = 0.01, **settings: Any) -> None:
        super().__init__(compress_ratio, **settings)
        self.sample_ratio = check_range("sample_ratio", sample_ratio, 0.0, 1.0, low_inclusive=False)
        self._scratch = SelectionScratch()

    @property
    def _selecting(self) -> dict[str, Any]:
        """The sampled selection's own settings, the same for every tensor and bucket."""
        return {"sample_ratio": self.sample_ratio, "scratch": self._scratch}

    def select(
        self, values: torch.Tensor, k: int, salt: int, out_indices: torch.Tensor, out_values: torch.Tensor
    ) -> None:
        kernels.sampled_topk_(values, k, salt=salt, out_indices=out_indices, out_values=out_values, **self._selecting)

    def select_segments(self, velocity: torch.Tensor, plan: SparsePlan, step_salt: int) -> None:
        # The same pairs as one select per segment; on a GPU all segments in one launch per kernel.
        kernels.sampled_topk_segments_(
            velocity,
            plan.selection,
            step_salt=step_salt,
            out_indices=plan.sent_indices,
            out_values=plan.sent_values,
            **self._selecting,
        )
