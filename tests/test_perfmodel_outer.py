"""The outer loop's performance model (lightning_gc.perfmodel.outer) on hand-computed cases, and its
rows in the CLI."""

from __future__ import annotations

import re

import pytest

from lightning_gc.common.outer_presets import OUTER_ARGUMENTS, OUTER_PRESETS, STREAMING_DEFAULTS
from lightning_gc.compressors import create
from lightning_gc.perfmodel import CodecCost, Network, calibration
from lightning_gc.perfmodel import __main__ as cli
from lightning_gc.perfmodel.outer import OuterSchedule, predict_outer, recommendation
from lightning_gc.perfmodel.step import Workload, best, predict

# p = 4 workers, a = 1 ms, B = 1 MB/s; M = 1 MB: T_ar(M) = 2(p-1) a + 2(p-1)/p M/B = 0.006 + 1.5 s
NET = Network(world_size=4, bandwidth=1e6, latency=1e-3)
M_NUMEL = 250_000
DENSE_SYNC = CodecCost("diloco", summed_bytes=1_000_000, gathered_bytes=0)  # the identity codec, free
T_AR = 1.506


def test_one_step_one_fragment_uncompressed_is_dense_ddp_without_overlap():
    """H = 1, P = 1, tau = 0, identity codec: step = C + T_ar(M), dense DDP's step when backward
    hides nothing (f = 0); with f > 0 DDP is faster, since the outer loop syncs after the step."""
    no_overlap = Workload(M_NUMEL, compute_s=1.0, overlap=0.0)
    outer = predict_outer(DENSE_SYNC, OuterSchedule(1), no_overlap, NET)
    dense = predict(no_overlap, NET, [])[0]
    assert outer.step_s == pytest.approx(dense.step_s) == pytest.approx(1.0 + T_AR)
    assert outer.comm_s == pytest.approx(dense.comm_s) and outer.speedup == pytest.approx(1.0)
    assert outer.bytes_per_step == dense.bytes_sent == 1_000_000 and outer.wire_ratio == pytest.approx(1.0)
    overlapped = Workload(M_NUMEL, compute_s=1.0, overlap=0.5)
    slower = predict_outer(DENSE_SYNC, OuterSchedule(1), overlapped, NET)
    assert slower.step_s == pytest.approx(2.506) and slower.speedup == pytest.approx(2.006 / 2.506)


def test_one_sync_every_h_steps_hand_computed():
    """H = 10, C = 1 s: period = 10 C + T_ar(M) = 11.506 s, 1.1506 s per inner step; the link
    carries 2(p-1)/p M = 1.5 MB per period: 1.5 s of 11.506; a tenth of DDP's bytes per step."""
    workload = Workload(M_NUMEL, compute_s=1.0, overlap=0.5)  # DDP per step: 1 + (1.506 - 0.5)
    outer = predict_outer(DENSE_SYNC, OuterSchedule(10), workload, NET)
    assert outer.comm_s == pytest.approx(T_AR) and outer.exposed_s == pytest.approx(T_AR)
    assert outer.step_s == pytest.approx(1.1506)
    assert outer.link_use == pytest.approx(1.5 / 11.506)
    assert outer.bytes_sent == 1_000_000 and outer.bytes_per_step == pytest.approx(100_000)
    assert outer.wire_ratio == pytest.approx(10.0)
    assert outer.speedup == pytest.approx(2.006 / 1.1506)


def test_sync_delay_hides_the_exchange_but_never_the_codec_or_host_time():
    workload = Workload(M_NUMEL, compute_s=1.0)
    one = predict_outer(DENSE_SYNC, OuterSchedule(10, sync_delay=1), workload, NET)
    assert one.exposed_s == pytest.approx(T_AR - 1.0) and one.step_s == pytest.approx((10 + 0.506) / 10)
    two = predict_outer(DENSE_SYNC, OuterSchedule(10, sync_delay=2), workload, NET)
    assert two.exposed_s == 0.0 and two.step_s == pytest.approx(1.0)  # the compute floor
    assert two.link_use == pytest.approx(1.5 / 10)
    coded = CodecCost("coded", summed_bytes=1_000_000, gathered_bytes=0, encode_s=0.2, decode_s=0.1)
    assert predict_outer(coded, OuterSchedule(10, sync_delay=2), workload, NET).step_s == pytest.approx(1.03)
    # a host pushing 10 MB/s spends 1.5 MB / 10 MB/s = 0.15 s of the core per sync: never hidden
    host_bound = Network(world_size=4, bandwidth=1e6, latency=1e-3, host_bandwidth=1e7)
    hosted = predict_outer(DENSE_SYNC, OuterSchedule(10, sync_delay=2), workload, host_bound)
    assert hosted.host_s == pytest.approx(0.15) and hosted.step_s == pytest.approx(1.015)


