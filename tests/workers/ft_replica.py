"""One torchft replica group (one process) for tests/test_torchft.py: a tiny MLP trained with a
compressed exchange over the quorum, per step (lightning_gc.integrations.ft) or, with --outer H,
one sync every H inner steps (lightning_gc.integrations.ft_outer); "steps" count syncs there.

Each step appends a JSON line to --log: {"steps", "committed", "participants", "residual", "time"}.
Gates the test drives, between steps only: --stall-at K stops this replica inside step K (after
backward, before the exchange: its peers wait for it in the collective) until it is killed;
--hold K:FILE (repeatable) waits before step K until FILE exists. Runs until it has committed
--steps steps and its last committed step had --final-participants replicas; then writes its
parameters and counters to --result.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lightning_gc.integrations.ft import fault_tolerant
from lightning_gc.integrations.ft_outer import fault_tolerant_outer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--final-participants", type=int, default=1)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--ready", type=Path)
    parser.add_argument("--stall-at", type=int)
    parser.add_argument("--hold", action="append", default=[])
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--compressor", default="dgc")
    parser.add_argument("--compress-ratio", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--outer", type=int, default=0, help="outer-loop mode: inner steps per sync (0: per step)")
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial model everywhere (torchft's init_sync heals it anyway)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    replica = OuterReplica(model, optimizer, args) if args.outer else StepReplica(model, optimizer, args)
    if args.ready is not None:
        args.ready.write_text("ready")
    holds = {int(step): Path(file) for step, file in (hold.split(":", 1) for hold in args.hold)}
    last_participants = 0
    with args.log.open("a") as log:
        while replica.count < args.steps or last_participants < args.final_participants:
            while replica.count in holds and not holds[replica.count].exists():
                time.sleep(0.02)
            replica.begin()
            replica.train()
            if args.stall_at is not None and replica.count >= args.stall_at:
                print(json.dumps({"stalled": replica.count, "time": time.time()}), file=log, flush=True)
                time.sleep(3600)  # the test kills this process here
            participants = replica.gc.participants
            committed = replica.finish()
            if committed:
                last_participants = participants
            line = {
                "steps": replica.count,
                "committed": committed,
                "participants": participants,
                "residual": replica.residual(),
                "time": time.time(),
            }
            print(json.dumps(line), file=log, flush=True)
    gc = replica.gc
    torch.save(
        {
            "parameters": [p.detach().clone() for p in model.parameters()] + replica.globals(),
            "steps": replica.count,
            "manager_step": gc.manager.current_step(),
            "rolled_back": gc.rolled_back,
            "healed": gc.healed,
            "dropped_residual": gc.dropped_residual,
        },
        args.result,
    )
    gc.close()


def _batch(replica: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.Generator().manual_seed(1000 * replica + index)
    return torch.randn(16, 32, generator=data), torch.randint(0, 4, (16,), generator=data)


class StepReplica:
    """Per-step mode: one batch, the compressed gradient exchange, commit or roll back."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> None:
        self.model, self.replica = model, args.replica
        self.gc = fault_tolerant(
            model, optimizer, args.compressor, lighthouse=args.lighthouse, replica_id=str(args.replica),
            min_replicas=args.min_replicas, timeout=args.timeout, compress_ratio=args.compress_ratio,
        )  # fmt: skip

    @property
    def count(self) -> int:
        return self.gc.steps

    def begin(self) -> None:
        self.gc.zero_grad()

    def train(self) -> None:
        x, y = _batch(self.replica, self.count)
        torch.nn.functional.cross_entropy(self.model(x), y).backward()

    def finish(self) -> bool:
        return self.gc.step()

    def residual(self) -> float:
        return float(self.gc.averager.residual().abs().sum())

    def globals(self) -> list[torch.Tensor]:
        return []


class OuterReplica:
    """Outer-loop mode: --outer H inner steps alone, then one compressed sync over the quorum."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> None:
        self.model, self.optimizer, self.replica = model, optimizer, args.replica
        self.gc = fault_tolerant_outer(
            model, optimizer, args.compressor, lighthouse=args.lighthouse, replica_id=str(args.replica),
            min_replicas=args.min_replicas, timeout=args.timeout, sync_every=args.outer,
            compress_ratio=args.compress_ratio,
        )  # fmt: skip

    @property
    def count(self) -> int:
        return self.gc.syncs

    def begin(self) -> None:
        self.gc.begin()

    def train(self) -> None:
        for inner in range(self.gc.sync_every):
            self.optimizer.zero_grad()
            x, y = _batch(self.replica, 10 * self.count + inner)
            torch.nn.functional.cross_entropy(self.model(x), y).backward()
            self.optimizer.step()

    def finish(self) -> bool:
        return self.gc.sync()

    def residual(self) -> float:
        return float(self.gc.fragment.averager.residual().abs().sum())

    def globals(self) -> list[torch.Tensor]:
        return [g.clone() for g in self.gc.global_parameters]


if __name__ == "__main__":
    main()
