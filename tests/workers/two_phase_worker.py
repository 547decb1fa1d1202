"""One rank of raw-DDP runs (no Lightning) through lightning_gc's comm hook, for test_two_phase.py.

For each run of the plan (``{"label", "compressor", "arguments", "steps", "resume_at", "defer_rounds", "delay",
"local_update"}``; compressor
``null`` is plain DDP without a hook) a fresh model from the same seed trains on this rank's
deterministic data with ``SGD(lr)``; the rank saves, per label, its losses and final parameters.
With ``resume_at`` the run stops there, keeps what a checkpoint would (parameters, optimizer,
the hook's per-rank state), builds model, DDP and hook anew and continues from that state.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from rank_setup import run_gloo_rank
from torch.nn.parallel import DistributedDataParallel

from lightning_gc.compressors import registry
from lightning_gc.runtime.hook import CompressionHookState, compression_hook
from lightning_gc.runtime.hook_options import HookOptions
from lightning_gc.runtime.settings import CompressionSettings


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )


def data_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed teacher's labels on this rank's inputs (8 batches per rank, cycled)."""
    teacher = torch.Generator().manual_seed(1234)
    weights = torch.randn(64, 10, generator=teacher)
    inputs = torch.randn(32, 64, generator=torch.Generator().manual_seed(100 * rank + step % 8))
    return inputs, (inputs @ weights).argmax(1)


def build(run: dict[str, Any], plan: dict[str, Any]) -> tuple[torch.nn.Module, Any, Any, CompressionHookState | None]:
    model = make_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=plan["bucket_cap_mb"])
    state = None
    if run["compressor"] is not None:
        compressor = registry.create(run["compressor"], **run.get("arguments", {}))
        memory = CompressionSettings().memory_for(compressor)
        names = {id(p): (n, i) for i, (n, p) in enumerate(model.named_parameters())}
        state = CompressionHookState(
            compressor,
            memory,
            names,
            options=HookOptions(
                defer_rounds=run.get("defer_rounds", True),
                delay=run.get("delay", 0),
                local_update=run.get("local_update", False),
            ),
        )
        ddp.register_comm_hook(state, compression_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=plan["lr"])
    return model, ddp, optimizer, state


def record_launches(state: CompressionHookState | None, launches: list[tuple[str, int]]) -> None:
    """Append each collective the hook launches to ``launches`` as (kind, bucket), the bucket
    numbered by the first launch of its run's plan since ``launches`` was last emptied (a plan is
    known by its receive buffer: both phases of a two-phase run receive into the same one)."""
    if state is None:
        return
    transport = state.exchange.transport
    launch, runs = transport.launch, {}

    def recording(payload: Any) -> Any:
        if not launches:
            runs.clear()
        all_to_all = payload.scattered is not None
        kind = "all-to-all" if all_to_all else "all-gather"
        receiving = payload.scattered_out if all_to_all else payload.gathered_out
        launches.append((kind, runs.setdefault(id(receiving), len(runs))))
        return launch(payload)

    transport.launch = recording


def train(run: dict[str, Any], plan: dict[str, Any], rank: int) -> dict[str, Any]:
    model, ddp, optimizer, state = build(run, plan)
    launches: list[tuple[str, int]] = []
    record_launches(state, launches)
    losses = []
    for step in range(run["steps"]):
        launches.clear()  # the last step's are kept
        if step == run.get("resume_at"):
            saved = {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": optimizer.state_dict(),
                "hook": state.state_dict() if state is not None else None,
            }
            model, ddp, optimizer, state = build(run, plan)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            if state is not None:
                state.load_state_dict(saved["hook"])
            record_launches(state, launches)
        inputs, labels = data_for(rank, step)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(inputs), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    server = state.exchange.state_dict() if state is not None else {}  # the two-phase server errors
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "server_error_entries": len(server.get("server", {})),
        "deferred_rounds": state.rounds.deferred if state is not None else 0,
        "bytes_sent": state.stats.bytes_sent if state is not None else 0,
        "last_step_launches": launches,
    }


def rank_body(plan: dict, rank: int) -> None:
    results = {run["label"]: train(run, plan, rank) for run in plan["runs"]}
    torch.save(results, os.path.join(plan["out"], f"rank{rank}.pt"))


if __name__ == "__main__":
    run_gloo_rank(rank_body)
