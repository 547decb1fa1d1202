"""``python -m lightning_gc.report <sweep_dir>``: one table and one plot for a sweep's runs.

Reads every ``result.json`` under the directory (see :mod:`lightning_gc.results`), prints a
``rich`` table (run, strategy, compression ratio, final metric, wire compression, step time,
throughput) sorted by ratio with dense runs last, and writes ``report.png`` into the directory:
the metric and the throughput against the compression ratio (log scale), dense runs drawn as
horizontal reference lines.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lightning_gc.results import load_results

Row = tuple[Path, dict[str, Any]]


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _order(row: Row) -> tuple[float, str]:
    ratio = row[1].get("compress_ratio")
    return (float("inf") if ratio is None else ratio, str(row[0]))


def build_table(rows: list[Row], root: Path) -> Table:
    """The report's table, one line per run."""
    metric_names = sorted({r["metric_name"] for _, r in rows})
    table = Table(title=f"{len(rows)} run(s) in {root}")
    for header in ("run", "strategy", "ratio", " / ".join(metric_names), "wire ×", "step (s)", "samples/s"):
        table.add_column(header, justify="left" if header in ("run", "strategy") else "right")
    for path, r in rows:
        ratio = r.get("compress_ratio")
        table.add_row(
            str(path.relative_to(root)) if path != root else ".",
            r.get("compressor") or r["strategy"],
            "dense" if ratio is None else f"{ratio:g}",
            _fmt(r.get("metric"), ".4f"),
            _fmt(r.get("wire_compression"), ".1f"),
            _fmt(r.get("step_time_s"), ".4f"),
            _fmt(r.get("samples_per_s"), ".1f"),
        )
    return table


def plot(rows: list[Row], out: Path) -> Path:
    """Write the metric and throughput against the compression ratio to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compressed = [r for _, r in rows if r.get("compress_ratio") is not None]
    dense = [r for _, r in rows if r.get("compress_ratio") is None]
    metric_name = rows[0][1]["metric_name"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, key, label in ((axes[0], "metric", metric_name), (axes[1], "samples_per_s", "throughput (samples/s)")):
        points = sorted((r["compress_ratio"], r[key]) for r in compressed if r.get(key) is not None)
        if points:
            ax.plot(*zip(*points), marker="o", label="compressed")
        for r in dense:
            if r.get(key) is not None:
                ax.axhline(r[key], linestyle="--", color="gray", label="dense DDP")
        ax.set_xscale("log")
        ax.set_xlabel("compression ratio (fraction of elements sent)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(str(rows[0][1].get("name", "")))
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def report(root: str | Path, console: Console | None = None) -> Path:
    """Print the table of the runs under ``root`` and write ``<root>/report.png``; return its path."""
    root = Path(root)
    rows = sorted(load_results(root), key=_order)
    if not rows:
        raise FileNotFoundError(f"no result.json under {root}: point at a run or sweep directory of train.py")
    console = console or Console()
    console.print(build_table(rows, root))
    png = plot(rows, root / "report.png")
    console.print(f"plot: {png}")
    return png


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_gc.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a train.py multirun (or run) directory")
    args = parser.parse_args(argv)
    try:
        report(args.sweep_dir)
    except FileNotFoundError as err:
        parser.exit(2, f"error: {err}\n")


if __name__ == "__main__":
    main()
