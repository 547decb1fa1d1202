"""Host time the comm hook holds the training thread per step, on real gloo ranks.

``gc/compress_s`` counts the codec's phases (decode included, which runs on the collective's
thread once the exchange lands) and ``gc/wait_s`` the hook's waits on collectives. Neither is the
time the hook holds the training thread: that also holds a delayed exchange's hand-over,
statistics and layout checks, and not the decode. With a delay, that time is what a step cannot
hide (the performance model's ``max(compute, exchange) + hook``). So this script times the hook
function itself, wrapped where the session registers it, and prints the two metrics beside it.

Each run is ``lightning_gc.attach(model, optimizer, NAME, **settings)`` on ``--world-size``
processes on loopback (no shaping), each pinned to its own core with one torch thread, training
``--model`` on synthetic batches. Runs alternate repeat by repeat, so their ratios are side by
side::

    python -m benchmarks.hook_host --model resnet18 --run "fp16 delay=1" --run "none delay=1" \
        [--repeats 3] [--steps 14] [--batch 8]

A run's settings are ``KEY=VALUE`` pairs of :func:`lightning_gc.attach` (Python literals, else
strings). For a before/after comparison of two trees, run the script in each (``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import ast
import os
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from benchmarks.netbench.models import MODELS, synthetic_batches

WARMUP_STEPS = 3
"""Steps left out of the medians: DDP's bucket rebuild and the compressors' plans happen there."""


def parse_run(text: str) -> tuple[str, dict[str, Any]]:
    """``"fp16 delay=1"`` -> ``("fp16", {"delay": 1})``."""
    name, *items = text.split()
    settings: dict[str, Any] = {}
    for item in items:
        key, equals, value = item.partition("=")
        if not equals:
            raise argparse.ArgumentTypeError(f"settings are KEY=VALUE pairs, got {item!r} in {text!r}")
        try:
            settings[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[key] = value
    return name, settings


def _rank(
    rank: int, world_size: int, port: int, model: str, run: tuple[str, dict[str, Any]], steps: int, batch: int, out: Any
) -> None:
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    rank_zero_only.rank = rank  # as Lightning's strategies do: the library's warnings once, from rank 0
    import lightning_gc
    from lightning_gc.runtime import session

    spent: list[float] = []
    registered = session.compression_hook

    def timed_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations here
        started = time.perf_counter()
        try:
            return registered(state, bucket)
        finally:
            spent.append(time.perf_counter() - started)

    session.compression_hook = timed_hook  # type: ignore[assignment]
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(MODELS[model]())
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        name, settings = run
        handle = lightning_gc.attach(ddp, optimizer, name, **settings)
        batches = synthetic_batches(4, batch, seed=rank)
        rows = []
        for step in range(steps):
            spent.clear()
            x, y = batches[step % len(batches)]
            started = time.perf_counter()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            handle.step()
            metrics = handle.last_metrics or {}
            rows.append(
                (
                    sum(spent),
                    time.perf_counter() - started,
                    float(metrics.get("gc/compress_s", 0.0)),
                    float(metrics.get("gc/wait_s", 0.0)),
                )
            )
        handle.finish()
        if rank == 0:
            out.put([statistics.median(column) for column in zip(*rows[WARMUP_STEPS:])])
    finally:
        dist.destroy_process_group()


def measure(
    model: str, run: tuple[str, dict[str, Any]], world_size: int, steps: int, batch: int, port: int
) -> list[float]:
    """Rank 0's medians over the timed steps: hook, step, compress and wait seconds."""
    context = mp.get_context("spawn")
    out = context.Queue()
    processes = [
        context.Process(target=_rank, args=(rank, world_size, port, model, run, steps, batch, out))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    failed = [process.exitcode for process in processes if process.exitcode != 0]
    if failed:
        raise RuntimeError(f"run {run} failed: exit codes {failed}")
    return out.get()


def markdown(results: dict[str, list[list[float]]]) -> str:
    """One row per run: medians over repeats (each repeat a median over steps), in ms."""
    lines = [
        "| run | hook ms / step | repeats | gc/compress_s ms | gc/wait_s ms | step ms |",
        "|---|---|---|---|---|---|",
    ]
    for label, repeats in results.items():
        hook, step, compress, wait = (statistics.median(column) * 1e3 for column in zip(*repeats))
        each = ", ".join(f"{row[0] * 1e3:.1f}" for row in repeats)
        lines.append(f"| {label} | {hook:.1f} | {each} | {compress:.1f} | {wait:.1f} | {step:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    parser.add_argument(
        "--run", action="append", type=parse_run, required=True, help='"NAME KEY=VALUE ..." (repeatable)'
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--port", type=int, default=29561)
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps, got {args.steps}")
    labels = [" ".join([name, *(f"{key}={value}" for key, value in settings.items())]) for name, settings in args.run]
    results: dict[str, list[list[float]]] = {label: [] for label in labels}
    for _ in range(args.repeats):
        for label, run in zip(labels, args.run):
            results[label].append(measure(args.model, run, args.world_size, args.steps, args.batch, args.port))
    print(
        f"{args.model}, {args.world_size} gloo ranks on loopback, batch {args.batch}, {platform.node()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; medians of {args.repeats} repeats x "
        f"{args.steps - WARMUP_STEPS} steps\n"
    )
    print(markdown(results))


if __name__ == "__main__":
    main()
