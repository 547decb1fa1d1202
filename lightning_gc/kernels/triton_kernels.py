"""Triton kernels for the compression hot path; each must equal its torch twin in ``reference.py``.

Imported lazily by :mod:`lightning_gc.kernels` (only when the Triton backend is chosen), so CPU
users never pay Triton's import or compile cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _momentum_compensate_kernel(
    grad_ptr, momentum_ptr, velocity_ptr, numel, momentum, NESTEROV: tl.constexpr, BLOCK: tl.constexpr
):
    # One pass: read g, u, v; write u, v. Arithmetic in fp32 whatever the storage dtype.
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    g = tl.load(grad_ptr + offsets, mask=inside).to(tl.float32)
    u = tl.load(momentum_ptr + offsets, mask=inside).to(tl.float32)
    v = tl.load(velocity_ptr + offsets, mask=inside).to(tl.float32)
    if NESTEROV:
        u = momentum * (u + g)
        v = v + u + g
    else:
        u = momentum * u + g
        v = v + u
    tl.store(momentum_ptr + offsets, u.to(momentum_ptr.dtype.element_ty), mask=inside)
    tl.store(velocity_ptr + offsets, v.to(velocity_ptr.dtype.element_ty), mask=inside)


def momentum_compensate_(
    grad: torch.Tensor, momentum_buf: torch.Tensor, velocity: torch.Tensor, momentum: float, nesterov: bool
) -> None:
    """Fused :func:`lightning_gc.kernels.reference.momentum_compensate_` (contiguous 1-D tensors)."""
    numel = grad.numel()
    if numel == 0:
        return
    grid = (triton.cdiv(numel, BLOCK),)
    _momentum_compensate_kernel[grid](grad, momentum_buf, velocity, numel, float(momentum), NESTEROV=nesterov, BLOCK=BLOCK)
