"""``python -m lightning_gc.perfmodel``: predict step time with and without compression.

    python -m lightning_gc.perfmodel --params 25.6e6 --compute-ms 200 --world-size 16 \\
        --bandwidth 1gbit --latency-us 50 [--compressor dgc] [--cost dgc=40,5]

Encode/decode costs are timed on ``--device`` unless given with ``--cost``: on at most
``--calibrate-numel`` elements (default 2**23), scaled linearly to the gradient (the codecs are
memory-bound passes over the gradient, so their time grows with its size; what they send is
computed for the whole gradient). The sample must not fit in the last-level cache, or the scaled
time is too low: on a 2-core VM with 32 MiB of L3, timing 2**23 elements and scaling to 25.6 M
came within 0.8-1.0x of timing all 25.6 M (fp16, PowerSGD, top-k, DGC), but 2**20 elements gave
0.24x for fp16. A world of more than 4 ranks whose gathered payloads are slow to decode (the
quantisers) has its decode timed on 4 ranks' payloads and scaled to ``--world-size`` (one decode
per payload: :mod:`lightning_gc.perfmodel.calibration`), which the output names. Timings are cached per
machine, torch version and settings in ``$XDG_CACHE_HOME/lightning_gc/perfmodel.json``
(``--cache``, or ``--no-cache``). The output says which costs were timed and which were given.
Bad values exit with status 2 and a message naming the option, the value and the valid range.

A compressor that takes the two-phase exchange and all-gathers here (the quantisers: onebit, qsgd,
signsgd, terngrad; :func:`two_phase_row`) also gets a ``<name>+two_phase`` row: the same
compressor with ``exchange="two_phase"`` (all-to-all, decode + average + re-encode, all-gather;
:func:`~lightning_gc.perfmodel.two_phase_cost`), so the ``use:`` line weighs it too. Its encode
and decode are derived from the calibrated (or ``--cost``) ones (:func:`~lightning_gc.perfmodel.two_phase_cost`:
two payloads decoded instead of ``p``, one chunk re-encoded): nothing more is timed.

With ``--outer`` (or ``--sync-every``) the outer-loop presets get rows of their own
(:mod:`lightning_gc.perfmodel.outer_options`, the maths in :mod:`lightning_gc.perfmodel.outer`):
time per inner step and link use for one compressed sync of a fragment every ``sync_every / fragments``
inner steps, its codec timed like a per-step one (``--cost PRESET=ENCODE_MS,DECODE_MS`` for the whole
model's sync). The ``use:`` line names an outer preset only when it is faster than every per-step
scheme, and says that it changes the optimisation.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_gc.common.markdown import markdown_table
from lightning_gc.common.outer_presets import OUTER_PRESETS
from lightning_gc.common.validation import check_choice, check_int, check_range
from lightning_gc.perfmodel import BITS_PER_BYTE, DENSE, CodecCost, Network, parse_rate, two_phase_cost
from lightning_gc.perfmodel.outer import format_outer_table, predict_outer, recommendation
from lightning_gc.perfmodel.outer_options import add_outer_options, outer_rows
from lightning_gc.perfmodel.step import Prediction, Workload, best, predict

# The compressors, calibration and rich are imported inside the functions that use them: they
# bring in torch (about 1 s warm, 10 s cold on 2 cores), which building the parser and `--help`
# do not need (tests/test_imports.py holds `--help` to no torch).


def two_phase_row(name: str, cost: CodecCost, arguments: dict[str, Any], world_size: int) -> CodecCost | None:
    """The ``<name>+two_phase`` row of ``cost``, for a compressor that takes ``exchange`` and
    all-gathers with these ``arguments``; ``None`` for the others (summed payloads gain nothing)."""
    from lightning_gc.compressors.chunks import two_phase_compressors

    if (
        name not in two_phase_compressors()
        or not cost.gathered_bytes
        or arguments.get("exchange", "gather") != "gather"
    ):
        return None
    return two_phase_cost(cost, world_size)


def _whole(value: float) -> float | int:
    """``value`` as an int when it is a whole number (``25.6e6`` -> 25600000), else unchanged."""
    return int(value) if float(value).is_integer() else value


def _count_from_module(path: str) -> int:
    """Trainable parameter count of ``package.module:ClassName`` built with no arguments."""
    module_name, _, class_name = path.partition(":")
    if not class_name:
        raise ValueError(f"`--module` must look like package.module:ClassName, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"`--module` {path!r}: cannot import {module_name!r} ({error})") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"`--module` {path!r}: module {module_name!r} has no {class_name!r}")
    try:
        model = cls()
    except TypeError as error:
        raise ValueError(f"`--module` {path!r} must build with no arguments: {error}") from None
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _positive_rate(text: str, option: str) -> float:
    """Bits per second of ``option``'s value (``1gbit``, ``2.5e9``), which must be > 0."""
    return check_range(f"{option} (bits/s)", parse_rate(text, option), 0.0, None, low_inclusive=False)


