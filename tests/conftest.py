"""Shared fixtures: launching real multi-process (gloo) runs of ``tests/workers``."""

from __future__ import annotations

import os

# Triton kernels run in Triton's CPU interpreter unless told otherwise; this must be set before
# triton is first imported. On a GPU machine, run with TRITON_INTERPRET=0 to test compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import json
import multiprocessing
import multiprocessing.forkserver
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from lightning_gc.common.layout import BucketLayout, Segment

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"


LONGEST_FIRST = (
    "test_sweep_and_errors", "test_reliability", "test_training", "test_kernels", "test_attach", "test_recipes",
    "test_readme", "test_compressors", "test_netbench", "test_quickstart", "test_adam", "test_perfmodel",
    "test_fabric", "test_kernels_compile", "test_hierarchy", "test_packaging", "test_two_phase",
)  # fmt: skip
"""The test files that take longest on 2 cores (30 s to 2 min each), longest first. The suite runs
on pytest-xdist workers that take whole files in collection order (``--dist loadfile``): with the
long files handed out first, the last ones are short and both workers stay busy to the end."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Collect :data:`LONGEST_FIRST` first, then the other files in their usual order."""
    position = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: position.get(item.path.stem, len(position)))


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Every test leaves the environment as it found it: an in-process Fabric or Trainer launch sets
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ..., which would make later tests look like
    ranks a launcher started."""
    saved = dict(os.environ)
    yield
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def layout_of(shapes: list[tuple[int, ...]]) -> BucketLayout:
    """Bucket 0 holding tensors of ``shapes`` back to back, named ``p0, p1, ...`` in that order."""
    segments, start = [], 0
    for order, shape in enumerate(shapes):
        segments.append(Segment(f"p{order}", order, start, shape))
        start = segments[-1].stop
    return BucketLayout(0, tuple(segments), tuple(range(len(segments))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_torchrun(
    script: Path, *args: str, cwd: Path = REPO, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc_per_node=2 script args`` on loopback, outside any distributed environment
    of this process; ``env`` replaces the environment (default: this one, the checkout importable)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        env["PYTHONFAULTHANDLER"] = "1"
    for _ in range(3):  # a free port can be taken by another process before torchrun listens on it
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", str(script), *args,
        ]  # fmt: skip
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        if "EADDRINUSE" not in done.stderr and "address already in use" not in done.stderr:
            break
    return done


def launch_ranks(
    worker: str,
    plan: dict[str, Any],
    out: Path,
    world_size: int = 2,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    devices_per_node: int | None = None,
    fresh: bool = False,
) -> list[Any]:
    """Run ``worker`` as ``world_size`` ranks on loopback (gloo) and return each rank's saved results
    (``devices_per_node``, ``fresh``: see :func:`start_ranks`)."""
    codes, logs = start_ranks(worker, plan, out, world_size, timeout, env, devices_per_node, fresh)
    if any(code != 0 for code in codes):
        tails = "\n".join(f"--- rank {r} (exit {c}) ---\n" + logs[r][-4000:] for r, c in enumerate(codes))
        raise AssertionError(f"distributed worker failed:\n{tails}")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def start_ranks(
    worker: str,
    plan: dict[str, Any],
    out: Path,
    world_size: int = 2,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    devices_per_node: int | None = None,
    fresh: bool = False,
) -> tuple[list[int | None], list[str]]:
    """Run ``worker`` as ``world_size`` ranks on loopback (gloo), with ``env`` added to the
    environment; each rank's exit code and output. A rank still running after ``timeout``
    seconds is killed and reported with code ``None``. With ``devices_per_node``, the ranks play
    nodes of that many devices, numbered node by node, as torchrun numbers them (``RANK``,
    ``LOCAL_RANK``, ``NODE_RANK``, ``LOCAL_WORLD_SIZE``); without, one node (``LOCAL_RANK`` = rank).
    Ranks are forks of a warm interpreter (``tests/workers/forked_rank.py``) unless ``fresh`` or
    ``env`` is given: then each is a new interpreter, with its own exit and finalization."""
    out.mkdir(parents=True, exist_ok=True)
    plan = {**plan, "out": str(out)}
    plan_path = out / "plan.json"
    plan_path.write_text(json.dumps(plan))
    fresh = fresh or bool(env)  # variables read at import need a fresh interpreter
    script = WORKERS / worker
    return _retried(
        lambda: _run_once(script, [str(plan_path)], out, world_size, timeout, env or {}, devices_per_node, fresh)
    )


def _retried(launch: Callable[[], tuple[list[int | None], list[str]]]) -> tuple[list[int | None], list[str]]:
    """``launch()``'s exit codes and logs, launched again (up to 3 times) while a rank reports
    EADDRINUSE: a free port can be taken by another process before rank 0 listens on it."""
    for _ in range(3):
        codes, logs = launch()
        if not any("EADDRINUSE" in log for log in logs):
            break
    return codes, logs


def train_under_torchrun(*overrides: str, logs: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc_per_node=2 train.py <overrides>``, as a cluster user launches it (the
    ranks started outside Lightning, which then launches nothing), with each rank a fork of the
    warm interpreter (:func:`start_ranks`, in this process's working directory) instead of a
    fresh one: it saves the ~10 s of CPU that importing Lightning costs each process. ``stdout``
    is rank 0's output (stdout and stderr together), ``stderr`` every rank's; ``returncode`` the
    first non-zero exit (-9: killed at ``timeout``)."""
    logs.mkdir(parents=True, exist_ok=True)
    elastic = {"TORCHELASTIC_RUN_ID": "tests", "GROUP_RANK": "0"}  # what torchrun sets besides the ranks
    codes, texts = _retried(
        lambda: _run_once(REPO / "train.py", list(overrides), logs, 2, timeout, elastic, None, False)
    )
    failed = [(-9 if code is None else code) for code in codes if code != 0]
    everything = "\n".join(
        f"--- rank {rank} (exit {code}) ---\n{text}" for rank, (code, text) in enumerate(zip(codes, texts))
    )
    return subprocess.CompletedProcess(["train.py", *overrides], failed[0] if failed else 0, texts[0], everything)


