"""The outer-loop options of ``python -m lightning_gc.perfmodel``: which presets to predict, and on
what schedule.

    python -m lightning_gc.perfmodel --params 25.6e6 --compute-ms 200 --world-size 8 \\
        --bandwidth 100mbit --outer sparseloco --sync-every 30 [--fragments 3 --sync-delay 2]

The outer loop changes the optimisation (module docstring of :mod:`lightning_gc.perfmodel.outer`),
so the CLI predicts it only when asked: ``--outer`` (every preset of
:data:`~lightning_gc.common.outer_presets.OUTER_PRESETS`, or the ones named) or ``--sync-every``
(every preset, at that ``H``). Each preset keeps its own compressor and compressor arguments
(``levels``, ``compress_ratio``); ``--sync-every``, ``--fragments`` and ``--sync-delay`` replace its
schedule. Nothing here imports torch: building the parser stays light (``--help``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from lightning_gc.common.outer_presets import OUTER_PRESETS, STREAMING_DEFAULTS
from lightning_gc.perfmodel.outer import OuterSchedule


@dataclass(frozen=True)
class OuterRow:
    """One outer-loop scheme to predict: a preset, its codec and its schedule."""

    preset: str
    compressor: str
    arguments: dict[str, Any]
    schedule: OuterSchedule


def add_outer_options(parser: argparse.ArgumentParser) -> None:
    """The ``--outer``, ``--sync-every``, ``--fragments`` and ``--sync-delay`` options, in a group."""
    group = parser.add_argument_group(
        "outer loop",
        "DiLoCo family: sync_every local steps with no communication, then one compressed sync of the "
        "pseudo-gradient. It changes the optimisation: not synchronous SGD's maths.",
    )
    group.add_argument(
        "--outer",
        nargs="*",
        choices=sorted(OUTER_PRESETS),
        metavar="PRESET",
        default=None,
        help=f"also predict these outer-loop presets, all when none is named ({', '.join(sorted(OUTER_PRESETS))}); "
        "the use: line then weighs them beside the per-step schemes",
    )
    group.add_argument(
        "--sync-every",
        type=int,
        default=None,
        help="inner steps between syncs for every outer preset (implies --outer). Default: each preset's own",
    )
    group.add_argument(
        "--fragments",
        type=int,
        default=None,
        help="fragments the model is synced in, at staggered steps, each 1/fragments of it. Default: 1",
    )
    group.add_argument(
        "--sync-delay",
        type=int,
        default=None,
        help="inner steps a fragment's exchange overlaps before it is waited for, below "
        "sync_every/fragments. Default: 0",
    )


def outer_rows(args: argparse.Namespace) -> list[OuterRow]:
    """The outer-loop schemes ``args`` ask for (none without ``--outer`` or ``--sync-every``).

    Raises:
        ValueError: ``--fragments`` or ``--sync-delay`` without ``--outer``/``--sync-every``, or a
            schedule :class:`~lightning_gc.perfmodel.outer.OuterSchedule` refuses, naming the option.
    """
    from lightning_gc.compressors.registry import argument_names, compressor_class

    if args.outer is None and args.sync_every is None:
        given = [
            option
            for option, value in (("--fragments", args.fragments), ("--sync-delay", args.sync_delay))
            if value is not None
        ]
        if given:
            raise ValueError(f"`{given[0]}` applies to the outer loop only: add --outer (or --sync-every)")
        return []
    rows = []
    for preset in args.outer or sorted(OUTER_PRESETS):
        settings = {**STREAMING_DEFAULTS, **OUTER_PRESETS[preset]}
        compressor = settings["compressor"]
        accepted = argument_names(compressor_class(compressor))
        schedule = _schedule(
            preset,
            args.sync_every if args.sync_every is not None else settings["sync_every"],
            args.fragments if args.fragments is not None else settings["fragments"],
            args.sync_delay if args.sync_delay is not None else settings["sync_delay"],
        )
        arguments = {k: v for k, v in settings.items() if k in accepted}
        rows.append(OuterRow(preset, compressor, arguments, schedule))
    return rows


def _schedule(preset: str, sync_every: Any, fragments: Any, sync_delay: Any) -> OuterSchedule:
    """``OuterSchedule`` with its error renamed to the CLI's options and the preset named."""
    try:
        return OuterSchedule(sync_every, fragments, sync_delay)
    except ValueError as error:
        message = str(error)
        for name in ("sync_every", "fragments", "sync_delay"):
            message = message.replace(f"`{name}`", f"`--{name.replace('_', '-')}`", 1)
        raise ValueError(f"{message} (outer preset {preset})") from None
