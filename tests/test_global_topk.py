"""The global top-k exchange (lightning_gc.exchanges.global_topk): its schedule, its merge, the
agreed positions and their exact average, its traffic, and training on real gloo process groups
(tests/workers/attach_worker.py)."""

from __future__ import annotations

import math
from collections import defaultdict, deque
from pathlib import Path

import pytest
import torch
from conftest import launch_ranks, layout_of

from lightning_gc import DGCStrategy, GradientCompressionStrategy
from lightning_gc.common.layout import BucketLayout
from lightning_gc.compressors import registry
from lightning_gc.compressors.base import EncodeContext
from lightning_gc.compressors.encoded import Encoded
from lightning_gc.compressors.sparse import EXCHANGES
from lightning_gc.exchanges.global_topk import (
    CandidateSlots,
    GlobalTopKExchange,
    agreed_positions,
    merge_candidates,
    selection_rounds,
)
from lightning_gc.exchanges.transport import LocalTransport, traffic_bytes

SHAPES = [(30, 20), (50,), (7, 9), (100,), (16, 16)]


def make_layout(shapes: list[tuple[int, ...]] = SHAPES) -> BucketLayout:
    return layout_of(shapes)


def simulate(compressors: list, velocities: list[torch.Tensor], layout: BucketLayout, step: int = 0) -> tuple:
    """One global top-k exchange among ``len(compressors)`` ranks in this process: every rank's
    rounds run as far as their messages allow (a message is posted when its round is reached and
    taken when the receiver's round is), then the all-reduce is summed by hand and every rank
    decodes. Returns every rank's decoded average, final round, wire traffic, and the values its
    memory was told it sent (before the all-reduce overwrote them)."""
    n = len(compressors)
    current: list[Encoded] = [
        c.encode(v, torch.empty_like(v), EncodeContext(layout, step, n, r))
        for r, (c, v) in enumerate(zip(compressors, velocities))
    ]
    mailbox: dict[tuple[int, int], deque] = defaultdict(deque)
    posted, traffic = [False] * n, [0.0] * n
    while any(e.payload.peer is not None for e in current):
        progress = False
        for rank, encoded in enumerate(current):
            peer = encoded.payload.peer
            if peer is None:
                continue
            if not posted[rank] and peer.to is not None:
                mailbox[(rank, peer.to)].append(peer.payload.clone())
                posted[rank], progress = True, True
            if peer.source is not None:
                if not mailbox[(peer.source, rank)]:
                    continue
                peer.into.copy_(mailbox[(peer.source, rank)].popleft())
            traffic[rank] += traffic_bytes(encoded.payload, n)
            current[rank], posted[rank], progress = encoded.next_round(), False, True
        assert progress, "the rounds deadlock"
    assert not any(mailbox.values()), "a message was never received"
    sent = [e.sent.values.clone() for e in current]
    total = sum(e.payload.summed.double() for e in current)
    outs = []
    for compressor, encoded in zip(compressors, current):
        traffic[len(outs)] += traffic_bytes(encoded.payload, n)
        encoded.payload.summed.copy_(total)
        out = torch.empty(layout.numel)
        compressor.decode(encoded, out, world_size=n)
        outs.append(out)
    return outs, current, traffic, sent


def global_topk(n: int, name: str = "topk", **arguments) -> list[GlobalTopKExchange]:
    """Each of ``n`` ranks' global top-k exchange of the compressor ``name`` (rounds run by hand)."""
    settings = {"compress_ratio": 0.05, "min_compress_numel": 10, "exchange": "global_topk", **arguments}
    return [GlobalTopKExchange(LocalTransport(n, r), registry.create(name, **settings)) for r in range(n)]


# ------------------------------------------------------------------------------------- the schedule
@pytest.mark.parametrize("world_size", [*range(1, 10), 12, 16])
def test_the_rounds_pair_up_and_leave_every_rank_with_everyones_candidates(world_size: int) -> None:
    """Sets as plain unions: after the rounds every rank holds all ranks' candidates, every message
    is received in the round it was sent for, and no rank takes more than log2(P) + 2 rounds."""
    sets = [{rank} for rank in range(world_size)]
    rounds = [selection_rounds(world_size, rank) for rank in range(world_size)]
    position = [0] * world_size
    mailbox: dict[tuple[int, int], deque] = defaultdict(deque)
    posted = [False] * world_size
    while any(p < len(r) for p, r in zip(position, rounds)):
        progress = False
        for rank in range(world_size):
            if position[rank] == len(rounds[rank]):
                continue
            current = rounds[rank][position[rank]]
            if current.to is not None and not posted[rank]:
                mailbox[(rank, current.to)].append(set(sets[rank]))
                posted[rank] = progress = True
            if current.source is not None:
                if not mailbox[(current.source, rank)]:
                    continue
                theirs = mailbox[(current.source, rank)].popleft()
                sets[rank] = theirs if current.adopt else sets[rank] | theirs
            position[rank] += 1
            posted[rank], progress = False, True
        assert progress, "deadlock"
    assert all(s == set(range(world_size)) for s in sets)
    power = 1 << (world_size.bit_length() - 1)
    assert max(len(r) for r in rounds) <= int(math.log2(power)) + 2
    assert all(len(r) == int(math.log2(power)) for r in rounds) == (power == world_size)
    with pytest.raises(ValueError, match="rank 4 is not one of 4 ranks"):
        selection_rounds(4, 4)


