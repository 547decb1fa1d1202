"""When compression pays: predicted step time of dense all-reduce vs each compressor.

Notation (DESIGN.md §6): ``p`` workers, ``M`` gradient bytes per worker, ``B`` link bandwidth in
bytes/s, ``a`` latency per message in seconds, ``r`` wire ratio, ``n`` collective rounds per step
(DDP buckets).

Communication (alpha-beta cost of the classic algorithms, per step)::

    ring all-reduce of M bytes            T_ar(M) = n * 2(p-1) a + 2(p-1)/p * M / B
    all-gather of m = M/r bytes per rank  T_ag(m) = n * (p-1) a   + (p-1) * m / B

A compressor's payload has a summed part (all-reduced) and a gathered part (all-gathered):
``T_comm = T_ar(summed) + T_ag(gathered)``; dense DDP is ``T_ar(M)``.

Overlap: DDP launches a bucket's collective while backward still computes earlier layers. With
per-step compute time ``C`` (forward + backward + optimizer of one worker, nothing exchanged) and
``f`` the fraction of ``C`` that can run concurrently with communication, the exposed part of
the exchange is ``max(0, T_comm - f C)``. Encoding and decoding run on the worker's compute
resource inside the hook, so they are never hidden::

    step(dense)      = C + max(0, T_ar(M) - f C)
    step(compressor) = C + T_enc + T_dec + max(0, T_comm - f C)
    speedup          = step(dense) / step(compressor)

Compression pays exactly when ``T_enc + T_dec + max(0, T_comm - f C) < max(0, T_ar(M) - f C)``.
The world of one rank exchanges nothing: every ``T`` is 0 for ``p = 1``.

``T_enc`` and ``T_dec`` come from :mod:`lightning_gc.calibration` (the real compressor timed on
this device) or are given. The model is checked against measured two-node runs by
``benchmarks/netbench``; it is a model, not a measurement.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_gc._validation import check_int, check_range

DENSE = "dense"
"""Name of the reference: plain DDP ring all-reduce, no encode/decode."""

BITS_PER_BYTE = 8


@dataclass(frozen=True)
class Network:
    """The cluster as the exchange sees it.

    Attributes:
        world_size: number of workers ``p`` (>= 1).
        bandwidth: link bandwidth ``B`` in bytes per second (> 0).
        latency: per-message latency ``a`` in seconds (>= 0).
    """

    world_size: int
    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1)
        check_range("bandwidth", self.bandwidth, 0.0, None, low_inclusive=False)
        check_range("latency", self.latency, 0.0, None)

    @classmethod
    def from_bits(cls, world_size: int, bits_per_second: float, latency: float = 0.0) -> Network:
        """A network whose bandwidth is given in bits per second (``1e9`` for 1 Gbit/s)."""
        check_range("bandwidth", bits_per_second, 0.0, None, low_inclusive=False)
        return cls(world_size, bits_per_second / BITS_PER_BYTE, latency)


@dataclass(frozen=True)
class Workload:
    """One worker's training step without communication.

    Attributes:
        gradient_numel: gradient elements per worker per step.
        compute_s: forward + backward + optimizer time ``C`` of one step, nothing exchanged.
        overlap: fraction ``f`` of ``compute_s`` that can run concurrently with communication
            (part of backward), in [0, 1].
        element_size: bytes per gradient element (4 for fp32).
        rounds: collective rounds per step ``n`` (DDP buckets), >= 1.
    """

    gradient_numel: int
    compute_s: float
    overlap: float = 0.5
    element_size: int = 4
    rounds: int = 1

    def __post_init__(self) -> None:
        check_int("gradient_numel", self.gradient_numel, 1)
        check_range("compute_s", self.compute_s, 0.0, None)
        check_range("overlap", self.overlap, 0.0, 1.0)
        check_int("element_size", self.element_size, 1)
        check_int("rounds", self.rounds, 1)

    @property
    def dense_bytes(self) -> int:
        """``M``: bytes plain DDP all-reduces per step."""
        return self.gradient_numel * self.element_size

    @property
    def hidden_s(self) -> float:
        """``f C``: communication time that backward can hide."""
        return self.overlap * self.compute_s


@dataclass(frozen=True)
class CodecCost:
    """What one compressor costs one worker per step, for the whole gradient.

    Attributes:
        name: compressor name (``"dense"`` for plain DDP).
        summed_bytes: bytes all-reduced per step.
        gathered_bytes: bytes all-gathered per rank per step.
        encode_s: compensation + encoding (+ memory commit) time per step.
        decode_s: decoding time per step, for ``p`` ranks' payloads.
    """

    name: str
    summed_bytes: int
    gathered_bytes: int
    encode_s: float = 0.0
    decode_s: float = 0.0

    def __post_init__(self) -> None:
        check_int("summed_bytes", self.summed_bytes, 0)
        check_int("gathered_bytes", self.gathered_bytes, 0)
        check_range("encode_s", self.encode_s, 0.0, None)
        check_range("decode_s", self.decode_s, 0.0, None)

    @property
    def bytes_sent(self) -> int:
        return self.summed_bytes + self.gathered_bytes

    @classmethod
    def dense(cls, workload: Workload) -> CodecCost:
        """Plain DDP: the whole gradient all-reduced, nothing encoded."""
        return cls(DENSE, summed_bytes=workload.dense_bytes, gathered_bytes=0)


@dataclass(frozen=True)
class Prediction:
    """Predicted step of one exchange scheme.

    Attributes:
        name: compressor name or ``"dense"``.
        comm_s: ``T_comm``, the collectives alone.
        codec_s: ``T_enc + T_dec``.
        exposed_s: ``max(0, T_comm - f C)``, the communication backward cannot hide.
        step_s: ``C + codec_s + exposed_s``.
        speedup: dense step time / this step time (> 1: faster than dense).
        bytes_sent: bytes this rank hands to the collectives per step.
        wire_ratio: dense bytes / bytes sent.
    """

    name: str
    comm_s: float
    codec_s: float
    exposed_s: float
    step_s: float
    speedup: float
    bytes_sent: int
    wire_ratio: float


def ring_allreduce_s(nbytes: float, network: Network, rounds: int = 1) -> float:
    """``T_ar = n 2(p-1) a + 2(p-1)/p * nbytes / B``; 0 when nothing is sent or ``p = 1``."""
    p = network.world_size
    if nbytes <= 0 or p == 1:
        return 0.0
    return rounds * 2 * (p - 1) * network.latency + 2 * (p - 1) / p * nbytes / network.bandwidth


def allgather_s(nbytes_per_rank: float, network: Network, rounds: int = 1) -> float:
    """``T_ag = n (p-1) a + (p-1) * nbytes_per_rank / B``; 0 when nothing is sent or ``p = 1``."""
    p = network.world_size
    if nbytes_per_rank <= 0 or p == 1:
        return 0.0
    return rounds * (p - 1) * network.latency + (p - 1) * nbytes_per_rank / network.bandwidth


def comm_s(cost: CodecCost, network: Network, rounds: int = 1) -> float:
    """``T_comm = T_ar(summed) + T_ag(gathered)``."""
    return ring_allreduce_s(cost.summed_bytes, network, rounds) + allgather_s(cost.gathered_bytes, network, rounds)


def exposed_s(communication_s: float, hidden_s: float) -> float:
    """``max(0, T_comm - f C)``: what overlap with backward cannot hide."""
    return max(0.0, communication_s - hidden_s)


def predict(workload: Workload, network: Network, costs: Sequence[CodecCost]) -> list[Prediction]:
    """Predictions for dense DDP (always first) and each of ``costs``; see the module docstring."""
    dense_cost = CodecCost.dense(workload)
    rows = []
    for cost in [dense_cost, *[c for c in costs if c.name != DENSE]]:
        t_comm = comm_s(cost, network, workload.rounds)
        codec = cost.encode_s + cost.decode_s
        exposed = exposed_s(t_comm, workload.hidden_s)
        rows.append((cost, t_comm, codec, exposed, workload.compute_s + codec + exposed))
    dense_step = rows[0][4]
    return [
        Prediction(
            name=cost.name,
            comm_s=t_comm,
            codec_s=codec,
            exposed_s=exposed,
            step_s=step,
            speedup=dense_step / step if step > 0 else 1.0,
            bytes_sent=cost.bytes_sent,
            wire_ratio=workload.dense_bytes / cost.bytes_sent if cost.bytes_sent else math.inf,
        )
        for cost, t_comm, codec, exposed, step in rows
    ]


def best(predictions: Sequence[Prediction]) -> Prediction:
    """The fastest scheme; dense wins ties (no compression without a predicted gain)."""
    return min(predictions, key=lambda p: (p.step_s, p.name != DENSE))


def pays(cost: CodecCost, workload: Workload, network: Network) -> bool:
    """Whether ``cost``'s scheme is predicted strictly faster than dense all-reduce."""
    dense, compressed = predict(workload, network, [cost])
    return compressed.step_s < dense.step_s


