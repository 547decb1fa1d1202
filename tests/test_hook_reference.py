"""The comm hook's sparse DGC equals a plain re-implementation of DESIGN.md §3, on 2 gloo ranks.

The reference below simulates both ranks in one process with nothing but torch: per-rank
momentum ``u`` and velocity ``v`` per tensor, exact top-k of ``|v|`` for large 2-D tensors,
momentum factor masking, dense momentum SGD for the rest, average over ranks, momentum-free SGD.
"""

from __future__ import annotations

import math

import pytest
import torch

WORLD = 2
MIN_COMPRESS_NUMEL = 100


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)
    )


def data_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 20, generator=g), torch.randn(16, 8, generator=g)


def reference_dgc(plan: dict) -> list[torch.Tensor]:
    model = make_model()
    params = list(model.parameters())
    m, wd, lr = plan["momentum"], plan["weight_decay"], plan["lr"]
    u = [[torch.zeros_like(p) for p in params] for _ in range(WORLD)]
    v = [[torch.zeros_like(p) for p in params] for _ in range(WORLD)]
    for step in range(plan["steps"]):
        sums = [torch.zeros_like(p) for p in params]
        for rank in range(WORLD):
            model.zero_grad()
            x, y = data_for(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            for i, p in enumerate(params):
                g = p.grad.clone()
                if plan["clip_norm"] is not None:
                    g *= min(1.0, plan["clip_norm"] / math.sqrt(WORLD) / (g.norm().item() + 1e-12))
                g += wd * p.detach()
                if plan["nesterov"]:
                    u[rank][i] = m * (u[rank][i] + g)
                    v[rank][i] += u[rank][i] + g
                else:
                    u[rank][i] = m * u[rank][i] + g
                    v[rank][i] += u[rank][i]
                flat_v, flat_u = v[rank][i].view(-1), u[rank][i].view(-1)
                if p.dim() > 1 and p.numel() >= MIN_COMPRESS_NUMEL:
                    k = math.ceil(plan["ratio"] * p.numel())
                    idx = torch.topk(flat_v.abs(), k).indices
                    sums[i].view(-1)[idx] += flat_v[idx]
                    flat_v[idx] = 0
                    flat_u[idx] = 0
                else:
                    sums[i] += v[rank][i]
                    v[rank][i].zero_()
        with torch.no_grad():
            for p, total in zip(params, sums):
                p -= lr * total / WORLD
    return [p.detach() for p in params]


@pytest.mark.parametrize(
    ("nesterov", "clip_norm", "bucket_cap_mb", "kernels"),
    [(False, None, 25.0, "torch"), (True, 0.5, 0.002, "torch"), (True, 0.5, 0.002, "triton")],
    ids=["plain-one-bucket", "nesterov-clipped-several-buckets", "same-with-triton-kernels"],
)
def test_hook_matches_reference_dgc(
    run_ranks, nesterov: bool, clip_norm: float | None, bucket_cap_mb: float, kernels: str
) -> None:
    plan = {
        "kernels": kernels,
        "ratio": 0.05,
        "momentum": 0.9,
        "nesterov": nesterov,
        "weight_decay": 1e-3,
        "lr": 0.1,
        "steps": 8,
        "clip_norm": clip_norm,
        "bucket_cap_mb": bucket_cap_mb,
        "min_compress_numel": MIN_COMPRESS_NUMEL,
    }
    ranks = run_ranks(plan, worker="hook_worker.py")
    expected = reference_dgc(plan)
    initial = list(make_model().parameters())
    for got in ranks:
        for g, e, p0 in zip(got, expected, initial):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(g, p0.detach())  # every tensor actually trained
