"""How much of an update the top-k carries: SGD's gradient against Adam's preconditioned step.

DGC sends each tensor's top ``ratio`` of elements by magnitude and keeps the rest in memory. What
that costs depends on how concentrated the update is: the fraction of its squared L2 norm

    captured(x, ratio) = sum over compressed tensors of ||top_k(x)||^2 / sum of ||x||^2,
    k = ceil(ratio * numel) per tensor,

is 1 for a vector with at most k non-zeros per tensor and ``ratio`` for one whose elements are all
the same size. Momentum SGD's update is its first moment; frozen-variance Adam's is that moment
over the frozen denominator ``d`` (:func:`lightning_gc.core.adam.frozen_denominators`, the
hand-over's own), which moves every element by about ``lr``: the question is whether that
flattens the distribution DGC relies on.

The task is the accuracy benchmark's ``ptb_adamw`` transformer (2 layers, d = 128) on the shared
PTB text, one process, batch 32 x 64 tokens (the benchmark's 2 x 16), AdamW lr 1e-3 wd 0.01.
After ``--freeze`` plain AdamW steps ``d`` is read from AdamW's state; training goes on with
AdamW for ``--steps`` more steps, and at each the captured fractions of the gradient ``g``, of
``g / d``, of AdamW's first moment ``m`` and of ``m / d`` are taken over the tensors DGC
compresses (:func:`lightning_gc.compressors.base.compressible` at DGC's default
``min_compress_numel``). Printed: the median over the steps.

    python benchmarks/topk_mass.py [--data ../shared/data] [--freeze 120] [--steps 20]
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import torch

from lightning_gc.compressors import create
from lightning_gc.compressors.base import split_segments
from lightning_gc.core.adam import frozen_denominators
from lightning_gc.perfmodel.calibration import layout_of_shapes
from recipes.language import PTBDataModule, TransformerLanguageModel

RATIOS = (0.001, 0.01)


def compressed_parameters(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors DGC (at its default settings) compresses rather than sends dense."""
    segments, _ = split_segments(layout_of_shapes([p.shape for p in params]).segments, create("dgc").min_compress_numel)
    return [params[segment.order] for segment in segments]


def captured(tensors: list[torch.Tensor], ratio: float) -> float:
    """The fraction of the squared L2 norm of ``tensors`` in each one's top ``ratio`` by magnitude."""
    kept = total = 0.0
    for tensor in tensors:
        squares = tensor.detach().reshape(-1).double().square()
        k = math.ceil(ratio * squares.numel())
        kept += float(torch.topk(squares, k).values.sum())
        total += float(squares.sum())
    return kept / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    parser.add_argument("--freeze", type=int, default=120, help="plain AdamW steps before d is read")
    parser.add_argument("--steps", type=int, default=20, help="steps measured after the freeze")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = PTBDataModule(root=str(args.data / "ptb"), batch_size=32, bptt=64)
    data.setup("fit")
    model = TransformerLanguageModel(vocab_size=data.vocab_size, d_model=128, num_layers=2, ff_size=512)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    compressed = compressed_parameters(list(model.parameters()))
    batches = iter(torch.utils.data.DataLoader(data.train_set, batch_size=32, shuffle=True))
    rows: dict[str, list[float]] = {}
    denominators: list[torch.Tensor] = []
    for step in range(args.freeze + args.steps):
        tokens, targets = next(batches)
        optimizer.zero_grad()
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        if step == args.freeze:  # v frozen here, as the hand-over freezes it
            frozen = frozen_denominators([optimizer])
            denominators = [frozen[p][0] for p in compressed]
        if step >= args.freeze:
            gradients = [p.grad for p in compressed]
            moments = [optimizer.state[p]["exp_avg"] for p in compressed]
            directions = {
                "gradient g (momentum SGD)": gradients,
                "g / d (frozen-variance Adam)": [g / d for g, d in zip(gradients, denominators)],
                "first moment m": moments,
                "m / d (Adam's step)": [m / d for m, d in zip(moments, denominators)],
            }
            for name, tensors in directions.items():
                for ratio in RATIOS:
                    rows.setdefault(f"{name}|{ratio}", []).append(captured(tensors, ratio))
        optimizer.step()
    numel = sum(p.numel() for p in compressed)
    print(f"{len(compressed)} compressed tensors, {numel:,} elements; freeze after {args.freeze} steps; "
          f"median of {args.steps} steps\n")  # fmt: skip
    print("| direction | " + " | ".join(f"captured at {r:.1%}" for r in RATIOS) + " |")
    print("|---|" + "---|" * len(RATIOS))
    for name in dict.fromkeys(key.split("|")[0] for key in rows):
        cells = " | ".join(f"{statistics.median(rows[f'{name}|{r}']):.1%}" for r in RATIOS)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
