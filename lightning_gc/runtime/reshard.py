"""A checkpoint entry written by ``N`` ranks, turned into one for ``M`` ranks (resume at another world size).

Per-rank state is owed to the global update, which averages over the ranks: what the next updates
owe is the *mean over ranks* of the residuals (velocities ``v``), of DGC's momenta ``u`` (future
``v <- v + u`` terms), of the delayed contributions in flight (``own.i`` under ``local_update``,
the carries), and, with ``local_update``, of the ranks' own parameters and SGD states (the update
is linear there). The rule: **every new rank gets the old mean**, ``x'_r' = (1/N) sum_r x_r`` for
each of these tensors, computed in float64 and rounded once to the state's dtype. Invariant::

    (1/M) sum_r' x'_r'  ==  (1/N) sum_r x_r        rounded once to x's dtype
                                                   (bit for bit where the ranks held the same x)

and ``v`` includes a two-phase server error folded into it (below): ``mean(v) + e`` is conserved.

Why the mean on every rank and not all of it on rank 0 (``(M/N) sum_r x_r`` there, zero
elsewhere), which conserves the same mean: (1) state that every rank holds alike (delayed averages
``average.i``, a dense tensor's SGD momentum, PowerSGD's ``Q``, step counters) stays alike, copied
bit for bit, and a round trip ``N -> M -> N`` returns the same bits; (2) top-k selection and
momentum factor masking see on every rank a residual of the scale its own gradients have, so each
rank's threshold and its masking of ``u`` behave as in the run that wrote it; on rank 0 alone the
residual is ``M`` times larger, fills that rank's top-k for many steps and crowds out its fresh
gradient, while the other ranks mask nothing. The price: at first every rank sends the inherited
values at the same positions (decoded as their mean, exactly what is owed), so the union of
positions is smaller than it will be once fresh gradients differ.

Whole-tensor state that is cut into per-rank pieces is re-cut instead: the two-phase server errors
(the exchange's state, :mod:`lightning_gc.exchanges.two_phase`, under ``"exchange"``; in the
compressor's state in checkpoints written before it moved, converted here; rank ``j`` owns piece
``j`` of ``N`` of every tensor,
:func:`~lightning_gc.common.layout.piece_bounds`) are reassembled from the ``N`` owners' pieces and
cut into ``M`` pieces, bit for bit. Where the saved ``exchange`` runs no two-phase form on ``M``
ranks (``"auto"`` below three), the whole error ``e`` is added to every rank's velocity instead
(it was owed to the mean, and ``mean(v + e) = mean(v) + e``), with a notice. PowerSGD's ``Q`` is
an all-reduced mean, the same on every rank: kept; where the ranks differ it restarts from its
seeded start, with a notice naming it. Refused (``IncompatibleCheckpoint``, naming it): state of
``hierarchy="node"`` (each rank holds its piece of every residual in node-sum units; the new
topology is known only once DDP is attached), server errors in the old whole-tensor form, and a
compressor's own state that differs across ranks and that this module does not know.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_gc.common.errors import IncompatibleCheckpoint
from lightning_gc.common.layout import piece_bounds
from lightning_gc.common.log import warn_on_rank_zero
from lightning_gc.compressors.chunks import runs_two_phase
from lightning_gc.exchanges.two_phase import EXCHANGE, PIECES, SERVER, SERVER_FORM, WORLD_SIZE, split_server_state

_MISSING = object()
"""A rank without the entry (a tensor it never bound): it counts as zeros in a mean."""


def reshard(entry: dict[str, Any], world_size: int, *, source: Any = "(in memory)") -> dict[str, Any]:
    """``entry`` (:func:`~lightning_gc.runtime.checkpoint.gather_entry`'s, complete) for ``world_size``
    ranks, by the rule of the module docstring; ``entry`` is left as it is. The new ranks' states
    are distinct dicts whose tensors (new ones) may be shared between ranks: load, do not write.

    Raises:
        IncompatibleCheckpoint: state that cannot be re-sharded (module docstring), named.
    """
    saved, ranks = int(entry["world_size"]), entry.get("ranks")
    if world_size < 1 or ranks is None or len(ranks) != saved:
        raise ValueError(f"cannot re-shard {source}: world_size={world_size}, {saved} ranks saved, ranks={ranks!r:.40}")
    if world_size == saved:
        return dict(entry)
    shapes = sorted({tuple(state["hierarchy"]) for state in ranks if state.get("hierarchy")})
    if shapes:
        raise IncompatibleCheckpoint(
            f"checkpoint {source} holds the compression state of {saved} ranks under hierarchy='node' with "
            f"(nodes, devices per node)={shapes[0]} and this run has world_size={world_size}: each rank holds "
            f"its piece of every tensor's residual in node-sum units, which is not re-sharded; resume with "
            f"{saved} processes"
        )
    config = entry.get("compressor") or {}
    numels = {
        name: tensors["velocity"].numel()
        for state in ranks
        for name, tensors in state.get("memory", {}).items()
        if "velocity" in tensors
    }
    split = [_split(state) for state in ranks]
    compressors = _compressor_states([codec for codec, _ in split], config, saved, world_size, source)
    exchanges, folded = _server_errors([exchange for _, exchange in split], config, saved, world_size, numels, source)
    memory = _mean_tree([state.get("memory", {}) for state in ranks], saved, "memory")
    for name, error in folded.items():  # owed to the mean: every rank's velocity takes it whole
        tensors = [state.get("memory", {}).get(name, {}).get("velocity", _MISSING) for state in ranks]
        memory.setdefault(name, {})["velocity"] = _mean(tensors, saved, f"memory.{name}.velocity", plus=error)
    own = ("memory", "compressor", "exchange")
    rest = _mean_tree([{k: v for k, v in s.items() if k not in own} for s in ranks], saved, "")
    warn_on_rank_zero(
        f"lightning_gc: checkpoint {source} holds the compression state of {saved} ranks and this run has "
        f"{world_size}: every rank resumes with the saved ranks' mean residuals, momenta and delayed "
        "contributions (what the next updates owe is kept)"
    )
    return {
        **entry,
        "world_size": world_size,
        "ranks": [
            {
                **rest,
                "memory": dict(memory),
                "compressor": compressors[r],
                **({"exchange": exchanges[r]} if exchanges[r] else {}),
            }
            for r in range(world_size)
        ],
    }


def _split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A saved rank's codec state and exchange state (server errors); a checkpoint written before
    they moved to the exchange holds them in the codec's (converted here)."""
    if "exchange" in state:
        return state.get("compressor", {}), state["exchange"]
    return split_server_state(state.get("compressor", {}))


# ---------------------------------------------------------------------- means
def _mean(values: Sequence[Any], count: int, where: str, plus: torch.Tensor | None = None) -> torch.Tensor:
    """``(1/count) sum(values) + plus`` in float64, rounded once to the values' dtype (missing ones
    are zeros); a copy of the value where every rank holds the same and nothing is added."""
    present = [value for value in values if value is not _MISSING]
    first = (present or [plus])[0]
    assert first is not None
    if any(value.shape != first.shape for value in present) or (plus is not None and plus.numel() != first.numel()):
        raise IncompatibleCheckpoint(
            f"the compression state {where} has shapes {sorted({tuple(v.shape) for v in present})} on the saved "
            "ranks (a corrupt checkpoint?): it cannot be re-sharded"
        )
    if plus is None and len(present) == count and all(torch.equal(first, value) for value in present[1:]):
        return first.clone()
    if not first.is_floating_point():  # counters and the like: the same on every rank, rank 0's
        return first.clone()
    total = torch.zeros(first.shape, dtype=torch.float64)
    for value in present:
        total += value.detach().to("cpu", torch.float64)
    total /= count
    if plus is not None:
        total += plus.detach().to("cpu", torch.float64).reshape(first.shape)
    return total.to(first.dtype)


def _mean_tree(values: Sequence[Any], count: int, where: str) -> Any:
    """Every tensor of the nested dicts, lists and tuples ``values`` (one per saved rank) by
    :func:`_mean`; any other leaf is the first rank's (step counters, settings: alike on every rank)."""
    present = [value for value in values if value is not _MISSING]
    first = present[0]
    if isinstance(first, torch.Tensor):
        return _mean(values, count, where)
    if isinstance(first, dict):
        keys = dict.fromkeys(key for value in present for key in value)
        return {
            key: _mean_tree(
                [v.get(key, _MISSING) if isinstance(v, dict) else _MISSING for v in values], count, f"{where}.{key}"
            )
            for key in keys
        }
    if isinstance(first, (list, tuple)) and all(len(v) == len(first) for v in present):
        items = [
            _mean_tree([v[i] if v is not _MISSING else _MISSING for v in values], count, f"{where}[{i}]")
            for i in range(len(first))
        ]
        return type(first)(items) if isinstance(first, list) else tuple(items)
    return first


def _same(a: Any, b: Any) -> bool:
    """Whether two nested states are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _names(names: Sequence[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


# ---------------------------------------------------------------------- compressor state
def _compressor_states(
    states: list[dict[str, Any]], config: dict[str, Any], saved: int, world_size: int, source: Any
) -> list[dict[str, Any]]:
    """Each new rank's compressor state."""
    name = config.get("name", "?")
    if not any(states):
        return [{} for _ in range(world_size)]
    if all(set(state) <= {"q"} for state in states):  # PowerSGD's warm-start factors
        factors = _warm_starts(states, name, saved, world_size)
        return [{"q": factors} for _ in range(world_size)]
    if all(_same(states[0], state) for state in states[1:]):
        return [states[0] for _ in range(world_size)]
    raise IncompatibleCheckpoint(
        f"checkpoint {source}: compressor {name!r} keeps state {sorted(states[0])} that differs across the {saved} "
        f"saved ranks and is not re-sharded; resume with {saved} processes"
    )


def _warm_starts(states: list[dict[str, Any]], name: str, saved: int, world_size: int) -> dict[str, torch.Tensor]:
    """PowerSGD's ``Q`` by parameter: kept where every rank holds the same (the all-reduced mean)."""
    factors = [state.get("q", {}) for state in states]
    kept, dropped = {}, []
    for tensor in dict.fromkeys(key for q in factors for key in q):
        values = [q.get(tensor) for q in factors]
        if all(v is not None and torch.equal(v, values[0]) for v in values):
            kept[tensor] = values[0].clone()
        else:
            dropped.append(tensor)
    if dropped:
        warn_on_rank_zero(
            f"lightning_gc: compressor {name!r}: the warm-start factors Q of {_names(dropped)} differ across the "
            f"{saved} saved ranks and restart from their seeded start on {world_size} ranks"
        )
    return kept


def _server_errors(
    states: list[dict[str, Any]],
    config: dict[str, Any],
    saved: int,
    world_size: int,
    numels: dict[str, int],
    source: Any,
) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """Each new rank's exchange state: the two-phase server errors reassembled from the owners'
    pieces and cut for ``world_size`` ranks, or (no two-phase form there) folded into every
    velocity (module docstring)."""
    name = config.get("name", "?")
    if not any(states):
        return [{} for _ in range(world_size)], {}
    exchange = next((s[EXCHANGE] for s in states if s.get(EXCHANGE)), config.get("exchange"))
    pieces = [state.get(SERVER, {}) for state in states]
    nonzero = any(t.any() for server in pieces for entry in server.values() for t in entry.values())
    if not (nonzero or any(s.get(EXCHANGE) for s in states)):  # older checkpoints' zeros: no one's correction
        return [{} for _ in range(world_size)], {}
    if any(state and state.get(SERVER_FORM) != PIECES for state in states):
        raise IncompatibleCheckpoint(
            f"checkpoint {source}: compressor {name!r} holds its server error feedback as whole tensors, the "
            f"form before each rank kept its piece; it is not re-sharded: resume with {saved} processes"
        )
    chunked = sorted({s.get(WORLD_SIZE, saved) for s in states if s} - {saved})
    if chunked:
        raise IncompatibleCheckpoint(
            f"checkpoint {source}: compressor {name!r}'s server errors are chunked for {chunked[0]} ranks but "
            f"{saved} ranks saved them (a corrupt checkpoint?): they cannot be re-sharded"
        )
    wholes = {}
    for tensor in dict.fromkeys(key for server in pieces for key in server):
        owned = [server.get(tensor, {}).get(SERVER) for server in pieces]
        like = next(piece for piece in owned if piece is not None)
        numel = numels.get(tensor, sum(piece.numel() for piece in owned if piece is not None))
        whole = torch.zeros(numel, dtype=like.dtype)
        for rank, piece in enumerate(owned):
            low, high = piece_bounds(numel, rank, saved)
            if piece is None:
                continue  # never bound: zeros
            if piece.numel() != high - low:
                raise IncompatibleCheckpoint(
                    f"checkpoint {source}: rank {rank}'s server error of {tensor!r} has {piece.numel()} elements, "
                    f"piece {rank} of {saved} of its {numel} has {high - low}: it cannot be re-sharded"
                )
            whole[low:high] = piece.detach().cpu().reshape(-1)
        wholes[tensor] = whole
    if runs_two_phase(exchange, world_size):
        cut = []
        for rank in range(world_size):
            server = {}
            for tensor, whole in wholes.items():
                low, high = piece_bounds(whole.numel(), rank, world_size)
                if low < high:
                    server[tensor] = {SERVER: whole[low:high].clone()}
            cut.append({SERVER: server, EXCHANGE: exchange, SERVER_FORM: PIECES, WORLD_SIZE: world_size})
        return cut, {}
    warn_on_rank_zero(
        f"lightning_gc: compressor {name!r} with exchange={exchange!r} runs no two-phase exchange on {world_size} "
        f"ranks: the server errors of {_names(list(wholes))} join every rank's residual, which owes them alike"
    )
    return [{} for _ in range(world_size)], wholes
