"""The Triton kernels on one tensor of more than 2**31 elements, on a GPU with room for it.

``program_id * BLOCK`` is int32 in Triton and wraps negative past 2**31 elements (an 8.6 GB fp32
tensor, a large embedding or a DDP bucket holding one); a mask ``offsets < numel`` lets the wrapped
offsets through, so a kernel that forgot int64 offsets writes before its tensor and never reaches
its tail. Each test puts something known past 2**31 and checks it is read or written there.

Needs CUDA and about 20 GiB of free GPU memory (fp16 values keep it there); skipped otherwise, and
on the CPU, where the interpreter would take hours over 2**31 elements.
"""

from __future__ import annotations

import pytest
import torch

from lightning_gc import kernels
from lightning_gc.kernels import dispatch

pytest.importorskip("triton")

PAST = 1 << 31
"""The first element whose int32 offset wraps."""
NEEDED_BYTES = 20 << 30


def _room_on_gpu() -> bool:
    if not torch.cuda.is_available() or dispatch.interpreting():
        return False
    free, _ = torch.cuda.mem_get_info()
    return free >= NEEDED_BYTES


pytestmark = pytest.mark.skipif(not _room_on_gpu(), reason="needs CUDA and ~20 GiB of free GPU memory")


@pytest.fixture(autouse=True)
def _release_memory():
    yield
    torch.cuda.empty_cache()


def _huge(numel: int, fill: float) -> torch.Tensor:
    return torch.full((numel,), fill, dtype=torch.float16, device="cuda")


def test_compensate_reaches_past_two_to_the_31() -> None:
    numel = PAST + 5_000
    grad, velocity, momentum = _huge(numel, 1.0), _huge(numel, 0.0), _huge(numel, 0.0)
    grad[PAST:] = 2.0  # the tail differs, so a wrapped offset reading the head would show
    with kernels.use_backend("triton"):
        kernels.compensate_(grad, velocity, momentum, momentum=0.9)
    assert torch.all(velocity[PAST:] == 2.0) and torch.all(momentum[PAST:] == 2.0)
    assert torch.all(velocity[PAST - 4096 : PAST] == 1.0)


def test_sign_packing_reaches_past_two_to_the_31() -> None:
    numel = PAST + 8 * 1_000 + 3  # a partial last byte as well
    values = _huge(numel, 1.0)
    values[PAST:] = -1.0
    with kernels.use_backend("triton"):
        packed = kernels.pack_signs(values)
    assert packed.numel() == -(-numel // 8)
    assert torch.all(packed[PAST // 8 : -1] == 0xFF) and int(packed[-1]) == 0b111
    assert torch.all(packed[PAST // 8 - 512 : PAST // 8] == 0)


def test_stochastic_quantize_reaches_past_two_to_the_31() -> None:
    # TernGrad (levels 1) of values equal to their scale: every level is exactly 1, no randomness,
    # code (1 << 1) | negative at 2 bits: 0b10 per non-negative element, 0b11 per negative one.
    numel = PAST + 4 * 1_000
    values = _huge(numel, 1.0)
    values[PAST:] = -1.0
    with kernels.use_backend("triton"):
        packed = kernels.stochastic_quantize(values, torch.ones((), device="cuda"), levels=1, seed=5)
    assert torch.all(packed[PAST // 4 :] == 0xFF)
    assert torch.all(packed[PAST // 4 - 512 : PAST // 4] == 0xAA)


def test_sampled_topk_finds_values_past_two_to_the_31() -> None:
    numel = PAST + 100_000
    values = torch.randn(numel, dtype=torch.float16, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    planted = torch.tensor([PAST + 17, PAST + 50_001, numel - 1], device="cuda")
    values[planted] = torch.tensor([300.0, -400.0, 500.0], dtype=torch.float16, device="cuda")
    k = 2_048
    indices = torch.empty(k, dtype=torch.int64, device="cuda")
    picked = torch.empty(k, dtype=torch.float16, device="cuda")
    with kernels.use_backend("triton"):
        kernels.sampled_topk_(values, k, sample_ratio=0.01, salt=1, scratch=None, out_indices=indices,
                              out_values=picked)  # fmt: skip
    assert set(planted.tolist()) <= set(indices.tolist())
    assert int(indices.min()) >= 0 and int(indices.max()) < numel
    assert torch.equal(values[indices][picked != 0], picked[picked != 0])  # genuine (index, value) pairs


def test_bucket_selection_finds_values_past_two_to_the_31() -> None:
    # a small segment at the bucket's start and one straddling 2**31: bucket positions in int64
    numel = PAST + 100_000
    values = torch.randn(numel, dtype=torch.float16, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    straddling_start = PAST - 60_000
    values[PAST + 33] = 1_000.0
    segments = kernels.SegmentedTopK(
        starts=(0, straddling_start), numels=(50_000, 160_000), ks=(50, 160), firsts=(0, 50), salts=(7, 8)
    )
    indices = torch.empty(segments.total_k, dtype=torch.int64, device="cuda")
    picked = torch.empty(segments.total_k, dtype=torch.float16, device="cuda")
    with kernels.use_backend("triton"):
        kernels.sampled_topk_segments_(values, segments, sample_ratio=0.01, step_salt=3, scratch=None,
                                       out_indices=indices, out_values=picked)  # fmt: skip
    assert PAST + 33 in indices[50:].tolist()
    assert all(straddling_start <= i < straddling_start + 160_000 for i in indices[50:].tolist())


def test_scatter_average_writes_past_two_to_the_31() -> None:
    out = torch.zeros(PAST + 100, dtype=torch.float32, device="cuda")
    indices = torch.tensor([PAST + 7, 5, PAST + 7], device="cuda")
    values = torch.tensor([2.0, 3.0, 4.0], device="cuda")
    with kernels.use_backend("triton"):
        kernels.scatter_average_(out, indices, values, world_size=2)
    assert float(out[PAST + 7]) == 3.0 and float(out[5]) == 1.5
    assert float(out.sum()) == 4.5
