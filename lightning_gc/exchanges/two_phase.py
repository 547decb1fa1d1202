"""The two-phase exchange: a compressed all-reduce whose traffic per rank does not grow with N.

Gathering quantised payloads costs every rank ``(N-1) M/c`` bytes for a bucket of ``M`` bytes
compressed ``c`` times, more than a dense ring all-reduce (``2 (N-1)/N M``) once ``N > 2c``.
The two-phase exchange (DeepSpeed's compressed all-reduce for 1-bit Adam, Tang et al. 2021,
Alg. 1; Bagua's ByteGrad; CGX) gives every rank ``j`` a chunk of the bucket to own: the ``j``-th
of ``N`` equal pieces of every tensor in it::

    phase 1, all-to-all:  rank i sends p_ij = encode(v_i[chunk j]) to rank j, for every j != i
    at rank j:            a_j = (1/N) (v_j[chunk j] + sum_{i != j} decode(p_ij))   the chunk's mean
                          s_j = a_j + e_j ;  q_j = encode(s_j) ;  e_j <- s_j - decode(q_j)
    phase 2, all-gather:  every rank receives every q_j and writes decode(q_j) into chunk j

The exchange asks the codec for its chunk capability
(:class:`~lightning_gc.compressors.chunks.ChunkCodec`: encode and decode any run of segments into
a payload of a size known in advance); the codec knows nothing of chunks' owners, rounds or the
server error. Chunks made of per-tensor pieces make who owns an element, how it is encoded (scales
per piece, random rounding salted by step, sender, chunk and tensor) and so the whole result
independent of how DDP buckets the parameters: the same before and after DDP's bucket rebuild and
across a resume.

Worker error feedback is the memory's, as in the gathered form: the rank's residual keeps
``v_i - decode(p_i*)``. A rank's own chunk never leaves it, so it is neither encoded nor decoded:
it enters the mean exactly and leaves no worker error (DeepSpeed's compressed all-reduce encodes
it too): less noise and ``1/N`` less codec work. Nor does the owner decode its re-encoded chunk
again in phase 2: it kept ``decode(q_j)`` for the server error. Server error feedback ``e_j``
keeps what re-encoding the mean dropped (the codec's ``server_feedback`` argument; by default on
for ``fft`` only, see :attr:`~lightning_gc.compressors.chunks.ExchangeChoice.server_feedback_default`).
It is this exchange's state: it lives on the rank that owns the chunk, and only for that chunk
(``1/N`` of the bucket): this rank's piece of each tensor, stored by parameter name like the
memory's residuals (:class:`~lightning_gc.common.flatstate.FlatState`: it survives DDP's bucket
rebuild) and returned by :meth:`TwoPhaseExchange.state_dict`, so checkpoints hold it per rank
(under ``"exchange"``; older ones held it in the compressor's state: :func:`split_server_state`
converts them) and a resume is exact. (DeepSpeed resets both buffers on load.) A resume at
another world size re-cuts the pieces for the new chunks (:mod:`lightning_gc.runtime.reshard`).

Bytes per rank: phase 1 sends ``N-1`` rows of one chunk's payload ``P ~ M/(cN)`` (its own stays),
phase 2 one row: ``N P ~ M/c`` reported as sent, as the gathered form reports its payload. On the
wire (:func:`~lightning_gc.exchanges.transport.traffic_bytes`) phase 2's row goes to ``N-1`` peers:
``2 (N-1)/N M/c`` in all, flat in ``N``, against ``(N-1) M/c`` for the gathered form. Every
chunk's payload is padded to the largest, ``P``; scales are per piece (``N`` times a per-tensor
codec's, a few bytes each).

Memory: what the owner computes on its chunk (sum, mean, re-encoded mean, server error) lives in
runs of the chunk's size, its pieces packed back to back (:func:`~lightning_gc.common.layout.packed_layout`;
its payload format is the chunk's, byte for byte). The bucket-sized buffers are this rank's decoded
contribution (the memory's error feedback needs it whole) and, below float32, decode's float32 sums.

The cost: the first phase must arrive before the owner averages; the comm hook waits for it at
the next bucket's hook, after launching that bucket's first phase (as for PowerSGD's first round:
every rank launches every collective from the hooks, in one order; :mod:`lightning_gc.exchanges.pipeline`),
and the owner re-encodes its chunk. The last bucket's phases cannot hide behind backward. With
``exchange="auto"`` the two-phase form is used from ``N = 3`` on: at ``N = 2`` both send the same
bytes and the gathered form needs one collective less; there, and for a job of another codec (the
hook's exact fallback for a bucket where compression does not pay), this exchange runs the codec's
own rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gc.common.errors import IncompatibleCheckpoint
from lightning_gc.common.flatstate import FlatState
from lightning_gc.common.layout import BucketLayout, Segment, chunk_segments, packed_layout
from lightning_gc.compressors.base import Compressor, EncodeContext, PlanCache
from lightning_gc.compressors.chunks import ChunkFormat, ExchangeChoice, encode_seed, two_phase_compressors
from lightning_gc.compressors.encoded import Encoded, Payload, Sent
from lightning_gc.compressors.numerics import aligned, summing_dtype
from lightning_gc.exchanges.base import CodecRounds, RoundsExchange
from lightning_gc.exchanges.transport import Transport

SERVER, EXCHANGE, SERVER_FORM, WORLD_SIZE = "server", "exchange", "server_form", "world_size"
PIECES = "pieces"
"""``SERVER_FORM`` of a checkpoint whose server errors are each rank's piece of each tensor (the
form before it held whole tensors, and named no form)."""
STATE_KEYS = (SERVER, EXCHANGE, SERVER_FORM, WORLD_SIZE)
"""What :meth:`TwoPhaseExchange.state_dict` holds (and what compressor state held before it moved)."""


@dataclass
class _TwoPhasePlan:
    """One bucket's two-phase formats and buffers at one rank (built once per layout, world size,
    rank, dtype). Only ``own_decoded`` (and, below float32, ``decode_total``) is bucket-sized: what
    the owner computes on its chunk lives in runs of the chunk's size (``owned``: ``1/N`` of the
    bucket), addressed by ``owned_format``, whose payload is ``formats[rank]``'s byte for byte.

    ``gathered`` is ``received``: phase 1's rows are read whole by :meth:`TwoPhaseExchange._server_round`
    before phase 2 is launched, and the all-gather is ordered after those reads (on the host for
    gloo; on NCCL the collective's stream waits for the current stream at launch). Phase 1's rows
    are not ``scattered``, whose sends a point-to-point all-to-all may still be reading."""

    formats: tuple[ChunkFormat, ...]  # chunk j's pieces at their bucket positions, and its payload format
    owned_format: ChunkFormat  # this rank's chunk, its pieces packed back to back in a run
    scattered: torch.Tensor  # uint8 N x P: row j for rank j
    received: torch.Tensor  # uint8 N x P: row i from rank i
    server_payload: torch.Tensor  # uint8 P: this rank's re-encoded chunk mean
    gathered: torch.Tensor  # uint8 N x P: every rank's re-encoded chunk mean; ``received``'s memory
    own_decoded: torch.Tensor  # velocity dtype, bucket-sized: this rank's values as receivers decode them
    owned_total: torch.Tensor  # summing-dtype run: the sum, then the mean, of the chunk; from float32 up, owned_values
    owned_values: torch.Tensor  # velocity dtype run: s_j
    owned_decoded: torch.Tensor  # velocity dtype run: decode(q_j)
    decode_total: torch.Tensor | None  # float32, bucket-sized: decode's sums below float32; None: they sum in out
    server: torch.Tensor | None  # velocity dtype run: server error e_j (views of the by-name store); None: no feedback
    owner: int = -1  # the chunk this rank re-encoded (owned_decoded holds its decoded mean); -1: none yet


class TwoPhaseExchange(RoundsExchange):
    """The two-phase form of an :class:`~lightning_gc.compressors.chunks.ExchangeChoice` codec over
    ``transport`` (module docstring; its rounds and server errors: :class:`TwoPhaseRounds`); the
    codec's own rounds where its ``exchange`` does not ask for the two-phase form at this world size.

    Raises:
        ValueError: ``codec`` cannot encode chunks (named, with those that can).
    """

    form = "two_phase"
    rounds: TwoPhaseRounds

    def __init__(self, transport: Transport, codec: Compressor) -> None:
        if not isinstance(codec, ExchangeChoice):
            raise ValueError(
                f"exchange='two_phase' re-encodes averaged chunks, which compressor {codec.name!r} cannot; "
                f"use one of {two_phase_compressors()}"
            )
        super().__init__(transport, TwoPhaseRounds(codec))

    def state_dict(self) -> dict[str, Any]:
        """The server errors (:meth:`TwoPhaseRounds.state_dict`)."""
        return self.rounds.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds.load_state_dict(state)

    def snapshot(self, previous: Any = None) -> Any:
        return self.rounds.snapshot(previous)

    def restore(self, snapshot: Any) -> None:
        self.rounds.restore(snapshot)


class TwoPhaseRounds(CodecRounds):
    """The two-phase rounds of one codec at one rank (module docstring), and the server errors of
    the chunks this rank owns."""

    def __init__(self, codec: ExchangeChoice) -> None:
        assert isinstance(codec, Compressor)
        super().__init__(codec)
        self.chunk = codec  # the codec's chunk capability and the user's exchange arguments
        self._server = FlatState((SERVER,))
        self._server_used = False  # a two-phase plan with server feedback was built: state to save
        self._server_world_size: int | None = None  # the world size of that plan (None: not known)
        self._plans: PlanCache[_TwoPhasePlan] = PlanCache(by_rank=True)

    # ------------------------------------------------------------------ encode and decode
    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        plan = self._plans.get(
            self.codec,
            context,
            velocity,
            lambda layout, like, n: self._build_two_phase_plan(layout, like, n, context.rank),
        )
        rows = plan.scattered.view(context.world_size, -1)
        for chunk, fmt in enumerate(plan.formats):
            if chunk == context.rank:  # stays here: enters the mean exactly (_server_round)
                _copy_pieces(fmt.segments, plan.own_decoded, velocity)
                continue
            seed = encode_seed(context.step, context.rank, chunk)
            self.chunk.encode_chunk(velocity, fmt, rows[chunk, : fmt.nbytes], plan.own_decoded, seed)
        rows_out = plan.scattered.numel() // context.world_size * (context.world_size - 1)
        payload = Payload(
            scattered=plan.scattered,
            scattered_out=plan.received,
            bytes_sent=rows_out,  # its own row stays here: with phase 2's row, N rows ~ the gathered payload
            elements_sent=velocity.numel(),
            stand_in=lambda: self._stand_in_chunks(plan, velocity, context),
        )
        return Encoded(payload, context=plan, next_round=lambda: self._server_round(plan, context))

    def _stand_in_chunks(self, plan: _TwoPhasePlan, velocity: torch.Tensor, context: EncodeContext) -> None:
        """Phase 1 without collectives: every rank sends this rank its chunk of ``velocity``, encoded
        as this rank would have encoded it (it keeps its own chunk exact, so no row of ``scattered``
        holds it); the owner's run buffers, free until :meth:`_server_round`, are the scratch."""
        owned, rows = plan.owned_format, plan.received.view(context.world_size, -1)
        _copy_pieces(owned.segments, plan.owned_values, _views(plan.formats[context.rank].segments, velocity))
        seed = encode_seed(context.step, context.rank, context.rank)
        self.chunk.encode_chunk(plan.owned_values, owned, rows[0, : owned.nbytes], plan.owned_decoded, seed)
        rows[1:].copy_(rows[0].expand_as(rows[1:]))

    def _server_round(self, plan: _TwoPhasePlan, context: EncodeContext) -> Encoded:
        """Phase 2 at rank ``r`` once every rank's chunk ``r`` arrived: average, add the server
        error, re-encode, keep what re-encoding dropped; the payload goes to every rank."""
        rank, world_size = context.rank, context.world_size
        fmt, owned = plan.formats[rank], plan.owned_format
        _copy_pieces(owned.segments, plan.owned_total, _views(fmt.segments, plan.own_decoded))  # own values, exact
        for sender, row in enumerate(plan.received.view(world_size, -1)):
            if sender != rank:
                self.chunk.add_decoded_chunk(row[: fmt.nbytes], owned, plan.owned_total, plan.own_decoded.dtype)
        plan.owned_total.div_(world_size)  # the mean in the summing dtype, then in the velocity's
        if plan.owned_total is not plan.owned_values:
            plan.owned_values.copy_(plan.owned_total)
        # a parameter no rank used: DDP drops what is decoded for it, so its server error stays out
        fed = [piece for piece in owned.segments if piece.name not in context.unused]
        if plan.server is not None and fed:
            torch._foreach_add_(_views(fed, plan.owned_values), _views(fed, plan.server))
        seed = encode_seed(context.step, world_size + rank, rank)
        self.chunk.encode_chunk(plan.owned_values, owned, plan.server_payload[: fmt.nbytes], plan.owned_decoded, seed)
        if plan.server is not None and fed:
            errors = torch._foreach_sub(_views(fed, plan.owned_values), _views(fed, plan.owned_decoded))
            _copy_pieces(fed, plan.server, errors)
        plan.owner = rank
        payload = Payload.all_gather(
            plan.server_payload,
            plan.gathered,
            elements_sent=0,  # counted with phase 1: the same values, averaged
            stand_in=lambda: self._stand_in_means(plan, rank, world_size),
        )
        return Encoded(payload, Sent.whole(plan.own_decoded), context=plan)

    @staticmethod
    def _stand_in_means(plan: _TwoPhasePlan, rank: int, world_size: int) -> None:
        """Phase 2 without collectives: rank ``j``'s re-encoded mean of chunk ``j`` stands in as
        what this rank sent it in phase 1 (chunk ``j``'s format); this rank's own, as re-encoded."""
        rows = plan.gathered.view(world_size, -1)
        rows.copy_(plan.scattered.view(world_size, -1))
        rows[rank].copy_(plan.server_payload)

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        plan = encoded.context
        total = out if plan.decode_total is None else plan.decode_total  # fp16 sums in float32: it could overflow
        total.zero_()
        # the chunk this rank re-encoded is decoded already, bit for bit what its row decodes to in
        # float32 (the codec's contract); in fp16 those values were rounded, so decode the row again
        reuse = plan.owner if plan.owned_decoded.dtype == torch.float32 else -1
        for chunk, (row, fmt) in enumerate(zip(plan.gathered.view(world_size, -1), plan.formats)):
            if chunk == reuse:
                _copy_pieces(fmt.segments, total, _views(plan.owned_format.segments, plan.owned_decoded))
            else:
                self.chunk.add_decoded_chunk(row[: fmt.nbytes], fmt, total, out.dtype)
        if total is not out:
            out.copy_(total)

    # ------------------------------------------------------------------ plan and state
    def _build_two_phase_plan(
        self, layout: BucketLayout, like: torch.Tensor, world_size: int, rank: int
    ) -> _TwoPhasePlan:
        chunks = [chunk_segments(layout, j, world_size) for j in range(world_size)]
        formats = tuple(self.chunk.chunk_format(pieces, like.dtype) for pieces in chunks)
        owned = packed_layout(layout, chunks[rank])  # the owner's run: its format's payload is formats[rank]'s
        row = aligned(max(1, *(f.nbytes for f in formats)))  # collectives of empty rows are not portable

        def payload(rows: int) -> torch.Tensor:
            return torch.zeros(rows * row, dtype=torch.uint8, device=like.device)

        received = payload(world_size)
        owned_values = like.new_zeros(owned.numel)
        summing = summing_dtype(like.dtype)  # float32 and wider: the chunk's sum becomes its mean in place,
        in_place = summing == like.dtype  # and decode sums in out
        return _TwoPhasePlan(
            formats=formats,
            owned_format=self.chunk.chunk_format(owned.segments, like.dtype),
            scattered=payload(world_size),
            received=received,
            server_payload=payload(1),
            gathered=received,  # phase 2 lands where phase 1 did, once the owner has summed it
            own_decoded=like.new_zeros(layout.numel),
            owned_total=owned_values if in_place else owned_values.new_zeros(owned.numel, dtype=summing),
            owned_values=owned_values,
            owned_decoded=like.new_zeros(owned.numel),
            decode_total=None if in_place else like.new_zeros(layout.numel, dtype=summing),
            server=self._bind_server(owned, like, world_size),
        )

    def _bind_server(self, owned: BucketLayout, like: torch.Tensor, world_size: int) -> torch.Tensor | None:
        """The server error run of the owner's chunk ``owned`` of ``world_size`` (``None`` without
        the feedback)."""
        if not self.chunk.server_feedback:
            return None
        self._server_used, self._server_world_size = True, world_size
        return self._server.bind(owned, like, (SERVER,))[SERVER]

    def state_dict(self) -> dict[str, Any]:
        """The server errors by parameter name (this rank's piece of each tensor), the ``exchange``
        that uses them, the world size they are chunked for and their form (empty until a two-phase
        step with ``server_feedback`` ran). Every rank that ran one names the exchange, also one
        whose chunk holds no piece, so that every rank refuses a resume that would drop the errors."""
        server = self._server.state_dict()
        if not (server or self._server_used):
            return {}
        state = {SERVER: server, EXCHANGE: self.chunk.exchange, SERVER_FORM: PIECES}
        if self._server_world_size is not None:
            state[WORLD_SIZE] = self._server_world_size
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output. A server error is someone's pending correction:
        a run that would not add it (no ``server_feedback``, or an ``exchange`` that does not run the
        two-phase form at the checkpoint's world size, which a resume keeps) is refused rather than
        dropping it; ``"two_phase"`` and ``"auto"`` resume each other where both run it."""
        kinds = [SERVER, EXCHANGE, SERVER_FORM, WORLD_SIZE]
        unknown = sorted(set(state) - set(kinds))
        if unknown:
            raise ValueError(
                f"the two-phase exchange of compressor {self.codec.name!r} keeps only {kinds} state, "
                f"got entries {unknown}"
            )
        server, saved, world_size = state.get(SERVER, {}), state.get(EXCHANGE), state.get(WORLD_SIZE)
        # every rank that ran the feedback names the exchange, so every rank refuses alike; older
        # checkpoints held zeros without the feedback and did not name the exchange
        holds = saved is not None or any(t.any() for entry in server.values() for t in entry.values())
        if holds and state.get(SERVER_FORM) != PIECES:
            raise IncompatibleCheckpoint(
                f"compressor {self.codec.name!r}: the checkpoint holds the server error feedback as whole tensors, "
                f"the form before each rank kept only its piece of each tensor; this version cannot read it "
                f"(resume with the version that wrote it, or start from the model weights alone)"
            )
        if holds:
            saved = saved or self.chunk.exchange
            # checkpoints before the world size was saved: only the same exchange is known to run it
            runs_it = self.chunk.exchange == saved or (world_size is not None and self.chunk.two_phase_at(world_size))
            if not self.chunk.server_feedback or not runs_it:
                raise IncompatibleCheckpoint(
                    f"compressor {self.codec.name!r}: the checkpoint holds the server error feedback of a run with "
                    f"exchange={saved!r}, server_feedback=True, and this run has exchange={self.chunk.exchange!r}, "
                    f"server_feedback={self.chunk.server_feedback!r}, which would drop it; resume with "
                    f"exchange={saved!r}, server_feedback=True"
                )
        # older checkpoints' zeros are no one's correction, and not in the form this version saves
        self._server.load_state_dict(server if holds else {})
        self._server_used, self._server_world_size = saved is not None, world_size
        self._plans.clear()  # plans hold views of the replaced buffers

    def snapshot(self, previous: Any = None) -> Any:
        """The server errors as copies on their device (:meth:`FlatState.snapshot`), with whether
        and at which world size the feedback ran."""
        kept = previous[0] if isinstance(previous, tuple) else None
        return self._server.snapshot(kept), self._server_used, self._server_world_size

    def restore(self, snapshot: Any) -> None:
        server, self._server_used, self._server_world_size = snapshot
        self._server.restore(server)  # in place: the plans' server runs stay bound


def _views(pieces: Sequence[Segment], flat: torch.Tensor) -> list[torch.Tensor]:
    """Each piece's view of ``flat`` (the run the pieces address: a bucket, or a packed chunk)."""
    return [piece.of(flat) for piece in pieces]


def _copy_pieces(pieces: Sequence[Segment], into: torch.Tensor, source: torch.Tensor | Sequence[torch.Tensor]) -> None:
    """``into[piece] <- source[piece]`` for every piece (``source`` the run they address, or one
    tensor per piece), in one multi-tensor op: on a GPU one launch for a chunk's dozens of pieces."""
    if pieces:
        sources = _views(pieces, source) if isinstance(source, torch.Tensor) else list(source)
        torch._foreach_copy_(_views(pieces, into), sources)


def split_server_state(compressor_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A rank's compressor state written before the server errors moved to the exchange, split into
    the codec's own state and the exchange's (:meth:`TwoPhaseExchange.state_dict`'s keys); states
    written since come back as they are, with no exchange state."""
    codec = {k: v for k, v in compressor_state.items() if k not in STATE_KEYS}
    return codec, {k: v for k, v in compressor_state.items() if k in STATE_KEYS}
