"""One rank of the outer loop under Lightning Fabric (FabricOuterLoopStrategy) on a real gloo group;
see test_outer_fabric.py. The ranks are started as torchrun would (RANK, LOCAL_RANK, WORLD_SIZE in
the environment): Fabric then launches nothing and joins the group itself.

Runs, in order: 10 steps straight with a checkpoint after step 6 (fragment 1's exchange in flight),
then two resumes of it for the last 4 steps: loaded before ``fabric.setup`` and after it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

from lightning_gc.integrations.outer_fabric import FabricOuterLoopStrategy
from lightning_gc.runtime.teardown import shut_down_process_group

SETTINGS = {"sync_every": 4, "fragments": 2, "sync_delay": 1, "mix": 0.5, "compressor": "topk", "compress_ratio": 0.1}
"""Fragment 0 launches at steps 4 and 8, fragment 1 at 2, 6, 10; each lands a step later."""


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [
        torch.nn.Linear(16, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 1),
    ]
    return torch.nn.Sequential(*layers)


def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(10_000 * rank + 10 * step + micro))
    return x, x.sum(dim=1, keepdim=True).sin()


def named(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def run(rank: int, out: Path, steps: range, resume: str | None = None) -> dict[str, Any]:
    """Train ``steps`` (two micro-batches a step, the first without backward sync); save after step 6."""
    strategy = FabricOuterLoopStrategy("diloco", **SETTINGS)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    raw = model = net(seed=0 if resume is None else 7)  # a resume starts from other weights: the checkpoint's win
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if resume == "before_setup":
        fabric.load(out / "step6.ckpt", state)
    model, optimizer = fabric.setup(model, optimizer)
    state.update(model=model, optimizer=optimizer)
    if resume == "after_setup":
        fabric.load(out / "step6.ckpt", state)
    result: dict[str, Any] = {"loaded_step": state["step"], "local_after_step": {}}
    for step in steps:
        for micro in range(2):
            x, y = batch(rank, step, micro)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                fabric.backward(F.mse_loss(model(x), y) / 2)
        optimizer.step()
        optimizer.zero_grad()
        result["local_after_step"][step + 1] = named(raw)
        if step + 1 == 6 and resume is None:
            state["step"] = 6
            result["in_flight_at_save"] = strategy.outer.in_flight
            result["global_at_save"] = {k: v.clone() for k, v in strategy.outer.global_parameters.items()}
            local = named(raw)
            with strategy.global_weights():
                result["evaluated_global"] = all(
                    torch.equal(v, result["global_at_save"][k]) for k, v in named(raw).items()
                )
            result["restored_local"] = all(torch.equal(v, local[k]) for k, v in named(raw).items())
            fabric.save(out / "step6.ckpt", state)
    result["finished"] = strategy.finish()
    result |= {
        "params": named(raw), "global": {k: v.clone() for k, v in strategy.outer.global_parameters.items()},
        "syncs": strategy.outer.syncs, "inner_steps": strategy.outer.inner_steps, "bytes": strategy.outer.bytes_sent,
    }  # fmt: skip
    return result


def main() -> None:
    torch.set_num_threads(1)  # two ranks share two cores
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    rank, out = int(os.environ["RANK"]), Path(plan["out"])
    results = {"straight": run(rank, out, range(10))}
    for resume in ("before_setup", "after_setup"):
        results[resume] = run(rank, out, range(6, 10), resume=resume)
    torch.save(results, out / f"rank{rank}.pt")
    shut_down_process_group()


if __name__ == "__main__":
    main()
