"""How many torch ops and Triton launches lightning_gc's comm hook dispatches per step, and where.

On a GPU the comm hook is bound by host time (RESULTS, "Fourth GPU run": DGC's kernels add 1.2 ms
of GPU work per ResNet-50 step, the hook 10-16 ms of host time), and every op dispatched costs host
time whether it launches a kernel or only makes a view. This script counts them on the CPU, with
the Triton backend under the interpreter, so a change to the hook's host overhead can be checked
without a GPU: the counts are exact and do not depend on the machine's load.

    TRITON_INTERPRET=1 python -m benchmarks.hook_ops [--model resnet18] [--compressor dgc] [--lines 20]

One gloo process group of one rank, ``lightning_gc.attach`` on a torchvision model under DDP with
SGD (momentum 0.9, weight decay 1e-4), two warm-up steps, then one counted step. Counted: what the
hook's thread dispatches while it runs the hook (a ``TorchDispatchMode``), each op by the innermost
``lightning_gc`` line on the stack, and the Triton launches from that thread (the torch ops that
Triton's interpreter runs inside a launch are not counted). Each collective is waited for as it is
launched, so its ``.then`` callbacks (the decode among them) run at once on the hook's thread and
are counted, as on a GPU, where an NCCL future is complete from the host's view as soon as its
work is queued. (Left to gloo's timing, a decode ran on the hook's thread or on gloo's, and the
counts of one ResNet-18 step varied between 117 ops and 138 on a loaded machine.)
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import lightning_gc
from lightning_gc import kernels
from lightning_gc.exchanges import comm
from lightning_gc.kernels import launch as launching
from lightning_gc.runtime import session

PACKAGE = str(Path(lightning_gc.__file__).parent) + os.sep


class HookCounts:
    """What the hook's thread dispatched while ``counting``: ``ops[(op, line)]``, ``launches[kernel]``."""

    def __init__(self) -> None:
        self.ops: collections.Counter[tuple[str, str]] = collections.Counter()
        self.launches: collections.Counter[str] = collections.Counter()
        self.counting = False
        self.in_hook = threading.local()


class _CountOps(TorchDispatchMode):
    def __init__(self, counts: HookCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(PACKAGE)]
        if ours:
            self.counts.ops[(str(func.overloadpacket), f"{ours[-1].filename[len(PACKAGE) :]}:{ours[-1].lineno}")] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(counts: HookCounts) -> Iterator[None]:
    """Hooks registered within the block count into ``counts`` while ``counts.counting``."""
    hook, launch = session.compression_hook, launching.launch

    @functools.wraps(hook)  # DDP reads the hook's signature
    def counted_hook(*args: Any) -> Any:
        if not counts.counting:
            return hook(*args)
        counts.in_hook.active = True
        try:
            with _CountOps(counts):
                return hook(*args)
        finally:
            counts.in_hook.active = False

    def counted_launch(kernel: Any, grid: Any, *args: Any, **meta: Any) -> None:
        if getattr(counts.in_hook, "active", False):
            counts.launches[getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))] += 1
        with _disable_current_modes():  # the interpreter's own torch ops are not the hook's
            launch(kernel, grid, *args, **meta)

    # imported lazily by the dispatch: import them before their `launch` is replaced
    from lightning_gc.kernels import compensation_triton, packing_triton, selection_triton, sparse_triton  # noqa: F401

    modules = [module for name, module in vars(kernels).items() if name.endswith("_triton")]
    collectives = [(dist, "all_reduce"), (dist, "all_to_all_single"), (comm, "all_gather_single")]
    originals = [getattr(owner, name) for owner, name in collectives]
    session.compression_hook = counted_hook
    for module in modules:
        module.launch = counted_launch
    for (owner, name), collective in zip(collectives, originals):
        setattr(owner, name, _completed(collective))
    try:
        yield
    finally:
        session.compression_hook = hook
        for module in modules:
            module.launch = launch
        for (owner, name), collective in zip(collectives, originals):
            setattr(owner, name, collective)


def _completed(collective: Any) -> Any:
    """``collective``, waited for before it returns its work (module docstring)."""

    @functools.wraps(collective)
    def run(*args: Any, **kwargs: Any) -> Any:
        work = collective(*args, **kwargs)
        if work is not None:
            work.wait()
        return work

    return run


def count_step(model_name: str, compressor: str) -> HookCounts:
    """The hook's ops and launches in one step, after two warm-up steps."""
    import torchvision
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(getattr(torchvision.models, model_name)())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 1000, (2,))
    counts = HookCounts()
    with kernels.use_backend("triton"), counting(counts):
        attached = lightning_gc.attach(model, optimizer, compressor, compress_ratio=0.001)
        for step in range(3):  # two to warm up (DDP rebuilds its buckets after the first), one counted
            counts.counting = step == 2
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            attached.step()
        counts.counting = False
        attached.finish()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", help="a torchvision model name")
    parser.add_argument("--compressor", default="dgc")
    parser.add_argument("--lines", type=int, default=20, help="the lines dispatching the most ops")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 before Python starts (Triton reads it at import)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29575")
    dist.init_process_group("gloo", rank=0, world_size=1)
    counts = count_step(args.model, args.compressor)
    dist.destroy_process_group()
    by_op: collections.Counter[str] = collections.Counter()
    for (op, _), n in counts.ops.items():
        by_op[op] += n
    print(f"{args.model}, {args.compressor}: the hook's thread dispatched {sum(by_op.values())} torch ops and "
          f"{sum(counts.launches.values())} Triton launches in one step")  # fmt: skip
    print("ops: " + ", ".join(f"{op} {n}" for op, n in by_op.most_common()))
    print("launches: " + ", ".join(f"{kernel} {n}" for kernel, n in counts.launches.most_common()))
    for (op, line), n in counts.ops.most_common(args.lines):
        print(f"  {n:5d}  {op:28s} {line}")


if __name__ == "__main__":
    main()
