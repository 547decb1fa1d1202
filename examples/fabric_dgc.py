"""DGC under Lightning Fabric: ``Fabric(strategy="dgc_ddp")``, with a checkpoint and an exact resume.

    python examples/fabric_dgc.py --steps 40 --out run/
    python examples/fabric_dgc.py --steps 40 --out run/ --resume run/step20.ckpt

Fabric starts the 2 CPU processes itself (``devices=2``; under torchrun it joins torchrun's). An
MLP trains on scikit-learn's digits (real data, offline) with SGD (momentum 0.9), which the
strategy hands over to DGC's momentum correction. ``fabric.save`` (called on every rank) writes the
model, the optimizer and every rank's compression state; ``fabric.load`` restores them, so the
resumed run's final parameters equal an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lightning.fabric import Fabric

import lightning_gc  # noqa: F401  (registers "dgc_ddp" and the other presets with Fabric)
from recipes.quickstart import digits_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--compress-ratio", type=float, default=0.01)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("fabric_dgc"))
    parser.add_argument("--resume", type=Path, default=None, help="a checkpoint this script wrote")
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", devices=2, strategy="dgc_ddp")
    fabric.strategy.session.compressor.compress_ratio = args.compress_ratio
    fabric.launch()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    model, optimizer = fabric.setup(net, optimizer)

    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume is not None:
        fabric.load(args.resume, state)
    data = digits_batches(fabric.global_rank, fabric.world_size, batch_size=32, seed=0)
    for _ in range(state["step"]):  # the same batches as an uninterrupted run
        next(data)
    for step in range(state["step"], args.steps):
        x, y = next(data)
        optimizer.zero_grad()
        fabric.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        metrics = fabric.strategy.compression.last_metrics
        if step % 10 == 0 and metrics is not None:
            fabric.print(f"step {step}: wire ratio {metrics['gc/wire_ratio']:.0f}x")
        if (step + 1) % args.checkpoint_every == 0:
            state["step"] = step + 1
            fabric.save(args.out / f"step{step + 1}.ckpt", state)  # every rank: a collective
    fabric.strategy.compression.finish()
    if fabric.global_rank == 0:
        torch.save([p.detach().cpu() for p in net.parameters()], args.out / "final.pt")
        print(f"totals: {fabric.strategy.compression.totals}", flush=True)


if __name__ == "__main__":
    main()
