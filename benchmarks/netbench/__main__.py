"""Run the two-node bandwidth-limited benchmark (root on Linux). See benchmarks/netbench/__init__.py.

    sudo python -m benchmarks.netbench --rates 1gbit 100mbit unshaped --models resnet18 mlp29m \
        --modes all --repeats 3 --steps 10 --warmup 3 --record

Per rate: the namespaces and shaped veth are created, measured with a socket test, used, and
deleted (also on failure or SIGTERM). Per model: encode/decode costs are calibrated once, on both
pinned cores at the same time (the memory-bus load of training). Then ``repeats`` rounds, each
running every mode once, in a rotated order so that no mode always runs first; records stream
to ``<out>/records.jsonl``. The table (with the performance model's predictions from the
measured ``noop`` step and link rate) is printed, written to ``<out>/table.md`` and, with
``--record``, appended to benchmarks/RESULTS.md; the bar chart goes to ``<out>/netbench.png``
(with ``--record`` also to benchmarks/netbench-<UTC time>.png).
``--records DIR/records.jsonl`` re-reports earlier measurements with a fresh calibration (no
root, nothing run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.netbench import report
from benchmarks.netbench.launch import REPO, run_mode
from benchmarks.netbench.modes import all_modes
from benchmarks.netbench.netns import TwoNodeLink
from benchmarks.netbench.predict import predict_modes
from lightning_gc.perfmodel import CodecCost

RESULTS = REPO / "benchmarks" / "RESULTS.md"
UNSHAPED = "unshaped"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["1gbit", "100mbit", UNSHAPED], help="tbf rates or 'unshaped'")
    parser.add_argument("--models", nargs="+", default=["resnet18", "mlp29m"])
    parser.add_argument("--modes", nargs="+", default=["all"], help=f"'all' or some of {all_modes()}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (torch PowerSGD needs >= 2)")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument(
        "--devices-per-node",
        type=int,
        default=1,
        help="processes per emulated node, sharing its core (no predictions then: the model is of 1 per node)",
    )
    parser.add_argument(
        "--cores-per-node",
        type=int,
        default=1,
        help="cores each emulated node is pinned to (compute keeps one torch thread; the rest serve gloo's transport)",
    )
    parser.add_argument("--overlap", type=float, default=0.5, help="perf model: fraction of compute hiding comm")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / time.strftime("netbench-%Y%m%d-%H%M%S"))
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--records", type=Path, default=None, help="re-report a records.jsonl (no run, no root)")
    args = parser.parse_args(argv)
    modes = all_modes() if args.modes == ["all"] else args.modes
    unknown = sorted(set(modes) - set(all_modes()))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; modes are {all_modes()}")
    if args.repeats < 1 or args.steps < 2 or args.warmup < 2:
        parser.error(
            f"need --repeats >= 1, --steps >= 2, --warmup >= 2; got {args.repeats}, {args.steps}, {args.warmup}"
        )
    cores = os.cpu_count() or 1
    if args.cores_per_node < 1 or 2 * args.cores_per_node > cores:
        parser.error(
            f"--cores-per-node must be between 1 and {cores // 2} (2 nodes on {cores} CPUs); got {args.cores_per_node}"
        )
    args.modes = modes
    return args


def node_cores(node: int, cores_per_node: int) -> str:
    """The ``taskset`` CPU list of emulated node ``node``: its own block of ``cores_per_node`` cores.

    >>> node_cores(0, 1), node_cores(1, 1), node_cores(1, 4)
    ('0', '1', '4-7')
    """
    first = node * cores_per_node
    return str(first) if cores_per_node == 1 else f"{first}-{first + cores_per_node - 1}"


def calibrate(model: str, modes: list[str], out: Path, cores_per_node: int = 1, nodes: int = 2) -> dict[str, CodecCost]:
    """Encode/decode costs of ``modes`` on ``model``, timed under the load training puts on the box.

    One timing process per emulated node runs at the same time, each pinned to its node's cores
    with one thread, as the training processes are: codecs are memory-bound, and two processes
    sharing the memory bus run them up to twice as slowly as one on an idle box. A step waits
    for the slower rank, so each cost is the larger of the processes' medians.
    """
    paths = [out / f"costs-{model}-node{node}.json" for node in range(nodes)]
    processes = []
    for node, path in enumerate(paths):
        cores = node_cores(node, cores_per_node)
        command = ["taskset", "-c", cores, sys.executable, "-m", "benchmarks.netbench.predict", "--model", model]
        command += ["--modes", *modes, "--out", str(path)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        processes.append(subprocess.Popen(command, cwd=REPO, env=env))
    if any(process.wait() != 0 for process in processes):
        raise RuntimeError(f"calibrating {model} failed (see the output above)")
    measured = [json.loads(path.read_text()) for path in paths]
    costs = {}
    for mode, first in measured[0].items():
        slowest = {key: max(m[mode][key] for m in measured) for key in ("encode_s", "decode_s")}
        costs[mode] = CodecCost(**{**first, **slowest})
    return costs


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run every (rate, repeat, model, mode) and return the records (also streamed to records.jsonl)."""
    records: list[dict[str, Any]] = []
    with (args.out / "records.jsonl").open("a") as stream:
        for rate in args.rates:
            cores = (node_cores(0, args.cores_per_node), node_cores(1, args.cores_per_node))
            with TwoNodeLink(None if rate == UNSHAPED else rate, cores=cores) as link:
                print(f"link {rate}: socket test {link.measured_bps / 1e9:.3f} Gbit/s", flush=True)
                for repeat in range(args.repeats):
                    for model in args.models:
                        shift = repeat % len(args.modes)
                        for mode in args.modes[shift:] + args.modes[:shift]:
                            record = run_mode(
                                mode, model, nodes=link.nodes, master_addr=link.master_addr,
                                out=args.out / rate / model / mode / f"r{repeat}",
                                steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
                                devices_per_node=args.devices_per_node,
                            )  # fmt: skip
                            record.update(
                                rate=rate, repeat=repeat, link_bps=link.measured_bps, nodes_total=2,
                                devices_per_node=args.devices_per_node, cores_per_node=args.cores_per_node,
                            )  # fmt: skip
                            records.append(record)
                            stream.write(json.dumps(record) + "\n")
                            stream.flush()
                            print(f"  {model:9s} {mode:16s} r{repeat} {record['median_s'] * 1e3:8.1f} ms", flush=True)
    return records


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.records is not None:  # re-report measured records with a fresh calibration
        records = [json.loads(line) for line in args.records.read_text().splitlines() if line.strip()]
        args.rates = list(dict.fromkeys(r["rate"] for r in records))
        args.models = list(dict.fromkeys(r["model"] for r in records))
        args.modes = list(dict.fromkeys(r["mode"] for r in records))
    elif os.geteuid() != 0:
        sys.exit("netbench needs root (network namespaces, tc); run it as root")
    modelled = args.devices_per_node == 1  # the predictions are of one process per node
    costs = (
        {model: calibrate(model, args.modes, args.out, args.cores_per_node) for model in args.models}
        if modelled
        else {}
    )
    if args.records is None:
        records = measure(args)
    link_bps = {r["rate"]: r["link_bps"] for r in records}
    # With one core per node (the default) that core runs both training and the transport: what it
    # pushes through TCP (the unshaped link's socket test) is the host-bound part of every exchange.
    host_bps = link_bps.get(UNSHAPED)
    predicted = {}
    devices_per_node = max(r.get("devices_per_node", 1) for r in records)
    cores_per_node = max(r.get("cores_per_node", 1) for r in records)
    for rate in args.rates if devices_per_node == 1 else ():
        for model in args.models:
            floor = [r["median_s"] for r in records if (r["rate"], r["model"], r["mode"]) == (rate, model, "noop")]
            if not floor:
                continue
            numel = next(r["gradient_numel"] for r in records if r["model"] == model)
            modelled = predict_modes(
                costs[model], numel, statistics.median(floor), link_bps[rate], overlap=args.overlap, host_bps=host_bps
            )
            predicted.update({(rate, model, mode): p.step_s for mode, p in modelled.items()})
    rows = report.summarize(records, predicted)
    rates = ", ".join(f"{rate} (socket test {bps / 1e9:.3f} Gbit/s)" for rate, bps in link_bps.items())
    steps = len(records[0]["step_s"])
    repeats = max(r["repeat"] for r in records) + 1
    command = "python -m benchmarks.netbench " + shlex.join(sys.argv[1:] if argv is None else argv)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = (
        f"\n### `{command}` — {platform.node()}, {os.cpu_count()} CPUs, {stamp}\n\n"
        f"Two emulated nodes (netns + veth + tbf), {cores_per_node} pinned core(s) and one torch thread each, gloo; "
        + ("" if devices_per_node == 1 else f"{devices_per_node} processes per node sharing its cores; ")
        + f"batch {records[0]['batch_size']} per process; {steps} timed steps after warm-up, "
        f"{repeats} interleaved repeat(s). Links: {rates}. "
        + (
            "No predictions: the model is of one process per node.\n\n"
            if devices_per_node > 1
            else "Predictions: `lightning_gc.perfmodel` from the "
            f"measured `noop` step, the socket-test rate, codec costs calibrated on both cores at once, "
            f"overlap {args.overlap}"
            + ("" if host_bps is None else f", host-bound transport at the unshaped rate {host_bps / 1e9:.3f} Gbit/s")
            + ".\n\n"
        )
    )
    table = header + report.markdown(rows) + "\n"
    print(table)
    (args.out / "table.md").write_text(table)
    report.chart(rows, args.out / "netbench.png")
    print(f"chart: {args.out / 'netbench.png'}")
    if args.record:
        chart = RESULTS.parent / f"netbench-{time.strftime('%Y%m%d-%H%M', time.gmtime())}.png"
        shutil.copyfile(args.out / "netbench.png", chart)
        with RESULTS.open("a") as f:
            f.write(table + f"\nChart: [`{chart.name}`]({chart.name}).\n")


if __name__ == "__main__":
    main()
