"""One rank of a plain DDP loop (``lightning_gc.attach``) under the Adam hand-over, where rank 1
leaves a head out of every other step, for test_adam.py.

Each run trains ``torch.optim.Adam(weight_decay=0.5)`` with DGC at ratio 1 (the hand-over after two
steps) and ``find_unused_parameters=True``. On rank 1's odd steps the head is either not used at
all (``"skip"``: DDP zeroes its slot) or used with a zero weight (``"zero"``: autograd reaches it
with a zero gradient, so the hand-over's gradient hook runs).
"""

from __future__ import annotations

import os

import torch
from rank_setup import run_gloo_rank
from torch.nn.parallel import DistributedDataParallel

import lightning_gc


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.side = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3), torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, side: str) -> torch.Tensor:
        h = torch.relu(self.body(x))
        if side == "skip":
            return self.head(h)
        return self.head(h) + (0.0 if side == "zero" else 1.0) * self.side(h)


def train(rank_one: str, rank: int, steps: int) -> torch.Tensor:
    """Every parameter, flat, after ``steps`` steps; rank 1's odd steps leave ``side`` out as ``rank_one`` says."""
    model = TwoHeads()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.5)
    gc = lightning_gc.attach(ddp, optimizer, "dgc", compress_ratio=1.0, adam_warmup_steps=2)
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(16, 8, generator=generator), torch.randint(0, 3, (16,), generator=generator)
        optimizer.zero_grad()
        side = rank_one if rank == 1 and step % 2 else "use"
        torch.nn.functional.cross_entropy(ddp(x, side), y).backward()
        gc.step()
    gc.finish()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def rank_body(plan: dict, rank: int) -> None:
    results = {rank_one: train(rank_one, rank, plan["steps"]) for rank_one in ("skip", "zero")}
    torch.save(results, os.path.join(plan["out"], f"rank{rank}.pt"))


if __name__ == "__main__":
    run_gloo_rank(rank_body)
