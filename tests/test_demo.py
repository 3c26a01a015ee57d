"""The README's demo, run as a user runs it: torchrun, 2 ranks, save, restart, resume;
and the inspect command it prints works on what it wrote."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def test_the_demo_resumes_bit_exact_and_prints_a_working_inspect_command(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node=2", str(REPO / "examples/train_demo.py"),
         "--out", str(tmp_path / "out"), "--steps", "6", "--extra-steps", "2"],
        check=False, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "RESUME OK" in run.stdout
    hint = next(line for line in run.stdout.splitlines() if "dcp-multilevel inspect" in line)
    command = shlex.split(hint.split("look inside:", 1)[1].split("(")[0])
    assert command[:2] == ["dcp-multilevel", "inspect"]
    assert Path(command[2]) == tmp_path / "out" / "step-6"
    script = Path(sys.executable).parent / "dcp-multilevel"
    shown = subprocess.run([str(script), *command[1:]], check=False, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "model.net.0.weight" in shown.stdout and "world size" in shown.stdout
