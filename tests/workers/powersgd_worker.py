"""One rank of raw-DDP runs comparing our ``powersgd`` with torch's ``powerSGD_hook``; see test_powersgd.py.

Runs, on the same model, data and seed, each of the plan's modes and saves the final parameters:

* ``torch``: DDP + ``powerSGD_hook``, whose random starting Q is replaced by ours (torch draws it
  from numpy's RandomState; the algorithm after that is what is compared);
* ``ours`` / ``ours_buckets``: DDP + our comm hook with ``PowerSGDCompressor``, in one bucket or
  in several (torch's own hook cannot run several buckets on gloo).

Both use ``SGD(momentum=0.9)``: momentum stays in the optimizer (no momentum correction).
(No ``from __future__ import annotations``: DDP checks a hook's annotations at runtime.)
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel

from lightning_gc.compressors import PowerSGDCompressor
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.runtime.hook import CompressionHookState, compression_hook

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rank_setup import run_gloo_rank
from test_hook_reference import data_for, make_model  # noqa: E402


def torch_hook_with_our_start(compressor: PowerSGDCompressor, names: dict[int, int]):
    """torch's hook, with the first Q of each bucket taken from ``compressor.initial_q``."""

    def hook(state: torch_powersgd.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        index = bucket.index()
        if state.iter >= state.start_powerSGD_iter and index not in state.q_memory_dict:
            ps, qs = [], []
            for param in bucket.parameters():
                rows = param.shape[0]
                cols = param.numel() // rows
                rank = min(rows, cols, state.matrix_approximation_rank)
                if param.dim() > 1 and (rows + cols) * rank * state.min_compression_rate < rows * cols:
                    ps.append(torch.empty(rows * rank))
                    qs.append(compressor.initial_q(names[id(param)], cols, rank).reshape(-1))
            state.p_memory_dict[index] = torch.cat(ps)
            state.q_memory_dict[index] = torch.cat(qs)
        return torch_powersgd.powerSGD_hook(state, bucket)

    return hook


def train(plan: dict, mode: str, rank: int) -> list[torch.Tensor]:
    model = make_model()
    bucket_cap_mb = 0.002 if mode == "ours_buckets" else 25.0
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    compressor = PowerSGDCompressor(plan["rank"], start_iter=plan["start_iter"], min_compression_rate=2.0)
    orders = {id(p): i for i, p in enumerate(model.parameters())}
    if mode == "torch":
        state = torch_powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=plan["rank"], start_powerSGD_iter=plan["start_iter"]
        )
        ddp.register_comm_hook(state, torch_hook_with_our_start(compressor, orders))
    else:
        names = {id(p): (n, i) for i, (n, p) in enumerate(model.named_parameters())}
        memory = CompensationMemory(momentum_correction=False, momentum_masking=False, clip_norm=None)
        ddp.register_comm_hook(CompressionHookState(compressor, memory, names), compression_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=plan["lr"], momentum=0.9)
    for step in range(plan["steps"]):
        x, y = data_for(rank, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def rank_body(plan: dict, rank: int) -> None:
    results = {mode: train(plan, mode, rank) for mode in plan["modes"]}
    torch.save(results, os.path.join(plan["out"], f"rank{rank}.pt"))


if __name__ == "__main__":
    run_gloo_rank(rank_body)
