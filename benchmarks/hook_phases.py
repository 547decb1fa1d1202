"""Where the comm hook's time goes on one CPU core: DGC's per-step phases on a model's real gradients.

The hook runs, per bucket (lightning_gc/exchanges/pipeline.py, timed here by its own Timeline)::

    screen      all_finite(grad)                  the default nonfinite="raise" check
    compensate  u <- m*u + g;  v <- v + u          memory.compensate
    encode      sampled top-k per tensor + pack    compressor.encode
    commit      v[idx] -= sent;  u[idx] <- 0       memory.commit
    decode      zero + scatter-add of N payloads   compressor.decode

Each phase is timed on the whole gradient as one bucket, on the netbench models' real gradients
(four synthetic batches, used in turn), with one torch thread like a netbench worker. Two
reference points are timed in the same run on the same data, so the speedups are side by side:
the screen as ``isfinite(grad).all()`` and the candidate search as ``abs`` + compare +
``nonzero`` over the whole tensor (what the hook and selection did before 2026-11-23).

    taskset -c 0 python -m benchmarks.hook_phases [--models resnet18 mlp29m] [--repeats 9] [--record]

``--codec "NAME KEY=VALUE ..."`` (repeatable) times any compressor's whole bucket instead, side by
side on the same gradients, with no momentum (error feedback only), as the pipeline's phases
(``encode`` includes a two-phase exchange's owner round, which runs when its first round arrives)
and the bucket's total::

    taskset -c 0 python -m benchmarks.hook_phases --models resnet18 \
        --codec onebit --codec "onebit exchange=two_phase" --codec "qsgd exchange=two_phase"

``--ops`` counts, for each codec, the torch ops one step of the bucket dispatches (views excluded:
each other op is about one kernel launch on a GPU, where a launch costs microseconds whatever its
size), and how many of them the model's small tensors (under :data:`SMALL` elements) account for:
the same step's count on a bucket of the large tensors only, subtracted. A count, not a time: it
shows from a CPU what per-tensor work would cost in launches.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.compressors import parse_row
from benchmarks.netbench.models import gradient_shapes
from benchmarks.netbench.predict import real_gradients
from lightning_gc.common.layout import BucketLayout
from lightning_gc.compressors import Compressor, DGCCompressor, create
from lightning_gc.core.guard import StepGuard
from lightning_gc.core.memory import BucketMemory, CompensationMemory
from lightning_gc.core.momentum import MomentumSpec
from lightning_gc.exchanges.pipeline import BucketJob, Rounds, run_bucket
from lightning_gc.exchanges.select import rounds_for
from lightning_gc.exchanges.timeline import Timeline
from lightning_gc.exchanges.transport import LocalTransport
from lightning_gc.kernels import selection
from lightning_gc.perfmodel.calibration import layout_of_shapes

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SMALL = 4096
"""Tensors with fewer elements than this are "small" in ``--ops`` (ResNet-18: its biases and norms)."""
PHASES = ("screen", "compensate", "encode", "commit", "decode")
REFERENCES = ("screen: isfinite().all()", "search: row maxima", "search: abs+ge+nonzero")


def _timed(work: Callable[..., object], *args: object, **kwargs: object) -> float:
    started = time.perf_counter()
    work(*args, **kwargs)
    return time.perf_counter() - started


def _screen_by_isfinite(values: torch.Tensor) -> bool:
    """The previous screen: ``isfinite`` writes a bool per element before reducing."""
    return bool(torch.isfinite(values).all())


def _search_by_row_maxima(values: torch.Tensor, threshold: torch.Tensor, scratch: selection.SelectionScratch) -> object:
    return selection._CandidateSearch(values, scratch).at_least(threshold)


def _search_by_mask(
    values: torch.Tensor, threshold: torch.Tensor, magnitude: torch.Tensor, mask: torch.Tensor
) -> object:
    """The previous search, with its reused buffers: ``nonzero(|x| >= thr)``."""
    torch.abs(values, out=magnitude)
    return torch.nonzero(torch.ge(magnitude, threshold, out=mask))


def exchange_rounds(compressor: Compressor, world_size: int) -> Rounds | None:
    """What runs ``compressor``'s rounds where its ``exchange`` names an exchange that builds them
    (two-phase, global top-k: its plans and server errors kept across steps), else ``None``."""
    return rounds_for(compressor, LocalTransport(world_size))


def bucket_steps(
    layout: BucketLayout,
    gradients: list[torch.Tensor],
    compressor: Compressor,
    memory: CompensationMemory,
    repeats: int,
    world_size: int,
    guard: StepGuard | None = None,
    rounds: Rounds | None = None,
) -> Iterator[tuple[torch.Tensor, Timeline, float, BucketMemory]]:
    """``repeats`` + 2 steps of the whole gradient as one bucket on ``world_size`` ranks that send
    alike (:class:`LocalTransport`), the gradients used in turn; for each step after the first two
    (they fill buffers and plans): its gradient, its phases, its seconds in all, the bucket's memory."""
    grad = torch.empty(layout.numel)
    bucket = memory.bucket(layout, grad)
    rounds = rounds or exchange_rounds(compressor, world_size)
    for step in range(repeats + 2):
        gradient = gradients[step % len(gradients)]
        grad.copy_(gradient)
        timeline = Timeline()
        started = time.perf_counter()
        run_bucket(
            BucketJob(compressor, memory, grad, layout, step, guard=guard, timeline=timeline),
            bucket,
            LocalTransport(world_size),
            rounds,
        ).averaged.wait()
        seconds = time.perf_counter() - started
        if step >= 2:
            yield gradient, timeline, seconds, bucket


