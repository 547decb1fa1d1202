"""Fault-tolerant replica groups on torchft with real components: a real ``torchft_lighthouse`` on
loopback, three replica groups (one process each, gloo, CPU) training a tiny MLP with DGC and error
feedback over the quorum (:mod:`lightning_gc.integrations.ft`); one replica is SIGKILLed inside a
step while its peers wait for it in the collective, the survivors roll that step back and keep
stepping, the killed one is restarted, heals from a live peer and rejoins, and every replica ends
with bitwise equal parameters at the same step count.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[ft]')")

WORKER = Path(__file__).resolve().parent / "workers" / "ft_replica.py"
TIMEOUT = 5.0  # the replicas' collective / commit timeout, seconds
STALL = 5  # replica 2 stops inside this step and is killed there
HOLD = STALL + 3  # the survivors wait here for the restarted replica (they step alone before it)
STEPS = HOLD + 4
DEADLINE = 90.0  # for the whole scenario; it takes about 20 s on two busy cores


@pytest.fixture
def lighthouse() -> Iterator[str]:
    """A real torchft lighthouse on a free loopback port; yields its address."""
    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    if not Path(binary).exists():
        pytest.skip("torchft is installed without its torchft_lighthouse console script")
    command = [binary, "--min_replicas", "2", "--bind", "127.0.0.1:0", "--quorum_tick_ms", "50"]
    command += ["--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "1000"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None
        for line in process.stdout:  # the port is only known once it listens
            found = re.search(r"listening on: http://[^:\s]+:(\d+)", line)
            if found:
                yield f"http://127.0.0.1:{found.group(1)}"
                break
        else:
            pytest.fail("torchft_lighthouse exited before listening")
    finally:
        process.kill()
        process.wait()


def _replica(tmp: Path, lighthouse: str, replica: int, name: str, *extra: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    env["TORCHFT_QUORUM_RETRIES"] = "0"
    command = [sys.executable, str(WORKER), "--lighthouse", lighthouse, "--replica", str(replica)]
    command += ["--steps", str(STEPS), "--final-participants", "3", "--min-replicas", "2"]
    command += ["--timeout", str(TIMEOUT), "--log", str(tmp / f"{name}.log"), "--result", str(tmp / f"{name}.pt")]
    with (tmp / f"{name}.out").open("wb") as out:
        return subprocess.Popen([*command, *extra], stdout=out, stderr=subprocess.STDOUT, env=env)


@contextlib.contextmanager
def socket_closed() -> Iterator[int]:
    """A loopback port nothing listens on (bound, never listened, so connections are refused)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def _lines(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(
    what: str, ready: Callable[[], bool], processes: list[subprocess.Popen[bytes]], tmp: Path, until: float
) -> None:
    while not ready():
        crashed = [p for p in processes if p.poll() not in (None, 0)]
        if crashed or time.monotonic() > until:
            outputs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(tmp.glob("*.out")))
            pytest.fail(f"waiting for {what}: {'a replica crashed' if crashed else 'deadline passed'}\n{outputs}")
        time.sleep(0.05)


