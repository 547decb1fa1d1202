"""The whole-hook benchmark's run syntax (``python -m benchmarks.hook_host --run "NAME KEY=VALUE"``)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.hook_host import parse_run


def test_a_run_is_a_compressor_and_attach_settings_as_python_literals_or_strings() -> None:
    assert parse_run("fp16 delay=1 local_update=True exchange=two_phase compress_ratio=0.01") == (
        "fp16",
        {"delay": 1, "local_update": True, "exchange": "two_phase", "compress_ratio": 0.01},
    )
    assert parse_run("none") == ("none", {})


def test_a_setting_without_a_value_is_refused_naming_it() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"KEY=VALUE pairs, got 'delay' in 'fp16 delay'"):
        parse_run("fp16 delay")
