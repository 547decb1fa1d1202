"""``python -m recipes.report <sweep_dir>``: one table and one plot for a sweep's runs.

Reads every ``result.json`` under the directory (see :mod:`recipes.results`), prints a
``rich`` table (run, the overrides that differ between runs, scheme, compression ratio, final
metric, wire compression, step time, throughput) sorted by scheme and ratio with dense runs last,
and writes ``report.png`` into the directory: the metric and the throughput against the
compression ratio (log scale), one line per scheme and set of other overrides; runs without a
ratio (dense DDP, quantisers, PowerSGD) are drawn as horizontal reference lines.

In a Hydra sweep directory (one with ``multirun.yaml``), results older than that file are left
from an earlier sweep into the same directory and are not reported; jobs of this sweep without a
result (failed or still running) are listed under the table.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from recipes.results import RESULT_FILE, load_results, scheme

Row = tuple[Path, dict[str, Any]]
SWEEP_MARKER = "multirun.yaml"
RATIO_OVERRIDE = "strategy.compress_ratio="


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _order(row: Row) -> tuple[bool, str, float, str]:
    ratio = row[1].get("compress_ratio")
    return (row[1].get("compressor") is None, scheme(row[1]), float("inf") if ratio is None else ratio, str(row[0]))


def varying_overrides(rows: Sequence[Row]) -> dict[Path, str]:
    """Per run, its overrides that not every run shares (what the sweep varied), space-joined."""
    sets = [set(r.get("overrides") or []) for _, r in rows]
    common = set.intersection(*sets) if sets else set()
    return {path: " ".join(sorted(s - common)) for (path, _), s in zip(rows, sets)}


def sweep_runs(root: Path) -> tuple[list[Row], list[Path], list[Path]]:
    """(current results, stale result directories, jobs without a result) under ``root``."""
    rows = load_results(root)
    marker = root / SWEEP_MARKER
    if not marker.is_file():
        return rows, [], []
    since = marker.stat().st_mtime
    current = [row for row in rows if (row[0] / RESULT_FILE).stat().st_mtime >= since]
    stale = [path for path, _ in rows if (path / RESULT_FILE).stat().st_mtime < since]
    jobs = [d for d in sorted(root.iterdir()) if (d / ".hydra").is_dir() and (d / ".hydra").stat().st_mtime >= since]
    missing = [d for d in jobs if not (d / RESULT_FILE).is_file()]
    return current, stale, missing


def build_table(rows: list[Row], root: Path) -> Table:
    """The report's table, one line per run."""
    metric_names = sorted({r["metric_name"] for _, r in rows})
    varied = varying_overrides(rows)
    table = Table(title=f"{len(rows)} run(s) in {root}")
    headers = ("run", "overrides", "scheme", "ratio", " / ".join(metric_names), "wire ×", "step (s)", "samples/s")
    for header in headers:
        table.add_column(header, justify="left" if header in ("run", "overrides", "scheme") else "right")
    for path, r in rows:
        ratio = r.get("compress_ratio")
        table.add_row(
            str(path.relative_to(root)) if path != root else ".",
            varied[path],
            scheme(r),
            "—" if ratio is None else f"{ratio:g}",
            _fmt(r.get("metric"), ".4f"),
            _fmt(r.get("wire_compression"), ".1f"),
            _fmt(r.get("step_time_s"), ".4f"),
            _fmt(r.get("samples_per_s"), ".1f"),
        )
    return table


def series(rows: Sequence[Row]) -> dict[str, list[dict[str, Any]]]:
    """Runs with a ratio grouped into lines: one per scheme and set of non-ratio overrides."""
    varied = varying_overrides(rows)
    lines: dict[str, list[dict[str, Any]]] = {}
    for path, r in rows:
        if r.get("compress_ratio") is None:
            continue
        others = " ".join(o for o in varied[path].split() if not o.startswith(RATIO_OVERRIDE))
        lines.setdefault(f"{scheme(r)} {others}".strip(), []).append(r)
    return lines


def references(rows: Sequence[Row]) -> list[tuple[str, dict[str, Any]]]:
    """Runs without a ratio (dense DDP, quantisers, PowerSGD), one per scheme and set of overrides
    other than the ratio (which they do not depend on: a sweep's dense twins are one line), labelled."""
    varied = varying_overrides(rows)
    found: dict[str, dict[str, Any]] = {}
    for path, r in rows:
        if r.get("compress_ratio") is None:
            others = " ".join(o for o in varied[path].split() if not o.startswith(RATIO_OVERRIDE))
            found.setdefault(f"{scheme(r)} {others}".strip(), r)
    return list(found.items())


def plot(rows: list[Row], out: Path) -> Path:
    """Write the metric and throughput against the compression ratio to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = series(rows)
    metric_name = rows[0][1]["metric_name"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, key, label in ((axes[0], "metric", metric_name), (axes[1], "samples_per_s", "throughput (samples/s)")):
        for name, runs in lines.items():
            points = sorted((r["compress_ratio"], r[key]) for r in runs if r.get(key) is not None)
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        for name, r in references(rows):
            if r.get(key) is not None:
                dense = r.get("compressor") is None
                ax.axhline(r[key], linestyle="--", color="gray" if dense else None, label=name)
        if lines:
            ax.set_xscale("log")
        ax.set_xlabel("compression ratio (fraction of elements sent)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(str(rows[0][1].get("name", "")))
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def report(root: str | Path, console: Console | None = None) -> Path:
    """Print the table of the runs under ``root`` and write ``<root>/report.png``; return its path."""
    root = Path(root)
    found, stale, missing = sweep_runs(root)
    rows = sorted(found, key=_order)
    if not rows:
        raise FileNotFoundError(f"no result.json under {root}: point at a run or sweep directory of train.py")
    table = build_table(rows, root)
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped: rich would squeeze the table into 80 columns and cut names
            natural = Console(width=10_000).measure(table).maximum
            console = Console(width=max(console.width, natural))
    console.print(table)
    for path in missing:
        console.print(f"job {path.relative_to(root)}: no result (failed or still running)")
    if stale:
        console.print(f"not reported: {len(stale)} result(s) older than {SWEEP_MARKER}, from an earlier sweep")
    png = plot(rows, root / "report.png")
    console.print(f"plot: {png}")
    return png


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a train.py multirun (or run) directory")
    args = parser.parse_args(argv)
    try:
        report(args.sweep_dir)
    except FileNotFoundError as err:
        parser.exit(2, f"error: {err}\n")


if __name__ == "__main__":
    main()
