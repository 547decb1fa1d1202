"""One torchft replica group (one process) for tests/test_torchft.py: a tiny MLP trained with a
compressed exchange over the quorum (lightning_gc.integrations.ft).

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
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial model everywhere (torchft's init_sync heals it anyway)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gc = fault_tolerant(
        model,
        optimizer,
        args.compressor,
        lighthouse=args.lighthouse,
        replica_id=str(args.replica),
        min_replicas=args.min_replicas,
        timeout=args.timeout,
        compress_ratio=args.compress_ratio,
    )
    if args.ready is not None:
        args.ready.write_text("ready")
    holds = {int(step): Path(file) for step, file in (hold.split(":", 1) for hold in args.hold)}
    last_participants = 0
    with args.log.open("a") as log:
        while gc.steps < args.steps or last_participants < args.final_participants:
            while gc.steps in holds and not holds[gc.steps].exists():
                time.sleep(0.02)
            gc.zero_grad()
            data = torch.Generator().manual_seed(1000 * args.replica + gc.steps)
            x = torch.randn(16, 32, generator=data)
            y = torch.randint(0, 4, (16,), generator=data)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if args.stall_at is not None and gc.steps >= args.stall_at:
                print(json.dumps({"stalled": gc.steps, "time": time.time()}), file=log, flush=True)
                time.sleep(3600)  # the test kills this process here
            participants = gc.participants
            committed = gc.step()
            if committed:
                last_participants = participants
            line = {
                "steps": gc.steps,
                "committed": committed,
                "participants": participants,
                "residual": float(gc.averager.residual().abs().sum()),
                "time": time.time(),
            }
            print(json.dumps(line), file=log, flush=True)
    torch.save(
        {
            "parameters": [p.detach().clone() for p in model.parameters()],
            "steps": gc.steps,
            "manager_step": gc.manager.current_step(),
            "rolled_back": gc.rolled_back,
            "healed": gc.healed,
            "dropped_residual": gc.dropped_residual,
        },
        args.result,
    )
    gc.close()


if __name__ == "__main__":
    main()
