"""DGC's compensation step (momentum correction, error feedback) in torch; Triton twin: :mod:`.compensation_triton`.

Per element of a bucket slice, with velocity (the residual memory) ``v``, momentum ``u``, factor ``m``::

    d = grad * grad_scale + weight_decay * param      (each term only when given)
    momentum != 0, plain:    u <- m*u + d;      v <- v + u
    momentum != 0, Nesterov: u <- m*u + d;      v <- v + (d + m*u)
    momentum == 0:           v <- v + d         (error feedback; u untouched, may be None)

``u`` is ``torch.optim.SGD``'s own momentum buffer in both forms (DGC's paper writes Nesterov's as
``u <- m*(u + d); v <- v + u + d``, which keeps ``m`` times it: the same while ``m`` is constant,
but a scheduled momentum would then multiply last step's buffer by this step's ``m``).
"""

from __future__ import annotations

import torch


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
    """One slice's compensation step, in place on ``velocity`` (v) and ``momentum_buf`` (u)::

        d = grad * grad_scale + weight_decay * param      (each term only when given)
        momentum != 0, plain:    u <- m*u + d;      v <- v + u
        momentum != 0, Nesterov: u <- m*u + d;      v <- v + (d + m*u)
        momentum == 0:           v <- v + d         (error feedback; u untouched, may be None)

    ``grad_scale`` is a 0-d tensor on the slice's device (e.g. a clipping factor), so no host
    sync is needed. ``grad`` may be overwritten with ``d``.
    """
    if grad_scale is not None:
        grad.mul_(grad_scale)
    if weight_decay != 0.0:
        assert param is not None, "weight decay needs the parameter"
        grad.add_(param, alpha=weight_decay)
    if momentum == 0.0:
        velocity.add_(grad)
        return
    assert momentum_buf is not None, "momentum needs a momentum buffer"
    torch.add(grad, momentum_buf, alpha=momentum, out=momentum_buf)
    if nesterov:  # SGD's step direction d + m*u, summed as torch sums it
        velocity.add_(grad.add_(momentum_buf, alpha=momentum))
    else:
        velocity.add_(momentum_buf)
