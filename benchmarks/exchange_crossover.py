"""Simulation, not a measurement: predicted exchange time per step of all-gather vs two-phase.

Pure :mod:`lightning_gc.perfmodel` (alpha-beta model, nothing is run or timed): a ResNet-50-size
gradient (25.6e6 fp32 parameters, M = 102.4 MB) exchanged once per step (one round) by dense ring
all-reduce, onebit and 4-bit qsgd all-gathered, and onebit and qsgd two-phase (all-to-all,
decode + average + re-encode, all-gather of the chunk averages). Compression ratios are the
compressors' own wire bytes for this gradient (onebit ~32x, qsgd ~7.9x). Times are ``T_comm``
alone: no encode/decode, no overlap with backward. The crossover is the smallest world size
where the all-gather is slower than dense ring all-reduce (its bytes alone: ``p > 2r``).

    python benchmarks/exchange_crossover.py [--png PATH]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from lightning_gc.compressors import create
from lightning_gc.perfmodel import (
    Network,
    allgather_s,
    calibration,
    gather_loses_to_dense_at,
    ring_allreduce_s,
    two_phase_s,
)

NUMEL = 25_600_000
DENSE_BYTES = NUMEL * 4
WORLD_SIZES = (2, 8, 32, 64, 128, 512)
GBITS = (10, 25, 100)
LATENCY_S = 50e-6
MAX_WORLD = 1 << 16


def payload_bytes() -> dict[str, int]:
    """Encoded bytes per rank of the whole gradient, as onebit and qsgd (4-bit codes) send them."""
    layout = calibration.layout_of_shapes(calibration.representative_shapes(NUMEL))
    return {name: create(name).wire_bytes(layout, 4) for name in ("onebit", "qsgd")}


def schemes(payloads: dict[str, int]) -> dict[str, Callable[[Network], float]]:
    """Scheme name -> predicted exchange seconds per step on a network."""
    rows: dict[str, Callable[[Network], float]] = {"dense ring": lambda net: ring_allreduce_s(DENSE_BYTES, net)}
    for name, m in payloads.items():
        rows[f"{name} gather"] = lambda net, m=m: allgather_s(m, net)
        rows[f"{name} two-phase"] = lambda net, m=m: two_phase_s(m, net)
    return rows


def time_crossover(m: int, gbit: float) -> int:
    """Smallest world size whose all-gather of ``m`` bytes is slower than dense ring all-reduce."""
    for p in range(2, MAX_WORLD):
        net = Network.from_bits(p, gbit * 1e9, LATENCY_S)
        if allgather_s(m, net) > ring_allreduce_s(DENSE_BYTES, net):
            return p
    return MAX_WORLD


def table(gbit: float, payloads: dict[str, int]) -> str:
    """Markdown: exchange milliseconds per step by world size, then the crossovers."""
    rows = schemes(payloads)
    lines = [f"### {gbit:g} Gbit/s, latency {LATENCY_S * 1e6:g} us (simulated, ms per step)", ""]
    lines += ["| N | " + " | ".join(rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for p in WORLD_SIZES:
        net = Network.from_bits(p, gbit * 1e9, LATENCY_S)
        lines.append(f"| {p} | " + " | ".join(f"{t(net) * 1e3:.1f}" for t in rows.values()) + " |")
    lines.append("")
    for name, m in payloads.items():
        ratio = DENSE_BYTES / m
        p = time_crossover(m, gbit)
        net = Network.from_bits(p, gbit * 1e9, LATENCY_S)
        dense, phased = ring_allreduce_s(DENSE_BYTES, net), two_phase_s(m, net)
        verdict = "still wins" if phased < dense else "loses too"
        lines.append(
            f"- {name} (r = {ratio:.1f}): gather sends more bytes than dense from N = "
            f"{gather_loses_to_dense_at(ratio)}, is slower from N = {p}; there two-phase {verdict} "
            f"({phased * 1e3:.1f} ms vs dense {dense * 1e3:.1f} ms)"
        )
    return "\n".join(lines)


def plot(path: str, payloads: dict[str, int]) -> None:
    """Exchange time against world size, one panel per bandwidth, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [2**k for k in range(1, 10)]
    figure, axes = plt.subplots(1, len(GBITS), figsize=(5 * len(GBITS), 4), sharey=True)
    for ax, gbit in zip(axes, GBITS):
        for name, t in schemes(payloads).items():
            millis = [t(Network.from_bits(p, gbit * 1e9, LATENCY_S)) * 1e3 for p in sizes]
            ax.plot(sizes, millis, marker=".", label=name)
        ax.set(xscale="log", yscale="log", xlabel="world size N", title=f"{gbit:g} Gbit/s (model)")
    axes[0].set_ylabel("exchange ms per step")
    axes[0].legend(loc="upper left", fontsize="small")
    figure.suptitle("ResNet-50 gradient (102.4 MB): simulated exchange time")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--png", default=None, help="also write a plot here")
    args = parser.parse_args()
    payloads = payload_bytes()
    print("\n\n".join(table(gbit, payloads) for gbit in GBITS))
    if args.png:
        plot(args.png, payloads)


if __name__ == "__main__":
    main()
