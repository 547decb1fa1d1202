"""SparseLoCo's codec: top-k per 64x64 chunk, 2-bit values, packed in-chunk indices, error feedback.

SparseLoCo (Sarfi et al. 2025, arXiv:2508.15706) sends, of each pseudo-gradient, the largest
values of every chunk of a weight matrix, each in 2 bits, with the in-chunk position in 12 bits.
This codec does the same for any bucket (the outer loop's flat pseudo-gradient, or a DDP bucket).

**Chunks.** A compressed tensor (:func:`~lightning_gc.compressors.base.compressible`: more than one
dimension and at least ``min_compress_numel`` elements) is read as the matrix
``[shape[0], numel / shape[0]]`` (a conv weight ``[out, in, kh, kw]`` as ``[out, in*kh*kw]``) and
tiled, row-major, into square chunks of ``S x S`` (``S = chunk_side``, 64: SparseLoCo's 64x64).
Ragged edges: the last chunk row / column is cut short (``r x c`` with ``r, c <= S``); it keeps its
slot numbering ``u * S + v`` within the full ``S x S`` square. 1-D tensors (biases, norms) and
small ones are not chunked: they go dense, exactly (float32 values in an all-reduce beside the
payload), as with every codec of this library (DGC section 3); SparseLoCo instead chunks them too.

**Selection.** Chunk ``b`` of ``n_b`` elements sends exactly ``k_b = min(n_b, ceil(ratio * n_b))``
values, its largest by magnitude (``torch.topk`` per chunk, all chunks of the bucket at once).

**2-bit values** (sign + one of two magnitude levels per chunk). Of chunk ``b``'s selected values
``x_i`` with ``a_i = |x_i|`` and mean ``m_b = mean_i a_i``, the *high* ones are ``a_i >= m_b``, the
*low* ones the rest; the chunk's two levels are the means of ``a_i`` over each group (one step of
Lloyd's algorithm from the split at the mean: the least-squares levels for that split; an empty
group's level is 0, unused), rounded to bfloat16 (fp32's range: no overflow, no underflow to 0 of
small pseudo-gradients). Value ``i`` is sent as the code ``(high << 1) | (x_i < 0)`` and decoded
as ``(-1)^negative * level_b[high]`` in the bucket's dtype. The decoded values are what memory
commits (``Sent.values``), so the residual keeps ``e - decode(sent)``: error feedback is exact and
what 2 bits round away is sent later. (SparseLoCo's reference code instead quantises each tensor's
selected values to 4 bins of a per-tensor lookup table; the two-level split per chunk needs no
table and adapts to each chunk's scale.)

**Wire** (one all-gathered ``uint8`` payload per bucket, each field padded to 4 bytes, with
``K = sum_b k_b`` pairs over ``B`` chunks and ``w = max(1, bit_length(S*S - 1))`` bits per index,
12 for 64x64)::

    levels   B x 2 bfloat16            (low, high) per chunk        4 B bytes
    codes    K x 2 bits, 4 per byte    sign | high << 1             ceil(K / 4) bytes
    indices  K x w bits, bit stream    in-chunk slot u * S + v      ceil(K w / 8) bytes

so ``wire_bytes = aligned(4 B) + aligned(ceil(K / 4)) + aligned(ceil(K w / 8)) + 4 * dense``
(``dense``: elements of the uncompressed tensors, in float32). Pairs are in chunk order, and within
a chunk by decreasing magnitude; a chunk's ``k_b`` is known from the layout, so no count travels.
At ratio 0.02 a full 64x64 chunk sends ``k = 82`` pairs in 4 + 20.5 + 123 bytes: ~111x fewer
than its 16 KiB in float32.

**Decode.** ``out = (1/N) sum_r scatter(positions_r, decoded_r)``, added rank after rank (each
rank's positions are distinct), so every rank computes the same bits on any device; the dense
tensors' all-reduced sum divided by ``N``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_gc import kernels
from lightning_gc.common.layout import BucketLayout, Segment
from lightning_gc.common.validation import check_int
from lightning_gc.compressors.base import AdjustableRatio, EncodeContext, PlannedCompressor, split_segments
from lightning_gc.compressors.dense import DensePart, decode_whole_bucket, encode_whole_bucket
from lightning_gc.compressors.encoded import Encoded, Payload, Sent
from lightning_gc.compressors.numerics import aligned
from lightning_gc.compressors.registry import register

LEVEL_DTYPE = torch.bfloat16
"""The dtype of each chunk's two magnitude levels on the wire."""
CODE_BITS = 2


def index_bits(chunk_side: int) -> int:
    """Bits of an in-chunk slot ``u * S + v`` in ``[0, S*S)``: ``max(1, bit_length(S*S - 1))``."""
    return max(1, (chunk_side * chunk_side - 1).bit_length())


