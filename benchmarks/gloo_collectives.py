"""What gloo's collectives cost on this host: all-reduce by dtype, all-gather against all-to-all.

The netbench runs train on CPUs over gloo, where the transport's work (copies, reductions)
shares the cores that compute. Two of its costs the byte counts do not show:

* **the reduction's dtype**: gloo sums float16 element by element, so an all-reduce of the same
  bytes costs more host time in float16 than in bfloat16 or float32 (``--dtypes``);
* **the all-gather's algorithm**: gloo's all-gather is a ring of ``N-1`` dependent steps, while
  its all-to-all posts every pair at once. An all-gather can be run as an all-to-all whose input
  holds the payload once per rank (``N`` copies: ``(N-1) m`` bytes sent, as the ring sends).

Every variant runs ``--repeats`` times on ``--world-size`` processes over loopback, one torch
thread each, a barrier before each timing; the median of rank 0's times is printed (ms).

    python -m benchmarks.gloo_collectives --world-size 2 --numel 11181642 --payload-bytes 16000 128000 22000000
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_gc.exchanges.comm import all_gather_single

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _median_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def _gather_through_all_to_all(out: torch.Tensor, payload: torch.Tensor, copies: torch.Tensor) -> None:
    """The all-gather as an all-to-all of ``payload`` copied once per rank into ``copies``."""
    copies.view(-1, payload.numel()).copy_(payload.view(1, -1).expand(copies.numel() // payload.numel(), -1))
    dist.all_to_all_single(out, copies)


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    world = args.world_size
    lines = []
    for name in args.dtypes:
        values = torch.randn(args.numel).to(DTYPES[name])
        dist.all_reduce(values)  # connections and buffers set up before timing
        ms = _median_ms(functools.partial(dist.all_reduce, values), args.repeats)
        lines.append(f"| all-reduce | {name} | {values.numel() * values.element_size() / 1e6:.3f} | {ms:.2f} |")
    for nbytes in args.payload_bytes:
        payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        out = torch.empty(world * nbytes, dtype=torch.uint8)
        copies = torch.empty(world * nbytes, dtype=torch.uint8)

        ring = _median_ms(functools.partial(all_gather_single, out, payload), args.repeats)
        expected = out.clone()
        pairs = _median_ms(functools.partial(_gather_through_all_to_all, out, payload, copies), args.repeats)
        assert torch.equal(out, expected), "the all-to-all form gathered something else"
        lines.append(f"| all-gather / through all-to-all | uint8 | {nbytes / 1e6:.3f} | {ring:.2f} / {pairs:.2f} |")
    if rank == 0:
        print(f"gloo, {world} processes on loopback, median of {args.repeats} (ms)\n")
        print("| collective | dtype | MB per rank | ms |\n|---|---|---|---|")
        print("\n".join(lines))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--numel", type=int, default=11_181_642, help="all-reduced elements (ResNet-18's gradient)")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--payload-bytes", type=int, nargs="+", default=[16_000, 128_000, 1_400_000, 22_000_000])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--port", type=int, default=29571)
    args = parser.parse_args()
    mp.spawn(_rank, args=(args, args.port), nprocs=args.world_size)


if __name__ == "__main__":
    main()
