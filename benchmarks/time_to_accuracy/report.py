"""The task's report: one table per link, the metric-against-wall-clock chart, the model's predictions.

Predictions: ``benchmarks.netbench.predict`` -- each mode's bytes and codec cost (ours calibrated
on this task's real gradients, torch's hooks timed), its per-step prediction on two nodes joined
by the link's socket-test rate from the ``noop`` step measured on that link (and, on shaped links,
the unshaped veth's rate as the host-bound transport) -- times the measured steps-to-target. The
model predicts the steady state only (DGC's warm-up stages are predicted at 0.1 %); modes it has
no prediction for (post-local SGD, the outer loop) show "–".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.time_to_accuracy import compose, modes, tasks
from benchmarks.time_to_accuracy.compose import Row, Trajectory

CHECK_WITHIN = 0.10  # the bound on the composition's error end to end


def predicted_steps(
    cfg: tasks.TaskConfig, data: Path, mode_names: list[str], steptimes: dict[str, dict[str, Any]], cache: Path | None
) -> dict[str, dict[str, float]]:
    """Per link, the performance model's steady step (s) of every mode it models."""
    from benchmarks.netbench.predict import mode_cost, predict_modes

    named = {modes.NETBENCH_NAMES[m]: m for m in mode_names if m in modes.NETBENCH_NAMES and m != modes.FLOOR}
    if not named or not steptimes:
        return {}
    torch.manual_seed(0)
    task_data = tasks.TaskData(cfg, data, seed=0)
    model = tasks.build_model(cfg, task_data.vocab)
    params = [p for p in model.parameters() if p.requires_grad]
    gradients = []
    for step in range(4):  # real gradients of the task, as calibration wants them
        model.zero_grad()
        tasks.loss(cfg, model(task_data.batch(step, 0)[0]), task_data.batch(step, 0)[1]).backward()
        gradients.append(torch.cat([p.grad.reshape(-1) for p in params]))
    shapes = [tuple(p.shape) for p in params]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers time them
    try:
        costs = {name: mode_cost(name, shapes, tasks.WORLD, cache, gradients) for name in named}
    finally:
        torch.set_num_threads(threads)
    out = {}
    for link, record in steptimes.items():
        floor = record["modes"].get(modes.FLOOR, {})
        if "step" not in floor:
            continue
        numel = sum(p.numel() for p in params)
        host = record.get("host_bps")
        step = predict_modes(costs, numel, floor["step"]["step_s"], record["socket_bps"], host_bps=host)
        out[link] = {named[name]: prediction.step_s for name, prediction in step.items()}
    return out


def chart(title: str, metric: str, higher_is_better: bool, panels: dict[str, list[Row]], path: Path) -> None:
    """One panel per link: each mode's metric against composed training wall-clock (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    for ax, (link, rows) in zip(axes[0], panels.items()):
        for row in rows:
            points = [(t, m) for t, m in row.curve if t > 0]
            if points:
                ax.plot(*zip(*points), marker=".", label=row.mode)
        ax.set_xscale("log")
        if not higher_is_better:
            ax.set_yscale("log")
        ax.set_xlabel("training wall-clock, s (composed; evaluations excluded)")
        ax.set_ylabel(f"held-out {metric}")
        ax.set_title(f"{title}, link {link}", fontsize=10)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build(
    cfg: tasks.TaskConfig,
    data: Path,
    directory: Path,
    mode_names: list[str],
    links: list[str],
    command: str,
    cache: Path | None = None,
) -> str:
    """``table.md`` and ``time_to_accuracy.png`` under ``directory`` from what the phases left there."""
    trajectories = {m: Trajectory.load(directory / "accuracy" / f"{m}.jsonl") for m in mode_names}
    if modes.REFERENCE not in trajectories:
        raise SystemExit(f"composition needs the {modes.REFERENCE!r} trajectory (the targets are its final metric)")
    steptimes = {
        link: json.loads(path.read_text()) for link in links if (path := directory / f"steptime-{link}.json").is_file()
    }
    predicted = predicted_steps(cfg, data, mode_names, steptimes, cache)
    dense = trajectories[modes.REFERENCE]
    goal, goal95 = compose.targets(dense.final, cfg.higher_is_better)
    meta = dense.meta
    sections = [
        f"### `{command}`\n",
        f"Task {cfg.name}{' (smoke)' if cfg.smoke else ''}: {meta['steps']} steps of global batch "
        f"{tasks.WORLD * cfg.batch_size} ({meta['parameters']:,} parameters), evaluated every {meta['eval_every']} "
        f"steps on the held-out split; seed {meta['seed']}, the same data order for every mode. Targets: dense DDP's "
        f"final {cfg.metric} {goal:.2f} and 95 % of it ({goal95:.2f}). Trajectories trained on loopback "
        "(2 processes, gloo, one pinned core and one torch thread each); times are training wall-clock, "
        "evaluations excluded, **composed**: each step of the trajectory at its kind's median step time on the "
        "link (netbench-style timing runs, median of repeats); ratios are to dense on the same link; steps to a "
        "target are those of the first evaluation reaching it. MB/rank: TCP payload rank 0 sent (loopback run).\n",
    ]
    panels = {}
    for link in links:
        if link not in steptimes:
            sections.append(f"Link {link}: no step times (run the steptime phase).\n")
            continue
        record = steptimes[link]
        measured = {}
        if link == "loopback":
            measured = dict(trajectories)  # the trajectories were themselves measured on loopback
        for path in sorted((directory / "e2e").glob(f"*@{link}.jsonl")):
            measured[path.name.split("@")[0]] = Trajectory.load(path)
        rows = compose.compose_link(
            trajectories, record["modes"], cfg.higher_is_better, measured, predicted.get(link), modes.REFERENCE
        )
        panels[link] = rows
        rate = f"socket test {record['socket_bps'] / 1e9:.3f} Gbit/s"
        sections.append(f"#### link {link} ({rate}; {record['repeats']} repeat(s))\n")
        sections.append(compose.markdown(rows, cfg.metric) + "\n")
        notes = []
        for mode, run in measured.items():
            if link == "loopback" and mode not in (modes.REFERENCE, "dgc"):
                continue  # on loopback every trajectory is its own end-to-end run: two notes suffice
            row = next(r for r in rows if r.mode == mode)
            error = row.composition_error
            within = "–" if error is None else ("yes" if abs(error) <= CHECK_WITHIN else "**no**")
            note = (
                f"end to end {mode}@{link}: measured {compose.seconds(row.measured_s)}, composed "
                f"{compose.seconds(row.checked_s)}, "
                f"error {compose.cell(None if error is None else 100 * error, '+.1f', ' %')} (within 10 %: {within})"
            )
            if link != "loopback":
                note += (
                    f"; largest metric difference to the trajectory {compose.determinism(trajectories[mode], run):.3g}"
                )
            notes.append(note)
        sections += [f"- {note}" for note in notes] + ([""] if notes else [])
    title = f"{cfg.name}{' (smoke)' if cfg.smoke else ''}"
    if panels:
        chart(title, cfg.metric, cfg.higher_is_better, panels, directory / "time_to_accuracy.png")
        sections.append("Chart: `time_to_accuracy.png`.\n")
    text = "\n".join(sections)
    (directory / "table.md").write_text(text)
    return text
