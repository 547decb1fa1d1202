"""Aggregate benchmark records into rows, a markdown table and a bar chart.

Per (rate, model, mode), over every repeat: the median of the repeats' median step times (each
over the timed steps), the min/max single step over all repeats, global samples/s at the median,
and ratios to the two references of the same rate and model: ``of floor`` = ``noop`` step /
step (DDP exchanging nothing), ``of ideal`` = ``ideal`` step / step (one process per node, no
DDP at all). Throughput ratios, so 1.0 means as fast as the reference. ``hook ms``: host time
our comm hook spent compensating, encoding and decoding per step (``gc/compress_s``); ``wait
ms``: host time it spent blocked on collectives (``gc/wait_s``: earlier rounds, merges, a node's
reduction, a delayed exchange; not DDP's own wait after backward).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.netbench.modes import IDEAL

FLOOR = "noop"


@dataclass(frozen=True)
class Row:
    """One mode's aggregate at one rate on one model; ``predicted_s`` is None where not modelled."""

    rate: str
    model: str
    mode: str
    repeats: int
    median_s: float
    min_s: float
    max_s: float
    samples_per_s: float
    of_floor: float | None
    of_ideal: float | None
    tx_bytes: float
    payload_bytes: float | None
    hook_s: float | None
    predicted_s: float | None
    wait_s: float | None = None

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured."""
        return None if self.predicted_s is None else (self.predicted_s - self.median_s) / self.median_s


def summarize(records: Sequence[dict[str, Any]], predicted: dict[tuple[str, str, str], float]) -> list[Row]:
    """Rows in first-seen order of (rate, model, mode); ``predicted`` maps that key to seconds."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        groups[(record["rate"], record["model"], record["mode"])].append(record)
    medians = {key: statistics.median(r["median_s"] for r in group) for key, group in groups.items()}
    rows = []
    for (rate, model, mode), group in groups.items():
        median = medians[(rate, model, mode)]
        floor = medians.get((rate, model, FLOOR))
        ideal = medians.get((rate, model, IDEAL))
        steps = [s for r in group for s in r["step_s"]]
        payloads = [r["payload_bytes_per_step"] for r in group if r["payload_bytes_per_step"] is not None]
        hooks = [r["hook_s_per_step"] for r in group if r.get("hook_s_per_step") is not None]
        waits = [r["wait_s_per_step"] for r in group if r.get("wait_s_per_step") is not None]
        rows.append(
            Row(
                rate=rate,
                model=model,
                mode=mode,
                repeats=len(group),
                median_s=median,
                min_s=min(steps),
                max_s=max(steps),
                samples_per_s=group[0]["batch_size"] * group[0]["nodes_total"] / median,
                of_floor=None if floor is None else floor / median,
                of_ideal=None if ideal is None else ideal / median,
                tx_bytes=statistics.median(r["tx_bytes_per_step"] for r in group),
                payload_bytes=statistics.median(payloads) if payloads else None,
                hook_s=statistics.median(hooks) if hooks else None,
                predicted_s=predicted.get((rate, model, mode)),
                wait_s=statistics.median(waits) if waits else None,
            )
        )
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown(rows: Sequence[Row]) -> str:
    lines = [
        "| link | model | mode | step ms (median) | min–max ms | samples/s | of floor | of ideal "
        "| MB/step on wire | MB/step payload | hook ms | wait ms | predicted ms | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        error = r.prediction_error
        lines.append(
            f"| {r.rate} | {r.model} | {r.mode} | {r.median_s * 1e3:.0f} | {r.min_s * 1e3:.0f}–{r.max_s * 1e3:.0f} "
            f"| {r.samples_per_s:.0f} | {_fmt(r.of_floor, '.2f')} | {_fmt(r.of_ideal, '.2f')} "
            f"| {r.tx_bytes / 1e6:.3f} | {_fmt(None if r.payload_bytes is None else r.payload_bytes / 1e6, '.3f')} "
            f"| {_fmt(None if r.hook_s is None else r.hook_s * 1e3, '.0f')} "
            f"| {_fmt(None if r.wait_s is None else r.wait_s * 1e3, '.0f')} "
            f"| {_fmt(None if r.predicted_s is None else r.predicted_s * 1e3, '.0f')} "
            f"| {_fmt(None if error is None else error * 100, '+.0f')}{'' if error is None else ' %'} |"
        )
    return "\n".join(lines)


def chart(rows: Sequence[Row], path: Path) -> None:
    """One panel per (link, model): throughput as a fraction of the floor, predictions as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r.rate, r.model) for r in rows))
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for ax, (rate, model) in zip(axes[:, 0], panels):
        panel = [r for r in rows if (r.rate, r.model) == (rate, model) and r.of_floor is not None]
        x = range(len(panel))
        ax.bar(x, [r.of_floor for r in panel], color="tab:blue", label="measured")
        predicted = [(i, r.median_s * r.of_floor / r.predicted_s) for i, r in enumerate(panel) if r.predicted_s]
        if predicted:
            ax.plot(*zip(*predicted), "k_", markersize=18, mew=2, label="predicted")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(x), [r.mode for r in panel], rotation=30, ha="right")
        ax.set_ylabel("throughput / no-op floor")
        ax.set_title(f"{model} on two emulated nodes, link {rate}")
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
