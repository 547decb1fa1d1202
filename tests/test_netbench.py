"""The netbench's multi-node launch path, unit-sized and without root: two "nodes" on loopback.

Each node is started like a user starts Lightning on a cluster (MASTER_ADDR/MASTER_PORT/
NODE_RANK/WORLD_SIZE, num_nodes=2, devices=1, gloo on an interface named by GLOO_SOCKET_IFNAME).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from benchmarks.netbench import report
from benchmarks.netbench.launch import Node, run_mode
from benchmarks.netbench.models import gradient_shapes
from lightning_gc.compressors import create
from lightning_gc.perfmodel.calibration import layout_of_shapes

STEPS, WARMUP, BATCH = 2, 2, 4


def test_two_nodes_on_loopback_produce_the_record(tmp_path):
    nodes = [Node("lo"), Node("lo")]
    record = run_mode(
        "gc_dgc",
        "tiny",
        nodes=nodes,
        master_addr="127.0.0.1",
        out=tmp_path,
        steps=STEPS,
        warmup=WARMUP,
        batch_size=BATCH,
    )
    assert (record["mode"], record["model"], record["world_size"], record["global_rank"]) == ("gc_dgc", "tiny", 2, 0)
    assert (record["nodes"], record["node_rank"], record["ifname"]) == (2, 0, "lo")
    assert (tmp_path / "rank1.json").exists()  # node 1 joined as global rank 1
    shapes = gradient_shapes("tiny")
    assert record["gradient_numel"] == sum(math.prod(s) for s in shapes)
    assert len(record["step_s"]) == STEPS and all(s > 0 for s in record["step_s"])
    assert min(record["step_s"]) <= record["median_s"] <= max(record["step_s"])
    assert record["samples_per_s"] == pytest.approx(2 * BATCH / record["median_s"])
    # after warm-up each step sends exactly DGC's wire bytes (one bucket), and the wire saw at least that
    wire = create("dgc", compress_ratio=0.001).wire_bytes(layout_of_shapes(shapes), 4)
    assert record["payload_bytes_per_step"] == wire
    assert record["tx_bytes_per_step"] >= wire
    assert 0 < record["hook_s_per_step"] < record["median_s"]
    assert 0 <= record["wait_s_per_step"] < record["median_s"]


def test_two_nodes_of_two_processes_send_half_the_payload_each_with_the_hierarchy(tmp_path):
    """``--devices-per-node 2``: Lightning starts each node's second process, four ranks in all; with
    ``gc_dgc_node`` each sends its shard's payload, about half of the flat exchange's."""
    common = dict(nodes=[Node("lo"), Node("lo")], master_addr="127.0.0.1", steps=STEPS, warmup=WARMUP)
    flat, node = (
        run_mode(mode, "tiny", out=tmp_path / mode, batch_size=BATCH, devices_per_node=2, **common)
        for mode in ("gc_dgc", "gc_dgc_node")
    )
    assert (node["world_size"], flat["world_size"]) == (4, 4)
    assert sorted(p.name for p in (tmp_path / "gc_dgc_node").glob("rank*.json")) == [f"rank{r}.json" for r in range(4)]
    assert node["samples_per_s"] == pytest.approx(4 * BATCH / node["median_s"])
    assert 0.4 < node["payload_bytes_per_step"] / flat["payload_bytes_per_step"] < 0.6


def test_report_ratios_and_predictions():
    def rec(mode: str, median: float) -> dict:
        steps = [median, median * 1.5]
        return {"rate": "1gbit", "model": "m", "mode": mode, "median_s": median, "step_s": steps, "batch_size": 8,
                "nodes_total": 2, "tx_bytes_per_step": 100.0, "payload_bytes_per_step": None}  # fmt: skip

    records = [rec(m, t * (1 + r / 10)) for r in range(3) for m, t in (("ideal", 0.1), ("noop", 0.2), ("ddp", 0.8))]
    rows = {r.mode: r for r in report.summarize(records, {("1gbit", "m", "ddp"): 0.6})}
    ddp = rows["ddp"]
    assert ddp.repeats == 3 and ddp.median_s == pytest.approx(0.88)
    assert ddp.of_floor == pytest.approx(0.22 / 0.88) and ddp.of_ideal == pytest.approx(0.11 / 0.88)
    assert ddp.min_s == pytest.approx(0.8) and ddp.max_s == pytest.approx(0.96 * 1.5)
    assert ddp.samples_per_s == pytest.approx(16 / 0.88)
    assert ddp.prediction_error == pytest.approx((0.6 - 0.88) / 0.88)
    assert rows["noop"].predicted_s is None
    table = report.markdown(list(rows.values()))
    assert "| 1gbit | m | ddp | 880 | 800–1440 | 18 | 0.25 | 0.12 | 0.000 | – | – | – | 600 | -32 % |" in table


def test_predicted_modes_keep_what_the_calibration_measured_for_every_exchange(tmp_path) -> None:
    """A two-phase mode's cost carries its two-phase bytes into the prediction (they were dropped,
    and the 100 Mbit/s two-phase steps were predicted 27-60 % short), and costs more wire time
    than a mode without them."""
    from benchmarks.netbench.predict import mode_cost, predict_modes

    shapes = [(64, 64), (64,), (128, 64)]
    numel = sum(math.prod(s) for s in shapes)
    cost = mode_cost("gc_onebit_2p", shapes, world_size=2, cache=None)
    assert cost.name == "gc_onebit_2p" and cost.two_phase_bytes > 0 and cost.gathered_bytes == 0
    without = dataclasses.replace(cost, two_phase_bytes=0)
    slow_link = predict_modes({"with": cost, "without": without}, numel, compute_s=0.0, bits_per_s=1e6)
    assert slow_link["with"].step_s > slow_link["without"].step_s + 0.5 * cost.two_phase_bytes * 8 / 1e6


def test_each_emulated_node_gets_its_own_block_of_cores(monkeypatch, capsys) -> None:
    from benchmarks.netbench.__main__ import node_cores, parse_args

    assert [node_cores(node, 1) for node in (0, 1)] == ["0", "1"]
    assert [node_cores(node, 4) for node in (0, 1)] == ["0-3", "4-7"]
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert parse_args(["--cores-per-node", "4"]).cores_per_node == 4
    for bad in ("5", "0"):
        with pytest.raises(SystemExit):
            parse_args(["--cores-per-node", bad])
        assert f"between 1 and 4 (2 nodes on 8 CPUs); got {bad}" in capsys.readouterr().err
