"""The Triton kernels' front end compiles for sm90 in every launch variant the package uses, checked on a
machine without a GPU (`tests/kernel_frontend.py`, in a subprocess with Triton's interpreter off: conftest
turns the interpreter on for this process, and the interpreter accepts code the compiler rejects)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("kernel_frontend.py")


@pytest.mark.oldest_triton
def test_every_launch_variant_lowers_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    report = done.stdout + done.stderr[-4000:]
    assert done.returncode == 0, report
    assert " 0 failed to compile" in done.stdout and "launches" in done.stdout, report
