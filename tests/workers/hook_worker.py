"""One rank of a raw-DDP run (no Lightning) with lightning_gc's comm hook; see test_hook_reference.py.

The plan gives the model/optimizer settings; every rank trains on its own deterministic data
(``data_for(rank, step)``) and saves its final parameters.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_gc.compressors import DGCCompressor
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.core.momentum import MomentumSpec
from lightning_gc.runtime.hook import CompressionHookState, compression_hook
from lightning_gc.runtime.hook_options import HookOptions

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rank_setup import run_gloo_rank
from test_hook_reference import data_for, make_model  # noqa: E402


def rank_body(plan: dict, rank: int) -> None:
    os.environ["LIGHTNING_GC_KERNELS"] = plan["kernels"]  # "torch", or "triton" (interpreted on CPU)
    model = make_model()
    ddp = DistributedDataParallel(
        model,
        bucket_cap_mb=plan["bucket_cap_mb"],
        gradient_as_bucket_view=plan.get("gradient_as_bucket_view", False),
    )
    names = {id(p): (n, i) for i, (n, p) in enumerate(model.named_parameters())}
    memory = CompensationMemory(momentum_correction=True, momentum_masking=True, clip_norm=plan["clip_norm"])
    spec = MomentumSpec(plan["momentum"], plan["nesterov"], plan["weight_decay"])
    memory.set_specs({name: spec for name, _ in model.named_parameters()})
    compressor = DGCCompressor(plan["ratio"], min_compress_numel=plan["min_compress_numel"], value_dtype="float32")
    delayed = {key: plan[key] for key in ("delay", "local_update", "sync_warmup_steps") if key in plan}
    ddp.register_comm_hook(
        CompressionHookState(compressor, memory, names, options=HookOptions(**delayed)), compression_hook
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=plan["lr"])  # momentum-free: it lives in memory
    for step in range(plan["steps"]):
        x, y = data_for(rank, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    torch.save([p.detach().clone() for p in model.parameters()], os.path.join(plan["out"], f"rank{rank}.pt"))


if __name__ == "__main__":
    run_gloo_rank(rank_body)
