"""Which implementation runs a hot-path op: Triton kernels on CUDA tensors, torch elsewhere.

The choice is made per call from the tensor's device, so GPU users get the kernels without any
configuration. It can be forced, for tests and benchmarks, with :func:`use_backend` or the
``LIGHTNING_GC_KERNELS`` environment variable (``auto``, ``torch`` or ``triton``). Forcing
``triton`` on CPU tensors needs ``TRITON_INTERPRET=1`` set before Triton is imported (Triton's
interpreter runs kernels on the CPU, slowly, for testing).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from contextvars import ContextVar

import torch

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "LIGHTNING_GC_KERNELS"

_forced: ContextVar[str | None] = ContextVar("lightning_gc_kernel_backend", default=None)


def triton_available() -> bool:
    """Whether Triton is importable (it is installed with CUDA builds of torch on Linux x86_64)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def requested_backend() -> str:
    """The backend asked for by :func:`use_backend` or the environment (``"auto"`` if neither)."""
    forced = _forced.get()
    if forced is not None:
        return forced
    value = os.environ.get(ENV_VAR, "auto")
    if value not in BACKENDS:
        raise ValueError(f"`{ENV_VAR}` must be one of {list(BACKENDS)}, got {value!r}")
    return value


def backend_for(tensor: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: the implementation that runs an op on ``tensor``. Float64 runs
    on torch whatever is asked: the Triton kernels compute in float32, which would round its
    values and overflow its range."""
    requested = requested_backend()
    if requested == "torch" or tensor.dtype == torch.float64:
        return "torch"
    if requested == "triton":
        if not triton_available():
            raise RuntimeError("the triton kernel backend was requested but triton is not installed")
        if not tensor.is_cuda and not interpreting():
            raise RuntimeError(
                "the triton kernel backend was requested for a CPU tensor; set TRITON_INTERPRET=1 "
                "before importing triton to run kernels in Triton's interpreter"
            )
        return "triton"
    return "triton" if tensor.is_cuda and triton_available() else "torch"


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force a backend inside a ``with`` block (``"auto"`` restores device-based choice)."""
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {list(BACKENDS)}, got {name!r}")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)
