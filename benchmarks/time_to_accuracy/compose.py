"""Composition: time-to-target = the trajectory's steps, each at its kind's step time on a link.

A mode's metric-against-step trajectory does not depend on the link (same seed and data order,
deterministic two-rank collectives), so it is trained once (on loopback) and timed per link
separately. For a trajectory whose steps have kinds ``k_1 .. k_s`` (run-length encoded in its
``end`` record) and a link's step times ``t[k]`` (``steptime-<link>.json``), the composed
training wall-clock after ``s`` steps is ``sum_i t[k_i]``; evaluations are not counted.

Targets (``targets``): dense DDP's final metric and 95 % of it (for a lower-is-better metric such
as perplexity, ``final / 0.95``); a mode's steps-to-target are those of its first evaluation at
or past the target (no interpolation between evaluations); ratios are to dense's time on the
same link. Where a run was also measured end to end (``e2e/<mode>@<link>.jsonl``, or the
trajectory itself on loopback) the table gives its measured time and the composition's error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NINETY_FIVE = 0.95


@dataclass
class Trajectory:
    """A training run's records (see :mod:`.worker`)."""

    mode: str
    meta: dict[str, Any]
    evals: list[dict[str, Any]]
    end: dict[str, Any]

    @classmethod
    def load(cls, path: Path) -> Trajectory:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        meta = records[0]
        return cls(meta["mode"], meta, [r for r in records if r["type"] == "eval"], records[-1])

    @property
    def final(self) -> float:
        return float(self.evals[-1]["metric"])

    @property
    def kinds(self) -> list[tuple[str, int]]:
        return [(k, int(n)) for k, n in self.end["kinds"]]


def targets(dense_final: float, higher_is_better: bool) -> tuple[float, float]:
    """(dense's final metric, 95 % of it): 0.95 x for accuracy, / 0.95 for perplexity."""
    return dense_final, dense_final * NINETY_FIVE if higher_is_better else dense_final / NINETY_FIVE


def reached(metric: float, target: float, higher_is_better: bool) -> bool:
    return metric >= target if higher_is_better else metric <= target


def steps_to_target(evals: list[dict[str, Any]], target: float, higher_is_better: bool) -> int | None:
    """Step of the first evaluation at or past ``target``; None if none is."""
    return next((int(e["step"]) for e in evals if reached(e["metric"], target, higher_is_better)), None)


def composed_time(kinds: list[tuple[str, int]], step_s: dict[str, float], steps: int) -> float:
    """Training time of the first ``steps`` steps: each at its kind's step time.

    >>> composed_time([("density=0.25", 2), ("density=0.001", 3)], {"density=0.25": 1.0, "density=0.001": 0.5}, 4)
    3.0
    """
    total, done = 0.0, 0
    for kind, count in kinds:
        take = min(count, steps - done)
        if take <= 0:
            break
        if kind not in step_s:
            raise KeyError(f"no step time for kind {kind!r} (timed: {sorted(step_s)})")
        total, done = total + take * step_s[kind], done + take
    if done < steps:
        raise ValueError(f"the trajectory has {done} steps, fewer than {steps}")
    return total