MODES = {
    "per_step": [],  # DGC 5 %, error feedback, the gradient exchanged every step
    "outer_loop": ["--outer", "3", "--compressor", "topk", "--compress-ratio", "0.1"],  # one sync per 3 inner steps
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_killed_replica_survivors_step_restarted_one_heals(tmp_path: Path, lighthouse: str, mode: str) -> None:
    """Per step, or per sync of the outer loop (where "steps" count syncs, and the parameters
    compared include theta_g)."""
    until = time.monotonic() + DEADLINE
    go = tmp_path / "go"
    processes = [
        _replica(
            tmp_path,
            lighthouse,
            r,
            f"r{r}",
            "--ready",
            str(tmp_path / f"ready{r}"),
            "--hold",
            f"0:{go}",
            *(["--hold", f"{HOLD}:{tmp_path / 'ready-restarted'}"] if r < 2 else ["--stall-at", str(STALL)]),
            *MODES[mode],
        )
        for r in range(3)
    ]
    try:
        _wait_for(
            "three replicas up",
            lambda: all((tmp_path / f"ready{r}").exists() for r in range(3)),
            processes,
            tmp_path,
            until,
        )
        go.write_text("go")
        _wait_for(
            "replica 2 inside its step",
            lambda: any("stalled" in x for x in _lines(tmp_path / "r2.log")),
            processes,
            tmp_path,
            until,
        )
        killed_at = time.time()
        processes[2].send_signal(signal.SIGKILL)
        processes[2].wait()
        lost_residual = _lines(tmp_path / "r2.log")[-2]["residual"]  # its last committed step's

        def survivors_stepped_alone() -> bool:
            return all(
                any(x.get("committed") and x["participants"] == 2 for x in _lines(tmp_path / f"r{r}.log"))
                for r in range(2)
            )

        _wait_for("the survivors to step without replica 2", survivors_stepped_alone, processes[:2], tmp_path, until)
        restarted = ["--ready", str(tmp_path / "ready-restarted"), *MODES[mode]]
        processes[2] = _replica(tmp_path, lighthouse, 2, "r2b", *restarted)
        _wait_for(
            "every replica to finish", lambda: all(p.poll() is not None for p in processes), processes, tmp_path, until
        )
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert [p.returncode for p in processes] == [0, 0, 0], [
        (tmp_path / f).read_text()[-2000:] for f in ("r0.out", "r1.out", "r2b.out")
    ]

    results = [torch.load(tmp_path / f"{name}.pt") for name in ("r0", "r1", "r2b")]
    for survivor in range(2):
        log = [x for x in _lines(tmp_path / f"r{survivor}.log") if "steps" in x]
        failed = next(i for i, x in enumerate(log) if not x["committed"])
        # the step in flight when replica 2 died is rolled back, within the configured timeout ...
        assert log[failed]["steps"] == STALL and log[failed]["time"] - killed_at < TIMEOUT + 2.0
        # ... and the survivors step again without it: no restart, no hang
        again = next(x for x in log[failed:] if x["committed"])
        assert again["participants"] == 2 and again["steps"] == STALL + 1
        assert again["time"] - killed_at < 2 * TIMEOUT + 5.0
        assert results[survivor]["rolled_back"] >= 1
    restarted = [x for x in _lines(tmp_path / "r2b.log") if "steps" in x]
    assert results[2]["healed"] == 1 and restarted[0]["steps"] > HOLD  # healed from a live peer, not from step 0
    assert all(x["participants"] == 3 for x in restarted)  # rejoined the quorum
    assert lost_residual > 0  # the killed replica's residual: unsent gradient mass, lost with it
    steps = {(r["steps"], r["manager_step"]) for r in results}
    assert len(steps) == 1 and next(iter(steps))[0] >= STEPS, [(r["steps"], r["manager_step"]) for r in results]
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["parameters"], other["parameters"]))


def test_replica_with_other_compression_settings_is_refused(tmp_path: Path, lighthouse: str) -> None:
    """Two replica groups that differ in ``compress_ratio``: the one that heals from the other (at
    step 0, torchft's init_sync) is refused with one line naming both settings."""
    processes = [
        _replica(tmp_path, lighthouse, r, f"r{r}", "--compress-ratio", ratio) for r, ratio in enumerate(("0.05", "0.1"))
    ]
    try:
        _wait_for("one replica to be refused", lambda: any(p.poll() is not None for p in processes), [], tmp_path,
                  time.monotonic() + DEADLINE)  # fmt: skip
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    refused = [p for p in processes if p.returncode not in (0, -signal.SIGKILL)]
    assert len(refused) == 1, [p.returncode for p in processes]
    output = (tmp_path / f"r{processes.index(refused[0])}.out").read_text()
    message = [line for line in output.splitlines() if line.startswith("ValueError")]
    assert message and "compress_ratio=0.05" in message[-1] and "compress_ratio=0.1" in message[-1], output[-2000:]
    assert "differ from the quorum's" in message[-1]


def test_unreachable_lighthouse_is_named() -> None:
    from lightning_gc.integrations.ft import fault_tolerant

    with socket_closed() as port:
        model = torch.nn.Linear(4, 2)
        address = f"http://127.0.0.1:{port}"
        with pytest.raises(ConnectionError, match=re.escape(f"cannot reach the torchft lighthouse at {address}")):
            fault_tolerant(model, torch.optim.SGD(model.parameters(), lr=0.1), lighthouse=address, replica_id="0",
                           timeout=1.0)  # fmt: skip


def test_point_to_point_exchange_is_refused_before_any_step() -> None:
    from lightning_gc.integrations.ft import FaultTolerantCompression

    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="exchange='global_topk' needs point-to-point rounds"):
        FaultTolerantCompression(model, optimizer, None, None, "topk", exchange="global_topk", compress_ratio=0.1)
