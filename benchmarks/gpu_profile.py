"""Where a GPU step's time goes: torch.profiler over DGC's selection and over the quick start's fit.

Two profiles, each printed as the top ops by self CPU time and by self device time, with the wall
time per call measured outside the profiler (median of repeats, synchronised):

  selection   ``kernels.sampled_topk_`` (Triton) and the exact ``torch.topk`` it replaces, per size
  fit         the quick start's DGC fit on one GPU (digits MLP, ``dgc_ddp``, world size 1), a few
              epochs: what the strategy adds per optimizer step on top of dense DDP
  host        the same fits timed per step without a profiler (median over steps), then the DGC
              fit under cProfile: the Python functions by own time, where a host sync shows up
              as the time of the call that waits
  phases      a plain DDP loop (``lightning_gc.attach``, no Lightning) on the quick start's model
              or ResNet-50 (``--model``): per-step time of backward, the comm hook and the step,
              dense against DGC against DGC selecting one tensor at a time, and the hook's
              per-bucket phases from its own timeline

    python benchmarks/gpu_profile.py [--sizes 1e6 25.6e6] [--rows 18] [--fit-epochs 3]
        [--only selection fit host phases] [--model digits|resnet50] [--steps 100] [--cprofile 0]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

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
        _profile_selection_at(int(size), rows)


def _profile_selection_at(numel: int, rows: int) -> None:
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


def _fit(name: str, epochs: int, callbacks: list | None = None) -> Any:
    """A quick-start fit on one GPU: ``dense`` (Lightning's DDP) or ``dgc`` (``DGCStrategy``)."""
    import lightning as L

    import lightning_gc
    from recipes.quickstart import DigitsClassifier, DigitsDataModule

    L.seed_everything(0, verbose=False)
    strategy = "ddp" if name == "dense" else lightning_gc.DGCStrategy(compress_ratio=RATIO)
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=callbacks or [])  # fmt: skip
    trainer.fit(DigitsClassifier(), DigitsDataModule())
    return trainer


def profile_fit(epochs: int, rows: int) -> None:
    for name in ("dense", "dgc"):
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer = _fit(name, epochs)
        seconds = time.perf_counter() - started
        print(f"\n##### fit {name}: {trainer.global_step} steps in {seconds:.2f} s (profiled)")
        _table(prof, rows)


def profile_host(epochs: int, rows: int) -> None:
    import lightning as L

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._started = 0.0

        def on_train_batch_start(self, *args: Any) -> None:
            torch.cuda.synchronize()
            self._started = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self._started)

    for name in ("dense", "dgc", "dense", "dgc"):
        clock = StepClock()
        _fit(name, epochs, [clock])
        print(f"##### step {name}: median {statistics.median(clock.seconds[10:]) * 1e3:.2f} ms over "
              f"{len(clock.seconds) - 10} steps (synchronised, no profiler)")  # fmt: skip
    profiler = cProfile.Profile()
    profiler.enable()
    _fit("dgc", epochs)
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(rows * 2)
    stats.sort_stats("cumtime").print_stats(r"lightning_gc", rows * 2)


def profile_phases(model_name: str, steps: int, profile_steps: int = 0) -> None:
    """Per-step host time of a plain DDP loop, dense against DGC, and DGC again with its selection
    made one tensor at a time (as before the bucket-wide kernels): the three side by side, each
    after a warm-up round of the same length. With ``profile_steps``, then that many DGC steps
    under cProfile (Python functions by own time; a host sync shows as the call that waits)."""
    import collections
    import functools
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lightning_gc
    from lightning_gc import pipeline, session
    from lightning_gc.compressors.dgc import DGCCompressor
    from lightning_gc.compressors.sparse import SparseCompressor

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl", rank=0, world_size=1)
    totals: dict[str, float] = collections.defaultdict(float)
    hook = session.compression_hook

    @functools.wraps(hook)
    def timed_hook(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return hook(*args)
        finally:
            totals["hook"] += time.perf_counter() - started

    session.compression_hook = timed_hook
    seconds = pipeline.Timeline.seconds

    def counted(self: pipeline.Timeline, *phases: str) -> float:
        if not phases:  # the hook's one reading per bucket, once its decode ran
            for phase, spent in self.phases:
                totals[f"bucket {phase}"] += spent
        return seconds(self, *phases)

    pipeline.Timeline.seconds = counted  # type: ignore[method-assign]
    if model_name == "resnet50":
        import torchvision

        make_net: Callable[[], torch.nn.Module] = torchvision.models.resnet50
        x = torch.randn(32, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (32,), device="cuda")
    else:
        from recipes.quickstart import DigitsClassifier

        make_net = DigitsClassifier
        x = torch.randn(32, 64, device="cuda")
        y = torch.randint(0, 10, (32,), device="cuda")
    bucket_wide = DGCCompressor.select_segments

    def build(kind: str) -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        DGCCompressor.select_segments = SparseCompressor.select_segments if kind == "dgc, each tensor" else bucket_wide
        model = DistributedDataParallel(make_net().cuda())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        attached = None if kind == "dense" else lightning_gc.attach(model, optimizer, "dgc", compress_ratio=RATIO)
        return model, optimizer, attached

    def clocked(name: str, fn: Callable[[], object]) -> None:
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        totals[name] += time.perf_counter() - started

    for kind in ("dense", "dgc", "dgc, each tensor"):
        model, optimizer, attached = build(kind)
        for _warm_then_timed in range(2):  # the first round warms up (compilation, allocation)
            totals.clear()
            for _ in range(steps):
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                clocked("backward", loss.backward)
                clocked("step", optimizer.step if attached is None else attached.step)
        report = "  ".join(f"{name} {spent / steps * 1e3:.3f}" for name, spent in sorted(totals.items()))
        print(f"##### phases {model_name}, {kind} (ms per step, {steps} steps): {report}")
        if attached is not None:
            attached.finish()
        del model, optimizer, attached
    DGCCompressor.select_segments = bucket_wide
    if profile_steps:
        model, optimizer, attached = build("dgc")
        profiler = cProfile.Profile()
        for profiled in (False, True):  # a warm-up round, then the profiled one
            if profiled:
                profiler.enable()
            for _ in range(profile_steps):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                attached.step()
            torch.cuda.synchronize()
        profiler.disable()
        print(f"##### cProfile of {profile_steps} DGC steps ({model_name}), by own time")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        attached.finish()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 25.6e6])
    parser.add_argument("--rows", type=int, default=18)
    parser.add_argument("--fit-epochs", type=int, default=3)
    parser.add_argument("--model", choices=["digits", "resnet50"], default="digits", help="phases: the model")
    parser.add_argument("--steps", type=int, default=100, help="phases: timed steps per variant")
    parser.add_argument("--cprofile", type=int, default=0, help="phases: then this many DGC steps under cProfile")
    parser.add_argument("--only", nargs="+", choices=["selection", "fit", "host", "phases"],
                        default=["selection", "fit", "host", "phases"])  # fmt: skip
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    if "selection" in args.only:
        profile_selection(args.sizes, args.rows)
    if "fit" in args.only:
        profile_fit(args.fit_epochs, args.rows)
    if "host" in args.only:
        profile_host(args.fit_epochs, args.rows)
    if "phases" in args.only:
        profile_phases(args.model, args.steps, args.cprofile)


if __name__ == "__main__":
    main()
