"""Where a GPU step's time goes: torch.profiler over DGC's selection and over the quick start's fit.

Two profiles, each printed as the top ops by self CPU time and by self device time, with the wall
time per call measured outside the profiler (median of repeats, synchronised):

  selection   ``kernels.sampled_topk_`` (Triton) and the exact ``torch.topk`` it replaces, per size
  fit         the quick start's DGC fit on one GPU (digits MLP, ``dgc_ddp``, world size 1), a few
              epochs: what the strategy adds per optimizer step on top of dense DDP

    python benchmarks/gpu_profile.py [--sizes 1e6 25.6e6] [--rows 18] [--fit-epochs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_gc import kernels

RATIO = 0.001


def _wall(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _table(prof: profile, rows: int) -> None:
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    print(averages.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60))


def profile_selection(sizes: list[float], rows: int) -> None:
    for size in sizes:
        numel = int(size)
        values = torch.randn(numel, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        k = max(1, int(numel * RATIO))
        indices = torch.empty(k, dtype=torch.int64, device="cuda")
        picked = torch.empty(k, device="cuda")

        def sampled() -> None:
            with kernels.use_backend("triton"):
                kernels.sampled_topk_(values, k, sample_ratio=0.01, salt=1, scratch=None, out_indices=indices,
                                      out_values=picked)  # fmt: skip

        def exact() -> None:
            torch.topk(values.abs(), k, sorted=False)

        print(f"\n##### selection, {numel:,} elements, k={k:,}: sampled {_wall(sampled, 20) * 1e3:.3f} ms, "
              f"exact topk {_wall(exact, 20) * 1e3:.3f} ms (wall, median of 20)")  # fmt: skip
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                sampled()
            torch.cuda.synchronize()
        _table(prof, rows)


def profile_fit(epochs: int, rows: int) -> None:
    import lightning as L

    import lightning_gc
    from recipes.quickstart import DigitsClassifier, DigitsDataModule

    for name in ("dense", "dgc"):
        L.seed_everything(0, verbose=False)
        strategy = "ddp" if name == "dense" else lightning_gc.DGCStrategy(compress_ratio=RATIO)
        trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_epochs=epochs, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        model = DigitsClassifier(hidden=[1024, 1024], lr=0.05, momentum=0.9, nesterov=False, weight_decay=1e-4,
                                 optimizer="sgd")  # fmt: skip
        data = DigitsDataModule(batch_size=32, val_fraction=0.2, split_seed=0, synthetic=False)
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer.fit(model, data)
        seconds = time.perf_counter() - started
        print(f"\n##### fit {name}: {trainer.global_step} steps in {seconds:.2f} s (profiled)")
        _table(prof, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 25.6e6])
    parser.add_argument("--rows", type=int, default=18)
    parser.add_argument("--fit-epochs", type=int, default=3)
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    profile_selection(args.sizes, args.rows)
    profile_fit(args.fit_epochs, args.rows)


if __name__ == "__main__":
    main()
