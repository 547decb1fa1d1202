"""Triton twin of :mod:`.compensation`: the compensation step fused into one pass.

Reads ``g`` (and ``p``), ``u``, ``v`` once and writes ``u``, ``v`` once, with the arithmetic in
float32 whatever the storage dtype (rounded once, on the store); ``grad`` is never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_gc.kernels.launch import BLOCK, launch, program_block


@triton.jit
def _compensate_kernel(
    grad_ptr,
    velocity_ptr,
    momentum_ptr,
    scale_ptr,
    param_ptr,
    numel,
    momentum,
    weight_decay,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One pass: read g (and p), u, v; write u, v. Arithmetic in fp32 whatever the storage dtype.
    base, offsets, inside = program_block(numel, BLOCK)
    grad_ptr, velocity_ptr, momentum_ptr, param_ptr = (
        grad_ptr + base,
        velocity_ptr + base,
        momentum_ptr + base,
        param_ptr + base,
    )
    d = tl.load(grad_ptr + offsets, mask=inside).to(tl.float32)
    if HAS_SCALE:
        d = d * tl.load(scale_ptr).to(tl.float32)
    if HAS_DECAY:
        d = d + weight_decay * tl.load(param_ptr + offsets, mask=inside).to(tl.float32)
    v = tl.load(velocity_ptr + offsets, mask=inside).to(tl.float32)
    if HAS_MOMENTUM:
        u = tl.load(momentum_ptr + offsets, mask=inside).to(tl.float32)
        u = momentum * u + d  # torch.optim.SGD's buffer, Nesterov or not
        if NESTEROV:
            v = v + (d + momentum * u)
        else:
            v = v + u
        tl.store(momentum_ptr + offsets, u.to(momentum_ptr.dtype.element_ty), mask=inside)
    else:
        v = v + d
    tl.store(velocity_ptr + offsets, v.to(velocity_ptr.dtype.element_ty), mask=inside)


def compensate_(
    grad: torch.Tensor,
    velocity: torch.Tensor,
    momentum_buf: torch.Tensor | None = None,
    *,
    momentum: float = 0.0,
    nesterov: bool = False,
    grad_scale: torch.Tensor | None = None,
    weight_decay: float = 0.0,
    param: torch.Tensor | None = None,
) -> None:
    """Fused :func:`lightning_gc.kernels.compensation.compensate_` (contiguous 1-D slices; ``grad`` is not written)."""
    numel = grad.numel()
    if numel == 0:
        return
    has_momentum = momentum != 0.0
    has_decay = weight_decay != 0.0
    launch(
        _compensate_kernel,
        (triton.cdiv(numel, BLOCK),),
        grad,
        velocity,
        momentum_buf if has_momentum else velocity,  # unused pointer when HAS_MOMENTUM is false
        grad_scale if grad_scale is not None else velocity,
        param if has_decay else velocity,
        numel,
        float(momentum),
        float(weight_decay),
        HAS_MOMENTUM=has_momentum,
        NESTEROV=nesterov,
        HAS_SCALE=grad_scale is not None,
        HAS_DECAY=has_decay,
        BLOCK=BLOCK,
    )
