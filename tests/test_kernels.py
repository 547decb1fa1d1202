"""Triton kernels equal their torch references (CPU tensors under TRITON_INTERPRET=1, or a GPU)."""

from __future__ import annotations

import pytest
import torch

from lightning_gc import kernels
from lightning_gc.kernels import dispatch, reference

triton = pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() and not dispatch.interpreting() else "cpu"
TOLERANCE = {torch.float32: (1e-6, 1e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}


SIZES = [0, 1, 1023, 1024, 1025, 4099]  # empty, single, around the 1024 block, ragged
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
COMPENSATE_VARIANTS = {
    "error-feedback": {"momentum": 0.0},
    "momentum": {"momentum": 0.9},
    "nesterov": {"momentum": 0.9, "nesterov": True},
    "nesterov+clip+decay": {"momentum": 0.9, "nesterov": True, "scale": 0.3, "weight_decay": 1e-2},
    "feedback+clip+decay": {"momentum": 0.0, "scale": 0.5, "weight_decay": 1e-3},
}


def _randn(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(COMPENSATE_VARIANTS))
def test_compensate_kernel_equals_reference(numel: int, dtype: torch.dtype, variant: str) -> None:
    options = dict(COMPENSATE_VARIANTS[variant])
    scale = options.pop("scale", None)
    g, u, v, p = (_randn(numel, dtype, seed=numel * 4 + i) for i in range(4))
    kwargs = {**options, "param": p, "grad_scale": None if scale is None else torch.tensor(scale, device=DEVICE)}
    # Reference in fp32 from the same inputs, rounded once at the end, as the kernel does.
    u_ref, v_ref = u.float(), v.float()
    ref_kwargs = {**kwargs, "param": p.float()}
    reference.compensate_(g.float(), v_ref, u_ref, **ref_kwargs)
    g_before, u_before = g.clone(), u.clone()
    with kernels.use_backend("triton"):
        assert kernels.backend_for(g) == "triton"
        kernels.compensate_(g, v, u, **kwargs)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(v, v_ref.to(dtype), rtol=rtol, atol=atol)
    expected_u = u_ref.to(dtype) if options["momentum"] else u_before  # error feedback leaves u alone
    torch.testing.assert_close(u, expected_u, rtol=rtol, atol=atol)
    assert torch.equal(g, g_before)  # the kernel reads the gradient, never writes it


@pytest.mark.parametrize("nesterov", [False, True])
def test_memory_compensate_is_the_same_on_either_backend(nesterov: bool) -> None:
    from lightning_gc.layout import BucketLayout
    from lightning_gc.memory import CompensationMemory
    from lightning_gc.momentum import MomentumSpec

    params = [torch.nn.Parameter(torch.randn(33, 31, device=DEVICE)), torch.nn.Parameter(torch.randn(7, device=DEVICE))]
    names = {id(p): (f"p{i}", i) for i, p in enumerate(params)}
    layout = BucketLayout.build(0, params, names, 33 * 31 + 7)
    results = []
    for backend in ("torch", "triton"):
        memory = CompensationMemory(momentum_correction=True, momentum_masking=True, clip_norm=1.0)
        memory.set_specs({"p0": MomentumSpec(0.9, nesterov, 1e-3), "p1": MomentumSpec(0.9, nesterov)})
        gen = torch.Generator().manual_seed(0)
        with kernels.use_backend(backend):
            for _ in range(3):
                grad = torch.randn(layout.numel, generator=gen).to(DEVICE)
                velocity = memory.compensate(memory.bucket(layout, grad), grad, params, world_size=2)
        results.append(velocity.clone())
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-6)


def test_auto_dispatch_follows_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert kernels.backend_for(torch.zeros(1)) == "torch"
    with kernels.use_backend("torch"):
        assert kernels.backend_for(torch.zeros(1)) == "torch"
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert kernels.backend_for(torch.zeros(1)) == "triton"  # interpreter is on in the test suite


def test_bad_backend_names_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"one of \['auto', 'torch', 'triton'\], got 'cuda'"):
        with kernels.use_backend("cuda"):
            pass
    monkeypatch.setenv(dispatch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="LIGHTNING_GC_KERNELS"):
        kernels.backend_for(torch.zeros(1))


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with kernels.use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.backend_for(torch.zeros(1))
