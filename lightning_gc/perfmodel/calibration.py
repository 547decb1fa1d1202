"""Encode/decode cost of a compressor on this device, measured on a representative gradient.

Times exactly what the comm hook runs per step on one rank (see :mod:`lightning_gc.runtime.hook`)::

    encode_s = finiteness screen + compensate (memory) + every round of compressor.encode + commit
               (- the optimizer's momentum update, when momentum correction takes it over)
    decode_s = compressor.decode of ``world_size`` ranks' payloads (+ the commit, for compressors
               whose residual needs the aggregate)

with the collectives replaced by local stand-ins (the world's payloads are this rank's, repeated),
and reports the bytes all rounds would all-reduce (``summed``) and all-gather (``gathered``).
Steps are numbered from :data:`STEADY_STEP`, past any warm-up a compressor runs dense (PowerSGD's
``start_iter``), so the steady state is what is timed.

Decoding an all-gather costs one decode per rank's payload, ``decode_s(N) = c + N d`` (``c``: the
mean and the dense parts, ``d``: unpacking one payload and adding it), and that is slow to time
at large ``N``: 16 qsgd payloads of 2**23 elements take 1.3 s per step on a 2-core CPU, 128 take
10 s. A world of more than :data:`TIMED_RANKS` ranks is therefore first timed with that many
payloads; when decoding all ``N`` would take longer than :data:`SCALE_ABOVE_S` over the timed
steps, its decode is scaled by ``N / TIMED_RANKS`` instead (``(N - 1) / (TIMED_RANKS - 1)`` for a
codec that adds its own row from what encode kept: ``Compressor.decodes_own_row``): exact for
``d``, an over-estimate by about ``c (N / TIMED_RANKS - 1)``, which is small where this applies
because ``d`` dominates there
(qsgd and onebit at ``N = 16``: within 7 % of timing all 16). Cheap decodes, where ``c`` may
dominate (DGC at 0.1 %: 2.5 ms for 16 payloads, of which scaling would make 7.5), are timed at
``N``; the threshold is a time, so on a loaded machine more decodes pass it (the perfmodel CLI
names every scaled one). All-reduced payloads (decoded once, whatever ``N``) and rounds whose
bytes or work depend on ``N`` otherwise (two-phase chunks, global top-k's merge rounds) are always
timed at ``N``.
Medians over ``repeats`` after one warm-up round. Results can be cached in a JSON file keyed by
compressor configuration, gradient shapes, world size, device and torch version.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_gc.common.layout import BucketLayout, Segment
from lightning_gc.compressors.base import Compressor
from lightning_gc.compressors.registry import argument_names, available, create
from lightning_gc.core.guard import StepGuard
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.core.momentum import MomentumSpec
from lightning_gc.exchanges.pipeline import BucketJob, run_bucket
from lightning_gc.exchanges.select import rounds_for
from lightning_gc.exchanges.timeline import DECODE_SIDE, ENCODE_SIDE, Timeline
from lightning_gc.exchanges.transport import LocalTransport
from lightning_gc.perfmodel import CodecCost

COLUMNS = 1024
STEADY_STEP = 1_000_000
TIMED_RANKS = 4
"""Gathered payloads decoded while timing a larger world whose decode is scaled (module docstring)."""
SCALE_ABOVE_S = 1.0
"""Decodes whose timed steps would take longer than this at the full world size are scaled."""


def layout_of_shapes(shapes: Sequence[tuple[int, ...]]) -> BucketLayout:
    """One bucket holding tensors of ``shapes`` back to back (names ``t0``, ``t1``, ...)."""
    segments, start = [], 0
    for order, shape in enumerate(shapes):
        segment = Segment(name=f"t{order}", order=order, start=start, shape=tuple(shape))
        segments.append(segment)
        start = segment.stop
    return BucketLayout(index=0, segments=tuple(segments), param_ids=tuple(range(len(segments))))


def representative_shapes(numel: int) -> list[tuple[int, ...]]:
    """A ``numel``-element gradient as one ``(rows, 1024)`` weight matrix plus a 1-D remainder."""
    rows, rest = divmod(numel, COLUMNS)
    shapes: list[tuple[int, ...]] = [(rows, COLUMNS)] if rows else []
    return shapes + ([(rest,)] if rest else [])


def module_shapes(module: torch.nn.Module) -> list[tuple[int, ...]]:
    """Shapes of ``module``'s trainable parameters, in ``parameters()`` order."""
    return [tuple(p.shape) for p in module.parameters() if p.requires_grad]


