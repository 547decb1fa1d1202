"""Every compressor on one ResNet-50-sized gradient: encode and decode time, bytes on the wire, ratio.

One 25.6 M-element fp32 weight gradient (a single 2-D tensor, 25,600 x 1,000), a world of one
rank (the collectives are identities, so this times the compressor alone; a multi-round
compressor's encode time covers all its rounds). Medians of interleaved repeats;
``--record`` appends the table to benchmarks/RESULTS.md.

    python benchmarks/compressors.py [--numel 25600000] [--repeats 3] [--device cpu|cuda] [--record]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lightning_gc.compressors import available, create
from lightning_gc.layout import BucketLayout

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
ARGUMENTS = {"topk": {"compress_ratio": 0.01}, "randomk": {"compress_ratio": 0.01}, "dgc": {"compress_ratio": 0.001}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=25_600_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    param = torch.nn.Parameter(torch.zeros(args.numel // 1000, 1000, device=device))
    layout = BucketLayout.build(0, [param], {id(param): ("weight", 0)}, param.numel())
    gradient = torch.randn(param.numel(), device=device, generator=torch.Generator(device=device).manual_seed(0))
    compressors = {name: create(name, **ARGUMENTS.get(name, {})) for name in available()}
    times: dict[str, dict[str, list[float]]] = {name: {"encode": [], "decode": []} for name in compressors}
    wire: dict[str, int] = {}
    out = torch.empty_like(gradient)
    for repeat in range(args.repeats + 1):  # the first round is warm-up
        for name, compressor in compressors.items():
            velocity = gradient.clone()
            _sync(device)
            started = time.perf_counter()
            encoded = compressor.encode(velocity, out, layout, step=repeat, world_size=1)
            bytes_sent = encoded.bytes_sent
            while encoded.next_round is not None:  # multi-round (powersgd): the reduce of one rank is itself
                encoded = encoded.next_round()
                bytes_sent += encoded.bytes_sent
            _sync(device)
            encoded_at = time.perf_counter()
            if encoded.gathered is not None:  # the all-gather of a world of one
                encoded.gathered_out.copy_(encoded.gathered)
            _sync(device)
            decode_started = time.perf_counter()
            compressor.decode(encoded, out, world_size=1)
            _sync(device)
            if repeat:
                times[name]["encode"].append(encoded_at - started)
                times[name]["decode"].append(time.perf_counter() - decode_started)
            wire[name] = bytes_sent

    dense = gradient.numel() * gradient.element_size()
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    rows = []
    for name in compressors:
        encode = statistics.median(times[name]["encode"]) * 1e3
        decode = statistics.median(times[name]["decode"]) * 1e3
        settings = ", ".join(f"{k}={v}" for k, v in ARGUMENTS.get(name, {}).items()) or "defaults"
        ratio = dense / wire[name]
        rows.append(f"| {name} | {settings} | {encode:.1f} | {decode:.1f} | {wire[name]:,} | {ratio:.1f} |")
    header = (
        f"\n### `python benchmarks/compressors.py --repeats {args.repeats}` — {machine}, "
        f"{time.strftime('%Y-%m-%d')}, {args.numel:,} fp32 elements ({dense / 1e6:.1f} MB dense)\n\n"
        "| compressor | arguments | encode (ms) | decode (ms) | bytes on the wire | wire ratio |\n"
        "|---|---|---|---|---|---|\n"
    )
    print(header + "\n".join(rows))
    if args.record:
        with RESULTS.open("a") as f:
            f.write(header + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
