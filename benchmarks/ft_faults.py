"""Three torchft replica groups on real data, one killed and restarted twice, against a run with no faults.

A real ``torchft_lighthouse`` on loopback and three replica groups (one process each,
:func:`lightning_gc.integrations.ft.fault_tolerant`, DGC with error feedback) train an MLP on
scikit-learn's digits. The batch of committed step ``s`` of group ``r`` is a fixed function of
``(seed, s, r)``, so a run with faults sees the same data as one without, except the batches of
the killed group while it is down. In the faulty run group 2 is SIGKILLed when it reaches
``--kills`` steps and restarted at once (its process start, imports included, is part of the
downtime); every step sleeps ``--compute-ms`` to stand for a real model's compute, so that the
downtime costs a realistic number of steps (the MLP itself takes about a millisecond). Printed
per seed: steps rolled back on the survivors, the seconds from a kill to the
survivors' next committed step, from a restart to the restarted group's first committed step
(healed), the killed group's residual at its last step (L1: gradient mass lost with it), and the
final validation accuracy of both runs.

    python -m benchmarks.ft_faults --seeds 0 1 2 --steps 600 --kills 150 350 --compute-ms 30
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BATCH = 32


def _digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    features, labels = load_digits(return_X_y=True)
    x = torch.tensor(features, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0).clamp(min=1e-6)
    y = torch.tensor(labels)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    val, train = order[:360], order[360:]
    return x[train], y[train], x[val], y[val]


def worker(args: argparse.Namespace) -> None:
    """One replica group: trains until ``--steps`` committed steps with all three groups taking
    part in the last one; logs every step as a JSON line; writes its validation accuracy."""
    from lightning_gc.integrations.ft import fault_tolerant

    torch.set_num_threads(1)
    x, y, x_val, y_val = _digits(args.seed)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gc = fault_tolerant(
        model, optimizer, "dgc", lighthouse=args.lighthouse, replica_id=str(args.replica), min_replicas=2,
        timeout=10.0, compress_ratio=0.01,
    )  # fmt: skip
    last = 0
    if args.go:  # a fair start: every group is up before the first step
        Path(args.go + f".{args.replica}").write_text("up")
        while not Path(args.go).exists():
            time.sleep(0.02)
    with open(args.log, "a") as log:
        while gc.steps < args.steps or last < 3:
            gc.zero_grad()
            time.sleep(args.compute_ms / 1000)  # stands for a real model's forward and backward
            batch = torch.Generator().manual_seed(args.seed * 100_003 + gc.steps * 7 + args.replica)
            index = torch.randint(len(x), (BATCH,), generator=batch)
            torch.nn.functional.cross_entropy(model(x[index]), y[index]).backward()
            participants = gc.participants
            committed = gc.step()
            last = participants if committed else last
            residual = float(gc.averager.residual().abs().sum())
            line = {"steps": gc.steps, "committed": committed, "participants": participants, "residual": residual}
            print(json.dumps({**line, "time": time.time()}), file=log, flush=True)
    with torch.no_grad():
        accuracy = float((model(x_val).argmax(1) == y_val).float().mean())
    Path(args.result).write_text(json.dumps({"accuracy": accuracy, "steps": gc.steps, "healed": gc.healed}))
    time.sleep(1.0)  # the peers' last commit votes finish before this manager goes away
    gc.close()


def _lighthouse(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = str(Path(sys.executable).parent / "torchft_lighthouse")
    command = [binary, "--min_replicas", "2", "--bind", "127.0.0.1:0", "--join_timeout_ms", "1000"]
    with log.open("wb") as out:
        process = subprocess.Popen(command + ["--heartbeat_timeout_ms", "1000"], stdout=out, stderr=subprocess.STDOUT)
    for _ in range(600):
        found = re.search(r"listening on: http://[^:\s]+:(\d+)", log.read_text())
        if found:
            return process, f"http://127.0.0.1:{found.group(1)}"
        time.sleep(0.05)
    process.kill()
    raise RuntimeError("torchft_lighthouse did not start listening")


def _lines(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run(seed: int, steps: int, kills: list[int], tmp: Path, compute_ms: float) -> dict[str, object]:
    """One run of three groups (faults at ``kills``, none when empty); its measurements."""
    lighthouse, address = _lighthouse(tmp / "lighthouse.log")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}

    def start(replica: int, name: str, go: str = "") -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "benchmarks.ft_faults", "--worker", "--seed", str(seed), "--go", go]
        command += ["--compute-ms", str(compute_ms)]
        command += ["--steps", str(steps), "--lighthouse", address, "--replica", str(replica)]
        command += ["--log", str(tmp / f"{name}.log"), "--result", str(tmp / f"{name}.json")]
        with (tmp / f"{name}.out").open("wb") as out:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    go = tmp / "go"
    processes = [start(r, f"r{r}", str(go)) for r in range(3)]
    killed, restarted, lost = [], [], []
    try:
        while not all(Path(f"{go}.{r}").exists() for r in range(3)):
            if any(p.poll() is not None for p in processes):
                raise RuntimeError("a replica group exited before the start")
            time.sleep(0.05)
        go.write_text("go")
        for number, at in enumerate(kills):
            log = tmp / f"r2-{number - 1}.log" if number else tmp / "r2.log"
            while not any(x["steps"] >= at for x in _lines(log)):
                if processes[2].poll() is not None:
                    raise RuntimeError((tmp / f"{log.stem}.out").read_text()[-3000:])
                time.sleep(0.01)
            processes[2].send_signal(signal.SIGKILL)
            processes[2].wait()
            killed.append(time.time())
            lost.append(_lines(log)[-1]["residual"])
            processes[2] = start(2, f"r2-{number}")
            restarted.append(time.time())
        for process in processes:
            process.wait(timeout=600)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        lighthouse.kill()
    survivors = [_lines(tmp / f"r{r}.log") for r in range(2)]
    recover = [min(x["time"] for x in survivors[0] if x["time"] > k and x["committed"]) - k for k in killed]
    heal = [_lines(tmp / f"r2-{n}.log")[0]["time"] - restarted[n] for n in range(len(kills))]
    names = ["r0", "r1", f"r2-{len(kills) - 1}" if kills else "r2"]
    finals = [json.loads((tmp / f"{name}.json").read_text()) for name in names]
    accuracy = finals[0]["accuracy"]
    assert len({(f["accuracy"], f["steps"]) for f in finals}) == 1, f"groups ended apart: {finals}"
    return {
        "rolled_back": sum(not x["committed"] for x in survivors[0]),
        "recover_s": [round(t, 2) for t in recover],
        "heal_s": [round(t, 2) for t in heal],
        "lost_residual_l1": [round(r, 2) for r in lost],
        "accuracy": round(accuracy, 4),
        "steps": finals[0]["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--kills", type=int, nargs="*", default=[150, 350], help="group 2's steps to kill it at")
    parser.add_argument("--compute-ms", type=float, default=30.0, help="sleep per step standing for compute")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--seed", "--replica"):
        parser.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    for name in ("--lighthouse", "--log", "--result", "--go"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print("| seed | accuracy, no faults | accuracy, 2 kills | rolled back | kill -> survivors step (s) "
          "| restart -> healed step (s) | lost residual (L1) |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as clean, tempfile.TemporaryDirectory() as faulty:
            base = run(seed, args.steps, [], Path(clean), args.compute_ms)
            hurt = run(seed, args.steps, args.kills, Path(faulty), args.compute_ms)
        print(
            f"| {seed} | {base['accuracy']} ({base['steps']} steps) | {hurt['accuracy']} ({hurt['steps']} steps) "
            f"| {hurt['rolled_back']} | {hurt['recover_s']} "
            f"| {hurt['heal_s']} | {hurt['lost_residual_l1']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
