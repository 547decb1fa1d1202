"""One rank of the per-sync byte count of every outer-loop preset over a real gloo group; see
test_outer_bytes.py.

For each case of the plan the rank builds the preset's outer loop (``outer_loop``) on a module of
the plan's parameter shapes (seeded the same on every rank), moves its own copy of the weights by a
rank-seeded step ``syncs * sync_every`` times (an inner step: the outer loop does not care how the
weights moved), and saves the bytes it sent, the syncs it made and theta_g.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_setup import run_gloo_rank  # noqa: E402

from lightning_gc.integrations.outer_attach import outer_loop  # noqa: E402


def module_of(shapes: list[list[int]]) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.ParameterDict({f"p{i}": torch.nn.Parameter(torch.randn(shape)) for i, shape in enumerate(shapes)})


def body(plan: dict, rank: int) -> None:
    results = {}
    for case in plan["cases"]:
        model = module_of(plan["shapes"])
        outer = outer_loop(model, case["preset"], sync_every=plan["sync_every"], **case.get("arguments", {}))
        generator = torch.Generator().manual_seed(1000 + rank)
        for _ in range(plan["syncs"] * plan["sync_every"]):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator), alpha=0.01)
            outer.inner_step_done()
        results[case["id"]] = {
            "bytes_sent": outer.bytes_sent,
            "syncs": outer.syncs,
            "global": {name: t.clone() for name, t in outer.global_parameters.items()},
            "world_size": dist.get_world_size(),
        }
    torch.save(results, Path(plan["out"]) / f"rank{rank}.pt")


if __name__ == "__main__":
    run_gloo_rank(body)
