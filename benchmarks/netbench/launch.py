"""Start the benchmark's processes the way a user starts Lightning on two nodes, and collect the record.

Each node gets the multi-node environment (``MASTER_ADDR``/``MASTER_PORT``/``NODE_RANK``/
``WORLD_SIZE``, ``GLOO_SOCKET_IFNAME``), one torch thread, glibc malloc thresholds set high (so
gradient-sized frees do not return pages to the OS every step), and a command prefix that puts it
in its namespace and pins it to its core (``ip netns exec ns taskset -c k``). Unit tests use an
empty prefix and loopback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.netbench.modes import IDEAL

REPO = Path(__file__).resolve().parents[2]
MALLOC_ENV = {
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),  # never give freed heap back to the OS
    "MALLOC_MMAP_THRESHOLD_": str(1 << 25),  # 32 MiB, glibc's maximum: smaller blocks come from the heap
    "MALLOC_TOP_PAD_": str(1 << 28),
}
DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "RANK")


@dataclass(frozen=True)
class Node:
    """Where one node's process runs: the interface gloo uses and the command prefix that places it."""

    ifname: str
    prefix: tuple[str, ...] = field(default_factory=tuple)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def node_env(node_rank: int, world_size: int, master_addr: str, master_port: int, ifname: str) -> dict[str, str]:
    """The environment of node ``node_rank``: a user's multi-node launch, one thread, malloc tuned."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    env.update(MALLOC_ENV)
    env.update(
        {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "NODE_RANK": str(node_rank),
            "WORLD_SIZE": str(world_size),
            "GLOO_SOCKET_IFNAME": ifname,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        }
    )
    return env


def run_nodes(
    command: Sequence[str],
    nodes: Sequence[Node],
    envs: Sequence[dict[str, str]],
    *,
    logs: Path,
    timeout: float,
    what: str,
) -> None:
    """Run ``command`` once per node (its ``prefix`` first, e.g. ``ip netns exec`` or ``taskset``)
    with that rank's environment, output in ``logs/node<rank>.log``; wait for all, kill what is
    left on the way out, and raise ``RuntimeError`` naming ``what`` with every log's tail when a
    process failed."""
    procs, files = [], []
    try:
        for rank, (node, env) in enumerate(zip(nodes, envs)):
            files.append(open(logs / f"node{rank}.log", "w"))
            procs.append(
                subprocess.Popen(
                    [*node.prefix, *command], env=env, cwd=REPO, stdout=files[-1], stderr=subprocess.STDOUT
                )
            )
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    if any(codes):
        tails = "\n".join(
            f"--- node {r} (exit {c}) ---\n{(logs / f'node{r}.log').read_text()[-3000:]}" for r, c in enumerate(codes)
        )
        raise RuntimeError(f"{what} failed:\n{tails}")


def run_mode(
    mode: str,
    model: str,
    *,
    nodes: Sequence[Node],
    master_addr: str,
    out: Path,
    steps: int,
    warmup: int,
    batch_size: int,
    timeout: float = 900.0,
    master_port: int | None = None,
    devices_per_node: int = 1,
) -> dict[str, Any]:
    """Run ``mode`` once and return rank 0's record, completed with ``samples_per_s``: global
    throughput, ``len(nodes) * batch_size / median step``. Mode ``ideal`` runs one process on
    ``nodes[0]`` and its ``samples_per_s`` is that of ``len(nodes)`` such processes exchanging
    nothing. Raises ``RuntimeError`` with the logs' tails when a process fails."""
    out.mkdir(parents=True, exist_ok=True)
    port = master_port or free_port()
    used = nodes[:1] if mode == IDEAL else nodes
    command = [sys.executable, "-m", "benchmarks.netbench.worker", "--mode", mode, "--model", model]
    command += ["--out", str(out), "--steps", str(steps), "--warmup", str(warmup), "--batch-size", str(batch_size)]
    command += ["--devices", str(devices_per_node), "--nodes", str(len(used))]
    envs = [node_env(rank, len(used), master_addr, port, node.ifname) for rank, node in enumerate(used)]
    if mode == IDEAL:
        envs = [{k: v for k, v in env.items() if k not in DISTRIBUTED_ENV} for env in envs]
    run_nodes(command, used, envs, logs=out, timeout=timeout, what=f"mode {mode!r}")
    record = json.loads((out / "rank0.json").read_text())
    record["processes"] = len(used)
    record["samples_per_s"] = record["batch_size"] * len(nodes) * devices_per_node / record["median_s"]
    return record
