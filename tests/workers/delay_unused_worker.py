"""One rank of a plain DDP loop (``lightning_gc.attach``) with delayed synchronisation and a
parameter that only some steps use, for test_delay.py.

The model's ``side`` parameter enters the loss linearly, ``(side * z).sum()`` with ``z`` fixed per
(rank, step), and only on steps where ``step % 3 == 0``: its averaged gradient does not depend on
how stale the other parameters are, so its final value is known exactly. A run may make one step's
gradient non-finite on rank 0 (``nan_at``) with ``nonfinite="skip"``: a skipped step that does not
use ``side`` leaves its final value unchanged. A run may pass its own DDP arguments (``ddp``) and
use ``side`` every ``side_every`` steps (``None``: never), and zero gradients in place
(``set_to_none``: False), which leaves an unused parameter a zero ``grad``, not ``None``.
"""

from __future__ import annotations

import os

import torch
from rank_setup import run_gloo_rank
from torch.nn.parallel import DistributedDataParallel

import lightning_gc


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.main = torch.nn.Linear(8, 1)
        self.side = torch.nn.Parameter(torch.zeros(16))

    def forward(self, x: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        loss = self.main(x).pow(2).mean()
        return loss if z is None else loss + (self.side * z).sum()


def side_input(rank: int, step: int) -> torch.Tensor:
    return torch.randn(16, generator=torch.Generator().manual_seed(1000 * rank + step))


def train(run: dict, plan: dict, rank: int) -> torch.Tensor:
    """``side`` then the ``main`` layer's weight and bias, flat, after training."""
    model = Model()
    ddp = DistributedDataParallel(model, **run.get("ddp", {"find_unused_parameters": True}))
    optimizer = torch.optim.SGD(model.parameters(), lr=plan["lr"])
    gc = lightning_gc.attach(ddp, optimizer, "none", **run["settings"])
    for step in range(plan["steps"]):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))
        if step == run.get("nan_at") and rank == 0:
            x[0, 0] = float("nan")  # a non-finite gradient on one rank: the step is skipped on every rank
        every = run.get("side_every", 3)
        z = side_input(rank, step) if every is not None and step % every == 0 else None
        optimizer.zero_grad(set_to_none=run.get("set_to_none", True))
        ddp(x, z).backward()
        gc.step()
    gc.finish()
    return torch.cat([model.side.detach(), model.main.weight.detach().flatten(), model.main.bias.detach()])


def rank_body(plan: dict, rank: int) -> None:
    sides = [train(run, plan, rank) for run in plan["runs"]]
    torch.save(sides, os.path.join(plan["out"], f"rank{rank}.pt"))


if __name__ == "__main__":
    run_gloo_rank(rank_body)
