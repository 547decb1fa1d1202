"""Every compressor on one ResNet-50-sized gradient: encode and decode time, bytes on the wire, ratio.

One 25.6 M-element fp32 weight gradient (a single 2-D tensor, 25,600 x 1,000), a world of one
rank (the collectives are identities, so this times the compressor alone; a multi-round
compressor's encode time covers all its rounds). Medians of interleaved repeats;
``--record`` appends the table to benchmarks/RESULTS.md.

By default one row per registered compressor (settings in ``ARGUMENTS``) plus the rows of
``EXTRA_ROWS``; ``--row "NAME KEY=VALUE ..."`` (repeatable) runs only the rows given, e.g. DGC's
wire formats side by side::

    python benchmarks/compressors.py [--numel 25600000] [--repeats 3] [--device cpu|cuda] [--record]
    python benchmarks/compressors.py --row "dgc compress_ratio=0.001" \
        --row "dgc compress_ratio=0.001 index_encoding=elias_fano value_dtype=float16"
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lightning_gc.common.layout import BucketLayout
from lightning_gc.compressors import available, create
from lightning_gc.compressors.base import EncodeContext
from lightning_gc.perfmodel.calibration import parse_arguments

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
ARGUMENTS = {"topk": {"compress_ratio": 0.01}, "randomk": {"compress_ratio": 0.01}, "dgc": {"compress_ratio": 0.001}}
EXTRA_ROWS = [("dgc", {"compress_ratio": 0.001, "index_encoding": "elias_fano", "value_dtype": "float16"})]


def default_rows() -> list[tuple[str, dict[str, object]]]:
    """(compressor name, arguments) of every row run without ``--row``."""
    return [(name, ARGUMENTS.get(name, {})) for name in available()] + EXTRA_ROWS


def parse_row(text: str) -> tuple[str, dict[str, object]]:
    """``"dgc compress_ratio=0.001 index_encoding=elias_fano"`` -> ``("dgc", {...})``; the arguments
    are checked against what the compressor takes."""
    name, *items = text.split()
    if name not in available():
        raise argparse.ArgumentTypeError(f"must start with a compressor name, one of {available()}, got {name!r}")
    try:
        arguments = parse_arguments(items)[name]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    taken = set(arguments)
    unknown = [item for item in items if item.partition("=")[0] not in taken]
    if unknown:
        raise argparse.ArgumentTypeError(f"compressor {name!r} takes no argument(s) {unknown}")
    return name, arguments


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=25_600_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--record", action="store_true")
    parser.add_argument(
        "--row", action="append", type=parse_row, help='"NAME KEY=VALUE ...": run only these rows (repeatable)'
    )
    args = parser.parse_args()
    rows = args.row or default_rows()
    device = torch.device(args.device)
    param = torch.nn.Parameter(torch.zeros(args.numel // 1000, 1000, device=device))
    layout = BucketLayout.build(0, [param], {id(param): ("weight", 0)}, param.numel())
    gradient = torch.randn(param.numel(), device=device, generator=torch.Generator(device=device).manual_seed(0))
    compressors = [create(name, **arguments) for name, arguments in rows]
    times: list[dict[str, list[float]]] = [{"encode": [], "decode": []} for _ in compressors]
    wire: list[int] = [0] * len(compressors)
    out = torch.empty_like(gradient)
    for repeat in range(args.repeats + 1):  # the first round is warm-up
        for row, compressor in enumerate(compressors):
            velocity = gradient.clone()
            _sync(device)
            started = time.perf_counter()
            encoded = compressor.encode(velocity, out, EncodeContext(layout, step=repeat, world_size=1))
            bytes_sent = encoded.payload.bytes_sent
            while encoded.next_round is not None:  # multi-round (powersgd): the reduce of one rank is itself
                encoded = encoded.next_round()
                bytes_sent += encoded.payload.bytes_sent
            _sync(device)
            encoded_at = time.perf_counter()
            payload = encoded.payload
            if payload.gathered is not None:  # the all-gather of a world of one
                payload.gathered_out.copy_(payload.gathered)
            _sync(device)
            decode_started = time.perf_counter()
            compressor.decode(encoded, out, world_size=1)
            _sync(device)
            if repeat:
                times[row]["encode"].append(encoded_at - started)
                times[row]["decode"].append(time.perf_counter() - decode_started)
            wire[row] = bytes_sent

    dense = gradient.numel() * gradient.element_size()
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    lines = []
    for row, (name, arguments) in enumerate(rows):
        encode = statistics.median(times[row]["encode"]) * 1e3
        decode = statistics.median(times[row]["decode"]) * 1e3
        settings = ", ".join(f"{k}={v}" for k, v in arguments.items()) or "defaults"
        ratio = dense / wire[row]
        lines.append(f"| {name} | {settings} | {encode:.1f} | {decode:.1f} | {wire[row]:,} | {ratio:.1f} |")
    selected = "".join(f' --row "{name} ' + " ".join(f"{k}={v}" for k, v in arguments.items()) + '"'
                       for name, arguments in rows) if args.row else ""  # fmt: skip
    header = (
        f"\n### `python benchmarks/compressors.py --repeats {args.repeats}{selected}` — {machine}, "
        f"{time.strftime('%Y-%m-%d')}, {args.numel:,} fp32 elements ({dense / 1e6:.1f} MB dense)\n\n"
        "| compressor | arguments | encode (ms) | decode (ms) | bytes on the wire | wire ratio |\n"
        "|---|---|---|---|---|---|\n"
    )
    print(header + "\n".join(lines))
    if args.record:
        with RESULTS.open("a") as f:
            f.write(header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
