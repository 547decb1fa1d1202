"""One rank of a plain-DDP run (``lightning_gc.attach``) that resumes at another world size: each of
the plan's ``"runs"`` (``{"name", "compressor", "kwargs"}``) builds a model, with ``"load"`` takes
model, optimizer and ``gc.state_dict()`` from ``<load>/<name>.pt`` (written by any number of
ranks), trains ``"steps"`` steps and writes the same to ``<save>/<name>.pt``. Per run it saves the
compression state as loaded (before the first step), the loss on a fixed batch before and after
training, and the parameters; see test_reshard.py."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from rank_setup import run_gloo_rank
from torch.nn.parallel import DistributedDataParallel

import lightning_gc

TEACHER = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
HELD_OUT = torch.randn(512, 32, generator=torch.Generator().manual_seed(5))


def loss_of(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(net(x), (x @ TEACHER).argmax(1))


def run(spec: dict, plan: dict, rank: int) -> dict:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    gc = lightning_gc.attach(model, optimizer, spec["compressor"], **spec.get("kwargs", {}))
    hook = gc.session.hook_state
    result: dict = {}
    if plan.get("load"):
        path = os.path.join(plan["load"], f"{spec['name']}.pt")
        saved = torch.load(path, weights_only=False)
        net.load_state_dict(saved["net"])
        optimizer.load_state_dict(saved["optimizer"])
        gc.load_state_dict(saved["gc"], source=path)
        result["loaded"] = {
            "step": hook.step,
            "memory": hook.memory.state_dict(),
            "compressor": hook.compressor.state_dict(),
            "exchange": hook.exchange.state_dict(),
            "delayed": None if hook.delay_line is None else hook.delay_line.state_dict(),
        }
    with torch.no_grad():
        result["loss_before"] = float(loss_of(net, HELD_OUT))
    generator = torch.Generator().manual_seed(plan["seed"] + rank)
    for _ in range(plan["steps"]):
        x = torch.randn(32, 32, generator=generator)
        optimizer.zero_grad()
        loss_of(model, x).backward()
        gc.step()
    entry = gc.state_dict()  # a collective: complete on rank 0
    if rank == 0:
        os.makedirs(plan["save"], exist_ok=True)
        state = {"net": net.state_dict(), "optimizer": optimizer.state_dict(), "gc": entry}
        torch.save(state, os.path.join(plan["save"], f"{spec['name']}.pt"))
    dist.barrier()
    with torch.no_grad():
        result["loss_after"] = float(loss_of(net, HELD_OUT))
    result["step"] = hook.step
    gc.finish()
    return result


def rank_body(plan: dict, rank: int) -> None:
    results = {spec["name"]: run(spec, plan, rank) for spec in plan["runs"]}
    torch.save(results, os.path.join(plan["out"], f"rank{rank}.pt"))


if __name__ == "__main__":
    run_gloo_rank(rank_body)
