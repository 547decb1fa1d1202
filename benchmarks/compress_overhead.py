"""Time of one DGC compression step on a ResNet-50-sized gradient: sampled threshold vs exact top-k.

One step = compensate (momentum correction) + select k = ceil(ratio * numel) + mask (momentum
factor masking and velocity reset at the sent indices), exactly what the comm hook does per
compressed tensor. Both selections run interleaved in the same process on the same gradients,
so their ratio is measured side by side; the script prints medians and, with ``--record``,
appends a row to benchmarks/RESULTS.md.

    python benchmarks/compress_overhead.py [--numel 25600000] [--ratio 0.001] [--repeats 7]
        [--device cpu|cuda] [--record]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_gc.common.layout import BucketLayout
from lightning_gc.compressors import DGCCompressor
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.core.momentum import MomentumSpec
from lightning_gc.kernels import topk_indices

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Select = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]
"""``(velocity, k, salt) -> (indices, values)``: the pairs to send."""


def make_step(numel: int, ratio: float, device: torch.device, select: Select):
    """A closure running compensate + select + mask on its own memory for a given gradient."""
    param = torch.nn.Parameter(torch.zeros(numel, 1, device=device))  # a 2-D weight: compressed
    layout = BucketLayout.build(0, [param], {id(param): ("weight", 0)}, numel)
    memory = CompensationMemory(momentum_correction=True, momentum_masking=True, clip_norm=None)
    memory.set_specs({"weight": MomentumSpec(momentum=0.9)})
    k = max(1, int(numel * ratio + 0.999999))
    step = 0

    def run(grad: torch.Tensor) -> float:
        nonlocal step
        work = grad.clone()
        _sync(device)
        started = time.perf_counter()
        state = memory.bucket(layout, work)
        velocity = memory.compensate(state, work, [param], world_size=1)
        indices, values = select(velocity, k, step)
        memory.commit_sparse(state, indices, values)
        _sync(device)
        step += 1
        return time.perf_counter() - started

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=25_600_000)
    parser.add_argument("--ratio", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--record", action="store_true", help="append the result to benchmarks/RESULTS.md")
    args = parser.parse_args()
    device = torch.device(args.device)

    compressor = DGCCompressor(args.ratio)

    def sampled(velocity: torch.Tensor, k: int, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
        indices = torch.empty(k, dtype=torch.int64, device=velocity.device)
        values = velocity.new_empty(k)
        compressor.select(velocity, k, salt, indices, values)
        return indices, values

    def exact(velocity: torch.Tensor, k: int, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
        indices = topk_indices(velocity, k)
        return indices, velocity[indices]

    steps = {
        "sampled": make_step(args.numel, args.ratio, device, sampled),
        "exact topk": make_step(args.numel, args.ratio, device, exact),
    }
    generator = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(args.numel, device=device, generator=generator) for _ in range(2)]
    for run in steps.values():  # warm-up: allocation of the memory buffers, first-touch page faults
        run(grads[0])
    times: dict[str, list[float]] = {name: [] for name in steps}
    for repeat in range(args.repeats):
        for name, run in steps.items():  # interleaved, so drift hits both alike
            times[name].append(run(grads[repeat % 2]))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    speedup = medians["exact topk"] / medians["sampled"]

    machine = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    )
    print(f"device: {machine}; numel={args.numel:,} ratio={args.ratio} repeats={args.repeats}")
    for name, ts in times.items():
        print(f"  {name:11s} median {medians[name] * 1e3:8.2f} ms  (min {min(ts) * 1e3:.2f}, max {max(ts) * 1e3:.2f})")
    print(f"  exact / sampled = {speedup:.2f}x")
    if args.record:
        row = (
            f"| {time.strftime('%Y-%m-%d')} | {machine} | {args.numel:,} | {args.ratio} | "
            f"{medians['sampled'] * 1e3:.1f} | {medians['exact topk'] * 1e3:.1f} | {speedup:.2f}x | {args.repeats} |\n"
        )
        RESULTS.write_text(insert_row(RESULTS.read_text(), row))


def insert_row(text: str, row: str) -> str:
    """``text`` with ``row`` added at the end of the results table (the one headed like ours)."""
    lines = text.splitlines(keepends=True)
    header = next(i for i, line in enumerate(lines) if line.startswith("| date | device | elements | ratio |"))
    end = header
    while end + 1 < len(lines) and lines[end + 1].startswith("|"):
        end += 1
    return "".join(lines[: end + 1] + [row] + lines[end + 1 :])


if __name__ == "__main__":
    main()
