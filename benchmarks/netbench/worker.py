"""One benchmark "node": trains for warm-up + timed steps and writes its record as JSON.

Launched once per node exactly as a user launches Lightning on a cluster without a scheduler:
``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK`` and ``WORLD_SIZE`` in the environment,
``Trainer(num_nodes=2, devices=--devices)``, no ``LOCAL_RANK`` (with one device per node Lightning
starts no extra process; with more it starts them in the node's namespace, as it does on a
cluster). ``GLOO_SOCKET_IFNAME`` names the interface gloo uses; processes of one node talk over
the namespace's loopback, unshaped. Mode ``ideal`` runs one process without any distributed strategy.

    python -m benchmarks.netbench.worker --mode gc_dgc --model resnet18 --out DIR [--steps 10 --warmup 3]

The record (``DIR/rank<r>.json``): per timed step, wall time between the ends of consecutive
training batches; medians of the bytes the gloo interface transmitted per step (TCP/IP headers
included) and, for ``lightning_gc`` modes, of the bytes its hook handed to the collectives, of
its codec's host time (``gc/compress_s``) and of the time it was blocked on collectives
(``gc/wait_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.netbench.models import BenchModule, synthetic_batches
from benchmarks.netbench.modes import IDEAL, make_strategy
from lightning_gc import GradientCompressionStrategy


def tx_bytes(ifname: str | None) -> int:
    """Bytes sent so far by ``ifname`` (0 when unknown)."""
    path = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes")
    return int(path.read_text()) if ifname and path.exists() else 0


class StepClock(Callback):
    """Wall time and interface tx bytes at the end of every training batch."""

    def __init__(self, ifname: str | None) -> None:
        self.ifname = ifname
        self.times: list[float] = []
        self.sent: list[int] = []
        self.payload: list[float] = []
        self.codec: list[float] = []
        self.waited: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter())
        self.sent.append(tx_bytes(self.ifname))
        strategy = trainer.strategy
        if isinstance(strategy, GradientCompressionStrategy):  # bytes its hook handed to collectives
            self.payload.append(strategy.totals["bytes_sent"])
            if "gc/compress_s" in trainer.callback_metrics:  # host time in the hook this step
                self.codec.append(float(trainer.callback_metrics["gc/compress_s"]))
                self.waited.append(float(trainer.callback_metrics["gc/wait_s"]))


def diffs(values: list[float] | list[int]) -> list[float]:
    return [float(b - a) for a, b in zip(values[:-1], values[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--devices", type=int, default=1, help="processes per node (Lightning starts the others)")
    parser.add_argument("--nodes", type=int, default=2, help="nodes (not WORLD_SIZE: Lightning rewrites it)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    nodes = 1 if args.mode == IDEAL else args.nodes
    node_rank = int(os.environ.get("NODE_RANK", 0))
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    L.seed_everything(0, verbose=False)
    module = BenchModule(args.model)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # set by Lightning in the processes it starts
    seed = node_rank * args.devices + local_rank
    batches = synthetic_batches(args.warmup + args.steps + 1, args.batch_size, seed=seed)
    clock = StepClock(ifname)
    strategy = "auto" if args.mode == IDEAL else make_strategy(args.mode)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1 if args.mode == IDEAL else args.devices,
        num_nodes=nodes,
        strategy=strategy,
        max_steps=len(batches),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[clock],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    step_s = diffs(clock.times)[args.warmup :]
    sent = diffs(clock.sent)[args.warmup :]
    payload = diffs(clock.payload)[args.warmup :]
    hook_s = clock.codec[args.warmup + 1 :]  # the timed steps' own entries
    wait_s = clock.waited[args.warmup + 1 :]
    record = {
        "mode": args.mode,
        "model": args.model,
        "nodes": nodes,
        "node_rank": node_rank,
        "global_rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "batch_size": args.batch_size,
        "gradient_numel": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "step_s": step_s,
        "median_s": statistics.median(step_s),
        "tx_bytes_per_step": statistics.median(sent) if sent else 0.0,
        "payload_bytes_per_step": statistics.median(payload) if payload else None,
        "hook_s_per_step": statistics.median(hook_s) if hook_s else None,
        "wait_s_per_step": statistics.median(wait_s) if wait_s else None,
        "ifname": ifname,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
