"""What each outer-loop preset sends per sync, in bytes per rank, against the formulas written here,
counted by real syncs over 2 gloo ranks.

With ``P`` trainable elements, ``D`` of them in tensors sent dense (1-D, or < 1024 elements), each
compressed tensor ``t`` of ``n_t`` elements, and ``aligned(x)`` = ``x`` rounded up to a multiple of 4:

* ``diloco`` (compressor ``none``): ``4 P``, every element as float32;
* ``diloco_int8`` (``int8``: 8-bit codes, one float32 max-abs scale per 512 elements):
  ``aligned(4 sum_t ceil(n_t / 512) + sum_t n_t) + 4 D``;
* ``sparseloco`` (``chunk_topk`` at 2 %, chunks of 64x64 with ragged edges, ``B`` chunks of
  ``n_b`` elements, ``K = sum_b ceil(0.02 n_b)`` values):
  ``aligned(4 B) + aligned(ceil(K / 4)) + aligned(ceil(12 K / 8)) + 4 D``;
* DGC on the pseudo-gradient (``outer_loop(model, "diloco", compressor="dgc", compress_ratio=r)``):
  ``8 sum_t ceil(r n_t) + 4 D`` (an int32 index and a float32 value per pair).

For the PTB transformer of ``recipe=transformer_ptb_*`` (1,709,568 parameters) that is, per rank
per sync: diloco 6,838,272 bytes; diloco_int8 1,733,648 (3.9x fewer); sparseloco 75,780 (90x);
DGC at 1 % 150,848 (45x), at 0.1 % 28,024 (244x). Over a run: times ``ceil(steps / sync_every)``.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import launch_ranks

SHAPES = [[300, 40], [130, 40], [130], [130], [130], [300, 130], [300], [16, 8]]
"""An embedding-like 300x40 (5 chunks, the last 44x40), a 130x40 (3 chunks: 64, 64, 2 rows), a
300x130 (15 chunks), biases and norms, and a 16x8 weight under 1024 elements (dense)."""


def aligned(n: int) -> int:
    return -(-n // 4) * 4


def split(shapes: list[list[int]]) -> tuple[list[list[int]], int]:
    """(compressed shapes, dense elements) by the rule every codec shares."""
    compressed = [s for s in shapes if len(s) > 1 and math.prod(s) >= 1024]
    return compressed, sum(math.prod(s) for s in shapes if s not in compressed)


def chunk_sizes(shape: list[int], side: int = 64) -> list[int]:
    rows, cols = shape[0], math.prod(shape[1:])
    return [min(side, rows - i) * min(side, cols - j) for i in range(0, rows, side) for j in range(0, cols, side)]


def diloco_bytes(shapes: list[list[int]]) -> int:
    return 4 * sum(math.prod(s) for s in shapes)


def diloco_int8_bytes(shapes: list[list[int]]) -> int:
    compressed, dense = split(shapes)
    scales = sum(math.ceil(math.prod(s) / 512) for s in compressed)
    return aligned(4 * scales + sum(math.prod(s) for s in compressed)) + 4 * dense


def sparseloco_bytes(shapes: list[list[int]], ratio: float = 0.02) -> int:
    compressed, dense = split(shapes)
    chunks = [n for s in compressed for n in chunk_sizes(s)]
    k = sum(math.ceil(ratio * n) for n in chunks)
    return aligned(4 * len(chunks)) + aligned(math.ceil(k / 4)) + aligned(math.ceil(12 * k / 8)) + 4 * dense


def dgc_bytes(shapes: list[list[int]], ratio: float) -> int:
    compressed, dense = split(shapes)
    return 8 * sum(math.ceil(ratio * math.prod(s)) for s in compressed) + 4 * dense


CASES = {
    "diloco": ({"preset": "diloco"}, diloco_bytes(SHAPES)),
    "diloco_int8": ({"preset": "diloco_int8"}, diloco_int8_bytes(SHAPES)),
    "sparseloco": ({"preset": "sparseloco"}, sparseloco_bytes(SHAPES)),
    "dgc": ({"preset": "diloco", "arguments": {"compressor": "dgc", "compress_ratio": 0.01}}, dgc_bytes(SHAPES, 0.01)),
}


@pytest.fixture(scope="module")
def synced(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    cases = [{"id": name, **case} for name, (case, _) in CASES.items()]
    plan = {"cases": cases, "shapes": SHAPES, "sync_every": 2, "syncs": 2}
    return launch_ranks("outer_bytes_worker.py", plan, tmp_path_factory.mktemp("outer_bytes"), world_size=2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bytes_per_sync_follow_the_documented_formula(synced: list[dict], name: str):
    expected = CASES[name][1]
    for rank in synced:
        run = rank[name]
        assert run["syncs"] == 2 and run["world_size"] == 2
        assert run["bytes_sent"] == 2 * expected, (name, run["bytes_sent"] / 2, expected)
    for key, theta in synced[0][name]["global"].items():  # the ranks agree on theta_g
        assert torch.equal(theta, synced[1][name]["global"][key]), (name, key)


def test_the_presets_rank_as_documented():
    """The same model: sparseloco < DGC at 1 % < diloco_int8 < diloco, the ratios of the docstring."""
    byte_counts = [sparseloco_bytes(SHAPES), dgc_bytes(SHAPES, 0.01), diloco_int8_bytes(SHAPES), diloco_bytes(SHAPES)]
    assert byte_counts == sorted(byte_counts)
    assert diloco_bytes(SHAPES) / sparseloco_bytes(SHAPES) > 25  # here a tenth of the elements are dense


def test_the_ptb_transformer_figures_of_the_docstring():
    """The formulas on the recipe's model agree with what each codec says it sends, and with the table."""
    from lightning_gc.compressors import create
    from lightning_gc.exchanges.averager import flat_layout
    from recipes.language import TransformerLanguageModel

    model = TransformerLanguageModel(vocab_size=10000, d_model=128, num_heads=4, num_layers=2, ff_size=512)
    named = [(name, list(p.shape)) for name, p in model.named_parameters() if p.requires_grad]
    shapes, layout = [shape for _, shape in named], flat_layout(named)
    figures = {
        "diloco": (diloco_bytes(shapes), create("none"), 6_838_272),
        "diloco_int8": (diloco_int8_bytes(shapes), create("int8"), 1_733_648),
        "sparseloco": (sparseloco_bytes(shapes), create("chunk_topk", compress_ratio=0.02), 75_780),
        "dgc 1 %": (dgc_bytes(shapes, 0.01), create("dgc", compress_ratio=0.01), 150_848),
        "dgc 0.1 %": (dgc_bytes(shapes, 0.001), create("dgc", compress_ratio=0.001), 28_024),
    }
    for name, (formula, codec, documented) in figures.items():
        assert formula == codec.wire_bytes(layout, 4) == documented, name
