"""The measuring phases: trajectories on loopback, step times per shaped link, end-to-end checks.

Processes start as netbench starts its nodes (``benchmarks.netbench.launch``: ``node_env``,
``Node``, ``free_port``), one per emulated node, each pinned to its own core (``taskset``: core
0 and core 1, the same for every mode and phase). Shaped links are netbench's
``TwoNodeLink`` (namespaces, veth, tbf; measured by its socket test, deleted on exit).

Layout under ``<out>/<task>/``: ``accuracy/<mode>.jsonl`` (trajectories), ``steptime-<link>.json``
(per mode and kind, the median over repeats of each repeat's median step), ``e2e/<mode>@<link>.jsonl``
(a whole training run on a shaped link), ``logs/`` (every process's output).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.netbench.launch import REPO, Node, free_port, node_env, run_nodes
from benchmarks.time_to_accuracy import modes, tasks

LOOPBACK = "loopback"
MASTER = "127.0.0.1"


def loopback_nodes() -> tuple[Node, Node]:
    """Two nodes on ``lo``, pinned to cores 0 and 1 (unpinned on a one-core machine)."""
    pinned = (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
    return tuple(Node("lo", ("taskset", "-c", str(k)) if pinned else ()) for k in range(2))  # type: ignore[return-value]


def missing_for_shaping() -> list[str]:
    """What the shaped phases need and this machine lacks (empty: ready)."""
    missing = [] if os.geteuid() == 0 else ["root (network namespaces, tc)"]
    return missing + [f"`{tool}`" for tool in ("ip", "tc", "taskset") if shutil.which(tool) is None]


def run_worker(
    arguments: Sequence[str], *, nodes: Sequence[Node], master_addr: str, logs: Path, timeout: float
) -> None:
    """Start one worker per node with ``arguments``; raise with the logs' tails if one fails."""
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port(master_addr) if master_addr == MASTER else free_port()
    command = [sys.executable, "-m", "benchmarks.time_to_accuracy.worker", *arguments]
    envs = [node_env(rank, len(nodes), master_addr, port, node.ifname) for rank, node in enumerate(nodes)]
    run_nodes(command, nodes, envs, logs=logs, timeout=timeout, what=f"worker {' '.join(arguments)}")


def worker_arguments(cfg: tasks.TaskConfig, data: Path, mode: str, out: Path, **options: int) -> list[str]:
    arguments = ["--task-config", json.dumps(cfg.to_dict()), "--data", str(data), "--mode", mode, "--out", str(out)]
    for name, value in options.items():
        arguments += [f"--{name.replace('_', '-')}", str(value)]
    return arguments


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def accuracy_phase(
    cfg: tasks.TaskConfig,
    data: Path,
    mode_names: Sequence[str],
    directory: Path,
    *,
    steps: int,
    eval_every: int,
    seed: int,
    timeout: float,
) -> None:
    """Each mode's trajectory on loopback, unshaped; a mode whose trajectory exists is not run again."""
    for mode in mode_names:
        out = directory / "accuracy" / f"{mode}.jsonl"
        if out.is_file():
            print(f"[{cfg.name}] {mode}: trajectory exists ({out})", flush=True)
            continue
        print(f"[{cfg.name}] {mode}: training on loopback", flush=True)
        arguments = worker_arguments(cfg, data, mode, out, steps=steps, eval_every=eval_every, seed=seed)
        run_worker(
            arguments,
            nodes=loopback_nodes(),
            master_addr=MASTER,
            logs=directory / "logs" / "accuracy" / mode,
            timeout=timeout,
        )
        last = read_records(out)[-2]
        print(f"[{cfg.name}] {mode}: {cfg.metric} {last['metric']:.2f} after {last['train_s']:.0f} s", flush=True)


