"""Memory a codec holds per rank between steps: the memory's residuals and momenta, and the
compressor's plans and state (payload buffers, decoded values, sums), with the two-phase exchange's
where it runs one (its plans and server errors).

On a GPU all of it is device memory beside the model, its gradients and the optimizer's state, so
it decides how large a model fits. Counted here on the CPU: after two steps of a model's whole
gradient as one bucket (:func:`benchmarks.hook_phases.bucket_steps`: ``N`` ranks that send alike
through :class:`~lightning_gc.exchanges.transport.LocalTransport`), the bytes of every distinct tensor storage
reachable from the compressor (and its two-phase exchange) and from the memory through
``lightning_gc`` objects, dicts and sequences. A count, not a timing: it is exact and the same on
every machine. DDP's buckets split the same buffers into pieces, so a multi-bucket run holds about
the same (plus a few payload paddings).

    python -m benchmarks.state_memory --models resnet18 --world-sizes 2 8 32 \
        --codec onebit --codec "onebit exchange=two_phase" --codec "fft exchange=two_phase"

Each cell is the compressor's (with its exchange's) MB at that world size, then (after "+") the memory's, and the sum as
a multiple of the gradient's float32 bytes.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

import torch

from benchmarks.compressors import parse_row
from benchmarks.hook_phases import bucket_steps, exchange_rounds
from benchmarks.netbench.models import gradient_shapes
from lightning_gc.compressors import create
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.perfmodel.calibration import layout_of_shapes

MB = 1e6


def held_bytes(roots: Iterable[object]) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots`` through ``lightning_gc``
    objects (their attributes), dicts, lists, tuples and sets; a storage shared by several views
    counts once."""
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif type(item).__module__.startswith("lightning_gc") and hasattr(item, "__dict__"):
            stack.extend(vars(item).values())
    return sum(storages.values())


def measure(
    shapes: list[tuple[int, ...]], codec: tuple[str, dict[str, object]], world_size: int
) -> tuple[int, int, int]:
    """(compressor bytes, memory bytes, gradient bytes) held after two steps of a gradient of
    ``shapes`` as one bucket on ``world_size`` ranks, with error feedback only (no momentum)."""
    layout = layout_of_shapes(shapes)
    compressor = create(codec[0], **codec[1])
    memory = CompensationMemory(momentum_correction=False, momentum_masking=False, clip_norm=None)
    gradients = [torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))]
    rounds = exchange_rounds(compressor, world_size)  # the exchange's plans and server errors count with the codec
    for _ in bucket_steps(layout, gradients, compressor, memory, 0, world_size, rounds=rounds):
        pass  # the two warm-up steps build every plan and buffer
    return held_bytes([compressor, rounds]), held_bytes([memory]), 4 * layout.numel


def markdown(model: str, world_sizes: list[int], rows: dict[str, list[tuple[int, int, int]]]) -> str:
    """One row per codec, one column per world size: compressor + memory MB (x the gradient)."""
    header = f"| {model} | " + " | ".join(f"N = {n}: compressor + memory MB (x gradient)" for n in world_sizes) + " |"
    lines = [header, "|---" * (len(world_sizes) + 1) + "|"]
    for label, cells in rows.items():
        text = [f"{c / MB:.1f} + {m / MB:.1f} ({(c + m) / g:.2f}x)" for c, m, g in cells]
        lines.append(f"| {label} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18"])
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 8, 32])
    parser.add_argument(
        "--codec", action="append", type=parse_row, required=True, help='"NAME KEY=VALUE ..." (repeatable)'
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    for model in args.models:
        shapes = gradient_shapes(model)
        rows = {
            " ".join([name, *(f"{k}={v}" for k, v in kwargs.items())]): [
                measure(shapes, (name, kwargs), n) for n in args.world_sizes
            ]
            for name, kwargs in args.codec
        }
        print(markdown(model, args.world_sizes, rows))


if __name__ == "__main__":
    main()