# ------------------------------------------------------------------------------------- the merge
def reference_merge(
    slots: list[tuple[int, int, int]], a: dict[int, float], b: dict[int, float]
) -> list[dict[int, float]]:
    """Per tensor ``(start, stop, k)``: the summed candidates, the k largest |value|, ties to the lower position."""
    summed = dict(a)
    for position, value in b.items():
        summed[position] = summed.get(position, 0.0) + value
    kept = []
    for start, stop, k in slots:
        mine = sorted(((p, v) for p, v in summed.items() if start <= p < stop), key=lambda pv: (-abs(pv[1]), pv[0]))
        kept.append(dict(mine[:k]))
    return kept


def test_merge_adds_shared_positions_keeps_each_tensors_k_largest_and_is_symmetric() -> None:
    layout = make_layout([(40, 5), (9,), (10, 10)])
    compressed = [(layout.segments[0], 6, 0), (layout.segments[2], 4, 6)]
    slots = CandidateSlots.of(compressed, torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)

    def candidates() -> tuple[torch.Tensor, torch.Tensor]:
        first = torch.randperm(30, generator=generator)[:6] + layout.segments[0].start  # overlapping ranges
        second = torch.randperm(12, generator=generator)[:4] + layout.segments[2].start
        values = torch.randint(-3, 4, (10,), generator=generator).float()  # small integers: many ties
        return torch.cat([first, second]), values

    for _ in range(20):
        a, b = candidates(), candidates()
        ab = (torch.empty(10, dtype=torch.int64), torch.empty(10))
        ba = (torch.empty(10, dtype=torch.int64), torch.empty(10))
        merge_candidates(slots, a, b, ab)
        merge_candidates(slots, b, a, ba)
        assert torch.equal(ab[0], ba[0]) and torch.equal(ab[1], ba[1])
        want = reference_merge(
            [(s.start, s.stop, k) for s, k, _ in compressed],
            dict(zip(a[0].tolist(), a[1].tolist())),
            dict(zip(b[0].tolist(), b[1].tolist())),
        )
        for (_, k, first), expected in zip(compressed, want):
            got = dict(zip(ab[0][first : first + k].tolist(), ab[1][first : first + k].tolist()))
            assert got == expected
            magnitudes = ab[1][first : first + k].abs()
            assert torch.equal(magnitudes, magnitudes.sort(descending=True).values)


def test_a_tensor_short_of_k_distinct_candidates_is_filled_with_its_lowest_free_positions() -> None:
    layout = make_layout([(4, 5), (3, 3)])
    compressed = [(layout.segments[0], 3, 0), (layout.segments[1], 2, 3)]
    slots = CandidateSlots.of(compressed, torch.device("cpu"))
    # the first tensor holds one distinct position (a selection padded with no-op pairs)
    candidates = torch.tensor([7, 7, 0, 22, 24])
    assert agreed_positions(slots, candidates).tolist() == [0, 1, 7, 22, 24]
    assert agreed_positions(slots, torch.tensor([3, 1, 2, 20, 21])).tolist() == [1, 2, 3, 20, 21]


