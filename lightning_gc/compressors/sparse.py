"""Sparsifying compressors: send the ``k = ceil(ratio * numel)`` largest values of each large tensor.

Per bucket, tensors with ``dim() > 1`` and at least ``min_compress_numel`` elements are
*compressed*: each contributes exactly ``k`` (index, value) pairs to one fixed-size all-gather.
Every other tensor (biases, norms, small tensors) is *dense*: its values are all-reduced (in
``dense_dtype`` if one is set). With ``compress_ratio == 1`` every tensor is dense and the bucket
goes through one plain all-reduce in the gradient's dtype.

The pairs go on the wire in the layout of :mod:`lightning_gc.compressors.wire`: int32 indices, or
an Elias--Fano code of the sorted indices (``index_encoding="elias_fano"``, ~12 bits per index at
0.1 % density), with values in ``value_dtype``.

With ``exchange="global_topk"`` the ranks first agree on ``k`` positions per tensor through
pairwise merges of their selections and then all-reduce their values there, so traffic per rank
grows as ``log N`` instead of ``N``: the global top-k exchange
(:mod:`lightning_gc.exchanges.global_topk`) runs the rounds, asking the codec for its selection.

Decompression of the gathered pairs::

    out = 0;  out[idx_r] += val_r / N  for every rank r   (duplicates add: scatter-add)
    out[dense] = (sum over ranks of dense values) / N

All buffers of a bucket (payload, gathered payloads, dense values, index lists) are allocated once
per plan (layout, settings, world size, device, dtype: see :class:`~lightning_gc.compressors.base.PlannedCompressor`)
and reused every step.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch

from lightning_gc import kernels
from lightning_gc.common.layout import BucketLayout, Segment
from lightning_gc.common.validation import check_choice, check_int
from lightning_gc.compressors.base import AdjustableRatio, EncodeContext, PlannedCompressor, split_segments
from lightning_gc.compressors.dense import DensePart, decode_whole_bucket, encode_whole_bucket
from lightning_gc.compressors.encoded import Encoded, Payload, Sent
from lightning_gc.compressors.wire import INDEX_ENCODINGS, VALUE_DTYPES
from lightning_gc.kernels.selection import SegmentedTopK, for_each_segment

_SALT_STEP = 1_000_003  # distinct steps must map far apart before the per-parameter offset is added
EXCHANGES = ("gather", "global_topk")
"""``exchange`` choices of the sparse compressors: every rank's pairs all-gathered, or the
positions agreed by the global top-k merges and the values all-reduced
(:class:`lightning_gc.exchanges.global_topk.GlobalTopKExchange`)."""


def dtype_name(argument: str, value: str | torch.dtype | None, *, optional: bool = False) -> str | None:
    """The name in :data:`VALUE_DTYPES` of ``value`` (a name or a ``torch.dtype``; ``None`` if
    ``optional``), or ``ValueError`` naming ``argument``, the value and the choices."""
    if isinstance(value, torch.dtype):
        value = next((k for k, v in VALUE_DTYPES.items() if v == value), str(value))
    return check_choice(argument, value, [*VALUE_DTYPES, *([None] if optional else [])])


@dataclass
class SparsePlan:
    """Sizes and reusable buffers for one bucket layout at one compression ratio."""

    layout: BucketLayout
    selection: SegmentedTopK  # the compressed segments: where each is, its k and first payload slot
    total_k: int
    dense_all: bool
    dense: DensePart | None  # the dense tensors of a partly compressed bucket
    sent_indices: torch.Tensor
    sent_values: torch.Tensor
    payload: torch.Tensor  # empty in a plan without pair buffers (plan_with(gathered=False))
    gathered: torch.Tensor


class SparseCompressor(AdjustableRatio, PlannedCompressor[SparsePlan]):
    """Shared machinery and arguments of top-k style sparsifiers; subclasses choose the ``k`` indices.

    The arguments are declared here once: :class:`~lightning_gc.compressors.simple.TopKCompressor`
    takes exactly these, :class:`~lightning_gc.compressors.dgc.DGCCompressor` these and its own.

    Args:
        compress_ratio: fraction of each compressed tensor's elements sent, in (0, 1]; a
            compressed tensor of ``n`` elements sends exactly ``k = ceil(compress_ratio * n)``
            pairs. With 1 the bucket goes through one plain all-reduce.
        min_compress_numel: tensors with fewer elements (and all 1-D tensors) are sent dense, >= 1.
        value_dtype: dtype of the values on the wire: ``"float32"``, ``"float16"`` or
            ``"bfloat16"`` (or the ``torch.dtype``). What a narrower dtype rounds away stays in
            the velocity (error feedback).
        index_encoding: ``"int32"`` (4 bytes per index) or ``"elias_fano"`` (the bucket's
            indices sorted and Elias--Fano coded: between ``l + 2`` and ``l + 3`` bits per index,
            ``l = floor(log2(bucket numel / k))``; same decoded result). See :mod:`lightning_gc.compressors.wire`.
        dense_dtype: dtype in which the dense tensors of a partly compressed bucket are
            all-reduced (``"float32"``, ``"float16"``, ``"bfloat16"``); ``None``: the gradient's.
            The sum over ranks is accumulated in that dtype, and what rounding drops stays in the
            velocity. A bucket sent wholly dense (``compress_ratio == 1``) is unaffected.
        exchange: ``"gather"`` (default): every rank's pairs are all-gathered, ``(N-1) k`` pairs
            received per rank. ``"global_topk"``: the ranks agree on ``k`` positions per tensor
            by merging their selections pairwise in ``log2 N`` rounds (gTop-k, Shi et al. 2019)
            and all-reduce their values there (in ``dense_dtype``; ``value_dtype`` and
            ``index_encoding`` then shape the merge rounds' messages). Fewer bytes from 4 ranks
            on; see :mod:`lightning_gc.exchanges.global_topk`.
    """

    arguments = ("compress_ratio", "min_compress_numel", "value_dtype", "index_encoding", "dense_dtype", "exchange")

    def __init__(
        self,
        compress_ratio: float = 0.01,
        *,
        min_compress_numel: int = 1024,
        value_dtype: str | torch.dtype = "float32",
        index_encoding: str = "int32",
        dense_dtype: str | torch.dtype | None = None,
        exchange: str = "gather",
    ) -> None:
        super().__init__()
        self.compress_ratio = compress_ratio
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 1)
        self.value_dtype = dtype_name("value_dtype", value_dtype)  # a name, as in config()
        self.index_encoding = check_choice("index_encoding", index_encoding, INDEX_ENCODINGS)
        self.dense_dtype = dtype_name("dense_dtype", dense_dtype, optional=True)
        if exchange in ("two_phase", "auto"):
            from lightning_gc.compressors.chunks import two_phase_compressors

            raise ValueError(
                f"`exchange={exchange!r}` is not for sparse compressors: the two-phase exchange re-encodes averaged "
                f"chunks, which only {two_phase_compressors()} can; a sparse compressor takes exchange in "
                f"{list(EXCHANGES)} "
                "('global_topk': agree on k positions in log2 N merge rounds, then all-reduce their values)"
            )
        self.exchange = check_choice("exchange", exchange, EXCHANGES)
        self.wire = INDEX_ENCODINGS[self.index_encoding](VALUE_DTYPES[self.value_dtype])

    @property
    def dense_wire_dtype(self) -> torch.dtype | None:
        """The ``torch.dtype`` of :attr:`dense_dtype` (``None``: the gradient's)."""
        return None if self.dense_dtype is None else VALUE_DTYPES[self.dense_dtype]

    def k_for(self, numel: int) -> int:
        """Elements sent of a compressed tensor of ``numel`` elements: ``ceil(ratio * numel)``."""
        return min(numel, self.ratio_of(numel))

    @abstractmethod
    def select(
        self, values: torch.Tensor, k: int, salt: int, out_indices: torch.Tensor, out_values: torch.Tensor
    ) -> None:
        """Write the ``k`` (index, value) pairs of the 1-D ``values`` to send into the outputs.

        Each pair is a selected element (its index in ``values`` and its value) or a no-op
        (any index, value 0).
        """

    def select_segments(self, velocity: torch.Tensor, plan: SparsePlan, step_salt: int) -> None:
        """Every compressed segment's ``k`` pairs into its output slots of ``plan.sent_indices`` and
        ``plan.sent_values``, indices as positions in the bucket, segment ``i`` of ``plan.selection``
        salted ``step_salt + plan.selection.salts[i]``. By default one :meth:`select` per segment; a
        compressor that can select a whole bucket at once overrides it."""
        for_each_segment(self.select, velocity, plan.selection, step_salt, plan.sent_indices, plan.sent_values)

    # ------------------------------------------------------------------ planning
    def exchange_form(self, world_size: int) -> str:
        return self.exchange

    def select_into(self, velocity: torch.Tensor, plan: SparsePlan, step: int) -> None:
        """This step's selection of ``velocity`` into ``plan.sent_indices`` and ``plan.sent_values``
        (salted by ``step`` and each tensor's order): what the gathered form sends, and what the
        global top-k exchange merges."""
        self.select_segments(velocity, plan, step * _SALT_STEP)

    def split_layout(self, layout: BucketLayout) -> tuple[list[tuple[Segment, int, int]], list[Segment], int]:
        """(compressed segments with k and first payload slot, dense segments, total k); at
        ratio 1 every segment is dense."""
        if self._compress_ratio >= 1.0:
            return [], list(layout.segments), 0
        compressible, dense = split_segments(layout.segments, self.min_compress_numel)
        compressed, total_k = [], 0
        for segment in compressible:
            k = self.k_for(segment.numel)
            compressed.append((segment, k, total_k))
            total_k += k
        return compressed, dense, total_k

    def wire_bytes(self, layout: BucketLayout, element_size: int, *, exchange: str | None = None) -> int:
        """The pairs' payload and the dense values; with ``exchange="global_topk"`` one merge
        round's message and the all-reduced agreed and dense values (what two ranks send: each
        doubling of the world size adds one message). ``exchange``: default this compressor's."""
        compressed, dense, total_k = self.split_layout(layout)
        if not compressed:
            return layout.numel * element_size
        dense_wire_dtype = self.dense_wire_dtype
        dense_size = element_size if dense_wire_dtype is None else dense_wire_dtype.itemsize
        summed = sum(s.numel for s in dense) + (total_k if (exchange or self.exchange) == "global_topk" else 0)
        return self.wire.payload_bytes(total_k, layout.numel) + summed * dense_size

    _split = split_layout  # the name before it was public

    def build_plan(self, layout: BucketLayout, like: torch.Tensor, world_size: int) -> SparsePlan:
        return self.plan_with(layout, like, world_size)

    def plan_with(
        self, layout: BucketLayout, like: torch.Tensor, world_size: int, *, gathered: bool = True
    ) -> SparsePlan:
        """A fresh plan of ``layout``: the selection's buffers and, ``gathered``, the pairs' payload
        and the dense tensors' part (the gathered form); without, the selection alone, which an
        exchange with buffers of its own asks for (:mod:`lightning_gc.exchanges.global_topk`, whose
        all-reduce carries the dense tensors with the agreed values)."""
        compressed, dense, total_k = self.split_layout(layout)
        device = like.device
        dense_all = not compressed
        payload_bytes = self.wire.payload_bytes(total_k, layout.numel) if compressed and gathered else 0
        separate = not dense_all and gathered
        dense_part = DensePart.of(dense, like, dtype=self.dense_wire_dtype) if separate else None
        return SparsePlan(
            layout=layout,
            selection=SegmentedTopK(
                starts=tuple(segment.start for segment, _, _ in compressed),
                numels=tuple(segment.numel for segment, _, _ in compressed),
                ks=tuple(k for _, k, _ in compressed),
                firsts=tuple(first for _, _, first in compressed),
                salts=tuple(segment.order for segment, _, _ in compressed),
            ),
            total_k=total_k,
            dense_all=dense_all,
            dense=dense_part,
            sent_indices=torch.empty(total_k, dtype=torch.int64, device=device),
            sent_values=like.new_empty(total_k),
            payload=torch.empty(payload_bytes, dtype=torch.uint8, device=device),
            gathered=torch.empty(world_size * payload_bytes, dtype=torch.uint8, device=device),
        )

    # ------------------------------------------------------------------ encode / decode
    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        plan = self.plan(context, velocity)
        if plan.dense_all:
            return encode_whole_bucket(velocity, out)
        self.select_into(velocity, plan, context.step)
        decoded = self.wire.pack(plan.payload, plan.sent_indices, plan.sent_values, context.layout.numel)
        dense = plan.dense
        summed = None if dense is None else dense.gather(velocity, context.world_size)
        return Encoded(
            Payload.all_gather(plan.payload, plan.gathered, elements_sent=plan.total_k, summed=summed),
            Sent(
                indices=plan.sent_indices,
                values=decoded,
                dense_positions=None if dense is None else dense.positions,
                dense_values=None if dense is None else dense.sent,
            ),
            context=plan,
        )

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        if decode_whole_bucket(encoded, out, world_size):
            return
        plan: SparsePlan = encoded.context
        out.zero_()
        indices, values = self.wire.unpack(plan.gathered, world_size, plan.total_k, plan.layout.numel)
        kernels.scatter_average_(out, indices, values, world_size, runs=world_size)
        if plan.dense is not None:
            plan.dense.write_mean(out, world_size)
