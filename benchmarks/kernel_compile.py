"""Registers and spills of every Triton kernel variant the wrappers launch, compiled ahead of time.

Compiles each variant (every dtype and flag combination the wrappers launch, and the same with every
specialisable integer argument equal to 1) for sm_80 and sm_90 through ptxas, on any machine, with
no GPU (see lightning_gc/kernels/aot.py), and prints per kernel the number of variants, the
registers per thread (min–max) and the most bytes spilled.

    TRITON_INTERPRET=0 python benchmarks/kernel_compile.py [--record]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
ARCHS = (80, 90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("this compiles the kernels: run it with TRITON_INTERPRET=0")
    import triton

    from lightning_gc.kernels import aot

    started = time.perf_counter()
    report = aot.report(ARCHS)
    seconds = time.perf_counter() - started
    per_kernel: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for row in report["rows"]:
        per_kernel[(row["variant"].split("[")[0], row["arch"])].append(row)
    kernels = sorted({kernel for kernel, _ in per_kernel})
    header = "| kernel | variants | " + " | ".join(f"sm_{a} registers | sm_{a} max spill (B)" for a in ARCHS) + " |"
    lines = [header, "|---|---|" + "---|---|" * len(ARCHS)]
    failures = [f"{row['variant']} sm_{row['arch']}: {row['error']}" for row in report["rows"] if "error" in row]
    for kernel in kernels:
        cells = []
        for arch in ARCHS:
            rows = [r for r in per_kernel[(kernel, arch)] if "error" not in r]
            registers = sorted(r["registers"] for r in rows)
            span = f"{registers[0]}–{registers[-1]}" if registers else "failed"
            cells += [span, str(max((r["spill_bytes"] for r in rows), default="–"))]
        lines.append(f"| {kernel} | {len(per_kernel[(kernel, ARCHS[0])])} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    print(f"{len(report['rows'])} compilations in {seconds:.0f} s; failures: {failures or 'none'}")
    if args.record:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with RESULTS.open("a") as results:
            results.write(
                f"\n### `TRITON_INTERPRET=0 python benchmarks/kernel_compile.py --record` — {platform.node()}, "
                f"no GPU, triton {triton.__version__}, {stamp}\n\n"
                f"Every variant the wrappers launch, and each with every specialisable integer argument = 1, "
                f"compiled ahead of time through ptxas: {len(report['rows'])} compilations, "
                f"{len(failures)} failures.\n\n{table}\n"
            )


if __name__ == "__main__":
    main()
