"""DGC in a plain DistributedDataParallel loop, without Lightning, launched by torchrun:

    torchrun --nproc_per_node=2 examples/torchrun_dgc.py --steps 60 --out run/
    torchrun --nproc_per_node=2 examples/torchrun_dgc.py --steps 60 --out run/ --resume run/step30.pt

Trains an MLP on scikit-learn's digits (real data, offline) with SGD (momentum 0.9) under
``lightning_gc.attach(..., "dgc")`` on gloo (CPU) or NCCL (GPU), writes a checkpoint every
``--checkpoint-every`` steps (model, optimizer and every rank's compression state) and the final
parameters to ``<out>/final.pt``. A resumed run continues exactly: its final parameters equal an
uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import lightning_gc
from recipes.quickstart import digits_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--compress-ratio", type=float, default=0.01)
    parser.add_argument("--checkpoint-every", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("torchrun_dgc"))
    parser.add_argument("--resume", type=Path, default=None, help="a checkpoint this script wrote")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
    model = DistributedDataParallel(net, device_ids=[device.index] if backend == "nccl" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    gc = lightning_gc.attach(model, optimizer, "dgc", compress_ratio=args.compress_ratio)

    start = 0
    if args.resume is not None:
        checkpoint = torch.load(args.resume, map_location=device, weights_only=False)
        net.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        gc.load_state_dict(checkpoint["lightning_gc"])
        start = checkpoint["step"]

    data = digits_batches(rank, world, batch_size=32, seed=0)
    for _ in range(start):  # the same batches as an uninterrupted run
        next(data)
    args.out.mkdir(parents=True, exist_ok=True)
    for step in range(start, args.steps):
        x, y = next(data)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        metrics = gc.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: wire ratio {metrics['gc/wire_ratio']:.0f}x", flush=True)
        if (step + 1) % args.checkpoint_every == 0:
            state = {  # gc.state_dict() is a collective: every rank calls it, rank 0 writes
                "model": net.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lightning_gc": gc.state_dict(),
                "step": step + 1,
            }
            if rank == 0:
                torch.save(state, args.out / f"step{step + 1}.pt")
    gc.finish()
    if rank == 0:
        torch.save([p.detach().cpu() for p in net.parameters()], args.out / "final.pt")
        print(f"totals: {gc.totals}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
