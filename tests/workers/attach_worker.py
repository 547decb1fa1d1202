"""One rank of plain DDP loops (no Lightning), one per entry of the plan's ``"runs"``:
``lightning_gc.attach`` or, with ``"compressor": null``, plain DDP + the same optimizer. Saves each
run's final parameters and totals; see test_attach.py."""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist
from rank_setup import run_gloo_rank
from torch.nn.parallel import DistributedDataParallel

import lightning_gc


def build(run: dict) -> tuple:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model = DistributedDataParallel(net, bucket_cap_mb=run.get("bucket_cap_mb", 25))
    if run["optimizer"] == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gc = None
    # a power-of-two loss scale, fp32 throughout: scaling and unscaling are exact
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if run.get("scaler") else None
    if run["compressor"] is not None:
        kwargs = {**run.get("kwargs", {}), **run.get("rank_kwargs", {}).get(str(dist.get_rank()), {})}
        gc = lightning_gc.attach(model, optimizer, run["compressor"], scaler=scaler, **kwargs)
    return net, model, optimizer, gc, scaler


def train(run: dict, rank: int) -> dict:
    """``run["steps"]`` steps; with ``"resume_after": k``, everything is rebuilt after step ``k``
    from the state a checkpoint would hold (model, optimizer, ``gc.state_dict()``), with
    ``run["resume_kwargs"]`` instead of ``run["kwargs"]`` when given. ``run["late"]``, ``{rank:
    [step, seconds]}``: that rank sleeps before that step's backward (a straggler)."""
    net, model, optimizer, gc, scaler = build(run)
    generator = torch.Generator().manual_seed(100 + rank)
    weights = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
    late_step, late_seconds = run.get("late", {}).get(str(rank), (-1, 0.0))
    metrics = []
    for step in range(run["steps"]):
        if step == run.get("resume_after"):
            entry = [gc.state_dict()]  # complete on rank 0, which a checkpoint file would hold
            dist.broadcast_object_list(entry, src=0)
            # copies: state dicts share storage with the live tensors, and finish() applies what a
            # delayed exchange still owes to them
            saved = copy.deepcopy((net.state_dict(), optimizer.state_dict(), entry[0]))
            gc.finish()
            run = {**run, "kwargs": run.get("resume_kwargs", run.get("kwargs", {}))}
            net, model, optimizer, gc, scaler = build(run)
            net.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            gc.load_state_dict(saved[2])
        x = torch.randn(16, 32, generator=generator)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), (x @ weights).argmax(1))
        if step == late_step:
            time.sleep(late_seconds)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if gc is None:
            optimizer.step()
        else:
            metrics.append(gc.step())
    result = {"params": torch.cat([p.detach().reshape(-1) for p in net.parameters()])}
    if gc is not None:
        gc.finish()
        result["totals"] = dict(gc.totals)
        result["metrics"] = metrics  # each step's gc/* metrics (None for a step that exchanged nothing)
        memory = gc.session.hook_state.memory.state_dict()
        result["memory_numel"] = {name: entry["velocity"].numel() for name, entry in memory.items()}
        result["buckets"] = len(gc.session.hook_state.layouts)
        result["deferred"] = gc.session.hook_state.rounds.deferred  # runs finished at a later bucket's hook
    return result


def rank_body(plan: dict, rank: int) -> None:
    results = [train(run, rank) for run in plan["runs"]]
    torch.save(results, os.path.join(plan["out"], f"rank{rank}.pt"))


if __name__ == "__main__":
    run_gloo_rank(rank_body)
