"""The performance model's formulas on hand-computed cases, calibration, and the CLI's errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_gc.common.outer_presets import OUTER_PRESETS
from lightning_gc.compressors import available, create
from lightning_gc.perfmodel import (
    CodecCost,
    Network,
    allgather_s,
    calibration,
    comm_s,
    exchange_bytes,
    gather_loses_to_dense_at,
    ring_allreduce_s,
    two_phase_cost,
    two_phase_s,
)
from lightning_gc.perfmodel import __main__ as cli
from lightning_gc.perfmodel.step import Workload, best, pays, predict

REPO = Path(__file__).resolve().parents[1]

# p = 4 workers, a = 1 ms, B = 1 MB/s
NET = Network(world_size=4, bandwidth=1e6, latency=1e-3)


def test_ring_allreduce_hand_computed():
    # 2(p-1)a + 2(p-1)/p M/B = 6 ms + 1.5 * 1 s
    assert ring_allreduce_s(1e6, NET) == pytest.approx(0.006 + 1.5)
    assert ring_allreduce_s(1e6, NET, rounds=3) == pytest.approx(3 * 0.006 + 1.5)
    assert ring_allreduce_s(0, NET) == 0.0
    assert ring_allreduce_s(1e6, Network(1, 1e6, 1e-3)) == 0.0  # a world of one exchanges nothing


def test_allgather_hand_computed():
    # (p-1)a + (p-1) m/B with m = 1e5: 3 ms + 0.3 s
    assert allgather_s(1e5, NET) == pytest.approx(0.003 + 0.3)
    # all-gather beats all-reduce on bytes only when r > p/2: at r = 2 = p/2 they tie on bandwidth
    assert allgather_s(5e5, Network(4, 1e6)) == pytest.approx(ring_allreduce_s(1e6, Network(4, 1e6)))


def test_two_phase_hand_computed():
    # m = 1e5 on p = 4: all-to-all (p-1)a + (p-1)/p m/B = 3 ms + 75 ms; all-gather of m/p = 25 kB
    # per rank (p-1)a + (p-1) m/p / B = 3 ms + 75 ms
    assert two_phase_s(1e5, NET) == pytest.approx(0.078 + 0.078)
    assert two_phase_s(1e5, NET, rounds=2) == pytest.approx(2 * 0.006 + 0.15)
    assert two_phase_s(1e5, NET) == pytest.approx(ring_allreduce_s(1e5, NET))  # same alpha-beta cost
    assert two_phase_s(0, NET) == 0.0 and two_phase_s(1e5, Network(1, 1e6, 1e-3)) == 0.0
    cost = CodecCost("q", summed_bytes=0, gathered_bytes=0, two_phase_bytes=100_000)
    assert comm_s(cost, NET) == pytest.approx(0.156) and cost.bytes_sent == 100_000
    assert cost.wire_bytes(4) == pytest.approx(150_000)


def test_two_phase_bytes_stay_flat_in_world_size_where_gather_grows_linearly():
    m = 1000.0
    sizes = [2, 8, 64, 512]
    two_phase = [exchange_bytes("two_phase", m, p) for p in sizes]
    gather = [exchange_bytes("gather", m, p) for p in sizes]
    assert two_phase == pytest.approx([2 * (p - 1) / p * m for p in sizes])
    assert all(t < 2 * m for t in two_phase)  # bounded: 2(p-1)/p m < 2m at any p
    assert gather == pytest.approx([(p - 1) * m for p in sizes])  # grows with p
    assert exchange_bytes("allreduce", m, 4) == pytest.approx(1500.0)
    assert exchange_bytes("gather", m, 1) == exchange_bytes("two_phase", m, 1) == 0.0
    with pytest.raises(ValueError, match="`exchange` must be one of"):
        exchange_bytes("ring", m, 4)


def test_onebit_gather_loses_to_dense_beyond_64_ranks_two_phase_does_not():
    dense = 102_400_000
    onebit = dense // 32
    assert gather_loses_to_dense_at(32) == 65  # p > 2r; at p = 64 the bytes tie
    assert exchange_bytes("gather", onebit, 64) == pytest.approx(exchange_bytes("allreduce", dense, 64))
    for p in (65, 128, 512):
        assert exchange_bytes("gather", onebit, p) > exchange_bytes("allreduce", dense, p)
        assert exchange_bytes("two_phase", onebit, p) < exchange_bytes("allreduce", dense, p)
    assert gather_loses_to_dense_at(7.9) == 16 and gather_loses_to_dense_at(0.1) == 2
    # in time, at p = 128 and 10 Gbit/s: gather slower than dense, two-phase faster
    net = Network.from_bits(128, 10e9, 50e-6)
    assert allgather_s(onebit, net) > ring_allreduce_s(dense, net) > two_phase_s(onebit, net)


def test_two_phase_cost_moves_the_gathered_bytes_and_reencodes():
    gathered = CodecCost("onebit", summed_bytes=8, gathered_bytes=1000, encode_s=0.004, decode_s=0.002)
    phased = two_phase_cost(gathered, world_size=4)
    assert phased.name == "onebit+two_phase"
    assert phased.payloads == {"allreduce": 8, "gather": 0, "two_phase": 1000, "peer": 0}
    # encode x (1 + 1/p): one chunk re-encoded; decode x 2/p: two payloads' worth instead of p payloads
    assert phased.encode_s == pytest.approx(0.005) and phased.decode_s == pytest.approx(0.001)
    assert cli.two_phase_row("onebit", gathered, {}, 4) == phased  # the CLI's row for a gathering quantiser
    assert cli.two_phase_row("dgc", CodecCost("dgc", 0, 1000), {}, 4) is None  # gathers, but has no two-phase form
    assert cli.two_phase_row("fp16", CodecCost("fp16", summed_bytes=500, gathered_bytes=0), {}, 4) is None
    assert cli.two_phase_row("onebit", gathered, {"exchange": "two_phase"}, 4) is None


@pytest.mark.parametrize("world_size, choice", [("2", "onebit"), ("128", "onebit+two_phase")])
def test_cli_weighs_the_two_phase_exchange(world_size, choice, capsys):
    """0.4 MB at 100 Mbit/s: on 2 ranks onebit's all-gather has fewer messages and less codec
    work than two-phase; on 128 it sends 127 payloads, more than dense, and two-phase wins."""
    cli.main(["--params", "1e5", "--compute-ms", "10", "--world-size", world_size, "--bandwidth", "100mbit",
              "--compressor", "onebit", "--cost", "onebit=0.2,0.1", "--no-cache"])  # fmt: skip
    stdout = capsys.readouterr().out
    assert "| onebit | " in stdout and "| onebit+two_phase | " in stdout
    assert f"use: {choice} (expected speedup" in stdout


def test_overlap_and_speedup_hand_computed():
    workload = Workload(gradient_numel=250_000, compute_s=1.0, overlap=0.5)  # M = 1 MB, f C = 0.5 s
    sparse = CodecCost("sparse", summed_bytes=0, gathered_bytes=100_000, encode_s=0.06, decode_s=0.04)
    dense, compressed = predict(workload, NET, [sparse])
    assert dense.name == "dense" and dense.comm_s == pytest.approx(1.506)
    assert dense.exposed_s == pytest.approx(1.006) and dense.step_s == pytest.approx(2.006)
    # 0.303 s of all-gather hides entirely behind 0.5 s of backward; codec is never hidden
    assert compressed.comm_s == pytest.approx(0.303) and compressed.exposed_s == 0.0
    assert compressed.step_s == pytest.approx(1.1)
    assert compressed.speedup == pytest.approx(2.006 / 1.1)
    assert compressed.wire_ratio == pytest.approx(10.0)
    assert best([dense, compressed]) is compressed and pays(sparse, workload, NET)


def test_codec_cost_can_lose_and_dense_wins_ties():
    workload = Workload(gradient_numel=250_000, compute_s=1.0, overlap=1.0)  # dense 1.506 s: 1.0 hidden
    slow = CodecCost("slow", summed_bytes=500_000, gathered_bytes=0, encode_s=0.6)
    assert not pays(slow, workload, NET)  # 0.6 s codec + 0 exposed > 0.506 s exposed
    tie = CodecCost("tie", summed_bytes=1_000_000, gathered_bytes=0)
    assert best(predict(workload, NET, [tie])).name == "dense"


def test_host_bound_transport_time_is_never_hidden():
    """p = 2, M = 100 MB at B = 100 MB/s: T_ar = 2(p-1)/p M/B = 1 s; C = 1 s, f = 1 hides all of it.
    A host pushing H = 1 GB/s spends T_host = 0.1 s of the core on it: step = C + T_host +
    max(0, T_ar - T_host - f C) = 1.1 s. A host slower than the link (H = 50 MB/s) makes the
    exchange all host time: step = C + 2 s."""
    workload = Workload(gradient_numel=25_000_000, compute_s=1.0, overlap=1.0)
    wire_bound = Network(world_size=2, bandwidth=1e8)
    (dense,) = predict(workload, wire_bound, [])
    assert dense.comm_s == pytest.approx(1.0) and dense.host_s == 0.0 and dense.step_s == pytest.approx(1.0)
    (dense,) = predict(workload, Network(world_size=2, bandwidth=1e8, host_bandwidth=1e9), [])
    assert dense.host_s == pytest.approx(0.1) and dense.exposed_s == 0.0 and dense.step_s == pytest.approx(1.1)
    (dense,) = predict(workload, Network(world_size=2, bandwidth=1e8, host_bandwidth=5e7), [])
    assert dense.host_s == pytest.approx(2.0) and dense.step_s == pytest.approx(3.0)
    assert Network.from_bits(2, 8e8, host_bits_per_second=8e9).host_bandwidth == pytest.approx(1e9)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 0, "bandwidth": 1.0}, "`world_size` must be an integer >= 1, got 0"),
        ({"world_size": 2, "bandwidth": 0.0}, "`bandwidth` must be in (0, inf], got 0.0"),
        ({"world_size": 2, "bandwidth": 1.0, "latency": -1.0}, "`latency` must be in [0, inf], got -1.0"),
        ({"world_size": 2, "bandwidth": 1.0, "host_bandwidth": 0.0}, "`host_bandwidth` must be in (0, inf], got 0.0"),
    ],
)
def test_network_rejects_nonsense(kwargs, message):
    with pytest.raises(ValueError) as error:
        Network(**kwargs)
    assert message in str(error.value)


def test_calibration_reports_what_the_compressor_sends():
    shapes = [(64, 1024), (64,)]
    cost = calibration.codec_cost("dgc", shapes, world_size=2, arguments={"compress_ratio": 0.01}, repeats=1)
    wire = create("dgc", compress_ratio=0.01).wire_bytes(calibration.layout_of_shapes(shapes), 4)
    assert cost.bytes_sent == wire and cost.gathered_bytes > 0 and cost.summed_bytes == 64 * 4
    assert cost.encode_s > 0 and cost.decode_s > 0
    fp16 = calibration.codec_cost("fp16", shapes, world_size=2, repeats=1)
    assert (fp16.summed_bytes, fp16.gathered_bytes) == ((64 * 1024 + 64) * 2, 0)


def test_calibration_cache_is_reused(tmp_path):
    cache = tmp_path / "costs.json"
    first = calibration.codec_cost("topk", 4096, world_size=2, cache=cache, repeats=1)
    assert calibration.codec_cost("topk", 4096, world_size=2, cache=cache, repeats=1) == first
    real = [torch.linspace(-1, 1, 4096), torch.linspace(1, -1, 4096)]  # other data: calibrated anew
    calibration.codec_cost("topk", 4096, world_size=2, cache=cache, repeats=1, gradients=real)
    assert len(json.loads(cache.read_text())) == 2
    measured = calibration.codec_cost("topk", 4096, world_size=2, measured=(0.002, 0.001))
    assert (measured.encode_s, measured.decode_s, measured.bytes_sent) == (0.002, 0.001, first.bytes_sent)


def test_a_calibration_keeps_what_another_process_cached_while_it_timed(tmp_path, monkeypatch):
    """Two processes calibrating at once (netbench times on both cores) share the cache file: each
    adds its entry to the file as it is when it writes, in one rename, and leaves no partial file."""
    cache = tmp_path / "costs.json"
    cache.write_text(json.dumps({}))
    timed = calibration.time_codec

    def timed_while_another_writes(*args, **kwargs):
        cache.write_text(json.dumps({"another": {"name": "x"}}))  # the other process finished first
        return timed(*args, **kwargs)

    monkeypatch.setattr(calibration, "time_codec", timed_while_another_writes)
    calibration.codec_cost("topk", 4096, world_size=2, cache=cache, repeats=1)
    stored = json.loads(cache.read_text())
    assert "another" in stored and len(stored) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["costs.json"]


def _cli(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "lightning_gc.perfmodel", "--params", "1e6", "--compute-ms", "100", *args]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_in_a_subprocess_rejects_nonsense_and_predicts():
    """``python -m lightning_gc.perfmodel`` itself: exit status 2 with the message, or the table
    (every other message is checked in this process: test_cli_rejects_nonsense)."""
    cases = {("--world-size", "0"): "error: `--world-size` must be an integer >= 1, got 0"}
    good = _cli("--world-size", "2", "--bandwidth", "100mbit", "--compressor", "dgc", "--cost", "dgc=5,1")
    running = {args: _cli(*args) for args in cases}
    for args, process in running.items():
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 2 and not stdout, (args, stderr)
        assert cases[args] in stderr, (args, stderr)
    stdout, stderr = good.communicate(timeout=120)
    assert good.returncode == 0, stderr
    # 4 MB at 100 Mbit/s on 2 workers: dense exposes 320 ms - 50 ms; dgc costs 6 ms of codec
    assert "| dense | 4.000 | 1.0 | 320.1 | 0.0 | 0.0 | 270.1 | 370.1 | 1.00 |" in stdout
    assert "use: dgc (expected speedup" in stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bandwidth=-5mbit"], "`--bandwidth (bits/s)` must be in (0, inf], got -5000000.0"),
        (["--bandwidth", "0"], "`--bandwidth (bits/s)` must be in (0, inf], got 0.0"),
        (["--bandwidth", "fast"], "`--bandwidth` must look like 1gbit, 100mbit or 2.5e9 (bits/s), got 'fast'"),
        (["--latency-us", "-1"], "`--latency-us` must be in [0, inf], got -1.0"),
        (["--host-bandwidth", "0"], "`--host-bandwidth (bits/s)` must be in (0, inf], got 0.0"),
        (["--compressor", "zip"], f"`--compressor` must be 'all' or one of {available()}, got 'zip'"),
        (["--overlap", "1.5"], "`--overlap` must be in [0, 1], got 1.5"),
        (["--params", "0.5"], "`--params` must be an integer >= 1, got 0.5"),
        (["--cost", "dgc=5"], "`--cost` must look like NAME=ENCODE_MS,DECODE_MS, got 'dgc=5'"),
        (["--cost", "dgc=5,x"], "`--cost` must look like NAME=ENCODE_MS,DECODE_MS, got 'dgc=5,x'"),
        (["--cost", "gzip=5,1"], f"`--cost compressor` must be one of {[*available(), *sorted(OUTER_PRESETS)]}"),
        (["--cost", "dgc=5,-1"], "`--cost dgc` must be in [0, inf], got -1.0"),
        (["--compressor", "dgc", "--cost", "topk=1,1"], "`--cost` names ['topk'], which `--compressor dgc` does not"),
        (["--compressor", "dgc", "--arg", "compress_ratio=2"], "`--arg` for dgc: `compress_ratio` must be in (0, 1]"),
        (["--compressor", "dgc", "--arg", "sample_ratio=abc"], "`--arg` for dgc: `sample_ratio` must be a finite"),
        (["--arg", "dgc=compress_ratio=2"], "`--arg` names ['dgc'], which no registered compressor takes"),
        (["--arg", "compress_ratio"], "`--arg` must look like NAME=VALUE, got 'compress_ratio'"),
    ],
)
def test_cli_rejects_nonsense(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--params", "1e6", "--compute-ms", "100", "--world-size", "2", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "module, message",
    [
        ("no_such_package.models:Net", "cannot import 'no_such_package.models'"),
        ("lightning_gc.perfmodel:NoSuchModel", "module 'lightning_gc.perfmodel' has no 'NoSuchModel'"),
        ("torch.nn:Linear", "must build with no arguments"),
    ],
)
def test_cli_rejects_a_module_it_cannot_build(module, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--module", module, "--compute-ms", "100", "--world-size", "2"])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", available())
def test_every_compressor_calibrates_through_all_its_rounds(name: str) -> None:
    """The codec timing follows the hook's protocol (PowerSGD's second round included) and counts
    the bytes of every round: they equal what the compressor says it puts on the wire."""
    shapes = [(64, 96), (96,), (32, 48)]
    cost = calibration.codec_cost(name, shapes, world_size=2, repeats=1)
    assert cost.encode_s > 0 and cost.decode_s > 0
    layout = calibration.layout_of_shapes(shapes)
    assert cost.summed_bytes + cost.gathered_bytes == create(name).wire_bytes(layout, 4)


def test_cli_times_a_sample_scales_it_caches_it_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    arguments = ["--params", "1e6", "--compute-ms", "100", "--world-size", "2", "--compressor", "fp16",
                 "--calibrate-numel", "65536", "--delay", "1"]  # fmt: skip
    assert cli.main(arguments) == 0
    stdout = capsys.readouterr().out
    assert "encode/decode timed on cpu on 65,536 elements, scaled to 1,000,000: fp16" in stdout
    assert "| fp16 | 2.000 | 2.0 |" in stdout  # bytes of the whole gradient, not of the sample
    assert ", delay=1" in stdout
    cached = json.loads((tmp_path / "lightning_gc" / "perfmodel.json").read_text())
    assert len(cached) == 1 and "|p=2|" in next(iter(cached))


def test_large_worlds_decode_four_payloads_and_scale_only_costly_plain_gathers(monkeypatch):
    shapes = [(64, 1024)]
    timed: list[tuple[str, int, float]] = []
    time_at = calibration._time_at

    def spy(compressor, shapes, world_size, *args):
        cost = time_at(compressor, shapes, world_size, *args)
        timed.append((compressor.name, world_size, cost.decode_s))
        return cost

    monkeypatch.setattr(calibration, "_time_at", spy)
    monkeypatch.setattr(calibration, "SCALE_ABOVE_S", 0.0)  # every decode counts as too slow to time at N
    qsgd = calibration.time_codec(create("qsgd"), shapes, world_size=16, repeats=1)
    # qsgd adds its own row from what encode kept: 3 of the 4 timed rows decode, 15 of the 16
    assert timed == [("qsgd", 4, pytest.approx(qsgd.decode_s * 3 / 15))] and qsgd.decode_timed_ranks == 4
    exact = time_at(create("qsgd"), shapes, 16, "cpu", 1, 0.0, None)
    assert (qsgd.gathered_bytes, qsgd.summed_bytes, exact.decode_timed_ranks) == (exact.gathered_bytes, 0, 0)

    timed.clear()  # rounds whose work depends on N otherwise are timed at N, whatever they cost
    two_phase = calibration.time_codec(create("qsgd", exchange="two_phase"), shapes, world_size=16, repeats=1)
    merged = calibration.time_codec(
        create("dgc", compress_ratio=0.01, exchange="global_topk"), shapes, world_size=16, repeats=1
    )
    fp16 = calibration.time_codec(create("fp16"), shapes, world_size=16, repeats=1)  # all-reduced: decoded once
    assert [(name, n) for name, n, _ in timed] == [("qsgd", 16), ("dgc", 4), ("dgc", 16), ("fp16", 4), ("fp16", 16)]
    assert fp16.decode_timed_ranks == 0
    assert two_phase.decode_timed_ranks == merged.decode_timed_ranks == 0
    assert two_phase.two_phase_bytes > 0 and merged.peer_messages == 4  # log2(16) merge rounds

    timed.clear()
    monkeypatch.setattr(calibration, "SCALE_ABOVE_S", float("inf"))  # cheap: every payload decoded
    assert calibration.time_codec(create("qsgd"), shapes, world_size=16, repeats=1).decode_timed_ranks == 0
    assert [n for _, n, _ in timed] == [4, 16]
    assert calibration.time_codec(create("qsgd"), shapes, world_size=3, repeats=1).decode_timed_ranks == 0


def test_cli_says_which_decodes_it_scaled(monkeypatch, capsys):
    monkeypatch.setattr(calibration, "SCALE_ABOVE_S", 0.0)
    args = ["--params", "65536", "--compute-ms", "100", "--world-size", "16", "--compressor", "onebit", "--no-cache"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "decode timed on 4 ranks' payloads and scaled to 16" in out and out.count("onebit") >= 2


def test_a_busy_machine_is_named_and_its_timings_are_timed_again_on_a_quiet_one(monkeypatch, capsys, tmp_path):
    cache = tmp_path / "costs.json"
    args = ["--params", "65536", "--compute-ms", "100", "--world-size", "2", "--compressor", "fp16"]
    args += ["--cache", str(cache)]
    timed = []
    codec = calibration.time_codec
    monkeypatch.setattr(calibration, "time_codec", lambda *a, **k: timed.append(1) or codec(*a, **k))
    for load, expected_timings, said in ((9.0, 1, True), (9.0, 1, True), (0.1, 2, False), (0.1, 2, False)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert cli.main(args) == 0
        err = capsys.readouterr().err
        assert ("this machine is busy (load average 9.0" in err) == said
        assert len(timed) == expected_timings  # busy: read what is there; quiet: time a busy entry again, once
    (entry,) = json.loads(cache.read_text()).values()
    assert calibration.BUSY not in entry


def test_scaled_cost_keeps_the_split_and_scales_the_seconds():
    sample = CodecCost("dgc", summed_bytes=100, gathered_bytes=300, encode_s=0.002, decode_s=0.001)
    full = cli.scaled_cost("dgc", 4 * 2**20, sample, 2**20, {"compress_ratio": 0.01})
    wire = create("dgc", compress_ratio=0.01).wire_bytes(
        calibration.layout_of_shapes(calibration.representative_shapes(4 * 2**20)), 4
    )
    assert full.summed_bytes + full.gathered_bytes == wire and full.summed_bytes == round(wire / 4)
    assert full.encode_s == pytest.approx(0.008) and full.decode_s == pytest.approx(0.004)
    assert cli.scaled_cost("dgc", 2**20, sample, 2**20, {}) is sample


def test_cli_with_a_delay_hides_the_exchange_behind_the_whole_step(capsys):
    arguments = ["--params", "1e6", "--compute-ms", "100", "--world-size", "2", "--bandwidth", "100mbit",
                 "--compressor", "dgc", "--cost", "dgc=5,1", "--delay", "1", "--no-cache"]  # fmt: skip
    assert cli.main(arguments) == 0
    # 4 MB at 100 Mbit/s: 320 ms of exchange; with a delay all of C = 100 ms hides it
    assert "| dense | 4.000 | 1.0 | 320.1 | 0.0 | 0.0 | 220.1 | 320.1 | 1.00 |" in capsys.readouterr().out


def test_point_to_point_rounds_hand_computed_and_counted_by_calibration():
    # q = 3 rounds of a 1 kB payload each and 400 B all-reduced on p = 4: T_p2p = 3 a + 3 kB / B
    cost = CodecCost("g", summed_bytes=400, gathered_bytes=0, peer_bytes=3000, peer_messages=3)
    assert comm_s(cost, NET) == pytest.approx(ring_allreduce_s(400, NET) + 3e-3 + 3e-3)
    assert comm_s(cost, NET, rounds=2) == pytest.approx(ring_allreduce_s(400, NET, rounds=2) + 6e-3 + 3e-3)
    assert cost.wire_bytes(4) == pytest.approx(1.5 * 400 + 3000) and cost.bytes_sent == 3400
    assert exchange_bytes("peer", 3000, 1) == 0.0 and comm_s(cost, Network(1, 1e6, 1e-3)) == 0.0

    shapes = [(64, 1024), (64,)]
    arguments = {"compress_ratio": 0.01}
    gathered = calibration.codec_cost("dgc", shapes, world_size=8, arguments=arguments, repeats=1)
    for world_size, messages in ((8, 3), (6, 4)):  # 6 ranks: rank 0 receives a fold-in, 2 rounds, hands back
        merged = calibration.codec_cost(
            "dgc", shapes, world_size=world_size, arguments={**arguments, "exchange": "global_topk"}, repeats=1
        )
        assert (merged.peer_messages, merged.gathered_bytes) == (messages, 0)
        # one pair payload through the link per round, the receive-only fold-in included
        assert merged.peer_bytes == messages * gathered.gathered_bytes
        k = 656  # ceil(1 % of 65,536): agreed fp32 values, with the dense 64-element tensor
        assert merged.summed_bytes == (k + 64) * 4


def test_cli_help_states_each_default_and_none_where_there_is_none():
    text = " ".join(cli.build_parser().format_help().split())  # argparse wraps lines
    for default in ("(default: 0.5)", "(default: 1gbit)", "(default: 0)", "(default: all)", "(default: 8388608)"):
        assert default in text, default
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: [])" not in text
