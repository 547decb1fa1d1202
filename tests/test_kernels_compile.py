"""Every Triton kernel variant the wrappers launch compiles for sm_80 and sm_90, on this CPU.

The suite runs the kernels in Triton's interpreter, which accepts programs the compiler rejects
(lightning_gc.kernels.aot): this compiles them as a GPU would, through ptxas, without one, in a
process of its own (kernels defined under TRITON_INTERPRET=1 cannot be compiled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from conftest import REPO

pytest.importorskip("triton")


def _compiled(code: str) -> Any:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return _compiled("import json; from lightning_gc.kernels import aot; print(json.dumps(aot.report()))")


@pytest.mark.parametrize("arch", [80, 90], ids=["sm_80", "sm_90"])
def test_every_launch_of_the_wrappers_compiles_with_and_without_the_jits_specialisation(
    report: dict[str, Any], arch: int
) -> None:
    rows = [row for row in report["rows"] if row["arch"] == arch]
    assert len(rows) >= 150  # every dtype/flag combination, as launched and with integer arguments = 1
    assert [f"{row['variant']}: {row['error']}" for row in rows if "error" in row] == []
    assert all(0 < row["registers"] <= 255 for row in rows)


def test_the_wrappers_launch_every_kernel(report: dict[str, Any]) -> None:
    assert report["launched_kernels"] == report["kernels"]


def test_an_integer_argument_equal_to_one_would_be_a_constant_the_kernel_must_not_convert() -> None:
    """What broke TernGrad on the first GPU: without ``do_not_specialize``, ``levels=1`` becomes a
    compile-time constant and ``levels.to(...)`` does not compile; the all-ones corner catches it."""
    outcome = _compiled(
        """
import json
from lightning_gc.kernels import aot, packing_triton
kernel = packing_triton._stochastic_quantize_kernel
launch = next(l for l in aot.wrapper_launches() if l.kernel is kernel and l.args[6] == 1)
variant = aot.variant_of(launch)
signature, constants = {**variant.signature, "levels": "constexpr"}, {**variant.constexprs, "levels": 1}
constant = aot.Variant(variant.kernel, signature, constants)
try:
    aot.compile_variant(constant, 90)
    error = None
except Exception as e:
    error = str(e)
print(json.dumps({"levels": variant.signature["levels"], "error": error}))
"""
    )
    assert outcome["levels"] == "i32"  # not specialised, thanks to do_not_specialize
    assert outcome["error"] is not None and "'int' object has no attribute 'to'" in outcome["error"]
