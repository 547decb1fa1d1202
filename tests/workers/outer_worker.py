"""One rank of the OuterLoop runs over a real gloo group; see test_outer.py.

Every case trains a small MLP (seeded the same on every rank) on this rank's own batches (seeded by
rank and step) towards one fixed teacher, and saves what the test compares: parameters after each
sync, losses, bytes sent, and for the reference cases the plain-DDP or uninterrupted run.
"""

from __future__ import annotations

import copy
import io
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_setup import run_gloo_rank  # noqa: E402

from lightning_gc.exchanges.averager import CompressedAverager  # noqa: E402
from lightning_gc.runtime.outer import OuterLoop, OuterSGD, Streaming  # noqa: E402

WIDTH = 32


def mlp(seed: int = 0, norm: bool = False) -> torch.nn.Module:
    """32 -> 64 -> 64 -> 1: its weights (2048 and 4096 elements) are the ones top-k compresses."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(WIDTH, 64), torch.nn.Tanh()]
    if norm:
        layers.append(torch.nn.BatchNorm1d(64))
    layers += [torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)]
    return torch.nn.Sequential(*layers)


def teacher(x: torch.Tensor) -> torch.Tensor:
    """A linear target, far (loss ~9) from where the MLP starts: 24 DiLoCo steps are all descent."""
    generator = torch.Generator().manual_seed(1234)
    w = torch.randn(WIDTH, 1, generator=generator) / WIDTH**0.5
    return 4 * x @ w


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, WIDTH, generator=torch.Generator().manual_seed(1000 * rank + step))
    return x, teacher(x)


def evaluate(model: torch.nn.Module) -> float:
    x = torch.randn(256, WIDTH, generator=torch.Generator().manual_seed(99))
    model.eval()
    with torch.no_grad():
        loss = F.mse_loss(model(x), teacher(x)).item()
    model.train()
    return loss


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    steps: range,
    outer: OuterLoop | None = None,
    on_sync: Callable[[], None] | None = None,
) -> None:
    for step in steps:
        x, y = batch(rank, step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        if outer is not None and outer.inner_step_done() and on_sync is not None:
            on_sync()


def equivalence(rank: int) -> dict[str, Any]:
    """H = 1, exact average, outer SGD lr 1 without momentum vs plain DDP."""
    model = mlp()
    reference = DistributedDataParallel(copy.deepcopy(model))
    plain_sgd = OuterSGD(lr=1.0, momentum=0.0, nesterov=False)
    outer = OuterLoop(model, sync_every=1, compressor="none", outer=plain_sgd)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, range(5), outer)
    train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), rank, range(5))
    return {"outer": snapshot(model), "ddp": snapshot(reference.module), "syncs": outer.syncs}


def diloco(rank: int) -> dict[str, Any]:
    """H = 4, AdamW inner, Nesterov outer defaults; BatchNorm buffers averaged at each sync."""
    model = mlp(norm=True)
    start = evaluate(model)
    outer = OuterLoop(model, sync_every=4)
    synced: list[dict[str, torch.Tensor]] = []
    before_sync: list[dict[str, torch.Tensor]] = []  # this rank's running statistics right before each sync
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # outer momentum multiplies it ~7x
    for step in range(24):
        train(model, optimizer, rank, range(step, step + 1))
        if (step + 1) % 4 == 0:
            before_sync.append({n: b.clone() for n, b in model.named_buffers() if b.is_floating_point()})
        if outer.inner_step_done():
            synced.append(snapshot(model))
    return {
        "start": start, "end": evaluate(model), "synced": synced, "syncs": outer.syncs, "before_sync": before_sync,
    }  # fmt: skip


def compressed(rank: int) -> dict[str, Any]:
    """SparseLoCo-style: top-k 10 % with error decay 0.95."""
    model = mlp()
    outer = OuterLoop(model, sync_every=2, compressor="topk", compress_ratio=0.1, error_decay=0.95)
    synced: list[dict[str, torch.Tensor]] = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, rank, range(12), outer, lambda: synced.append(snapshot(model)))
    numel = sum(p.numel() for p in model.parameters())
    return {"synced": synced, "syncs": outer.syncs, "bytes_sent": outer.bytes_sent, "numel": numel}


def saved_and_rebuilt(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    outer: OuterLoop,
    settings: Callable[[torch.nn.Module], tuple[torch.optim.Optimizer, OuterLoop]],
) -> tuple[torch.nn.Module, torch.optim.Optimizer, OuterLoop]:
    """What a run killed here and restarted holds: the state saved (through bytes, as a file would
    be), fresh objects built by ``settings``, the state loaded into them."""
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "outer": outer.state_dict()}, buffer)
    model = mlp(norm=True)
    optimizer, outer = settings(model)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    outer.load_state_dict(state["outer"])
    return model, optimizer, outer


def resume_settings(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, OuterLoop]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = OuterLoop(model, sync_every=4, compressor="topk", compress_ratio=0.1, error_decay=0.95)
    return optimizer, outer


def resume(rank: int) -> dict[str, Any]:
    """16 steps straight vs 10 steps, a checkpoint mid-interval, fresh objects, 6 more steps."""
    model = mlp(norm=True)
    optimizer, outer = resume_settings(model)
    train(model, optimizer, rank, range(16), outer)
    straight = {"model": snapshot(model), "global": copy.deepcopy(outer.global_parameters), "syncs": outer.syncs}

    model = mlp(norm=True)
    optimizer, outer = resume_settings(model)
    train(model, optimizer, rank, range(10), outer)
    saved_at = (outer.inner_steps, outer.syncs)
    model, optimizer, outer = saved_and_rebuilt(model, optimizer, outer, resume_settings)
    train(model, optimizer, rank, range(10, 16), outer)
    resumed = {"model": snapshot(model), "global": copy.deepcopy(outer.global_parameters), "syncs": outer.syncs}
    return {"straight": straight, "resumed": resumed, "saved_at": saved_at}


def mismatch(rank: int) -> dict[str, Any]:
    """Ranks that start from different parameters are refused, naming the first that differs."""
    try:
        OuterLoop(mlp(seed=rank), sync_every=2)
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": None}


class UnstreamedDiLoCo:
    """The outer loop written out without fragments (what OuterLoop did before streaming): every
    ``sync_every`` steps, one averager over every parameter, outer Nesterov SGD, theta_r <- theta_g."""

    def __init__(self, model: torch.nn.Module, sync_every: int, **codec: Any) -> None:
        self.model, self.sync_every, self.steps = model, sync_every, 0
        self.params = list(model.parameters())
        shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
        self.averager = CompressedAverager(codec.pop("compressor"), shapes, **codec)
        self.globals = [p.detach().clone() for p in self.params]
        self.optimizer = torch.optim.SGD(self.globals, lr=0.7, momentum=0.9, nesterov=True)

    def inner_step_done(self) -> bool:
        self.steps += 1
        if self.steps % self.sync_every:
            return False
        numels = [p.numel() for p in self.params]
        with torch.no_grad():
            delta = torch.cat([(g - p).reshape(-1) for g, p in zip(self.globals, self.params)])
            average = self.averager.average(delta).wait()
            for piece, g in zip(average.split(numels), self.globals):
                g.grad = piece.view(g.shape).clone()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            for g, p in zip(self.globals, self.params):
                p.copy_(g)
        return True


def unstreamed(rank: int) -> dict[str, Any]:
    """fragments=1, sync_delay=0, mix=0 vs the outer loop written out without fragments."""
    codec = {"compressor": "topk", "compress_ratio": 0.1, "error_decay": 0.95}
    results = {}
    for name in ("streamed", "reference"):
        model = mlp()
        if name == "streamed":
            outer: Any = OuterLoop(model, sync_every=3, streaming=Streaming(1, 0, 0.0), **codec)
        else:
            outer = UnstreamedDiLoCo(model, 3, **codec)
        train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank, range(10), outer)
        results[name] = snapshot(model)
    return results


def stagger(rank: int) -> dict[str, Any]:
    """P = 2, H = 4, tau = 1: theta_g of every fragment after every inner step, and whether the
    module then held it."""
    model = mlp()
    outer = OuterLoop(model, sync_every=4, streaming=Streaming(fragments=2, sync_delay=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    globals_after, local_is_global, landed, flying = [], [], [], []
    for step in range(12):
        x, y = batch(rank, step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        landed.append(outer.inner_step_done())
        flying.append(outer.in_flight)
        globals_after.append([[t.clone() for t in f.globals] for f in outer.fragments])
        local_is_global.append([all(torch.equal(p, g) for p, g in zip(f.params, f.globals)) for f in outer.fragments])
    sizes = [sum(p.numel() for p in f.params) for f in outer.fragments]
    return {
        "globals": globals_after, "local_is_global": local_is_global, "landed": landed, "flying": flying,
        "sizes": sizes, "syncs": outer.syncs,
    }  # fmt: skip


def streaming_settings(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, OuterLoop]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    streaming = Streaming(fragments=2, sync_delay=1, mix=0.5)
    outer = OuterLoop(model, sync_every=4, compressor="topk", compress_ratio=0.1, error_decay=0.95, streaming=streaming)
    return optimizer, outer


def streaming_resume(rank: int) -> dict[str, Any]:
    """P = 2, tau = 1, mix 0.5: 16 steps straight vs 10 (fragment 1's exchange launched at step
    10 still in flight), a checkpoint, fresh objects, 6 more steps."""
    model = mlp(norm=True)
    optimizer, outer = streaming_settings(model)
    train(model, optimizer, rank, range(16), outer)
    straight = {"model": snapshot(model), "global": copy.deepcopy(outer.global_parameters), "syncs": outer.syncs}
    sent = outer.bytes_sent

    model = mlp(norm=True)
    optimizer, outer = streaming_settings(model)
    train(model, optimizer, rank, range(10), outer)
    in_flight = outer.in_flight
    model, optimizer, outer = saved_and_rebuilt(model, optimizer, outer, streaming_settings)
    resumed_in_flight = outer.in_flight
    train(model, optimizer, rank, range(10, 16), outer)
    resumed = {"model": snapshot(model), "global": copy.deepcopy(outer.global_parameters), "syncs": outer.syncs}
    return {
        "straight": straight, "resumed": resumed, "in_flight": in_flight, "resumed_in_flight": resumed_in_flight,
        "bytes": (sent, outer.bytes_sent),
    }  # fmt: skip


def buffers(rank: int) -> dict[str, Any]:
    """H = 4 with BatchNorm: 6 steps (a sync at 4, two local steps since); the buffers the module
    holds inside global_weights() (what validation and checkpoints see) and outside it."""
    model = mlp(norm=True)
    outer = OuterLoop(model, sync_every=4)
    train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank, range(6), outer)
    local = {name: b.clone() for name, b in model.named_buffers()}
    with outer.global_weights():
        inside = {name: b.clone() for name, b in model.named_buffers()}
    after = {name: b.clone() for name, b in model.named_buffers()}
    state = outer.state_dict()["global_buffers"]
    return {"local": local, "inside": inside, "after": after, "state": state}


CASES = {
    "equivalence": equivalence, "diloco": diloco, "compressed": compressed, "resume": resume, "mismatch": mismatch,
    "unstreamed": unstreamed, "stagger": stagger, "streaming_resume": streaming_resume, "buffers": buffers,
}  # fmt: skip


def body(plan: dict, rank: int) -> None:
    results = {name: CASES[name](rank) for name in plan["cases"]}
    torch.save(results, Path(plan["out"]) / f"rank{rank}.pt")


if __name__ == "__main__":
    run_gloo_rank(body)