# ---------------------------------------------------------------------------------------- CLI
def parse_rate(text: str) -> float:
    """``"1gbit"``, ``"100mbit"``, ``"2.5e9"`` (bits/s) -> bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    lowered = text.strip().lower()
    scale = next((s for unit, s in units.items() if lowered.endswith(unit)), 1.0)
    number = lowered.removesuffix(next((u for u in units if lowered.endswith(u)), ""))
    try:
        return float(number) * scale
    except ValueError:
        raise ValueError(f"`--bandwidth` must be a rate like 1gbit, 100mbit or 2.5e9 (bits/s), got {text!r}") from None


def _whole(value: float) -> float | int:
    """``value`` as an int when it is a whole number (``25.6e6`` -> 25600000), else unchanged."""
    return int(value) if float(value).is_integer() else value


def _count_from_module(path: str) -> int:
    """Trainable parameter count of ``package.module:ClassName`` built with no arguments."""
    module_name, _, class_name = path.partition(":")
    if not class_name:
        raise ValueError(f"`--module` must look like package.module:ClassName, got {path!r}")
    cls = getattr(importlib.import_module(module_name), class_name)
    model = cls()
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _parse_costs(items: Sequence[str]) -> dict[str, tuple[float, float]]:
    """``NAME=ENCODE_MS,DECODE_MS`` -> {name: (encode_s, decode_s)}."""
    costs = {}
    for item in items:
        name, _, values = item.partition("=")
        parts = values.split(",")
        if not name or len(parts) != 2:
            raise ValueError(f"`--cost` must look like NAME=ENCODE_MS,DECODE_MS, got {item!r}")
        encode_ms, decode_ms = (check_range(f"--cost {name}", float(v), 0.0, None) for v in parts)
        costs[name] = (encode_ms / 1e3, decode_ms / 1e3)
    return costs


def format_table(predictions: Sequence[Prediction]) -> str:
    """Markdown table of predictions."""
    lines = [
        "| scheme | MB sent | wire ratio | comm (ms) | encode+decode (ms) | exposed (ms) | step (ms) | speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in predictions:
        lines.append(
            f"| {p.name} | {p.bytes_sent / 1e6:.3f} | {p.wire_ratio:.1f} | {p.comm_s * 1e3:.1f} | "
            f"{p.codec_s * 1e3:.1f} | {p.exposed_s * 1e3:.1f} | {p.step_s * 1e3:.1f} | {p.speedup:.2f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_gc.perfmodel",
        description="Predict DDP step time with and without gradient compression on a cluster.",
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=float, help="gradient elements per step (e.g. 25.6e6)")
    size.add_argument("--module", help="package.module:LightningModuleClass, built with no arguments")
    parser.add_argument("--compute-ms", type=float, required=True, help="per-step compute time C, no exchange")
    parser.add_argument("--overlap", type=float, default=0.5, help="fraction f of C that hides communication")
    parser.add_argument("--world-size", type=int, required=True, help="number of workers p")
    parser.add_argument("--bandwidth", default="1gbit", help="link bandwidth: 1gbit, 100mbit, or bits/s")
    parser.add_argument("--latency-us", type=float, default=50.0, help="per-message latency a in microseconds")
    parser.add_argument("--rounds", type=int, default=1, help="collective rounds per step (DDP buckets)")
    parser.add_argument("--compressor", default="all", help="a registered compressor name, or 'all'")
    parser.add_argument("--arg", action="append", default=[], help="compressor argument NAME=VALUE (repeatable)")
    parser.add_argument("--cost", action="append", default=[], help="measured NAME=ENCODE_MS,DECODE_MS (skips timing)")
    parser.add_argument("--device", default="cpu", help="device to calibrate encode/decode on")
    parser.add_argument("--cache", type=Path, default=None, help="JSON file caching calibrations")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit status (2 with a message on bad input)."""
    from lightning_gc import calibration
    from lightning_gc.compressors.registry import available

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_int("--world-size", args.world_size, 1)
        bits = check_range("--bandwidth (bits/s)", parse_rate(args.bandwidth), 0.0, None, low_inclusive=False)
        check_range("--latency-us", args.latency_us, 0.0, None)
        check_range("--compute-ms", args.compute_ms, 0.0, None)
        check_range("--overlap", args.overlap, 0.0, 1.0)
        check_int("--rounds", args.rounds, 1)
        if args.compressor != "all" and args.compressor not in available():
            raise ValueError(f"`--compressor` must be 'all' or one of {available()}, got {args.compressor!r}")
        numel = _count_from_module(args.module) if args.module else _whole(args.params)
        check_int("--params", numel, 1)
        network = Network.from_bits(args.world_size, bits, args.latency_us * 1e-6)
        workload = Workload(numel, args.compute_ms / 1e3, args.overlap, rounds=args.rounds)
        measured = _parse_costs(args.cost)
        names = available() if args.compressor == "all" else [args.compressor]
        arguments = calibration.parse_arguments(args.arg)
    except ValueError as error:
        parser.error(str(error))
    costs = [
        calibration.codec_cost(
            name,
            workload.gradient_numel,
            world_size=network.world_size,
            arguments=arguments.get(name, {}),
            device=args.device,
            measured=measured.get(name),
            cache=args.cache,
        )
        for name in names
    ]
    predictions = predict(workload, network, costs)
    print(
        f"p={network.world_size}, B={network.bandwidth * BITS_PER_BYTE / 1e9:g} Gbit/s, "
        f"a={network.latency * 1e6:g} us, M={workload.dense_bytes / 1e6:.1f} MB, "
        f"C={workload.compute_s * 1e3:g} ms, f={workload.overlap:g}, rounds={workload.rounds}"
    )
    print(format_table(predictions))
    choice = best(predictions)
    if choice.name == DENSE:
        print("use: dense all-reduce (no compressor is predicted faster)")
    else:
        print(f"use: {choice.name} (expected speedup {choice.speedup:.2f}x over dense all-reduce)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