# ------------------------------------------------------------------------------------- the exchange
@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(
    "arguments",
    [{}, {"name": "dgc"}, {"index_encoding": "elias_fano", "value_dtype": "float16"}],
    ids=["topk", "dgc", "elias_fano-fp16"],
)
def test_every_rank_agrees_on_k_positions_per_tensor_and_gets_their_exact_average(world_size: int, arguments) -> None:
    layout = make_layout()
    compressors = global_topk(world_size, **arguments)
    generator = torch.Generator().manual_seed(world_size)
    velocities = [torch.randn(layout.numel, generator=generator) for _ in range(world_size)]
    outs, final, _, sent_values = simulate(compressors, [v.clone() for v in velocities], layout)
    agreed = final[0].sent.indices
    for encoded, out in zip(final[1:], outs[1:]):
        assert torch.equal(encoded.sent.indices, agreed) and torch.equal(out, outs[0])
    for segment in layout.segments[0], layout.segments[2], layout.segments[4]:  # compressed: exactly k each
        inside = ((agreed >= segment.start) & (agreed < segment.stop)).sum().item()
        assert inside == math.ceil(0.05 * segment.numel)
    assert agreed.unique().numel() == agreed.numel()
    mean = sum(velocities) / world_size
    sent = torch.cat([agreed, final[0].sent.dense_positions])
    torch.testing.assert_close(outs[0][sent], mean[sent], rtol=1e-6, atol=1e-7)
    unsent = torch.ones(layout.numel, dtype=torch.bool)
    unsent[sent] = False
    assert not outs[0][unsent].any()
    for told, velocity in zip(sent_values, velocities):  # memory is told each rank's exact values there
        assert torch.equal(told, velocity[agreed])


def test_the_agreed_positions_hold_most_of_the_global_top_ks_mass() -> None:
    """Selection from merged local candidates, not from the sum itself: on 8 ranks whose
    gradients share a signal, the agreed positions hold at least 90 % of the |sum| that the true
    top-k of the sum holds; with equal velocities they are each rank's own top-k."""
    layout = make_layout([(64, 64)])
    world_size, k = 8, math.ceil(0.05 * 64 * 64)
    generator = torch.Generator().manual_seed(0)
    signal = torch.randn(layout.numel, generator=generator) * 2
    velocities = [signal + torch.randn(layout.numel, generator=generator) for _ in range(world_size)]
    _, final, _, _ = simulate(global_topk(world_size), [v.clone() for v in velocities], layout)
    total = sum(velocities).abs()
    captured = total[final[0].sent.indices].sum() / total.topk(k).values.sum()
    assert captured > 0.9, captured
    _, same, _, _ = simulate(global_topk(4), [signal.clone() for _ in range(4)], layout)
    assert torch.equal(same[0].sent.indices, signal.abs().topk(k).indices.sort().values)


def test_traffic_per_rank_grows_with_log_n_and_undercuts_the_gather_from_four_ranks() -> None:
    """Per rank: log2(N) messages of the pairs' payload plus a ring all-reduce of the agreed
    values, exactly; against (N-1) payloads gathered."""
    layout = make_layout([(128, 256), (256,), (64, 128)])
    gather = registry.create("topk", compress_ratio=0.01)
    payload = gather.wire_bytes(layout, 4) - 256 * 4  # the pairs without the dense bias
    for world_size in (2, 4, 8, 16):
        velocities = [torch.randn(layout.numel)] * world_size
        _, final, traffic, _ = simulate(global_topk(world_size, compress_ratio=0.01), velocities, layout)
        summed = final[0].payload.summed.numel() * 4
        want = math.log2(world_size) * payload + 2 * (world_size - 1) / world_size * summed
        assert all(math.isclose(t, want) for t in traffic), (world_size, traffic, want)
        gathered = (world_size - 1) * payload + 2 * (world_size - 1) / world_size * 256 * 4
        assert (traffic[0] < gathered) == (world_size >= 4), (world_size, traffic[0], gathered)
    agreed = registry.create("topk", compress_ratio=0.01, exchange="global_topk")
    assert agreed.wire_bytes(layout, 4) == payload + summed


def test_exchange_is_checked_where_it_is_written_and_recorded() -> None:
    assert EXCHANGES == ("gather", "global_topk")
    assert DGCStrategy(exchange="global_topk").compressor.config()["exchange"] == "global_topk"
    assert GradientCompressionStrategy("topk", exchange="global_topk").compressor.exchange == "global_topk"
    with pytest.raises(ValueError, match=r"exchange.*'gather', 'global_topk'.*'globaltopk'"):
        registry.create("dgc", exchange="globaltopk")
    with pytest.raises(ValueError, match=r"exchange='global_topk'.*'randomk'.*topk and dgc"):
        GradientCompressionStrategy("randomk", exchange="global_topk")
    with pytest.raises(ValueError, match=r"exchange='two_phase'.*sparse compressors.*\['gather', 'global_topk'\]"):
        DGCStrategy(exchange="two_phase")


# ------------------------------------------------------------------------------------------- gloo
GLOBAL = {"exchange": "global_topk"}


