"""Where every Triton kernel is launched from: contiguity check, interpreter lock, block size.

Imported only by the Triton modules (``*_triton.py``), themselves imported lazily by
:mod:`lightning_gc.kernels`, so CPU users never pay Triton's import or compile cost. Launches go
through :func:`launch`, which :func:`intercepted` can redirect (:mod:`.aot` records launches so).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_gc.kernels.dispatch import interpreting

BLOCK = 1024
"""Elements per program of the elementwise and scatter kernels."""

_INTERPRETER_LOCK = threading.Lock()
_interceptor: Callable[..., None] | None = None


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Launch ``kernel``; serialised under TRITON_INTERPRET=1, whose interpreter keeps global grid
    state (DDP runs hooks and communication callbacks on different threads). The kernels index
    their tensors as flat arrays, so a strided view would be read or written wrongly: refused."""
    if _interceptor is not None:
        _interceptor(kernel, grid, *args, **meta)
        return
    strided = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not a.is_contiguous()]
    if strided:
        name = getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))
        raise ValueError(f"{name}: tensor arguments {strided} are not contiguous")
    if interpreting():
        with _INTERPRETER_LOCK:
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


@contextmanager
def intercepted(instead: Callable[..., None]) -> Iterator[None]:
    """Within the block, :func:`launch` calls ``instead(kernel, grid, *args, **meta)`` and launches
    nothing (not thread-safe: for :mod:`.aot`, which runs the wrappers on made-up data)."""
    global _interceptor
    previous, _interceptor = _interceptor, instead
    try:
        yield
    finally:
        _interceptor = previous
