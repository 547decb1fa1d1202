"""Ahead-of-time compilation of the Triton kernels for a CUDA GPU, on a machine without one.

Triton's CPU interpreter (``TRITON_INTERPRET=1``, how the test suite runs the kernels) executes
the Python of a kernel without compiling it, and accepts programs the compiler rejects. This module
compiles what a GPU would compile, with ``triton.compile`` for a ``GPUTarget`` (ptxas ships with
triton), so such programs fail here:

1. :func:`wrapper_launches` runs every public wrapper of the Triton modules (``*_triton.py``)
   on CPU tensors of every dtype and flag combination it accepts, recording each launch's kernel,
   arguments and compile-time constants instead of launching (through :func:`.launch.intercepted`);
2. :func:`variant_of` turns a launch into the signature Triton's JIT would compile, including its
   *specialisation*: an integer argument equal to 1 becomes a compile-time constant unless the
   kernel lists it in ``do_not_specialize`` (``ones=True`` forces every such argument to 1, the
   corner that broke TernGrad's kernel on the first GPU that ran it);
3. :func:`compile_variant` compiles one variant for ``sm_<arch>`` and reads ptxas's register and
   spill counts.

``benchmarks/kernel_compile.py`` reports registers and spills of every variant;
``tests/test_kernels_compile.py`` compiles them through ``python -m lightning_gc.kernels.aot``
(the kernels must be imported with ``TRITON_INTERPRET=0``, which the CPU test suite does not do).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pkgutil
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.uint8: "*u8",
    torch.bool: "*i1",
}


@dataclass(frozen=True)
class Launch:
    """One launch a wrapper made: the kernel, its runtime arguments and its constexpr arguments."""

    kernel: Any
    args: tuple[Any, ...]
    meta: dict[str, Any]


@dataclass(frozen=True)
class Variant:
    """What Triton compiles for a launch: argument types and compile-time constants."""

    kernel: Any
    signature: dict[str, str]
    constexprs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        runtime = ",".join(t for t in self.signature.values() if t != "constexpr")
        constants = ",".join(f"{k}={v}" for k, v in sorted(self.constexprs.items()))
        return f"{self.kernel.fn.__name__}[{runtime}|{constants}]"

    def key(self) -> tuple[str, tuple[tuple[str, str], ...], tuple[tuple[str, Any], ...]]:
        return self.name, tuple(self.signature.items()), tuple(sorted(self.constexprs.items()))


@dataclass(frozen=True)
class Compiled:
    """A compiled variant: ptxas's registers per thread and spilled bytes (stores + loads)."""

    variant: Variant
    arch: int
    registers: int
    spill_bytes: int


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Within the block, the wrappers record their launches here instead of launching."""
    from lightning_gc.kernels.launch import intercepted

    launches: list[Launch] = []

    def record(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
        launches.append(Launch(kernel, args, meta))

    with intercepted(record):
        yield launches


def triton_modules() -> list[Any]:
    """Every Triton module of :mod:`lightning_gc.kernels` (``*_triton``), imported."""
    import lightning_gc.kernels as package

    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.name.endswith("_triton"))
    return [importlib.import_module(f"{package.__name__}.{name}") for name in names]


def wrapper_launches() -> list[Launch]:
    """Every launch the wrappers make over the dtypes and flags they accept (on made-up data)."""
    from lightning_gc.kernels import compensation_triton, packing_triton, selection_triton, sparse_triton
    from lightning_gc.kernels.selection import SegmentedTopK, SelectionScratch

    numel, k = 4096, 8
    indices = torch.arange(k, dtype=torch.int64)
    calls: list[Callable[[], object]] = []
    for dtype in FLOAT_DTYPES:
        g = torch.randn(numel).to(dtype)
        for momentum, nesterov in ((0.0, False), (0.9, False), (0.9, True)):
            for scale in (None, torch.ones(())):
                for decay in (0.0, 1e-4):
                    calls.append(
                        partial(compensation_triton.compensate_, g, g.clone(), g.clone(), momentum=momentum,
                                nesterov=nesterov, grad_scale=scale, weight_decay=decay, param=g)
                    )  # fmt: skip
        large = torch.randn(1 << 20).to(dtype)  # large enough for the sampled threshold (small ones go exact)
        calls.append(
            partial(selection_triton.sampled_topk_, large, 1024, sample_ratio=0.01, salt=1,
                    scratch=SelectionScratch(), out_indices=torch.empty(1024, dtype=torch.int64),
                    out_values=torch.empty(1024, dtype=dtype))
        )  # fmt: skip
        bucket = SegmentedTopK(starts=(0, 1 << 19), numels=(1 << 19, 2048), ks=(512, 2), firsts=(0, 512), salts=(0, 1))
        calls.append(  # a sampled segment and an exact one (too small to sample), selected together
            partial(selection_triton.sampled_topk_segments_, large, bucket, sample_ratio=0.01, step_salt=1,
                    scratch=None, out_indices=torch.empty(514, dtype=torch.int64),
                    out_values=torch.empty(514, dtype=dtype))
        )  # fmt: skip
        for masking in (False, True):
            calls.append(
                partial(sparse_triton.commit_sparse_, g.clone(), g.clone() if masking else None, indices, g[:k])
            )
        for values_dtype in FLOAT_DTYPES:
            calls.append(partial(sparse_triton.scatter_average_, g.clone(), indices, g[:k].to(values_dtype), 2))
        calls.append(partial(packing_triton.pack_signs, g))
        for levels in (1, 3, 7, 15, 127):
            calls.append(partial(packing_triton.stochastic_quantize, g, torch.ones(()), levels, 11))
    for width in (1, 2, 4, 8):
        calls.append(partial(packing_triton.pack_codes, torch.zeros(numel, dtype=torch.uint8), width))
        calls.append(
            partial(packing_triton.unpack_codes, torch.zeros(numel * width // 8, dtype=torch.uint8), width, numel)
        )
    with recording() as launches:
        for call in calls:
            call()
    return launches


def _scalar_type(value: Any) -> str:
    # Triton's JIT rules for Python scalars.
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64" if -(2**63) <= value < 2**63 else "u64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__} {value!r}")


def variant_of(launch: Launch, ones: bool = False) -> Variant:
    """The variant Triton's JIT compiles for ``launch``; ``ones`` sets every integer argument it
    would specialise to 1 (the JIT turns an integer argument equal to 1 into a constant)."""
    kernel = launch.kernel
    runtime = [p for p in kernel.params if not p.is_constexpr]
    if len(runtime) != len(launch.args):
        raise ValueError(
            f"{kernel.fn.__name__} takes {len(runtime)} runtime arguments, launched with {len(launch.args)}"
        )
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for param, value in zip(runtime, launch.args):
        if isinstance(value, torch.Tensor):
            signature[param.name] = _POINTER_TYPES[value.dtype]
            continue
        integer = isinstance(value, int) and not isinstance(value, bool)
        if integer and not param.do_not_specialize and (value == 1 or ones):
            signature[param.name] = "constexpr"
            constexprs[param.name] = 1
        else:
            signature[param.name] = _scalar_type(value)
    for param in kernel.params:
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = launch.meta[param.name]
    return Variant(kernel, signature, constexprs)


def unique_variants(launches: list[Launch], ones: bool = False) -> list[Variant]:
    """The distinct variants of ``launches``, in first-seen order."""
    seen: dict[Any, Variant] = {}
    for launch in launches:
        variant = variant_of(launch, ones)
        seen.setdefault(variant.key(), variant)
    return list(seen.values())


_PTXAS_LINE = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_variant(variant: Variant, arch: int = 90) -> Compiled:
    """Compile ``variant`` for ``sm_<arch>`` (raises what the compiler raises) and read ptxas's
    resource use from a verbose re-assembly of the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    source = ASTSource(fn=variant.kernel, signature=variant.signature, constexprs=variant.constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
    with tempfile.TemporaryDirectory() as scratch:
        ptx = Path(scratch) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a" if arch >= 90 else f"--gpu-name=sm_{arch}",
             str(ptx), "-o", str(Path(scratch) / "kernel.cubin")],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    registers = _PTXAS_LINE.search(report)
    spills = _SPILLS.search(report)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas -v gave no resource line for {variant.name}:\n{report}")
    return Compiled(variant, arch, int(registers[1]), int(spills[1]) + int(spills[2]))