def _parse_costs(items: Sequence[str]) -> dict[str, tuple[float, float]]:
    """``NAME=ENCODE_MS,DECODE_MS`` -> {name: (encode_s, decode_s)}; a name is a compressor's or
    an outer-loop preset's."""
    from lightning_gc.compressors.registry import available

    costs = {}
    for item in items:
        name, _, values = item.partition("=")
        try:
            encode_ms, decode_ms = (float(v) for v in values.split(","))
        except ValueError:
            raise ValueError(f"`--cost` must look like NAME=ENCODE_MS,DECODE_MS, got {item!r}") from None
        check_choice("--cost compressor", name, [*available(), *sorted(OUTER_PRESETS)])
        for value in (encode_ms, decode_ms):
            check_range(f"--cost {name}", value, 0.0, None)
        costs[name] = (encode_ms / 1e3, decode_ms / 1e3)
    return costs


def busy_cpu() -> float | None:
    """The 1-minute load average when other work competes for the CPUs (timings then come out
    slow and scattered: up to 25x, seen beside a 2-process training run on 2 cores), else ``None``.
    Busy means more than one runnable task per core besides this process: the average lags by a
    minute and counts this process too (2.2 on 2 cores right after a test run had ended)."""
    load = os.getloadavg()[0]
    return load if load > (os.cpu_count() or 1) + 1 else None


