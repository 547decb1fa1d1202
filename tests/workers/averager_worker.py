"""One rank of CompressedAverager runs over real gloo groups; see test_averager.py.

For each case of the plan, the rank averages ``calls`` flat tensors of its own (seeded by rank and
call) and saves every average and its final residual, so the test can check the ranks agree and
that nothing was lost. Cases run over a group made with ``dist.new_group`` (not the default one).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_setup import run_gloo_rank  # noqa: E402

from lightning_gc.exchanges.averager import CompressedAverager  # noqa: E402

SHAPES = [("w", (48, 40)), ("b", (40,)), ("v", (3000,))]


def inputs(rank: int, call: int, numel: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + call)
    return torch.randn(numel, generator=generator)


def body(plan: dict, rank: int) -> None:
    group = dist.new_group(list(range(dist.get_world_size())))
    results = {}
    for case in plan["cases"]:
        averager = CompressedAverager(case["compressor"], SHAPES, group=group, **case.get("arguments", {}))
        averages = []
        for call in range(plan["calls"]):
            averages.append(averager.average(inputs(rank, call, averager.numel)).wait().clone())
        results[case["id"]] = {
            "averages": averages,
            "residual": averager.residual(),
            "inputs": [inputs(rank, call, averager.numel) for call in range(plan["calls"])],
            "bytes_sent": averager.bytes_sent,
        }
    torch.save(results, Path(plan["out"]) / f"rank{rank}.pt")


if __name__ == "__main__":
    run_gloo_rank(body)
