"""Hierarchical exchange on multi-device nodes, and ECMP vs spraying: simulation, not a measurement.

Prints Markdown: (a) predicted exchange time per step of ResNet-50's gradient (M = 102.4 MB) for
8 devices per node, :mod:`lightning_gc.perfmodel.hierarchy`; (b) the leaf-spine load of the
hierarchical gather's inter-node ring step, :mod:`lightning_gc.perfmodel.leafspine`.
``python benchmarks/hierarchy_model.py [--png PATH]``.
"""

from __future__ import annotations

import argparse

from lightning_gc.perfmodel import leafspine
from lightning_gc.perfmodel.hierarchy import Cluster, all_schemes, dense_hierarchical, flat_gather_loses_at

M = 102.4e6
"""ResNet-50 gradient bytes (25.6 M fp32)."""
WIRE_RATIO = 500.0
"""DGC at 0.1 % density, fp32 value + int32 index: 8 bytes per kept element of 4000."""
POWERSGD_BYTES = M / 100
"""PowerSGD rank 4: compressed size passed as a number."""
PER_NODE = 8
NODES = (2, 8, 32, 128, 512)
INTER_GBIT = (10, 25, 100)
INTRA_BW, INTRA_LAT, INTER_LAT = 200e9, 2e-6, 10e-6


def cluster(nodes: int, gbit: float) -> Cluster:
    return Cluster(nodes, PER_NODE, INTRA_BW, INTRA_LAT, gbit * 1e9 / 8, INTER_LAT)


def exchange_table() -> list[str]:
    names = [s.name for s in all_schemes(M, WIRE_RATIO, POWERSGD_BYTES, cluster(2, 10))]
    lines = [
        "| inter | nodes | N | " + " | ".join(f"{n} ms" for n in names) + " |",
        "|---" * (3 + len(names)) + "|",
    ]
    for gbit in INTER_GBIT:
        for nodes in NODES:
            times = all_schemes(M, WIRE_RATIO, POWERSGD_BYTES, cluster(nodes, gbit))
            cells = " | ".join(f"{t.seconds * 1e3:.2f}" for t in times)
            lines.append(f"| {gbit} Gbit/s | {nodes} | {nodes * PER_NODE} | {cells} |")
    lines.append("")
    for gbit in INTER_GBIT:
        ring = flat_gather_loses_at(M, WIRE_RATIO, cluster(1, gbit))
        hier = flat_gather_loses_at(M, WIRE_RATIO, cluster(1, gbit), dense=dense_hierarchical)
        lines.append(
            f"- {gbit} Gbit/s: flat DGC gather slower than dense ring from {ring} nodes (N = {ring * PER_NODE}),"
            f" than dense hierarchical from {hier} nodes (N = {hier * PER_NODE})."
        )
    return lines


def fabric_table(rows: list[leafspine.ComparisonRow]) -> list[str]:
    keys = list(rows[0].relative)
    lines = [
        "| nodes | " + " | ".join(f"{k} max/ideal" for k in keys) + " | " + " | ".join(f"{k} µs" for k in keys) + " |",
        "|---" * (1 + 2 * len(keys)) + "|",
    ]
    for row in rows:
        rel = " | ".join(f"{row.relative[k]:.2f}" for k in keys)
        sec = " | ".join(f"{row.completion_s[k] * 1e6:.1f}" for k in keys)
        lines.append(f"| {row.nodes} | {rel} | {sec} |")
    return lines


def plot(rows: list[leafspine.ComparisonRow], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in [s.name for s in all_schemes(M, WIRE_RATIO, POWERSGD_BYTES, cluster(2, 10))]:
        ys = [
            next(t for t in all_schemes(M, WIRE_RATIO, POWERSGD_BYTES, cluster(n, 10)) if t.name == name).seconds * 1e3
            for n in NODES
        ]
        left.plot([n * PER_NODE for n in NODES], ys, marker="o", label=name)
    left.set(
        xscale="log",
        yscale="log",
        xlabel="ranks N (8 per node)",
        ylabel="exchange ms / step",
        title="10 Gbit/s inter-node (model)",
    )
    left.legend(fontsize=7)
    for key in rows[0].relative:
        right.plot([r.nodes for r in rows], [r.relative[key] for r in rows], marker="o", label=key)
    right.set(xscale="log", xlabel="nodes", ylabel="busiest spine link / ideal", title="leaf-spine (simulation)")
    right.legend(fontsize=7)
    fig.suptitle("simulation, not a measurement")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--png", help="write a plot (matplotlib Agg) to this path")
    args = parser.parse_args()
    rows = leafspine.compare(pair_bytes=M / WIRE_RATIO)
    print("# Hierarchical exchange model — simulation, not a measurement\n")
    print(
        f"M = {M / 1e6:.1f} MB, {PER_NODE} devices/node, intra {INTRA_BW / 1e9:.0f} GB/s {INTRA_LAT * 1e6:.0f} µs,"
        f" inter latency {INTER_LAT * 1e6:.0f} µs, DGC wire ratio {WIRE_RATIO:.0f},"
        f" PowerSGD {POWERSGD_BYTES / 1e6:.2f} MB\n"
    )
    print("\n".join(exchange_table()))
    print(
        "\n## Leaf-spine, hierarchical gather ring step (8 hosts/leaf, 8 spines, 100 Gbit/s links, every"
        " neighbour on the next leaf; ecmp = one flow per node pair, L=m = m shard flows, seed 0)\n"
    )
    print("\n".join(fabric_table(rows)))
    if args.png:
        plot(rows, args.png)
        print(f"\nplot: {args.png}")


if __name__ == "__main__":
    main()
