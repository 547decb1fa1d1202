"""Shared fixtures: launching real multi-process (gloo) runs of ``tests/workers``."""

from __future__ import annotations

import os

# Triton kernels run in Triton's CPU interpreter unless told otherwise; this must be set before
# triton is first imported. On a GPU machine, run with TRITON_INTERPRET=0 to test compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_ranks(worker: str, plan: dict[str, Any], out: Path, world_size: int = 2, timeout: float = 600) -> list[Any]:
    """Run ``worker`` as ``world_size`` ranks on loopback (gloo) and return each rank's saved results."""
    out.mkdir(parents=True, exist_ok=True)
    plan = {**plan, "out": str(out)}
    plan_path = out / "plan.json"
    plan_path.write_text(json.dumps(plan))
    port = _free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "NODE_RANK": "0",
            "LOCAL_RANK": str(rank),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
        }
        log = open(out / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKERS / worker), str(plan_path)], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        )
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    if any(codes):
        tails = "\n".join(
            f"--- rank {r} (exit {c}) ---\n" + (out / f"rank{r}.log").read_text()[-4000:] for r, c in enumerate(codes)
        )
        raise AssertionError(f"distributed worker failed:\n{tails}")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


@pytest.fixture
def run_ranks(tmp_path: Path) -> Callable[..., list[Any]]:
    """``run_ranks(plan, worker="fit_worker.py")`` -> per-rank results of a 2-process gloo run."""

    def run(plan: dict[str, Any], worker: str = "fit_worker.py", name: str = "run") -> list[Any]:
        return launch_ranks(worker, plan, tmp_path / name)

    return run
