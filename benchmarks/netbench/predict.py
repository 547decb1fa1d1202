"""The performance model's prediction for every benchmark mode (validation of ``lightning_gc.perfmodel``).

Per mode, what each rank sends and what encoding/decoding costs it per step:

* ``ddp``: the whole gradient all-reduced, no codec;  ``noop``: nothing sent, no codec (it *is*
  the measured compute time ``C`` the other predictions start from);
* ``torch_fp16``: half the bytes all-reduced; codec = timed cast to fp16, divide, cast back;
* ``torch_powersgdR``: matrices torch would compress send ``(n + m) R`` values (P, then Q),
  the rest dense; codec = timed error feedback, ``P = MQ``, QR of P, ``Q = M^T P``, ``PQ^T``;
  one bucket is ready only when backward ends, so nothing overlaps (``f = 0``);
* ``gc_<name>``: :func:`lightning_gc.perfmodel.calibration.codec_cost` on the model's parameter shapes and
  its real gradients on four synthetic batches (the DGC modes with momentum correction at 0.9, as
  the benchmark trains); ``gc_<name>_delay1`` costs the same and is predicted with
  ``Workload(delay=1)``: the whole next step can hide its exchange.

Timing runs in this process: launch it pinned to one core with one thread, like the workers::

    taskset -c 0 python -m benchmarks.netbench.predict --model resnet18 --modes ddp gc_dgc --out costs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks.netbench.models import BenchModule, gradient_shapes, synthetic_batches
from benchmarks.netbench.modes import DGC_MODES, IDEAL, split_delay, split_mode
from lightning_gc.perfmodel import CodecCost, Network, calibration
from lightning_gc.perfmodel.step import Prediction, Workload, predict

ELEMENT_SIZE = 4
DDP_BUCKET_BYTES = 25 * 2**20
POWERSGD_MIN_COMPRESSION_RATE = 2
DGC_MOMENTUM = 0.9


def _median_time(work: Callable[[], object], repeats: int) -> float:
    work()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def fp16_hook_cost(shapes: Sequence[tuple[int, ...]], world_size: int, repeats: int = 3) -> CodecCost:
    numel = sum(math.prod(s) for s in shapes)
    flat = torch.randn(numel)

    def codec() -> None:
        half = flat.to(torch.float16).div_(world_size)
        flat.copy_(half)

    return CodecCost("torch_fp16", summed_bytes=numel * 2, gathered_bytes=0, encode_s=_median_time(codec, repeats))


def powersgd_hook_cost(shapes: Sequence[tuple[int, ...]], rank: int, repeats: int = 3) -> CodecCost:
    matrices, dense = [], 0
    for shape in shapes:
        rows, cols = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
        if len(shape) > 1 and (rows + cols) * rank * POWERSGD_MIN_COMPRESSION_RATE < rows * cols:
            matrices.append((torch.randn(rows, cols), torch.randn(cols, rank), torch.zeros(rows, cols)))
        else:
            dense += rows * cols
    sent = dense + sum((m.shape[0] + m.shape[1]) * rank for m, _, _ in matrices)

    def codec() -> None:
        for matrix, q, error in matrices:
            matrix.add_(error)
            p = torch.linalg.qr(matrix @ q).Q
            q = matrix.t() @ p
            error.copy_(matrix).sub_(p @ q.t())

    cost = _median_time(codec, repeats)
    return CodecCost(f"torch_powersgd{rank}", summed_bytes=sent * ELEMENT_SIZE, gathered_bytes=0, encode_s=cost)


def real_gradients(model: str, steps: int = 4, batch_size: int = 32) -> list[torch.Tensor]:
    """Flat gradients of ``model`` on ``steps`` synthetic batches, as the workers compute them."""
    module = BenchModule(model)
    params = [p for p in module.parameters() if p.requires_grad]
    gradients = []
    for batch in synthetic_batches(steps, batch_size, seed=0):
        module.zero_grad()
        module.training_step(batch, 0).backward()
        gradients.append(torch.cat([p.grad.reshape(-1) for p in params]))
    return gradients


def mode_cost(
    mode: str,
    shapes: Sequence[tuple[int, ...]],
    world_size: int,
    cache: Path | None,
    gradients: Sequence[torch.Tensor] | None = None,
) -> CodecCost:
    """What ``mode`` sends and costs per step (timed here, ours on ``gradients``); ``ddp``/``noop`` need no timing."""
    numel = sum(math.prod(s) for s in shapes)
    if mode == "ddp":
        return CodecCost("ddp", summed_bytes=numel * ELEMENT_SIZE, gathered_bytes=0)
    if mode == "noop":
        return CodecCost("noop", summed_bytes=0, gathered_bytes=0)
    if mode == "torch_fp16":
        return fp16_hook_cost(shapes, world_size)
    if mode.startswith("torch_powersgd"):
        return powersgd_hook_cost(shapes, int(mode.removeprefix("torch_powersgd")))
    if mode.startswith("gc_"):
        base, exchange, _, _ = split_mode(mode)  # a delay changes when the exchange happens, not what it costs
        dgc = base in DGC_MODES
        name = "dgc" if dgc else base.removeprefix("gc_")
        arguments = {**(DGC_MODES[base] if dgc else {}), **({} if exchange is None else {"exchange": exchange})}
        momentum = DGC_MOMENTUM if dgc else 0.0
        cost = calibration.codec_cost(
            name,
            list(shapes),
            world_size=world_size,
            arguments=arguments,
            cache=cache,
            momentum=momentum,
            gradients=gradients,
        )
        return dataclasses.replace(cost, name=mode)  # every field: two-phase and point-to-point bytes too
    raise ValueError(f"no prediction for mode {mode!r}")


def predict_modes(
    costs: dict[str, CodecCost],
    gradient_numel: int,
    compute_s: float,
    bits_per_s: float,
    *,
    overlap: float = 0.5,
    host_bps: float | None = None,
) -> dict[str, Prediction]:
    """Predicted step per mode on two nodes joined by a ``bits_per_s`` link, from compute time ``C``;
    ``host_bps``: the rate at which a node's one core drives the transport (``None``: free)."""
    network = Network.from_bits(2, bits_per_s, latency=50e-6, host_bits_per_second=host_bps)
    dense_bytes = gradient_numel * ELEMENT_SIZE
    buckets = 1 + math.ceil(dense_bytes / DDP_BUCKET_BYTES)
    out = {}
    for mode, cost in costs.items():
        single = mode.startswith("torch_powersgd")
        workload = Workload(
            gradient_numel,
            compute_s,
            0.0 if single else overlap,
            rounds=1 if single else buckets,
            delay=split_delay(mode)[1],
        )
        out[mode] = predict(workload, network, [cost])[-1]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--modes", nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = gradient_shapes(args.model)
    gradients = real_gradients(args.model)
    costs = {mode: mode_cost(mode, shapes, 2, args.cache, gradients).__dict__ for mode in args.modes if mode != IDEAL}
    args.out.write_text(json.dumps(costs, indent=1))


if __name__ == "__main__":
    main()
