"""Bytes on the wire per rank and step by exchange, measured on real gloo processes.

    python benchmarks/exchange_bytes.py [--world-sizes 2 4] [--model resnet18]

``N`` processes (gloo on loopback) train a few steps of the model through the comm hook with
``onebit`` and 4-bit ``qsgd``, each with ``exchange="gather"`` and ``"two_phase"``, and with DGC at
0.1 % with ``exchange="gather"`` and ``"global_topk"``. The hook's exchange is the real
:class:`~lightning_gc.exchanges.transport.GroupTransport`, wrapped to add up what every collective it
launches puts on the wire per rank (:func:`lightning_gc.exchanges.transport.traffic_bytes`: all-gather
``(N-1) m``, all-to-all ``(N-1)/N m``, ring all-reduce ``2 (N-1)/N m``, a point-to-point message
``m``). The quantisers' table compares the last step's bytes with ``2 (N-1)/N M/c``, where ``M`` is
the dense gradient and ``c`` the gathered form's compression (dense bytes / payload bytes of one
rank); DGC's compares the global top-k exchange with the gather.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from lightning_gc.compressors import create
from lightning_gc.compressors.encoded import Payload
from lightning_gc.exchanges.select import exchange_for
from lightning_gc.exchanges.transport import GroupTransport, traffic_bytes
from lightning_gc.runtime.hook import CompressionHookState, compression_hook
from lightning_gc.runtime.settings import CompressionSettings
from lightning_gc.runtime.teardown import shut_down_process_group

SCHEMES = [("onebit", {}), ("qsgd", {"levels": 7})]
EXCHANGES = ("gather", "two_phase")
SPARSE = ("dgc", {"compress_ratio": 0.001})
SPARSE_EXCHANGES = ("gather", "global_topk")
STEPS = 3


class CountingTransport(GroupTransport):
    """The real collectives, counting each rank's bytes on the wire (``traffic``) for the current step."""

    def __init__(self) -> None:
        super().__init__()
        self.traffic = 0.0
        self.payload = 0

    def launch(self, payload: Payload) -> Future[Payload]:
        self.traffic += traffic_bytes(payload, self.world_size)
        self.payload += payload.bytes_sent if payload.gathered is not None and payload.scattered is None else 0
        return super().launch(payload)


def model_for(name: str) -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, name)(num_classes=10)


def worker(rank: int, world_size: int, port: int, model_name: str, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    count(rank, world_size, model_name, results)
    # what count() built (DDP models, hook states holding the group) is unreachable now: collect it
    # before finalization, where a gloo thread still holding the group aborts the process
    shut_down_process_group()


def count(rank: int, world_size: int, model_name: str, results: dict) -> None:
    """Every scheme's bytes on the wire per rank at the last step, into ``results`` (rank 0)."""
    runs = [(name, arguments, exchange) for name, arguments in SCHEMES for exchange in EXCHANGES]
    runs += [(SPARSE[0], SPARSE[1], exchange) for exchange in SPARSE_EXCHANGES]
    for name, arguments, exchange in runs:
        model = model_for(model_name)
        ddp = DistributedDataParallel(model)
        compressor = create(name, exchange=exchange, **arguments)
        names = {id(p): (n, i) for i, (n, p) in enumerate(model.named_parameters())}
        counting = CountingTransport()
        memory = CompressionSettings().memory_for(compressor)
        state = CompressionHookState(compressor, memory, names, exchange=exchange_for(compressor, counting))
        ddp.register_comm_hook(state, compression_hook)
        for _ in range(STEPS):  # the last step runs on DDP's rebuilt buckets
            counting.traffic, counting.payload = 0.0, 0
            inputs = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(rank))
            ddp(inputs).sum().backward()
            model.zero_grad()
        if rank == 0:
            dense = sum(p.numel() * p.element_size() for p in model.parameters())
            results[(world_size, name, exchange)] = (counting.traffic, counting.payload, dense)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", default="resnet18", help="a torchvision model name")
    args = parser.parse_args()
    results = mp.Manager().dict()
    for world_size in args.world_sizes:
        mp.spawn(worker, args=(world_size, free_port(), args.model, results), nprocs=world_size, join=True)
    print(f"{args.model}: bytes on the wire per rank at step {STEPS} (real gloo processes)\n")
    print("| N | compressor | exchange | bytes per rank | c (gathered) | 2(N-1)/N M/c | measured / ideal |")
    print("|---|---|---|---|---|---|---|")
    for world_size in args.world_sizes:
        for name, _ in SCHEMES:
            _, payload, dense = results[(world_size, name, "gather")]
            ratio = dense / payload
            ideal = 2 * (world_size - 1) / world_size * dense / ratio
            for exchange in EXCHANGES:
                traffic = results[(world_size, name, exchange)][0]
                print(
                    f"| {world_size} | {name} | {exchange} | {traffic:,.0f} | {ratio:.1f} | {ideal:,.0f} "
                    f"| {traffic / ideal:.3f} |"
                )
    print(f"\n{SPARSE[0]} {SPARSE[1]}: bytes on the wire per rank at step {STEPS}\n")
    print("| N | " + " | ".join(SPARSE_EXCHANGES) + " | global_topk / gather |")
    print("|---" * (2 + len(SPARSE_EXCHANGES)) + "|")
    for world_size in args.world_sizes:
        traffic = [results[(world_size, SPARSE[0], exchange)][0] for exchange in SPARSE_EXCHANGES]
        cells = " | ".join(f"{t:,.0f}" for t in traffic)
        print(f"| {world_size} | {cells} | {traffic[1] / traffic[0]:.2f} |")


if __name__ == "__main__":
    main()