def measure(model: str, repeats: int, ratio: float, world_size: int = 2) -> dict[str, float]:
    """Median seconds per phase (and per reference point) over ``repeats`` steps."""
    layout = layout_of_shapes(gradient_shapes(model))
    compressor = DGCCompressor(ratio)
    memory = CompensationMemory(momentum_correction=True, momentum_masking=True, clip_norm=None)
    memory.set_specs({s.name: MomentumSpec(momentum=0.9) for s in layout.segments})
    guard = StepGuard("raise", memory, compressor)
    largest = max(layout.segments, key=lambda s: s.numel)
    threshold = torch.tensor(0.0)
    magnitude, mask = torch.empty(largest.numel), torch.empty(largest.numel, dtype=torch.bool)
    scratch = selection.SelectionScratch()
    times: dict[str, list[float]] = {name: [] for name in PHASES + REFERENCES}
    steps = bucket_steps(layout, real_gradients(model), compressor, memory, repeats, world_size, guard)
    for gradient, timeline, _, bucket in steps:
        sample = {phase: timeline.seconds(phase) for phase in PHASES}
        sample["screen: isfinite().all()"] = _timed(_screen_by_isfinite, gradient)
        values = largest.of(bucket.velocity)  # after the commit: differs from encode's input in k places
        threshold.fill_(torch.quantile(values[:: max(1, values.numel() // 100_000)].abs(), 0.998).item())
        sample["search: row maxima"] = _timed(_search_by_row_maxima, values, threshold, scratch)
        sample["search: abs+ge+nonzero"] = _timed(_search_by_mask, values, threshold, magnitude, mask)
        for name, seconds in sample.items():
            times[name].append(seconds)
    return {name: statistics.median(values) for name, values in times.items()}


def measure_codec(
    model: str, codec: tuple[str, dict[str, object]], repeats: int, world_size: int = 2
) -> dict[str, float]:
    """Median seconds of each pipeline phase and of the whole bucket (``total``) over ``repeats``
    steps of one compressor (``(name, arguments)``), with error feedback only (no momentum)."""
    layout = layout_of_shapes(gradient_shapes(model))
    memory = CompensationMemory(momentum_correction=False, momentum_masking=False, clip_norm=None)
    times: dict[str, list[float]] = {}
    steps = bucket_steps(layout, real_gradients(model), create(codec[0], **codec[1]), memory, repeats, world_size)
    for _, timeline, seconds, _ in steps:
        for phase in dict.fromkeys(name for name, _ in timeline.phases):
            times.setdefault(phase, []).append(timeline.seconds(phase))
        times.setdefault("total", []).append(seconds)
    return {phase: statistics.median(values) for phase, values in times.items()}


class _OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while it is active, views excluded (they launch no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _ops_per_step(shapes: list[tuple[int, ...]], codec: tuple[str, dict[str, object]], world_size: int) -> int:
    """Ops (views excluded) of one step of a bucket of ``shapes`` (:func:`bucket_steps`' fourth:
    the first three fill buffers and plans), the gradient's copy into the bucket included."""
    layout = layout_of_shapes(shapes)
    memory = CompensationMemory(momentum_correction=False, momentum_masking=False, clip_norm=None)
    gradients = [torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))]
    steps = bucket_steps(layout, gradients, create(codec[0], **codec[1]), memory, 2, world_size)
    next(steps)
    with _OpCounter() as counter:
        next(steps)
    return counter.count


def count_ops(
    shapes: list[tuple[int, ...]], codec: tuple[str, dict[str, object]], world_size: int = 2
) -> tuple[int, int]:
    """(ops of one step of tensors of ``shapes`` as one bucket, of those the ones its small tensors add)."""
    every = _ops_per_step(shapes, codec, world_size)
    large = _ops_per_step([s for s in shapes if math.prod(s) >= SMALL], codec, world_size)
    return every, every - large


def ops_markdown(model: str, shapes: list[tuple[int, ...]], counts: dict[str, tuple[int, int]]) -> str:
    """One row per codec: ops per step, and the share the small tensors (of ``model``'s ``shapes``) take."""
    small = [math.prod(s) for s in shapes if math.prod(s) < SMALL]
    total = sum(math.prod(s) for s in shapes)
    lines = [
        f"| {model} | ops per step | of them for the {len(small)} of {len(shapes)} tensors under {SMALL} elements "
        f"({100 * sum(small) / total:.2f} % of the elements) |",
        "|---|---|---|",
    ]
    for label, (every, of_small) in counts.items():
        lines.append(f"| {label} | {every} | {of_small} ({100 * of_small / max(every, 1):.0f} %) |")
    return "\n".join(lines)


def codec_markdown(model: str, results: dict[str, dict[str, float]]) -> str:
    """One row per codec, one column per phase seen (ms), then the total."""
    phases = list(dict.fromkeys(p for timings in results.values() for p in timings if p != "total")) + ["total"]
    lines = [f"| {model} | " + " | ".join(f"{p} (ms)" for p in phases) + " |", "|---" * (len(phases) + 1) + "|"]
    for label, timings in results.items():
        cells = [f"{timings[p] * 1e3:.1f}" if p in timings else "–" for p in phases]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(results: dict[str, dict[str, float]]) -> str:
    models = list(results)
    lines = ["| phase | " + " | ".join(f"{m} (ms)" for m in models) + " |", "|---" * (len(models) + 1) + "|"]
    for name in PHASES + ("hook total",) + REFERENCES:
        cells = []
        for model in models:
            seconds = sum(results[model][p] for p in PHASES) if name == "hook total" else results[model][name]
            cells.append(f"{seconds * 1e3:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "mlp29m"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--ratio", type=float, default=0.001)
    parser.add_argument(
        "--codec",
        action="append",
        type=parse_row,
        help='"NAME KEY=VALUE ...": time this compressor instead (repeatable)',
    )
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--ops", action="store_true", help="with --codec: count ops per step instead of timing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.codec:
        for model in args.models:
            labels = [" ".join([name, *(f"{k}={v}" for k, v in kwargs.items())]) for name, kwargs in args.codec]
            if args.ops:
                shapes = gradient_shapes(model)
                print(
                    ops_markdown(model, shapes, {label: count_ops(shapes, c) for label, c in zip(labels, args.codec)})
                )
                continue
            print(
                codec_markdown(
                    model, {label: measure_codec(model, c, args.repeats) for label, c in zip(labels, args.codec)}
                )
            )
        return
    results = {model: measure(model, args.repeats, args.ratio) for model in args.models}
    table = markdown(results)
    print(table)
    if args.record:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        command = f"taskset -c 0 python -m benchmarks.hook_phases --models {' '.join(args.models)}"
        header = (
            f"\n### `{command} --repeats {args.repeats}` — {platform.node()}, 1 torch thread, {stamp}\n\n"
            f"DGC at {args.ratio}, momentum 0.9, world size 2, whole gradient as one bucket, real "
            "gradients; medians. The search rows time the largest tensor's candidate search alone.\n\n"
        )
        with RESULTS.open("a") as results_file:
            results_file.write(header + table + "\n")


if __name__ == "__main__":
    main()