def test_fragments_move_a_part_each_and_let_the_same_delay_hide_it():
    """H = 12, C = 0.2 s. P = 3 fragments of M/3: T_comm,f = 0.006 + 1.5/3 s. Without a delay they
    add a latency each (a little slower than P = 1); with tau = 3 (3 * 3 < 12) tau C = 0.6 s hides a
    fragment's 0.506 s entirely, where it hides only 0.6 of the whole model's 1.506 s."""
    workload = Workload(M_NUMEL, compute_s=0.2)
    fragment = DENSE_SYNC.scaled(1 / 3)
    t_fragment = 0.006 + 1.5 * fragment.summed_bytes / 1e6
    whole = predict_outer(DENSE_SYNC, OuterSchedule(12), workload, NET)
    split = predict_outer(fragment, OuterSchedule(12, fragments=3), workload, NET)
    assert split.comm_s == pytest.approx(t_fragment)
    assert split.step_s == pytest.approx((12 * 0.2 + 3 * t_fragment) / 12)
    assert whole.step_s == pytest.approx((12 * 0.2 + T_AR) / 12) and whole.step_s < split.step_s
    assert split.bytes_per_step == pytest.approx(whole.bytes_per_step, rel=1e-6)  # same bytes per period
    hidden = predict_outer(fragment, OuterSchedule(12, fragments=3, sync_delay=3), workload, NET)
    assert hidden.exposed_s == 0.0 and hidden.step_s == pytest.approx(0.2)
    assert hidden.link_use == pytest.approx(3 * 1.5 * fragment.summed_bytes / 1e6 / 2.4)
    partly = predict_outer(DENSE_SYNC, OuterSchedule(12, sync_delay=3), workload, NET)
    assert partly.step_s == pytest.approx((2.4 + T_AR - 0.6) / 12)
    assert OuterSchedule(12, fragments=3).fragment_numel(10) == 4  # the largest of 10 elements in 3


@pytest.mark.parametrize(
    "arguments, message",
    [
        ((0,), "`sync_every` must be an integer >= 1, got 0"),
        ((10, 0), "`fragments` must be an integer >= 1, got 0"),
        ((10, 1, -1), "`sync_delay` must be an integer >= 0, got -1"),
        ((12, 3, 4), "`sync_delay` must be below sync_every / fragments = 12/3 = 4, got 4: a fragment's exchange"),
        ((10, 1, 10), "`sync_delay` must be below sync_every / fragments = 10/1"),
    ],
)
def test_schedule_refuses_nonsense(arguments, message):
    with pytest.raises(ValueError) as error:
        OuterSchedule(*arguments)
    assert message in str(error.value)


@pytest.mark.parametrize(("sync_every", "fragments", "sync_delay"), [(12, 3, 4), (10, 1, 10), (5, 2, 3), (4, 4, 1)])
def test_the_runtime_and_the_model_refuse_the_same_schedules_alike(sync_every, fragments, sync_delay):
    """One rule (tau P < H) and one message for the outer loop's Streaming and the model's OuterSchedule."""
    from lightning_gc.runtime.outer_fragments import Streaming

    with pytest.raises(ValueError) as runtime:
        Streaming(fragments, sync_delay).check(sync_every)
    with pytest.raises(ValueError) as model:
        OuterSchedule(sync_every, fragments, sync_delay)
    assert str(runtime.value) == str(model.value)
    for allowed in range(sync_delay):
        if allowed * fragments < sync_every:
            Streaming(fragments, allowed).check(sync_every)
            OuterSchedule(sync_every, fragments, allowed)


def test_recommendation_names_an_outer_scheme_only_when_faster_and_says_it_changes_the_optimisation():
    workload = Workload(M_NUMEL, compute_s=1.0)
    per_step = predict(workload, NET, [CodecCost("fast", summed_bytes=1000, gathered_bytes=0)])
    outer = [predict_outer(DENSE_SYNC, OuterSchedule(10), workload, NET)]  # 1.1506 s per step
    assert recommendation(best(per_step), outer) is None  # "fast": 1.0 + 0 exposed
    assert recommendation(best(per_step), []) is None
    line = recommendation(per_step[0], outer)  # against dense per step, 2.006 s
    assert line is not None and line.startswith("use: diloco outer loop, sync_every=10, fragments=1, sync_delay=0")
    assert f"expected speedup {2.006 / 1.1506:.2f}x over dense all-reduce)" in line
    assert "changes the optimisation" in line and "not synchronous SGD" in line


def test_the_presets_table_is_the_front_ends_table():
    """The model reads the presets from lightning_gc.common (it sits below the front ends); the
    front ends use that very table, not a copy."""
    from lightning_gc.integrations import outer_attach

    assert outer_attach.OUTER_PRESETS is OUTER_PRESETS
    assert outer_attach.OUTER_ARGUMENTS is OUTER_ARGUMENTS
    assert outer_attach.STREAMING_DEFAULTS is STREAMING_DEFAULTS


