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
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from lightning_gc import kernels

RATIO = 0.001
VARIANTS = ("dense", "dgc", "dgc, each tensor", "dgc, nonfinite=skip", "dgc, unscreened")
"""The phases' loop variants: dense DDP, DGC, DGC selecting one tensor at a time, DGC whose non-finite
screen defers its check to one all-rank test after backward instead of one host sync per bucket, and
DGC with no screen at all (a bound on what the screen's per-bucket host sync costs)."""


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


def profile_phases(
    model_name: str,
    steps: int,
    profile_steps: int = 0,
    find_syncs: bool = False,
    variants: tuple[str, ...] = VARIANTS,
    device_steps: int = 0,
) -> None:
    """Per-step host time of a plain DDP loop, dense against DGC, and DGC again with its selection
    made one tensor at a time (as before the bucket-wide kernels): the three side by side, each
    after a warm-up round of the same length. With ``profile_steps``, then that many DGC steps
    under cProfile (Python functions by own time; a host sync shows as the call that waits). With
    ``find_syncs``, then the host syncs of one DGC step and the host cost of an NCCL all-reduce's
    parts. With ``device_steps``, each variant's GPU time per step under ``torch.profiler``."""
    import collections
    import functools
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lightning_gc
    from lightning_gc.compressors.dgc import DGCCompressor
    from lightning_gc.compressors.sparse import SparseCompressor
    from lightning_gc.core.guard import StepGuard
    from lightning_gc.exchanges import pipeline
    from lightning_gc.runtime import session

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
    screen = StepGuard.screen

    def build(kind: str) -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        DGCCompressor.select_segments = SparseCompressor.select_segments if kind == "dgc, each tensor" else bucket_wide
        StepGuard.screen = (lambda *args, **kwargs: None) if kind == "dgc, unscreened" else screen  # type: ignore[method-assign]
        model = DistributedDataParallel(make_net().cuda())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        options = {"nonfinite": "skip"} if kind == "dgc, nonfinite=skip" else {}
        attached = (
            None if kind == "dense" else lightning_gc.attach(model, optimizer, "dgc", compress_ratio=RATIO, **options)
        )
        return model, optimizer, attached

    def clocked(name: str, fn: Callable[[], object]) -> None:
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        totals[name] += time.perf_counter() - started

    for kind in variants:
        model, optimizer, attached = build(kind)
        per_step: dict[str, list[float]] = collections.defaultdict(list)
        for _warm_then_timed in range(2):  # the first round warms up (compilation, allocation)
            per_step.clear()
            for _ in range(steps):
                totals.clear()
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                clocked("backward", loss.backward)
                clocked("step", optimizer.step if attached is None else attached.step)
                for name, spent in totals.items():
                    per_step[name].append(spent)
        report = "  ".join(f"{name} {statistics.median(v) * 1e3:.3f}" for name, v in sorted(per_step.items()))
        print(f"##### phases {model_name}, {kind} (ms per step, median of {steps} steps): {report}")
        if device_steps:
            _device_time(kind, model, optimizer, attached, x, y, device_steps)
        if attached is not None:
            attached.finish()
        del model, optimizer, attached
    DGCCompressor.select_segments, StepGuard.screen = bucket_wide, screen  # type: ignore[method-assign]
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
    if find_syncs:
        model, optimizer, attached = build("dgc")
        _report_syncs(model, optimizer, attached, x, y)
        attached.finish()
        _time_collective_calls()
    dist.destroy_process_group()


def _device_time(kind: str, model: Any, optimizer: Any, attached: Any, x: Any, y: Any, steps: int) -> None:
    """GPU time per step of ``steps`` steps under ``torch.profiler``: the kernels' total self device
    time (whether the step is bound by the GPU's work or by the host), and the largest ops."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            (optimizer.step if attached is None else attached.step)()
        torch.cuda.synchronize()
    # the kernels' own time, as the table's "Self CUDA time total" counts it: user annotations such as
    # DistributedDataParallel.forward span kernels already counted
    kernels_only = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    busy = sum(event.self_device_time_total for event in kernels_only) / steps / 1e3
    print(f"##### device time, {kind}: {busy:.3f} ms of GPU work per step ({steps} steps)")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))


def _report_syncs(model: Any, optimizer: Any, attached: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    """One DGC step (after three warm ones) under ``torch.cuda.set_sync_debug_mode("warn")``: every
    call that makes the host wait for the GPU, by the innermost ``lightning_gc`` line on its stack."""
    import collections
    import traceback
    import warnings

    import lightning_gc

    package = str(Path(lightning_gc.__file__).parent) + "/"

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        attached.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    found: collections.Counter[str] = collections.Counter()

    def record(message: Any, *args: Any, **kwargs: Any) -> None:
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(package)]
        where = f"{ours[-1].filename[len(package) :]}:{ours[-1].lineno} {ours[-1].name}" if ours else "outside"
        found[f"{where} | {str(message).splitlines()[0][:80]}"] += 1

    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"##### host syncs in one DGC step: {sum(found.values())}")
    for where, count in found.most_common():
        print(f"  {count:4d}  {where}")


def _time_collective_calls(numel: int = 1 << 20, repeats: int = 200) -> None:
    """Host time of each part of ``comm.allreduce_sum`` on NCCL: the launch, ``get_future`` and the
    ``.then`` chaining, each the median of ``repeats`` calls."""
    import torch.distributed as dist

    from lightning_gc.exchanges import comm

    tensor = torch.ones(numel, device="cuda")
    parts: dict[str, list[float]] = {"all_reduce": [], "get_future": [], "then": [], "allreduce_sum": []}
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        work = dist.all_reduce(tensor, async_op=True)
        t1 = time.perf_counter()
        future = work.get_future()
        t2 = time.perf_counter()
        future.then(lambda f: f.value())
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        comm.allreduce_sum(tensor, None)
        t5 = time.perf_counter()
        for name, spent in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t5 - t4), strict=True):
            parts[name].append(spent)
    print(
        "##### NCCL collective host time, median of",
        repeats,
        "(ms): " + "  ".join(f"{name} {statistics.median(v) * 1e3:.3f}" for name, v in parts.items()),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 25.6e6])
    parser.add_argument("--rows", type=int, default=18)
    parser.add_argument("--fit-epochs", type=int, default=3)
    parser.add_argument("--model", choices=["digits", "resnet50"], default="digits", help="phases: the model")
    parser.add_argument("--steps", type=int, default=100, help="phases: timed steps per variant")
    parser.add_argument("--cprofile", type=int, default=0, help="phases: then this many DGC steps under cProfile")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS[:3], help="phases: the loops")
    parser.add_argument("--device-steps", type=int, default=0, help="phases: GPU time per step over this many")
    parser.add_argument("--syncs", action="store_true", help="phases: then the host syncs of one DGC step")
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
        profile_phases(args.model, args.steps, args.cprofile, args.syncs, tuple(args.variants), args.device_steps)


if __name__ == "__main__":
    main()