def widened(levels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``levels`` (bfloat16) in ``dtype``, saturated at its largest finite value (a level of float16's
    65504 rounds up to 65536 in bfloat16): the one rule sender and receivers decode by."""
    wide = levels.float()
    if torch.finfo(dtype).max < torch.finfo(wide.dtype).max:
        wide.clamp_(max=torch.finfo(dtype).max)
    return wide.to(dtype)


@dataclass(frozen=True)
class ChunkWire:
    """Byte offsets of one bucket's payload fields (module docstring), for ``chunks`` chunks and
    ``pairs`` selected values at ``width`` bits per index."""

    chunks: int
    pairs: int
    width: int

    @property
    def levels_bytes(self) -> int:
        return aligned(self.chunks * 2 * LEVEL_DTYPE.itemsize)

    @property
    def codes_bytes(self) -> int:
        return aligned(-(-self.pairs * CODE_BITS // 8))

    @property
    def index_bytes(self) -> int:
        return aligned(-(-self.pairs * self.width // 8))

    @property
    def nbytes(self) -> int:
        return self.levels_bytes + self.codes_bytes + self.index_bytes

    def fields(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (levels, codes, indices) byte columns of ``rows`` (``[ranks, nbytes]`` or ``[nbytes]``)."""
        a, b = self.levels_bytes, self.levels_bytes + self.codes_bytes
        return rows[..., :a], rows[..., a:b], rows[..., b : self.nbytes]


def pack_slots(slots: torch.Tensor, width: int, field: torch.Tensor) -> None:
    """Write ``slots`` (int32, each ``< 2**width``) into the zeroed uint8 ``field`` as the bit stream
    of the module docstring (bit ``j`` of slot ``i`` at bit ``i*width + j``, little-end first). At 12
    bits (64x64 chunks) two slots are three bytes, built with int32 shifts: ``a & 255``,
    ``a >> 8 | (b & 15) << 4``, ``b >> 4``; other widths go through one uint8 per bit."""
    needed = -(-slots.numel() * width // 8)
    if width == 12:
        pairs = torch.nn.functional.pad(slots.to(torch.int32), (0, slots.numel() % 2)).view(-1, 2)
        a, b = pairs[:, 0], pairs[:, 1]
        triples = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=1).to(torch.uint8)
        field[:needed].copy_(triples.reshape(-1)[:needed])
        return
    shifts = torch.arange(width, dtype=torch.int32, device=slots.device)
    bits = ((slots.to(torch.int32).unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    packed = kernels.pack_codes(bits, 1)
    field[: packed.numel()].copy_(packed)


def unpack_slots(rows: torch.Tensor, pairs: int, width: int) -> torch.Tensor:
    """The ``[ranks, pairs]`` int32 slots of each rank's uint8 index field ``rows`` (``[ranks, bytes]``),
    inverse of :func:`pack_slots`."""
    ranks = rows.shape[0]
    if width == 12:
        half = -(-pairs // 2)
        needed = -(-pairs * width // 8)
        t = torch.nn.functional.pad(rows[:, :needed].to(torch.int32), (0, 3 * half - needed)).view(ranks, half, 3)
        a = t[..., 0] | ((t[..., 1] & 0xF) << 8)
        b = (t[..., 1] >> 4) | (t[..., 2] << 4)
        return torch.stack([a, b], dim=-1).reshape(ranks, 2 * half)[:, :pairs]
    bits = kernels.unpack_codes(rows.reshape(-1), 1, rows.numel() * 8).view(ranks, -1)
    bits = bits[:, : pairs * width].reshape(ranks, pairs, width).to(torch.int32)
    return (bits << torch.arange(width, dtype=torch.int32, device=rows.device)).sum(-1, dtype=torch.int32)


@dataclass
class _ChunkPlan:
    """One bucket's chunks at one ratio: where each slot of each chunk is, which top-k slots are
    sent, and the reusable buffers."""

    wire: ChunkWire
    slots: torch.Tensor  # [B, S*S] bucket position of each slot (int32 below 2**31 elements); numel: the pad
    pad: torch.Tensor  # [B, S*S] bool: the slot lies outside the tensor
    top: int  # max_b k_b: torch.topk's k for every chunk
    kept: torch.Tensor  # [B, top] bool: slot j of chunk b's ranking is sent (j < k_b)
    kept_flat: torch.Tensor  # int64 positions of the kept entries in the flattened [B, top], chunk order
    counts: torch.Tensor  # [B] k_b, float32
    chunk_of_pair: torch.Tensor  # [K] int64: the chunk of each sent pair
    extended: torch.Tensor  # numel + 1 values: the velocity and a 0 at the pad position
    dense: DensePart | None
    payload: torch.Tensor
    gathered: torch.Tensor


def chunk_slots(segment: Segment, side: int, pad: int, device: torch.device) -> torch.Tensor:
    """``[chunks, side*side]`` bucket positions of ``segment``'s chunks (module docstring), row-major
    chunk order, slot ``u * side + v`` at row ``u``, column ``v``; ``pad`` where a ragged chunk has
    no element."""
    rows = segment.shape[0]
    cols = segment.numel // rows
    row_chunks, col_chunks = -(-rows // side), -(-cols // side)
    r = torch.arange(row_chunks * side, device=device).view(row_chunks, 1, side, 1)
    c = torch.arange(col_chunks * side, device=device).view(1, col_chunks, 1, side)
    positions = torch.where((r < rows) & (c < cols), segment.start + r * cols + c, pad)
    return positions.reshape(row_chunks * col_chunks, side * side)


@register
class ChunkTopKCompressor(AdjustableRatio, PlannedCompressor[_ChunkPlan]):
    """SparseLoCo's codec: top-k of every ``chunk_side x chunk_side`` chunk, 2-bit values (sign and
    one of two per-chunk magnitude levels), in-chunk indices bit-packed; biased, so error feedback
    is on by default (module docstring for the exact rules and the wire).

    Args:
        compress_ratio: fraction of each chunk's elements sent, in (0, 1] (SparseLoCo: 1-3 %).
        chunk_side: side ``S`` of the square chunks, >= 1 (64: SparseLoCo's 64x64).
        min_compress_numel: smaller (and all 1-D) tensors are sent dense and exactly, >= 1.
    """

    name = "chunk_topk"
    arguments = ("compress_ratio", "chunk_side", "min_compress_numel")
    needs_whole_tensors = True  # chunks are 2-D tiles of the tensor's matrix

    def __init__(self, compress_ratio: float = 0.02, *, chunk_side: int = 64, min_compress_numel: int = 1024) -> None:
        super().__init__()
        self.compress_ratio = compress_ratio
        self.chunk_side = check_int("chunk_side", chunk_side, 1)
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 1)

    # ------------------------------------------------------------------ sizes
    def chunk_sizes(self, segment: Segment) -> list[int]:
        """Elements of each of ``segment``'s chunks, in chunk order."""
        side, rows = self.chunk_side, segment.shape[0]
        cols = segment.numel // rows
        heights = [min(side, rows - i) for i in range(0, rows, side)]
        widths = [min(side, cols - j) for j in range(0, cols, side)]
        return [h * w for h in heights for w in widths]

    def k_for(self, chunk_numel: int) -> int:
        """Values sent of a chunk of ``chunk_numel`` elements: ``min(n, ceil(ratio * n))``."""
        return min(chunk_numel, self.ratio_of(chunk_numel))

    def _chunks(self, layout: BucketLayout) -> tuple[list[Segment], list[Segment], list[int]]:
        """(compressed segments, dense segments, k of every chunk in bucket order)."""
        compressed, dense = split_segments(layout.segments, self.min_compress_numel)
        ks = [self.k_for(n) for segment in compressed for n in self.chunk_sizes(segment)]
        return compressed, dense, ks

    def wire_bytes(self, layout: BucketLayout, element_size: int) -> int:
        compressed, dense, ks = self._chunks(layout)
        if not compressed:
            return layout.numel * element_size
        wire = ChunkWire(len(ks), sum(ks), index_bits(self.chunk_side))
        return wire.nbytes + sum(s.numel for s in dense) * element_size

    # ------------------------------------------------------------------ planning
    def build_plan(self, layout: BucketLayout, like: torch.Tensor, world_size: int) -> _ChunkPlan:
        device, numel = like.device, layout.numel
        compressed, dense, ks = self._chunks(layout)
        slots = torch.cat([chunk_slots(s, self.chunk_side, numel, device) for s in compressed])
        if numel < torch.iinfo(torch.int32).max:  # [B, S*S]: as large as the chunked tensors; int32 halves it
            slots = slots.to(torch.int32)
        k = torch.tensor(ks, dtype=torch.int64, device=device)
        top = max(ks)
        kept = torch.arange(top, device=device) < k.unsqueeze(1)
        wire = ChunkWire(len(ks), sum(ks), index_bits(self.chunk_side))
        return _ChunkPlan(
            wire=wire,
            slots=slots,
            pad=slots == numel,
            top=top,
            kept=kept,
            kept_flat=torch.nonzero(kept.reshape(-1)).reshape(-1),
            counts=k.to(torch.float32),
            chunk_of_pair=torch.repeat_interleave(torch.arange(len(ks), device=device), k),
            extended=like.new_zeros(numel + 1),
            dense=DensePart.of(dense, like),
            payload=torch.empty(wire.nbytes, dtype=torch.uint8, device=device),
            gathered=torch.empty(world_size * wire.nbytes, dtype=torch.uint8, device=device),
        )

    # ------------------------------------------------------------------ encode / decode
    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        if not split_segments(context.layout.segments, self.min_compress_numel)[0]:
            return encode_whole_bucket(velocity, out)
        plan = self.plan(context, velocity)
        plan.extended[:-1].copy_(velocity)
        magnitudes = plan.extended[plan.slots].abs_().masked_fill_(plan.pad, -1.0)  # a pad is never chosen
        ranked = torch.topk(magnitudes, plan.top, dim=1, sorted=True).indices  # [B, top], largest first
        positions = plan.slots.gather(1, ranked)
        values = plan.extended[positions]
        levels, high = self._levels(values.abs(), plan)
        negative = values < 0
        magnitude = widened(levels, values.dtype).gather(1, high)
        decoded = torch.where(negative, -magnitude, magnitude)

        def sent(matrix: torch.Tensor) -> torch.Tensor:  # the kept entries, in chunk order
            return matrix.reshape(-1)[plan.kept_flat]

        self._pack(plan, levels, sent(high.to(torch.uint8) << 1 | negative.to(torch.uint8)), sent(ranked))
        summed = None if plan.dense is None else plan.dense.gather(velocity, context.world_size)
        return Encoded(
            Payload.all_gather(plan.payload, plan.gathered, elements_sent=plan.wire.pairs, summed=summed),
            Sent(
                indices=sent(positions).long(),
                values=sent(decoded),
                dense_positions=None if plan.dense is None else plan.dense.positions,
                dense_values=None if plan.dense is None else plan.dense.sent,
            ),
            context=plan,
        )

    @staticmethod
    def _levels(magnitudes: torch.Tensor, plan: _ChunkPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Each chunk's (low, high) levels ``[B, 2]`` in :data:`LEVEL_DTYPE` and each ranked slot's
        level ``[B, top]`` (0 low, 1 high; only kept slots count): the split at the chunk's mean, in
        float32 whatever the bucket's dtype (a float16 chunk's sum of 4,096 magnitudes would overflow)."""
        kept = plan.kept
        magnitudes = magnitudes.float().masked_fill_(~kept, 0.0)
        mean = magnitudes.sum(1, keepdim=True) / plan.counts.unsqueeze(1)
        high = (magnitudes >= mean) & kept
        low = kept & ~high
        sums = torch.stack([(magnitudes * low).sum(1), (magnitudes * high).sum(1)], dim=1)
        counts = torch.stack([low.sum(1), high.sum(1)], dim=1).to(sums.dtype)
        levels = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0).to(LEVEL_DTYPE)
        return levels, high.to(torch.int64)

    @staticmethod
    def _pack(plan: _ChunkPlan, levels: torch.Tensor, codes: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the levels, 2-bit codes and ``width``-bit slot numbers into ``plan.payload``."""
        wire = plan.wire
        plan.payload.zero_()  # padding is sent: keep it deterministic
        level_bytes, code_bytes, index_bytes = wire.fields(plan.payload)
        level_bytes[: wire.chunks * 4].view(LEVEL_DTYPE).copy_(levels.reshape(-1))
        packed = kernels.pack_codes(codes, CODE_BITS)
        code_bytes[: packed.numel()].copy_(packed)
        pack_slots(slots, wire.width, index_bytes)

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        if decode_whole_bucket(encoded, out, world_size):
            return
        plan: _ChunkPlan = encoded.context
        wire = plan.wire
        level_bytes, code_bytes, index_bytes = wire.fields(plan.gathered.view(world_size, wire.nbytes))
        levels = level_bytes[:, : wire.chunks * 4].contiguous().view(LEVEL_DTYPE).view(world_size, wire.chunks * 2)
        codes = kernels.unpack_codes(code_bytes.reshape(-1), CODE_BITS, code_bytes.numel() * 4)
        codes = codes.view(world_size, -1)[:, : wire.pairs].to(torch.int64)
        slots = unpack_slots(index_bytes, wire.pairs, wire.width)
        side2 = plan.slots.shape[1]
        positions = plan.slots.reshape(-1)[plan.chunk_of_pair * side2 + slots].long()
        magnitude = widened(levels, out.dtype).gather(1, (plan.chunk_of_pair * 2 + (codes >> 1)).view(world_size, -1))
        values = torch.where((codes & 1).bool(), -magnitude, magnitude)
        out.zero_()
        kernels.scatter_average_(out, positions.reshape(-1), values.reshape(-1), world_size, runs=world_size)
        if plan.dense is not None:
            plan.dense.write_mean(out, world_size)