_TASKS: list[tuple[Variant, int, bool]] = []
"""What :func:`report`'s forked workers compile, by index: variants hold JIT functions, which do
not pickle, so the children read them from the memory they inherit."""


def _compile_row(index: int) -> dict[str, Any]:
    variant, arch, launched = _TASKS[index]
    row: dict[str, Any] = {"variant": variant.name, "arch": arch, "launched": launched}
    try:
        compiled = compile_variant(variant, arch)
        row |= {"registers": compiled.registers, "spill_bytes": compiled.spill_bytes}
    except Exception as error:  # every failing variant is reported, not only the first
        row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1]}"
    return row


def report(archs: tuple[int, ...] = (80, 90), workers: int | None = None) -> dict[str, Any]:
    """Compile every launched variant and its all-ones corner for each of ``archs``: per variant,
    registers and spilled bytes or the compiler's error; and which kernels the wrappers launch.
    Compiles run in ``workers`` forked processes (default: one per core), in the same order."""
    launches = wrapper_launches()
    launched, corner = unique_variants(launches), unique_variants(launches, ones=True)
    variants = list({v.key(): v for v in launched + corner}.values())
    _TASKS[:] = [(variant, arch, variant in launched) for arch in archs for variant in variants]
    workers = min(len(_TASKS), workers or os.cpu_count() or 1)
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            rows = pool.map(_compile_row, range(len(_TASKS)), chunksize=1)
    else:
        rows = [_compile_row(index) for index in range(len(_TASKS))]
    _TASKS.clear()
    kernels = sorted(n for m in triton_modules() for n in vars(m) if n.startswith("_") and n.endswith("_kernel"))
    return {"rows": rows, "kernels": kernels, "launched_kernels": sorted({v.kernel.fn.__name__ for v in launched})}


if __name__ == "__main__":
    import json

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("python -m lightning_gc.kernels.aot compiles kernels: run it with TRITON_INTERPRET=0")
    print(json.dumps(report()))
