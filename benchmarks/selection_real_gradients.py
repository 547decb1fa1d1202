"""DGC's sampled selection on real gradients: candidates admitted per tensor and time.

torchvision's ResNet-18 (10 classes), one backward pass on random 32x32 inputs; for every weight
tensor DGC compresses, the number of candidates the sampled threshold admits (``>= k`` means no
re-selection pass) and the median time of ``sampled_topk_indices`` over ``--repeats`` runs.

    python benchmarks/selection_real_gradients.py [--ratio 0.001] [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torchvision

from lightning_gc.kernels import selection


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratio", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    inputs, labels = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    torch.nn.functional.cross_entropy(model(inputs), labels).backward()
    total, short = 0.0, 0
    print("| tensor | elements | k | candidates | ms |\n|---|---|---|---|---|")
    for name, param in model.named_parameters():
        gradient = param.grad.reshape(-1)
        k = math.ceil(args.ratio * gradient.numel())
        plan = selection.sample_plan(gradient.numel(), k, 0.01, salt=7)
        if param.dim() < 2 or plan is None:
            continue
        magnitude = gradient.abs()
        threshold = torch.topk(magnitude[selection.sample_positions(plan, "cpu")], plan.rank).values.min()
        candidates = int((magnitude >= threshold).sum())
        short += candidates < k
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            selection.sampled_topk_indices(gradient, k, sample_ratio=0.01, salt=7)
            times.append(time.perf_counter() - started)
        total += statistics.median(times)
        print(f"| {name} | {gradient.numel():,} | {k:,} | {candidates:,} | {statistics.median(times) * 1e3:.2f} |")
    print(f"\n{short} tensors admitted fewer than k candidates; selection over all: {total * 1e3:.1f} ms (median each)")


if __name__ == "__main__":
    main()