CLI = ["--params", "1e6", "--compute-ms", "100", "--world-size", "2", "--bandwidth", "100mbit", "--no-cache",
       "--compressor", "dgc", "--cost", "dgc=5,1"]  # fmt: skip


def _row(stdout: str, name: str) -> list[str]:
    line = next(line for line in stdout.splitlines() if line.startswith(f"| {name} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_cli_prints_the_outer_rows_and_recommends_the_fastest(capsys):
    """4 MB at 100 Mbit/s on 2 ranks: diloco's sync all-reduces 4 MB in 2 a + 4 MB / 12.5 MB/s =
    320.1 ms once per 10 steps of 100 ms: 132.0 ms per step, the link busy 320 of 1320 ms. Dense
    DDP per step: 370.1 ms. sparseloco sends far less and beats dgc's 106 ms per step."""
    sparse = OUTER_PRESETS["sparseloco"]
    assert cli.main([*CLI, "--outer", "diloco", "sparseloco", "--sync-every", "10",
                     "--cost", "diloco=0,0", "--cost", "sparseloco=2,1"]) == 0  # fmt: skip
    stdout = capsys.readouterr().out
    assert "| diloco | 10 | 1 | 0 | 4.000 | 0.4000 | 10 | 320.1 | 0.0 | 0.0 | 320.1 | 132.0 | 24.2% | 2.80 |" in stdout
    assert "outer loop, per inner step (it changes the optimisation" in stdout
    row = _row(stdout, "sparseloco")
    codec = create(sparse["compressor"], compress_ratio=sparse["compress_ratio"])
    layout = calibration.layout_of_shapes(calibration.representative_shapes(1_000_000))
    assert row[4] == f"{codec.wire_bytes(layout, 4) / 1e6:.3f}"  # the codec's own wire format
    assert row[8] == "3.0"  # --cost 2 + 1 ms
    assert "use: sparseloco outer loop, sync_every=10, fragments=1, sync_delay=0" in stdout
    assert "over dgc per step). It changes the optimisation" in stdout
    assert "encode/decode given with --cost: dgc, diloco, sparseloco" in stdout


def test_cli_fragments_scale_the_sync_and_one_step_syncs_equal_dense_ddp_without_overlap(capsys):
    sparse = OUTER_PRESETS["sparseloco"]
    assert cli.main([*CLI, "--outer", "sparseloco", "--sync-every", "10", "--fragments", "2", "--sync-delay", "4",
                     "--cost", "sparseloco=2,1"]) == 0  # fmt: skip
    row = _row(capsys.readouterr().out, "sparseloco")
    codec = create(sparse["compressor"], compress_ratio=sparse["compress_ratio"])
    half = calibration.layout_of_shapes(calibration.representative_shapes(500_000))
    assert row[1:4] == ["10", "2", "4"] and row[4] == f"{codec.wire_bytes(half, 4) / 1e6:.3f}"
    assert row[8] == "1.5"  # half the model: half the given codec time
    assert row[10] == "0.0" and row[11] == "100.3"  # tau C = 400 ms hides it; 2 x 1.5 ms per 10 steps

    assert cli.main([*CLI, "--overlap", "0", "--sync-every", "1", "--outer", "diloco", "--cost", "diloco=0,0"]) == 0
    stdout = capsys.readouterr().out
    assert _row(stdout, "dense")[7] == _row(stdout, "diloco")[11] == "420.1"
    assert "use: dgc (expected speedup" in stdout  # per step still wins: no outer recommendation


@pytest.mark.parametrize(
    "args, message",
    [
        (["--fragments", "2"], "`--fragments` applies to the outer loop only: add --outer (or --sync-every)"),
        (["--sync-delay", "1"], "`--sync-delay` applies to the outer loop only"),
        (["--outer", "--sync-every", "10", "--fragments", "2", "--sync-delay", "5"],
         "`--sync-delay` must be below sync_every / fragments = 10/2"),
        (["--sync-every", "0"], "`--sync-every` must be an integer >= 1, got 0 (outer preset diloco)"),
        (["--outer", "--fragments", "0"], "`--fragments` must be an integer >= 1, got 0"),
        (["--cost", "sparseloco=1,1"], "`--cost` names outer preset(s) ['sparseloco'], which `--outer` does not"),
        (["--outer", "diloco", "--cost", "sparseloco=1,1"], "which `--outer` does not select"),
        (["--outer", "zip"], "argument --outer: invalid choice: 'zip'"),
    ],
)  # fmt: skip
def test_cli_refuses_outer_nonsense(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--params", "1e6", "--compute-ms", "100", "--world-size", "2", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_help_shows_the_outer_options():
    text = " ".join(cli.build_parser().format_help().split())
    assert re.search(r"--outer \[PRESET \.\.\.\]", text) and "It changes the optimisation" in text
    for preset in OUTER_PRESETS:
        assert preset in text
