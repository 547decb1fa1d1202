"""Time to accuracy on two emulated nodes: every mode trained to the end, timed per link, composed.

    python -m benchmarks.time_to_accuracy --task cifar10 --modes all --links 1gbit,100mbit,10mbit \\
        --end-to-end dense@100mbit --end-to-end dgc@100mbit          # root: namespaces and tc
    python -m benchmarks.time_to_accuracy --task cifar10 --modes dense,dgc,fp16_hook --smoke --out DIR

Phases (``--phases``, default all of them, each skipping what its files already hold):

1. ``accuracy``: each mode trained to the end on loopback, unshaped (2 processes, gloo, one pinned
   core and one torch thread each), evaluated on the held-out split every ``--eval-every`` steps:
   ``<out>/<task>/accuracy/<mode>.jsonl`` (step, samples, bytes sent per rank, metric, training
   time). Needs no root.
2. ``steptime``: per link, netbench-style timing runs of every mode (and DDP's no-op hook, the
   compute reference) on netbench's namespaces, veth and tbf (root), ``--repeats`` interleaved
   rounds, medians; a mode's schedule is squeezed so each *kind* of step (DGC's warm-up
   densities, post-local SGD's averaging steps, the outer loop's syncs, ...) is timed.
3. ``e2e``: the ``--end-to-end MODE@LINK`` runs: MODE trained to the end on the shaped LINK.
4. ``compose``: ``<out>/<task>/table.md`` (per link: time to dense DDP's final metric and to 95 % of
   it, ratios to dense, final metric, bytes per rank, the performance model's prediction) and
   ``time_to_accuracy.png`` (metric against wall-clock, every mode).

Composition versus end to end: a mode's metric-against-step trajectory does not depend on the link
(same seed, data order, deterministic collectives), so time-to-target is *composed*: the
trajectory's steps, each at its kind's step time measured on the link. Training every mode on
every link end to end would take links x modes full runs; composition takes one run per mode and
a few minutes of timing per link. ``--end-to-end MODE@LINK`` trains MODE on LINK for real and the
table gives the measured time beside the composed one and their difference (the issue asks for
dense and dgc at 100mbit within 10 %); every other figure is composed and the table says so.

``--smoke``: synthetic data and tiny models, a few steps (``--steps``, default 6), loopback only
(no root, no tc), one repeat: the test suite runs it so the benchmark cannot rot.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from benchmarks.netbench.launch import REPO
from benchmarks.time_to_accuracy import modes, phases, report, tasks

DEFAULT_DATA = REPO.parent / "shared" / "data"
PHASES = ("accuracy", "steptime", "e2e", "compose")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=tasks.TASKS, required=True)
    parser.add_argument("--modes", default="all", help=f"comma-separated, or 'all': {','.join(modes.all_modes())}")
    parser.add_argument("--links", default="1gbit,100mbit,10mbit", help="comma-separated tbf rates (or 'loopback')")
    parser.add_argument("--smoke", action="store_true", help="synthetic data, tiny models, a few steps, loopback only")
    parser.add_argument("--out", type=Path, default=None, help="default: runs/time-to-accuracy-<UTC time>")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    parser.add_argument(
        "--end-to-end", action="append", default=[], metavar="MODE@LINK",
        help="also train MODE on the shaped LINK to the end, to check the composition (repeatable)",
    )  # fmt: skip
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared data folder")
    parser.add_argument("--epochs", type=float, default=None, help="cifar10: 16, ptb: 4")
    parser.add_argument("--train-size", type=int, default=None, help="cifar10: training images (20,000)")
    parser.add_argument("--steps", type=int, default=None, help="train this many steps instead (smoke: 6)")
    parser.add_argument("--eval-every", type=int, default=None, help="steps (default: half an epoch; smoke: 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None, help="timing rounds per link (3; smoke: 1)")
    parser.add_argument("--kind-steps", type=int, default=None, help="timed steps per kind (6; smoke: 2)")
    parser.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per process")
    args = parser.parse_args(argv)
    args.modes = modes.all_modes() if args.modes == "all" else [m for m in args.modes.split(",") if m]
    known = modes.all_modes()
    if unknown := [m for m in args.modes if m not in known]:
        parser.error(f"unknown mode(s) {unknown}; modes are {known}")
    if modes.REFERENCE not in args.modes:
        args.modes.insert(0, modes.REFERENCE)  # the targets are dense's final metric
    args.links = [phases.LOOPBACK] if args.smoke else [link for link in args.links.split(",") if link]
    args.phases = [p for p in args.phases.split(",") if p]
    if bad := [p for p in args.phases if p not in PHASES]:
        parser.error(f"unknown phase(s) {bad}; phases are {list(PHASES)}")
    try:
        args.checks = [tuple(item.split("@", 1)) for item in args.end_to_end]
        if any(mode not in args.modes or not link for mode, link in args.checks):
            raise ValueError
    except ValueError:
        parser.error(f"--end-to-end takes MODE@LINK with MODE one of --modes {args.modes}; got {args.end_to_end}")
    if args.smoke and args.checks:
        parser.error("--end-to-end needs shaped links, which --smoke does not use")
    args.steps = args.steps if args.steps is not None else (6 if args.smoke else 0)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    args.kind_steps = args.kind_steps or (2 if args.smoke else 6)
    args.out = args.out or REPO / "runs" / time.strftime("time-to-accuracy-%Y%m%d-%H%M%S", time.gmtime())
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = tasks.config(args.task, smoke=args.smoke, epochs=args.epochs, train_size=args.train_size)
    shaped = [link for link in args.links if link != phases.LOOPBACK]
    needs_root = ("steptime" in args.phases and shaped) or ("e2e" in args.phases and args.checks)
    if needs_root and (missing := phases.missing_for_shaping()):
        sys.exit(f"time_to_accuracy: the shaped phases (links {shaped}) need {', '.join(missing)}; "
                 "run as root, or --smoke / --phases accuracy,compose / --links loopback")  # fmt: skip
    if not args.smoke and not args.data.is_dir():
        sys.exit(
            f"time_to_accuracy: --data {args.data} is not a directory (the {args.task} task needs the shared data)"
        )
    directory = args.out / cfg.name
    directory.mkdir(parents=True, exist_ok=True)
    data = tasks.prepare(cfg, args.data.resolve(), args.out / "cache")
    steps_per_epoch = tasks.TaskData(cfg, data, args.seed).steps_per_epoch
    eval_every = args.eval_every or (2 if args.smoke else max(1, steps_per_epoch // 2))
    training = {"steps": args.steps, "eval_every": eval_every, "seed": args.seed, "timeout": args.timeout}
    if "accuracy" in args.phases:
        phases.accuracy_phase(cfg, data, args.modes, directory, **training)
    if "steptime" in args.phases:
        phases.steptime_phase(
            cfg, data, args.modes, directory, args.links, repeats=args.repeats, kind_steps=args.kind_steps,
            seed=args.seed, timeout=args.timeout,
        )  # fmt: skip
    if "e2e" in args.phases and args.checks:
        phases.end_to_end(cfg, data, args.checks, directory, **training)
    if "compose" in args.phases:
        command = "python -m benchmarks.time_to_accuracy " + shlex.join(sys.argv[1:] if argv is None else argv)
        text = report.build(
            cfg, data, directory, args.modes, args.links, command, cache=args.out / "cache" / "costs.json"
        )
        print(text)
        print(f"table: {directory / 'table.md'}\nchart: {directory / 'time_to_accuracy.png'}")


if __name__ == "__main__":
    main()