def test_global_topk_trains_like_ddp_where_it_must_and_keeps_ranks_identical(tmp_path: Path) -> None:
    """Three real gloo ranks (not a power of two: a rank folds in and gets the result back; four
    ranks across nodes are in tests/test_hierarchy.py) through ``attach`` with DGC (momentum
    correction, Nesterov, weight decay):
    agreeing on every position is DDP; at 5 % the ranks stay bitwise identical, stay about as
    close to DDP as the gathered exchange, and a run rebuilt from its state after step 6 ends
    where the uninterrupted one does (to the all-reduce's rounding); delay 1 works on it."""
    sparse = {"compressor": "dgc", "optimizer": "sgd", "steps": 12, "kwargs": {"compress_ratio": 0.05, **GLOBAL}}
    runs = [
        {"compressor": None, "optimizer": "sgd", "steps": 12},
        {"compressor": "dgc", "optimizer": "sgd", "steps": 12, "kwargs": {"compress_ratio": 0.9999, **GLOBAL}},
        {"compressor": "dgc", "optimizer": "sgd", "steps": 12, "kwargs": {"compress_ratio": 0.05}},
        sparse,
        {**sparse, "resume_after": 6},
        {**sparse, "kwargs": {**sparse["kwargs"], "delay": 1}},
    ]
    ranks = launch_ranks("attach_worker.py", {"runs": runs}, tmp_path, world_size=3)
    ddp, everything, gathered, agreed, resumed, delayed = ranks[0]

    def distance(run: dict) -> float:
        return ((run["params"] - ddp["params"]).abs().max() / ddp["params"].abs().max()).item()

    assert distance(everything) < 1e-5
    assert 0 < distance(agreed) < 2 * distance(gathered)
    # the all-reduce sums three or more ranks in an order that follows DDP's bucket layout, which a
    # fresh DDP has differently until its rebuild: a resume is exact to rounding (a plain DDP
    # all-reduce resumed on 3 ranks differs by the same 1e-8); bitwise on 2 (tests/test_hierarchy.py)
    torch.testing.assert_close(resumed["params"], agreed["params"], rtol=0, atol=1e-6)
    assert torch.isfinite(delayed["params"]).all() and not torch.equal(delayed["params"], agreed["params"])
    for other in ranks[1:]:
        for ours, theirs in zip(ranks[0], other):
            assert torch.equal(ours["params"], theirs["params"])


def test_the_codecs_exchange_argument_chooses_the_exchange_and_each_checks_its_capability() -> None:
    """``exchange=`` chooses the implementation (:func:`exchange_for`); an exchange refuses a codec
    without the capability it asks for, naming it and those that have it; the flat pipeline refuses
    a codec whose argument names another exchange rather than gathering it."""
    from lightning_gc.core.memory import CompensationMemory
    from lightning_gc.exchanges.base import FlatExchange
    from lightning_gc.exchanges.pipeline import BucketJob
    from lightning_gc.exchanges.select import exchange_for
    from lightning_gc.exchanges.two_phase import TwoPhaseExchange

    transport = LocalTransport(4)
    assert type(exchange_for(registry.create("dgc", exchange="global_topk"), transport)) is GlobalTopKExchange
    assert type(exchange_for(registry.create("dgc"), transport)) is FlatExchange
    assert type(exchange_for(registry.create("qsgd", exchange="auto"), transport)) is TwoPhaseExchange
    assert type(exchange_for(registry.create("powersgd"), transport)) is FlatExchange
    for chosen in (
        exchange_for(registry.create(n, exchange=e), transport)
        for n, e in [("dgc", "global_topk"), ("fft", "two_phase")]
    ):
        # the rounds the pipeline's decode callback holds on the backend's thread hold no process group
        assert not any(isinstance(value, (LocalTransport, FlatExchange)) for value in vars(chosen.rounds).values())
    with pytest.raises(ValueError, match=r"exchange='global_topk'.*'onebit'.*\['dgc', .*'topk'\]"):
        GlobalTopKExchange(transport, registry.create("onebit"))
    with pytest.raises(ValueError, match=r"exchange='two_phase'.*'dgc'.*\['bf16', 'fft'"):
        TwoPhaseExchange(transport, registry.create("dgc"))
    layout = make_layout()
    grad = torch.randn(layout.numel)
    memory = CompensationMemory(momentum_correction=False, momentum_masking=False, clip_norm=None)
    job = BucketJob(registry.create("dgc", exchange="global_topk"), memory, grad, layout, 0)
    with pytest.raises(ValueError, match=r"'dgc' asks for exchange='global_topk' at 4 ranks.*exchange_for"):
        FlatExchange(transport).run(job)
