"""Hot-path ops vs their memory-traffic limit: Triton kernels (CUDA) and torch twins, side by side.

For each size, each op is timed per implementation (median of interleaved repeats) and compared
with the *memory-traffic limit*: the bytes the op must move at minimum divided by the device's
copy bandwidth, measured in the same run (``dst.copy_(src)``, counted as read + write). On a CPU
only the torch twins run: Triton needs a GPU (its CPU interpreter is for correctness, not speed).

    python benchmarks/kernels.py [--sizes 1e6 25.6e6 100e6] [--repeats 5] [--record]

Ops (fp32 gradient, DGC ratio 0.1 %):
  compensate     fused momentum correction: reads g, u, v; writes u, v           (20 B/element)
  compensate_nesterov  the same with Nesterov momentum                            (20 B/element)
  dgc_step       compensate + sampled top-k selection + masking of the k sent    (28 B/element)
  exact_topk     compensate + exact torch.topk + masking (what DGC replaces)     (not a limit row)
  pack_signs     1 bit per element                                               (4.125 B/element)
  quantize_4bit  QSGD, 7 levels, 4-bit codes, incl. the norm pass                (8.5 B/element)
  select_each    the gradient as 54 tensors (ResNet-50 compresses 54), each selected alone
  select_bucket  the same 54 tensors selected together (kernels.sampled_topk_segments_)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from lightning_gc import kernels
from lightning_gc.kernels import selection


def _triton_selection() -> ModuleType:  # imported only where Triton runs (a CUDA device)
    from lightning_gc.kernels import selection_triton

    return selection_triton


RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
RATIO = 0.001
BYTES_PER_ELEMENT = {
    "compensate": 20.0,
    "compensate_nesterov": 20.0,
    "dgc_step": 28.0,
    "pack_signs": 4.125,
    "quantize_4bit": 8.5,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - started


def copy_bandwidth(numel: int, device: torch.device, repeats: int) -> float:
    """Bytes per second of a large device copy, counting the read and the write."""
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = statistics.median(_timed(lambda: dst.copy_(src), device) for _ in range(repeats))
    return 2 * src.numel() * src.element_size() / seconds


def make_ops(numel: int, device: torch.device) -> dict[str, Callable[[], object]]:
    gen = torch.Generator(device=device).manual_seed(0)
    g = torch.randn(numel, device=device, generator=gen)
    u = torch.zeros(numel, device=device)
    v = torch.zeros(numel, device=device)
    k = max(1, int(numel * RATIO))
    indices = torch.empty(k, dtype=torch.int64, device=device)
    values = torch.empty(k, device=device)
    scratch = kernels.SelectionScratch()

    def compensate() -> None:
        kernels.compensate_(g, v, u, momentum=0.9)

    def dgc_step() -> None:
        compensate()
        kernels.sampled_topk_(v, k, sample_ratio=0.01, salt=1, scratch=scratch, out_indices=indices, out_values=values)
        kernels.commit_sparse_(v, u, indices, values)

    def exact_topk() -> None:
        compensate()
        chosen = torch.topk(v.abs(), k, sorted=False).indices
        kernels.commit_sparse_(v, u, chosen, v[chosen])

    tensors = 54
    size = numel // tensors
    numels = [size] * (tensors - 1) + [numel - size * (tensors - 1)]
    starts = [i * size for i in range(tensors)]
    ks = [max(1, int(n * RATIO)) for n in numels]
    firsts = [sum(ks[:i]) for i in range(tensors)]
    bucket = kernels.SegmentedTopK(tuple(starts), tuple(numels), tuple(ks), tuple(firsts), tuple(range(tensors)))
    bucket_indices = torch.empty(bucket.total_k, dtype=torch.int64, device=device)
    bucket_values = torch.empty(bucket.total_k, device=device)
    selecting = dict(sample_ratio=0.01, step_salt=1, scratch=scratch, out_indices=bucket_indices,
                     out_values=bucket_values)  # fmt: skip

    def select_each() -> None:
        one = selection.sampled_topk_ if kernels.backend_for(v) == "torch" else _triton_selection().sampled_topk_
        selection.sampled_one_at_a_time(one, v, bucket, **selecting)

    def select_bucket() -> None:
        kernels.sampled_topk_segments_(v, bucket, **selecting)

    def quantize_4bit() -> None:  # QSGD's default: 7 levels, one norm per 512 elements
        norms = torch.linalg.vector_norm(torch.nn.functional.pad(g, (0, -g.numel() % 512)).view(-1, 512), dim=1)
        kernels.stochastic_quantize(g, norms, 7, 3, 512)

    return {
        "compensate": compensate,
        "compensate_nesterov": lambda: kernels.compensate_(g, v, u, momentum=0.9, nesterov=True),
        "dgc_step": dgc_step,
        "exact_topk": exact_topk,
        "pack_signs": lambda: kernels.pack_signs(g),
        "quantize_4bit": quantize_4bit,
        "select_each": select_each,
        "select_bucket": select_bucket,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 25.6e6, 100e6])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    device = torch.device(args.device)
    backends = ["torch", "triton"] if device.type == "cuda" else ["torch"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    bandwidth = copy_bandwidth(int(50e6), device, args.repeats)
    print(f"device: {name}; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")

    rows = []
    for size in args.sizes:
        numel = int(size)
        ops = make_ops(numel, device)
        times: dict[tuple[str, str], list[float]] = {}
        for backend in backends:  # warm-up: compilation, allocation, first-touch page faults
            with kernels.use_backend(backend):
                for fn in ops.values():
                    fn()
        for _ in range(args.repeats):
            for op, fn in ops.items():
                for backend in backends:  # interleaved, so drift hits every row alike
                    with kernels.use_backend(backend):
                        times.setdefault((op, backend), []).append(_timed(fn, device))
        for op in ops:
            limit = BYTES_PER_ELEMENT[op] * numel / bandwidth if op in BYTES_PER_ELEMENT else None
            medians = {b: statistics.median(times[(op, b)]) for b in backends}
            rows.append((numel, op, medians, limit))
            cells = "  ".join(f"{b} {m * 1e3:9.2f} ms" for b, m in medians.items())
            vs_limit = "  ".join(f"{b}/limit {m / limit:5.2f}" for b, m in medians.items()) if limit else ""
            print(f"{numel:>11,}  {op:19s} {cells}  {vs_limit}")
        timed = {op: medians for n, op, medians, _ in rows if n == numel}
        for b in backends:
            print(f"{numel:>11,}  exact_topk / dgc_step ({b}) = {timed['exact_topk'][b] / timed['dgc_step'][b]:.1f}x")
            print(f"{numel:>11,}  select_each / select_bucket ({b}) = "
                  f"{timed['select_each'][b] / timed['select_bucket'][b]:.1f}x")  # fmt: skip
        del ops

    if args.record:
        with RESULTS.open("a") as f:
            f.write(
                f"\n### `python benchmarks/kernels.py --repeats {args.repeats} --record` — {name}, "
                f"{time.strftime('%Y-%m-%d')}, copy bandwidth {bandwidth / 1e9:.1f} GB/s\n\n"
                "| elements | op | " + " | ".join(f"{b} (ms)" for b in backends) + " | "
                + " | ".join(f"{b} / traffic limit" for b in backends) + " |\n"
                "|---|---|" + "---|" * (2 * len(backends)) + "\n"
            )  # fmt: skip
            for numel, op, medians, limit in rows:
                ms = " | ".join(f"{medians[b] * 1e3:.2f}" for b in backends)
                ratio = " | ".join(f"{medians[b] / limit:.2f}" if limit else "—" for b in backends)
                f.write(f"| {numel:,} | {op} | {ms} | {ratio} |\n")


if __name__ == "__main__":
    main()
