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


def reference_dgc(plan: dict) -> list[list[torch.Tensor]]:
    """Every rank's final parameters. With ``delay`` d >= 1, step t >= ``sync_warmup_steps``
    applies the average of step t - d (zero before the first delayed step), plus with
    ``local_update`` its own step-t contribution minus its own step-(t-d) one (OD-SGD)."""
    models = [make_model() for _ in range(WORLD)]
    params = [list(model.parameters()) for model in models]
    m, wd, lr = plan["momentum"], plan["weight_decay"], plan["lr"]
    delay, local, warmup = plan.get("delay", 0), plan.get("local_update", False), plan.get("sync_warmup_steps", 0)
    u = [[torch.zeros_like(p) for p in params[0]] for _ in range(WORLD)]
    v = [[torch.zeros_like(p) for p in params[0]] for _ in range(WORLD)]
    averages: dict[int, list[torch.Tensor]] = {}
    owns: dict[tuple[int, int], list[torch.Tensor]] = {}
    for step in range(plan["steps"]):
        sent = [[torch.zeros_like(p) for p in params[0]] for _ in range(WORLD)]
        for rank in range(WORLD):
            models[rank].zero_grad()
            x, y = data_for(rank, step)
            torch.nn.functional.mse_loss(models[rank](x), y).backward()
            for i, p in enumerate(params[rank]):
                g = p.grad.clone()
                if plan["clip_norm"] is not None:
                    g *= min(1.0, plan["clip_norm"] / math.sqrt(WORLD) / (g.norm().item() + 1e-12))
                g += wd * p.detach()
                u[rank][i] = m * u[rank][i] + g  # torch.optim.SGD's buffer
                v[rank][i] += g + m * u[rank][i] if plan["nesterov"] else u[rank][i]
                flat_v, flat_u = v[rank][i].view(-1), u[rank][i].view(-1)
                if p.dim() > 1 and p.numel() >= MIN_COMPRESS_NUMEL:
                    k = math.ceil(plan["ratio"] * p.numel())
                    idx = torch.topk(flat_v.abs(), k).indices
                    sent[rank][i].view(-1)[idx] = flat_v[idx]
                    flat_v[idx] = 0
                    flat_u[idx] = 0
                else:
                    sent[rank][i] += v[rank][i]
                    v[rank][i].zero_()
        averages[step] = [sum(s[i] for s in sent) / WORLD for i in range(len(sent[0]))]
        for rank in range(WORLD):
            owns[(rank, step)] = sent[rank]
        zeros = [torch.zeros_like(p) for p in params[0]]
        for rank in range(WORLD):
            if delay == 0 or step < warmup:
                applied = averages[step]
            else:
                old = step - delay
                applied = averages[old] if old >= warmup else zeros
                if local:
                    mine, old_mine = owns[(rank, step)], owns[(rank, old)] if old >= warmup else zeros
                    applied = [a + n - o for a, n, o in zip(applied, mine, old_mine)]
            with torch.no_grad():
                for p, update in zip(params[rank], applied):
                    p -= lr * update
    return [[p.detach() for p in rank_params] for rank_params in params]


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
    for got, want in zip(ranks, expected):
        for g, e, p0 in zip(got, want, initial):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(g, p0.detach())  # every tensor actually trained


@pytest.mark.parametrize(
    ("delay", "local_update", "sync_warmup_steps", "gradient_as_bucket_view"),
    [(1, False, 0, False), (1, False, 0, True), (1, True, 2, False), (2, True, 1, False)],
    ids=["stale-by-one", "stale-by-one-gradients-as-bucket-views", "od-sgd-after-warmup", "delay-two-od-sgd"],
)
def test_delayed_hook_matches_the_stale_and_od_sgd_rules(
    run_ranks, delay: int, local_update: bool, sync_warmup_steps: int, gradient_as_bucket_view: bool
) -> None:
    """The hook hands DDP the average of ``delay`` steps ago (plus, with ``local_update``, the
    rank's own newest minus its own ``delay``-old contribution), several buckets, real gloo.
    Without the local update the hook hands DDP the average's slot itself, which DDP copies into
    the gradients, or into the bucket they are views of (``gradient_as_bucket_view``)."""
    plan = {
        "kernels": "torch",
        "ratio": 0.05,
        "momentum": 0.9,
        "nesterov": False,
        "weight_decay": 1e-3,
        "lr": 0.1,
        "steps": 7,
        "clip_norm": None,
        "bucket_cap_mb": 0.002,
        "min_compress_numel": MIN_COMPRESS_NUMEL,
        "delay": delay,
        "local_update": local_update,
        "sync_warmup_steps": sync_warmup_steps,
        "gradient_as_bucket_view": gradient_as_bucket_view,
    }
    ranks = run_ranks(plan, worker="hook_worker.py")
    expected = reference_dgc(plan)
    for got, want in zip(ranks, expected):
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    synchronous = reference_dgc({**plan, "delay": 0})
    assert not torch.allclose(expected[0][0], synchronous[0][0])  # the delay changes the trajectory
    if local_update:
        assert not torch.allclose(ranks[0][0], ranks[1][0])  # ranks differ by their own terms
    else:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0], ranks[1]))
