"""Triton twin of :mod:`.sparse`: the memory commit and the decode as one pass over the pairs.

Indices may repeat, so the adds are atomic (relaxed: pure accumulations, ordered by the kernel's
end alone), and the sums may come out in any order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_gc.kernels.launch import BLOCK, launch, program_block


@triton.jit
def _commit_sparse_kernel(
    velocity_ptr, momentum_ptr, index_ptr, sent_ptr, pairs, MASK: tl.constexpr, BLOCK: tl.constexpr
):
    base, j, inside = program_block(pairs, BLOCK)
    i = tl.load(index_ptr + base + j, mask=inside, other=0).to(tl.int64)
    sent = tl.load(sent_ptr + base + j, mask=inside, other=0.0).to(tl.float32)
    # atomic: indices may repeat; relaxed: a pure accumulation, ordered by the kernel's end alone
    tl.atomic_add(velocity_ptr + i, -sent, mask=inside, sem="relaxed")
    if MASK:
        zero = tl.zeros([BLOCK], dtype=tl.float32).to(momentum_ptr.dtype.element_ty)
        tl.store(momentum_ptr + i, zero, mask=inside & (sent != 0.0))


def commit_sparse_(
    velocity: torch.Tensor, momentum_buf: torch.Tensor | None, indices: torch.Tensor, sent: torch.Tensor
) -> None:
    """Fused :func:`lightning_gc.kernels.sparse.commit_sparse_`: one pass over the sent pairs."""
    pairs = indices.numel()
    if pairs == 0:
        return
    masking = momentum_buf is not None
    launch(
        _commit_sparse_kernel,
        (triton.cdiv(pairs, BLOCK),),
        velocity,
        momentum_buf if masking else velocity,
        indices,
        sent,
        pairs,
        MASK=masking,
        BLOCK=BLOCK,
    )


@triton.jit
def _scatter_average_kernel(out_ptr, index_ptr, values_ptr, pairs, scale, BLOCK: tl.constexpr):
    base, j, inside = program_block(pairs, BLOCK)
    i = tl.load(index_ptr + base + j, mask=inside, other=0).to(tl.int64)
    v = tl.load(values_ptr + base + j, mask=inside, other=0.0).to(tl.float32)
    tl.atomic_add(out_ptr + i, v * scale, mask=inside, sem="relaxed")  # a pure accumulation: no ordering


def scatter_average_(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, world_size: int) -> None:
    """Fused :func:`lightning_gc.kernels.sparse.scatter_average_` (atomics: sums in any order)."""
    pairs = indices.numel()
    if pairs == 0:
        return
    indices, values = indices.contiguous(), values.contiguous()  # e.g. one pair per rank's row
    launch(
        _scatter_average_kernel,
        (triton.cdiv(pairs, BLOCK),),
        out,
        indices,
        values,
        pairs,
        1.0 / world_size,
        BLOCK=BLOCK,
    )