def ratio(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


@dataclass
class Row:
    """One mode on one link."""

    mode: str
    final: float
    steps: tuple[int | None, int | None]  # to 95 %, to final
    time_s: tuple[float | None, float | None]
    of_dense: tuple[float | None, float | None] = (None, None)
    bytes_to_final: float | None = None
    bytes_run: float = 0.0
    predicted_s: float | None = None  # perf model's step x steps to final
    measured_s: float | None = None  # end to end, at the steps to final (or the whole run)
    curve: list[tuple[float, float]] = field(default_factory=list)  # (composed s, metric) per evaluation

    @property
    def checked_s(self) -> float | None:
        """The composed time an end-to-end run is compared with: to the final target, else the whole run."""
        if self.time_s[1] is not None:
            return self.time_s[1]
        return self.curve[-1][0] if self.curve else None

    @property
    def composition_error(self) -> float | None:
        """(composed - measured) / measured at the same step."""
        composed = self.checked_s
        if self.measured_s is None or composed is None or self.measured_s <= 0:
            return None
        return (composed - self.measured_s) / self.measured_s


def compose_link(
    trajectories: dict[str, Trajectory],
    step_times: dict[str, dict[str, dict[str, float]]],
    higher_is_better: bool,
    measured: dict[str, Trajectory] | None = None,
    predicted_step_s: dict[str, float] | None = None,
    reference: str = "dense",
) -> list[Row]:
    """Rows of one link: ``step_times[mode][kind]["step_s"]``; ``measured``: end-to-end runs on this
    link by mode; ``predicted_step_s``: the performance model's steady step by mode."""
    dense = trajectories[reference]
    goals = targets(dense.final, higher_is_better)
    rows = []
    for mode, run in trajectories.items():
        times = {kind: values["step_s"] for kind, values in step_times.get(mode, {}).items()}
        steps = tuple(steps_to_target(run.evals, goal, higher_is_better) for goal in (goals[1], goals[0]))
        try:
            time_s = tuple(None if s is None else composed_time(run.kinds, times, s) for s in steps)
            curve = [(composed_time(run.kinds, times, e["step"]), e["metric"]) for e in run.evals]
        except KeyError:  # the mode was not timed on this link
            time_s, curve = (None, None), []
        at_final = next((e for e in run.evals if e["step"] == steps[1]), None)
        row = Row(mode, run.final, steps, time_s, bytes_run=float(run.end["tcp_bytes"]), curve=curve)  # type: ignore[arg-type]
        row.bytes_to_final = None if at_final is None else float(at_final["tcp_bytes"])
        if predicted_step_s and mode in predicted_step_s and steps[1] is not None:
            row.predicted_s = predicted_step_s[mode] * steps[1]
        if measured and mode in measured:
            evals = measured[mode].evals
            at = steps[1] if steps[1] is not None else evals[-1]["step"]
            row.measured_s = next((e["train_s"] for e in evals if e["step"] == at), None)
        rows.append(row)
    by_mode = {row.mode: row for row in rows}
    for row in rows:
        row.of_dense = tuple(ratio(row.time_s[i], by_mode[reference].time_s[i]) for i in range(2))  # type: ignore[assignment]
    return rows


def cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else format(value, spec) + suffix


def seconds(value: float | None) -> str:
    """``1234 s``, ``12.3 s``, ``0.0123 s``; ``–`` for None."""
    return "–" if value is None else f"{value:.0f} s" if value >= 100 else f"{value:.3g} s"


def markdown(rows: list[Row], metric: str, composed: bool = True) -> str:
    """The link's table (ratios: time / dense's time; < 1 is faster)."""
    mark = " (composed)" if composed else ""
    lines = [
        f"| mode | final {metric} | steps to 95 % | time to 95 %{mark} | × dense | steps to final "
        f"| time to final{mark} | × dense | measured end to end | composition error | predicted (perf model) "
        "| MB/rank to final | MB/rank run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        error = None if r.composition_error is None else 100 * r.composition_error
        to_final = None if r.bytes_to_final is None else r.bytes_to_final / 1e6
        lines.append(
            f"| {r.mode} | {r.final:.2f} | {cell(r.steps[0], 'd')} | {seconds(r.time_s[0])} "
            f"| {cell(r.of_dense[0], '.2f')} | {cell(r.steps[1], 'd')} | {seconds(r.time_s[1])} "
            f"| {cell(r.of_dense[1], '.2f')} | {seconds(r.measured_s)} | {cell(error, '+.1f', ' %')} "
            f"| {seconds(r.predicted_s)} | {cell(to_final, '.2f')} | {r.bytes_run / 1e6:.2f} |"
        )
    return "\n".join(lines)


def determinism(a: Trajectory, b: Trajectory) -> float:
    """Largest metric difference between two runs of one mode at the same evaluation steps."""
    mine = {e["step"]: e["metric"] for e in a.evals}
    return max((abs(e["metric"] - mine[e["step"]]) for e in b.evals if e["step"] in mine), default=0.0)