class _Rank:
    """One rank process, started fresh (``subprocess``) or forked from the warm forkserver."""

    def __init__(self, process: subprocess.Popen[bytes] | multiprocessing.process.BaseProcess) -> None:
        self.process = process

    def poll(self) -> int | None:
        if isinstance(self.process, subprocess.Popen):
            return self.process.poll()
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()
        if isinstance(self.process, subprocess.Popen):
            self.process.wait()
        else:
            self.process.join()


_warm: multiprocessing.context.BaseContext | None = None
_LAUNCHER_VARIABLES = {
    "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
}  # fmt: skip


def _warm_context() -> multiprocessing.context.BaseContext:
    """The session's forkserver, started once with ``forked_rank.PRELOAD`` imported (see there),
    in the environment every rank gets at least (one OpenMP thread: libgomp reads it at load)."""
    global _warm
    if _warm is None:
        if str(WORKERS) not in sys.path:
            sys.path.insert(0, str(WORKERS))  # the forkserver takes this process's sys.path
        from forked_rank import PRELOAD

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["forked_rank", *PRELOAD])
        # not whatever launcher variables the test that happens to start it has set
        clean = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES and not k.startswith("PL_")}
        with mock.patch.dict(os.environ, {**clean, "OMP_NUM_THREADS": "1"}, clear=True):
            multiprocessing.forkserver.ensure_running()
        _warm = context
    return _warm


def _start_rank(script: Path, argv: list[str], rank_env: dict[str, str], log_path: Path, fresh: bool) -> _Rank:
    if fresh:
        with open(log_path, "w") as log:
            command = [sys.executable, str(script), *argv]
            return _Rank(subprocess.Popen(command, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    context = _warm_context()
    from forked_rank import run_rank

    process = context.Process(target=run_rank, args=(str(script), argv, rank_env, str(log_path)))
    process.start()
    return _Rank(process)


FAILURE_GRACE_S = 60.0
"""Once a rank has failed, how long the others may take to notice and exit before being killed."""


def _run_once(
    script: Path,
    argv: list[str],
    out: Path,
    world_size: int,
    timeout: float,
    env: dict[str, str],
    devices_per_node: int | None,
    fresh: bool,
) -> tuple[list[int | None], list[str]]:
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "NODE_RANK": str(rank // (devices_per_node or world_size)),
            "LOCAL_RANK": str(rank % (devices_per_node or world_size)),
            "LOCAL_WORLD_SIZE": str(devices_per_node or world_size),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",  # a rank that aborts prints every thread's Python stack
            **env,
        }
        procs.append(_start_rank(script, argv, rank_env, out / f"rank{rank}.log", fresh))
    deadline = time.monotonic() + timeout
    hung: set[int] = set()
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            time.sleep(0.2)
    finally:
        for rank, p in enumerate(procs):
            if p.poll() is None:
                hung.add(rank)
                p.kill()
    codes = [None if rank in hung else p.poll() for rank, p in enumerate(procs)]
    return codes, [(out / f"rank{r}.log").read_text() for r in range(world_size)]


@pytest.fixture
def run_ranks(tmp_path: Path) -> Callable[..., list[Any]]:
    """``run_ranks(plan, worker="fit_worker.py")`` -> per-rank results of a 2-process gloo run
    (``fresh``: see :func:`start_ranks`)."""

    def run(plan: dict[str, Any], worker: str = "fit_worker.py", name: str = "run", fresh: bool = False) -> list[Any]:
        return launch_ranks(worker, plan, tmp_path / name, fresh=fresh)

    return run


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    """A real gloo process group of one rank (this process), for code that runs collectives."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()