def parse_arguments(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``["compress_ratio=0.001", ...]`` -> per compressor name, the arguments it accepts."""
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"`--arg` must look like NAME=VALUE, got {item!r}")
        try:
            parsed[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            parsed[key] = text
    per_name = {}
    for name in available():
        from lightning_gc.compressors.registry import compressor_class

        accepted = argument_names(compressor_class(name))
        per_name[name] = {k: v for k, v in parsed.items() if k in accepted}
    unused = sorted(set(parsed) - {k for args in per_name.values() for k in args})
    if unused:
        raise ValueError(f"`--arg` names {unused}, which no registered compressor takes")
    return per_name


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _OptimizerMomentum:
    """``torch.optim.SGD``'s momentum update over a gradient (``buf <- m*buf + g``), the
    work DGC's momentum correction takes out of the optimizer."""

    def __init__(self, grad: torch.Tensor, momentum: float) -> None:
        self.grad, self.momentum = grad, momentum
        self.buffer = torch.zeros_like(grad)

    def time(self, device: torch.device) -> float:
        _sync(device)
        started = time.perf_counter()
        self.buffer.mul_(self.momentum).add_(self.grad)
        _sync(device)
        return time.perf_counter() - started


def time_codec(
    compressor: Compressor,
    shapes: Sequence[tuple[int, ...]],
    *,
    world_size: int,
    device: str | torch.device = "cpu",
    repeats: int = 3,
    momentum: float = 0.0,
    gradients: Sequence[torch.Tensor] | None = None,
) -> CodecCost:
    """Measure ``compressor`` on a gradient of ``shapes`` (one bucket); see the module docstring.

    ``momentum`` > 0 adds DGC's momentum correction to the compensation, as ``DGCStrategy`` runs it.
    That work moves out of the optimizer (its step becomes momentum-free), so the optimizer's
    momentum update it replaces (``buf <- m*buf + g`` over the gradient) is timed alongside and
    subtracted: ``encode_s`` is the step's net added cost, which is what the model adds to ``C``.
    ``gradients``: flat gradients of the real model, used in turn (default: one standard normal
    gradient). Real gradients matter for data-dependent compressors: how DGC's candidates spread
    over the tensor, and whether the sampled threshold needs a retry, depend on the data.
    """
    two_phase = compressor.exchange_form(world_size) == "two_phase"
    timed_ranks = world_size if two_phase else min(world_size, TIMED_RANKS)
    cost = _time_at(compressor, shapes, timed_ranks, device, repeats, momentum, gradients)
    if timed_ranks == world_size:
        return cost
    own = 0 if compressor.decodes_own_row else 1  # a row added from what encode kept costs no decode
    scaled = dataclasses.replace(
        cost, decode_s=cost.decode_s * (world_size - own) / (timed_ranks - own), decode_timed_ranks=timed_ranks
    )
    # only an all-gather's decode grows with N (an all-reduced payload is decoded once), and only a
    # plain one's: two-phase chunks and merge rounds depend on N otherwise
    plain_gather = cost.gathered_bytes > 0 and not (cost.two_phase_bytes or cost.peer_messages)
    if plain_gather and scaled.decode_s * (repeats + 1) > SCALE_ABOVE_S:
        return scaled
    return _time_at(compressor, shapes, world_size, device, repeats, momentum, gradients)


def _time_at(
    compressor: Compressor,
    shapes: Sequence[tuple[int, ...]],
    world_size: int,
    device: str | torch.device,
    repeats: int,
    momentum: float,
    gradients: Sequence[torch.Tensor] | None,
) -> CodecCost:
    """:func:`time_codec` in a world of exactly ``world_size`` ranks."""
    device = torch.device(device)
    layout = layout_of_shapes(shapes)
    memory = CompensationMemory(
        momentum_correction=momentum > 0,
        momentum_masking=True,
        clip_norm=None,
        error_feedback=compressor.biased or momentum > 0,
    )
    memory.set_specs({s.name: MomentumSpec(momentum=momentum) for s in layout.segments})
    if gradients is None:
        generator = torch.Generator(device=device).manual_seed(0)
        gradients = [torch.randn(layout.numel, device=device, generator=generator)]
    grad = torch.empty(layout.numel, device=device)
    bucket = memory.bucket(layout, grad)
    guard = StepGuard("raise", memory, compressor)  # the hook's default screen, host sync included
    encode_times, decode_times = [], []
    moved = _OptimizerMomentum(grad, momentum) if momentum > 0 else None
    two_phase = compressor.exchange_form(world_size) == "two_phase"
    # the chosen exchange's rounds (its plans kept across steps), over a fresh counting transport each step
    rounds = rounds_for(compressor, LocalTransport(world_size))
    for step in range(repeats + 1):  # step 0 warms up buffers and plans
        grad.copy_(gradients[step % len(gradients)].reshape(-1))
        timeline, exchange = Timeline(sync=lambda: _sync(device)), LocalTransport(world_size)
        job = BucketJob(compressor, memory, grad, layout, STEADY_STEP + step, guard=guard, timeline=timeline)
        run_bucket(job, bucket, exchange, rounds).averaged.wait()
        moved_s = 0.0 if moved is None else moved.time(device)
        if step:
            encode_times.append(max(0.0, timeline.seconds(*ENCODE_SIDE) - moved_s))
            decode_times.append(timeline.seconds(*DECODE_SIDE))
    return CodecCost(  # a two-phase payload is the all-to-all's; its all-gather is the second phase
        name=compressor.name,
        summed_bytes=exchange.summed_bytes,
        gathered_bytes=0 if two_phase else exchange.gathered_bytes,
        encode_s=statistics.median(encode_times),
        decode_s=statistics.median(decode_times),
        two_phase_bytes=exchange.scattered_bytes if two_phase else 0,
        peer_bytes=exchange.peer_bytes,
        peer_messages=exchange.peer_messages,
    )


CACHE_VERSION = 6
"""Bumped when :class:`~lightning_gc.perfmodel.CodecCost` gains a field or codecs get faster: older
entries are timed anew (version 2: point-to-point bytes and rounds; 3: decodes scaled from fewer
payloads; 4: the quantisers' CPU paths 2.6-3.7x faster and two-phase's own chunk left exact; 5: the
gathered quantisers' own row not decoded; 6: two-phase rounds decode rows of their chunks' formats)."""


def _cache_key(
    compressor: Compressor,
    shapes: Sequence[tuple[int, ...]],
    world_size: int,
    device: str,
    momentum: float,
    gradients: Sequence[torch.Tensor] | None,
) -> str:
    digest = hashlib.sha1(repr(list(shapes)).encode())
    for gradient in gradients or []:
        digest.update(gradient.reshape(-1)[:4096].detach().cpu().numpy().tobytes())
    config = json.dumps(compressor.config(), sort_keys=True, default=str)
    return (
        f"{config}|data={digest.hexdigest()[:12]}|p={world_size}|m={momentum}|{device}|torch={torch.__version__}"
        f"|v{CACHE_VERSION}"
    )


BUSY = "timed_busy"
"""Marks a cached timing taken on a loaded machine (see :func:`codec_cost`)."""


def codec_cost(
    name: str,
    numel_or_shapes: int | Sequence[tuple[int, ...]],
    *,
    world_size: int,
    arguments: dict[str, Any] | None = None,
    device: str = "cpu",
    measured: tuple[float, float] | None = None,
    cache: Path | None = None,
    repeats: int = 3,
    momentum: float = 0.0,
    gradients: Sequence[torch.Tensor] | None = None,
    busy: bool = False,
) -> CodecCost:
    """The :class:`~lightning_gc.perfmodel.CodecCost` of compressor ``name`` (built from ``arguments``).

    ``measured=(encode_s, decode_s)`` replaces the timing (the byte counts still come from one
    real encode); ``cache`` is a JSON file read before and updated after timing; ``gradients``:
    see :func:`time_codec`. ``busy``: the machine is loaded, so a timing taken now is kept only
    until a run on a quiet machine times it again (a busy run reads any entry).
    """
    compressor = create(name, **(arguments or {}))
    shapes = representative_shapes(numel_or_shapes) if isinstance(numel_or_shapes, int) else list(numel_or_shapes)
    if measured is not None:
        sizes = time_codec(
            compressor, shapes, world_size=world_size, device=device, repeats=1, momentum=momentum, gradients=gradients
        )
        return dataclasses.replace(sizes, encode_s=measured[0], decode_s=measured[1], decode_timed_ranks=0)
    key = _cache_key(compressor, shapes, world_size, device, momentum, gradients)
    stored = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}
    entry = dict(stored.get(key, {}))
    taken_busy = entry.pop(BUSY, False)
    if entry and (busy or not taken_busy):
        return CodecCost(**entry)
    cost = time_codec(
        compressor,
        shapes,
        world_size=world_size,
        device=device,
        repeats=repeats,
        momentum=momentum,
        gradients=gradients,
    )
    if cache is not None:
        stored = json.loads(cache.read_text()) if cache.exists() else {}  # what others added while this timed
        stored[key] = {**cost.__dict__, **({BUSY: True} if busy else {})}
        _write_atomically(cache, json.dumps(stored, indent=1, sort_keys=True))
    return cost


def _write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` in one rename, so that a process reading it at the same time
    (netbench calibrates on both of its cores at once) sees the old file or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