def default_cache() -> Path:
    """Where calibrations are kept between runs: ``$XDG_CACHE_HOME`` (or ``~/.cache``)/lightning_gc."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "lightning_gc" / "perfmodel.json"


def scaled_cost(name: str, numel: int, sample: CodecCost, sampled_numel: int, arguments: dict) -> CodecCost:
    """``sample`` (timed on ``sampled_numel`` elements) scaled to a ``numel``-element gradient:
    seconds in proportion, bytes as the compressor sends them for the whole gradient, split between
    all-reduce and all-gather as in the sample. A sample with point-to-point rounds (global top-k)
    has its bytes scaled in proportion too (its ``k`` pairs and agreed values grow with the
    gradient), its rounds kept."""
    if sampled_numel == numel:
        return sample
    from lightning_gc.compressors.registry import create
    from lightning_gc.perfmodel import calibration

    factor = numel / sampled_numel
    if sample.peer_bytes:
        return sample.scaled(factor)
    layout = calibration.layout_of_shapes(calibration.representative_shapes(numel))
    wire = create(name, **arguments).wire_bytes(layout, 4)
    sampled_sent = sample.summed_bytes + sample.gathered_bytes
    summed = round(wire * sample.summed_bytes / sampled_sent) if sampled_sent else 0
    return CodecCost(name, summed, wire - summed, sample.encode_s * factor, sample.decode_s * factor)


def format_table(predictions: Sequence[Prediction]) -> str:
    """Markdown table of predictions."""
    header = (
        "scheme",
        "MB sent",
        "wire ratio",
        "comm (ms)",
        "encode+decode (ms)",
        "host (ms)",
        "exposed (ms)",
        "step (ms)",
        "speedup",
    )
    return markdown_table(
        header,
        (
            (
                p.name,
                f"{p.bytes_sent / 1e6:.3f}",
                f"{p.wire_ratio:.1f}",
                f"{p.comm_s * 1e3:.1f}",
                f"{p.codec_s * 1e3:.1f}",
                f"{p.host_s * 1e3:.1f}",
                f"{p.exposed_s * 1e3:.1f}",
                f"{p.step_s * 1e3:.1f}",
                f"{p.speedup:.2f}",
            )
            for p in predictions
        ),
    )


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ``(default: ...)`` after each option's help, but for options with no default to
    show (required ones, ``None``, flags, repeatable lists)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None or isinstance(action.default, (bool, list)):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_gc.perfmodel",
        description="Predict DDP step time with and without gradient compression on a cluster.",
        formatter_class=_DefaultsShown,
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=float, help="gradient elements per step (e.g. 25.6e6)")
    size.add_argument("--module", help="package.module:LightningModuleClass, built with no arguments")
    parser.add_argument("--compute-ms", type=float, required=True, help="per-step compute time C, no exchange")
    parser.add_argument("--overlap", type=float, default=0.5, help="fraction f of C that hides communication")
    parser.add_argument("--world-size", type=int, required=True, help="number of workers p")
    parser.add_argument("--bandwidth", default="1gbit", help="link bandwidth: 1gbit, 100mbit, or bits/s")
    parser.add_argument("--latency-us", type=float, default=50.0, help="per-message latency a in microseconds")
    parser.add_argument(
        "--host-bandwidth",
        default=None,
        help="rate H at which the compute core itself drives the transport (e.g. TCP on the training CPU), "
        "bits/s or 10gbit; that time is never hidden. Default: the transport takes no compute time",
    )
    parser.add_argument("--rounds", type=int, default=1, help="collective rounds per step, DDP buckets")
    parser.add_argument(
        "--delay",
        type=int,
        default=0,
        help="delayed synchronisation (strategy's delay): the exchange hides behind C",
    )
    parser.add_argument("--compressor", default="all", help="a registered compressor name, or 'all'")
    parser.add_argument("--arg", action="append", default=[], help="compressor argument NAME=VALUE (repeatable)")
    parser.add_argument(
        "--cost",
        action="append",
        default=[],
        help="measured NAME=ENCODE_MS,DECODE_MS of a compressor or an outer preset's whole sync (skips timing)",
    )
    parser.add_argument("--device", default="cpu", help="device to calibrate encode/decode on")
    parser.add_argument(
        "--calibrate-numel",
        type=float,
        default=2**23,
        help="time codecs on at most this many elements, then scale",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed rounds per codec (median), after one warm-up",
    )
    parser.add_argument("--cache", type=Path, default=None, help="JSON file caching calibrations (default: per user)")
    parser.add_argument("--no-cache", action="store_true", help="time afresh and keep nothing")
    add_outer_options(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit status (2 with a message on bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.progress import Progress

    from lightning_gc.compressors.registry import available, create
    from lightning_gc.perfmodel import calibration

    try:
        check_int("--world-size", args.world_size, 1)
        bits = _positive_rate(args.bandwidth, "--bandwidth")
        check_range("--latency-us", args.latency_us, 0.0, None)
        host_bits = None if args.host_bandwidth is None else _positive_rate(args.host_bandwidth, "--host-bandwidth")
        check_range("--compute-ms", args.compute_ms, 0.0, None)
        check_range("--overlap", args.overlap, 0.0, 1.0)
        check_int("--rounds", args.rounds, 1)
        check_int("--delay", args.delay, 0)
        sampled_numel = check_int("--calibrate-numel", _whole(args.calibrate_numel), 1024)
        check_int("--repeats", args.repeats, 1)
        if args.compressor != "all" and args.compressor not in available():
            raise ValueError(f"`--compressor` must be 'all' or one of {available()}, got {args.compressor!r}")
        numel = _count_from_module(args.module) if args.module else _whole(args.params)
        check_int("--params", numel, 1)
        network = Network.from_bits(args.world_size, bits, args.latency_us * 1e-6, host_bits)
        workload = Workload(numel, args.compute_ms / 1e3, args.overlap, rounds=args.rounds, delay=args.delay)
        measured = _parse_costs(args.cost)
        names = available() if args.compressor == "all" else [args.compressor]
        outer = outer_rows(args)
        unselected = sorted(set(measured) - set(names) - set(OUTER_PRESETS))
        if unselected:
            raise ValueError(f"`--cost` names {unselected}, which `--compressor {args.compressor}` does not select")
        unselected = sorted(set(measured) & set(OUTER_PRESETS) - {row.preset for row in outer})
        if unselected:
            raise ValueError(f"`--cost` names outer preset(s) {unselected}, which `--outer` does not select")
        arguments = calibration.parse_arguments(args.arg)
        for name in names:  # bad values fail here, with the option's message, not mid-calibration
            try:
                create(name, **arguments.get(name, {}))
            except ValueError as error:
                if not arguments.get(name):
                    raise
                raise ValueError(f"`--arg` for {name}: {error}") from None
    except ValueError as error:
        parser.error(str(error))
    cache = None if args.no_cache else (args.cache or default_cache())
    busy = busy_cpu() if args.device == "cpu" else None
    if busy is not None:
        print(
            f"perfmodel: this machine is busy (load average {busy:.1f} on {os.cpu_count()} cores): codec timings "
            "taken now are slow and noisy; they are cached only until a run on a quiet machine times them again",
            file=sys.stderr,
        )
    timed_numel = min(numel, sampled_numel)
    costs, decode_scaled, fragments = [], [], []
    # (label, compressor, its arguments, elements its cost is for): per-step compressors on the whole
    # gradient, outer presets on one fragment of the model
    todo = [(name, name, arguments.get(name, {}), numel) for name in names]
    todo += [(row.preset, row.compressor, row.arguments, row.schedule.fragment_numel(numel)) for row in outer]
    with Progress(transient=True, console=Console(stderr=True)) as progress:
        timing = progress.add_task(f"timing codecs on {timed_numel:,} elements", total=len(todo))
        for label, name, codec_arguments, target in todo:
            sampled = numel if label in measured else timed_numel
            sample = calibration.codec_cost(
                name,
                sampled,
                world_size=network.world_size,
                arguments=codec_arguments,
                device=args.device,
                measured=measured.get(label),
                cache=cache,
                repeats=args.repeats,
                busy=busy is not None,
            )
            if sample.decode_timed_ranks:
                decode_scaled.append(label)
            cost = scaled_cost(name, target, sample, sampled, codec_arguments)
            if label in OUTER_PRESETS:  # one fragment's sync, named by its preset
                fragments.append(dataclasses.replace(cost, name=label))
            else:
                costs.append(cost)
                row = two_phase_row(name, costs[-1], codec_arguments, network.world_size)
                if row is not None:
                    costs.append(row)
            progress.advance(timing)
    predictions = predict(workload, network, costs)
    outer_predictions = [predict_outer(f, row.schedule, workload, network) for f, row in zip(fragments, outer)]
    print(
        f"p={network.world_size}, B={network.bandwidth * BITS_PER_BYTE / 1e9:g} Gbit/s, "
        f"a={network.latency * 1e6:g} us, "
        + ("" if network.host_bandwidth is None else f"H={network.host_bandwidth * BITS_PER_BYTE / 1e9:g} Gbit/s, ")
        + f"M={workload.dense_bytes / 1e6:.1f} MB, "
        f"C={workload.compute_s * 1e3:g} ms, f={workload.overlap:g}, rounds={workload.rounds}"
        + (f", delay={workload.delay}" if workload.delay else "")
    )
    timed = [label for label, *_ in todo if label not in measured]
    if timed:
        scale = "" if timed_numel == numel else f", scaled to {numel:,}"
        print(f"encode/decode timed on {args.device} on {timed_numel:,} elements{scale}: {', '.join(timed)}")
    if decode_scaled:
        print(
            f"decode timed on {calibration.TIMED_RANKS} ranks' payloads and scaled to {network.world_size} "
            f"(one decode per payload; an upper bound by the per-step part): {', '.join(decode_scaled)}"
        )
    if measured:
        print(f"encode/decode given with --cost: {', '.join(sorted(measured))}")
    print(format_table(predictions))
    if outer_predictions:
        print(
            "outer loop, per inner step (it changes the optimisation: sync_every local steps, then an outer step "
            "on the averaged compressed pseudo-gradient; not synchronous SGD):"
        )
        print(format_outer_table(outer_predictions))
    choice = best(predictions)
    outer_choice = recommendation(choice, outer_predictions)
    if outer_choice is not None:
        print(outer_choice)
    elif choice.name == DENSE:
        print("use: dense all-reduce (no compressor is predicted faster)")
    else:
        print(f"use: {choice.name} (expected speedup {choice.speedup:.2f}x over dense all-reduce)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
