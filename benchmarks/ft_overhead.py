"""Per-step cost of the torchft transport against the plain gloo one, on loopback.

The same MLP, data and compressor (DGC with error feedback) on ``--replicas`` processes, one torch
thread each, two ways:

* **plain**: one torch.distributed gloo group; each step: forward/backward, then
  :class:`~lightning_gc.exchanges.averager.CompressedAverager` over the group and the optimizer step;
* **torchft**: a real ``torchft_lighthouse`` and one replica group per process
  (:func:`lightning_gc.integrations.ft.fault_tolerant`); each step: the quorum (``zero_grad``),
  forward/backward, then the exchange over the quorum, the commit vote and the optimizer step.

Printed: the median over steps (after ``--warmup``) of rank 0's step time and of its parts (ms),
side by side, and their ratios; with ``--rounds R`` the two run alternately ``R`` times and the
median of the ``R`` medians is printed.

    python -m benchmarks.ft_overhead --replicas 3 --steps 60 --hidden 1024
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(32, 256, generator=data), torch.randint(0, 10, (32,), generator=data)


def _plain(rank: int, args: argparse.Namespace, port: int, out: Path) -> None:
    from lightning_gc.exchanges.averager import CompressedAverager

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.replicas)
    model = _model(args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    params = list(model.parameters())
    averager = CompressedAverager("dgc", [(str(i), p.shape) for i, p in enumerate(params)], compress_ratio=args.ratio)
    times = []
    for step in range(args.steps):
        dist.barrier()
        began = time.perf_counter()
        optimizer.zero_grad()
        x, y = _batch(rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        computed = time.perf_counter()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        average = averager.average(flat).wait()
        offset = 0
        for p in params:
            p.grad.copy_(average[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()
        ended = time.perf_counter()
        times.append({"step": ended - began, "quorum": 0.0, "compute": computed - began, "exchange": ended - computed})
    if rank == 0:
        out.write_text(json.dumps(times))
    dist.destroy_process_group()


def _ft(rank: int, args: argparse.Namespace, lighthouse: str, out: Path) -> None:
    from lightning_gc.integrations.ft import fault_tolerant

    torch.set_num_threads(1)
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        os.environ.pop(name, None)
    model = _model(args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gc = fault_tolerant(
        model, optimizer, "dgc", lighthouse=lighthouse, replica_id=str(rank), min_replicas=args.replicas,
        timeout=30.0, compress_ratio=args.ratio,
    )  # fmt: skip
    times = []
    while gc.steps < args.steps:
        began = time.perf_counter()
        gc.zero_grad()
        quorum = time.perf_counter()
        x, y = _batch(rank, gc.steps)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        computed = time.perf_counter()
        committed = gc.step()
        ended = time.perf_counter()
        if committed and gc.participants == args.replicas:
            times.append(
                {
                    "step": ended - began,
                    "quorum": quorum - began,
                    "compute": computed - quorum,
                    "exchange": ended - computed,
                }
            )
    if rank == 0:
        out.write_text(json.dumps(times))
    time.sleep(1.0)  # let the peers finish their last step before this manager goes away
    gc.close()


def _lighthouse(replicas: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = str(Path(sys.executable).parent / "torchft_lighthouse")
    command = [binary, "--min_replicas", str(replicas), "--bind", "127.0.0.1:0", "--join_timeout_ms", "5000"]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    for _ in range(300):
        found = re.search(r"listening on: http://[^:\s]+:(\d+)", log.read_text())
        if found:
            return process, f"http://127.0.0.1:{found.group(1)}"
        if process.poll() is not None:
            break
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"torchft_lighthouse did not start listening: {log.read_text()[-500:]}")


def _medians(times: list[dict[str, float]], warmup: int) -> dict[str, float]:
    kept = times[warmup:]
    return {key: 1000 * statistics.median(t[key] for t in kept) for key in kept[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width (parameters about 267 x hidden)")
    parser.add_argument("--ratio", type=float, default=0.01, help="DGC's compress_ratio")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternated; the median of their medians")
    args = parser.parse_args()
    plains, fts = [], []
    for _ in range(args.rounds):  # alternated, so that load from other processes hits both alike
        with tempfile.TemporaryDirectory() as tmp:
            plain_out, ft_out = Path(tmp) / "plain.json", Path(tmp) / "ft.json"
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_plain, args=(args, port, plain_out), nprocs=args.replicas)
            lighthouse, address = _lighthouse(args.replicas, Path(tmp) / "lighthouse.log")
            try:
                mp.spawn(_ft, args=(args, address, ft_out), nprocs=args.replicas)
            finally:
                lighthouse.kill()
            plains.append(_medians(json.loads(plain_out.read_text()), args.warmup))
            fts.append(_medians(json.loads(ft_out.read_text()), args.warmup))
    plain = {key: statistics.median(r[key] for r in plains) for key in plains[0]}
    ft = {key: statistics.median(r[key] for r in fts) for key in fts[0]}
    parameters = sum(p.numel() for p in _model(args.hidden).parameters())
    print(
        f"{args.replicas} replicas on loopback, MLP of {parameters} parameters, DGC {args.ratio}, median ms per step "
        f"(median of {args.rounds} alternated runs)"
    )
    print("| part | plain gloo | torchft | ratio |\n|---|---|---|---|")
    for key in ("step", "quorum", "compute", "exchange"):
        ratio = f"{ft[key] / plain[key]:.2f}" if plain[key] > 0 else "-"
        print(f"| {key} | {plain[key]:.2f} | {ft[key]:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