def kind_medians(end: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per kind of a timing run's ``end`` record: the median step (s) and the median bytes sent per
    step, leaving out the run's first ``offset`` steps and the first step of every stretch of a kind."""
    times: dict[str, list[float]] = defaultdict(list)
    sent: dict[str, list[float]] = defaultdict(list)
    kinds, step_s, cumulative = end["step_kinds"], end["step_s"], end["step_tcp_bytes"]
    for i in range(end["offset"], len(kinds)):
        stretch = (i > 0 and kinds[i - 1] == kinds[i]) or (i + 1 < len(kinds) and kinds[i + 1] == kinds[i])
        if stretch and (i == 0 or kinds[i - 1] != kinds[i]):
            continue  # the first step of a new stretch settles (allocations at a new density)
        times[kinds[i]].append(step_s[i])
        sent[kinds[i]].append(cumulative[i] - (cumulative[i - 1] if i else 0))
    return {k: {"step_s": statistics.median(times[k]), "tcp_bytes": statistics.median(sent[k])} for k in times}


def time_modes(
    cfg: tasks.TaskConfig,
    data: Path,
    mode_names: Sequence[str],
    directory: Path,
    link: str,
    *,
    nodes: Sequence[Node],
    master_addr: str,
    repeats: int,
    kind_steps: int,
    seed: int,
    timeout: float,
) -> dict[str, Any]:
    """Timing runs of every mode (and ``noop``) on one link, ``repeats`` interleaved rounds in a
    rotated order; per mode and kind the median over repeats of each repeat's median."""
    timed = [modes.FLOOR, *(m for m in mode_names if m != modes.FLOOR)]
    runs: dict[str, list[dict[str, dict[str, float]]]] = defaultdict(list)
    for repeat in range(repeats):
        shift = repeat % len(timed)
        for mode in timed[shift:] + timed[:shift]:
            out = directory / "steptime" / link / mode / f"r{repeat}.jsonl"
            steps = modes.timing_steps(mode, kind_steps, modes.TIMING_OFFSET)
            arguments = worker_arguments(cfg, data, mode, out, steps=steps, timing=kind_steps, seed=seed)
            run_worker(arguments, nodes=nodes, master_addr=master_addr, logs=out.with_suffix(""), timeout=timeout)
            runs[mode].append(kind_medians(read_records(out)[-1]))
            shown = ", ".join(f"{k} {v['step_s'] * 1e3:.1f} ms" for k, v in runs[mode][-1].items())
            print(f"  {link:9s} {mode:15s} r{repeat} {shown}", flush=True)
    result = {}
    for mode, measured in runs.items():
        kinds = {k for run in measured for k in run}
        result[mode] = {
            k: {
                field: statistics.median(run[k][field] for run in measured if k in run)
                for field in ("step_s", "tcp_bytes")
            }
            for k in sorted(kinds)
        }
    return {"modes": result, "runs": runs}


def loopback_rate(seconds: float) -> float:
    """Goodput of one TCP stream over loopback between the two pinned cores (netbench's socket test)."""
    module = [sys.executable, "-m", "benchmarks.netbench.sockettest"]
    nodes, port = loopback_nodes(), free_port(MASTER)
    server = subprocess.Popen(
        [*nodes[1].prefix, *module, "server", MASTER, str(port)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert server.stdout is not None
        server.stdout.readline()
        subprocess.run(
            [*nodes[0].prefix, *module, "client", MASTER, str(port), str(seconds)],
            check=True,
            cwd=REPO,
            timeout=seconds + 60,
        )
        return float(server.stdout.readline())
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()


def steptime_phase(
    cfg: tasks.TaskConfig, data: Path, mode_names: Sequence[str], directory: Path, links: Sequence[str], **options: Any
) -> None:
    """``steptime-<link>.json`` for every link: loopback (unshaped, no root) or a tbf rate, with
    the socket-test rate; shaped links also record the unshaped veth's rate (``host_bps``: what one
    core pushes through TCP, the performance model's host-bound transport)."""
    host_bps = None
    if any(link != LOOPBACK for link in links):
        from benchmarks.netbench.netns import TwoNodeLink

        with TwoNodeLink(None) as unshaped:
            host_bps = unshaped.measured_bps
        print(f"unshaped veth: socket test {host_bps / 1e9:.3f} Gbit/s", flush=True)
    for link in links:
        if link == LOOPBACK:
            rate = loopback_rate(0.5 if cfg.smoke else 2.0)
            print(f"link {link}: socket test {rate / 1e9:.3f} Gbit/s", flush=True)
            timed = time_modes(
                cfg, data, mode_names, directory, link, nodes=loopback_nodes(), master_addr=MASTER, **options
            )
        else:
            from benchmarks.netbench.netns import TwoNodeLink

            with TwoNodeLink(link) as shaped:
                rate = shaped.measured_bps
                print(f"link {link}: socket test {rate / 1e9:.3f} Gbit/s", flush=True)
                timed = time_modes(
                    cfg,
                    data,
                    mode_names,
                    directory,
                    link,
                    nodes=shaped.nodes,
                    master_addr=shaped.master_addr,
                    **options,
                )
        record = {"link": link, "socket_bps": rate, "host_bps": host_bps, "repeats": options["repeats"], **timed}
        (directory / f"steptime-{link}.json").write_text(json.dumps(record, indent=1))


def end_to_end(
    cfg: tasks.TaskConfig,
    data: Path,
    checks: Sequence[tuple[str, str]],
    directory: Path,
    *,
    steps: int,
    eval_every: int,
    seed: int,
    timeout: float,
) -> None:
    """Whole training runs of ``(mode, link)`` on the shaped link: what composition is checked against."""
    from benchmarks.netbench.netns import TwoNodeLink

    for mode, link in checks:
        out = directory / "e2e" / f"{mode}@{link}.jsonl"
        if out.is_file():
            continue
        with TwoNodeLink(link) as shaped:
            print(
                f"[{cfg.name}] {mode}@{link}: end to end (socket test {shaped.measured_bps / 1e9:.3f} Gbit/s)",
                flush=True,
            )
            arguments = worker_arguments(cfg, data, mode, out, steps=steps, eval_every=eval_every, seed=seed)
            run_worker(
                arguments,
                nodes=shaped.nodes,
                master_addr=shaped.master_addr,
                logs=directory / "logs" / "e2e" / f"{mode}@{link}",
                timeout=timeout,
            )
