"""`make demo`, run as the Makefile runs it (a short variant): 4 ranks on 2 simulated
nodes train with the schedule and three levels, print the closing tables; node 1's
disk is deleted; a restart restores it from the other node and resumes bit-exact."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]

# Fewer steps than `make demo`, and a job that "fails" every 2 s, so that the schedule
# saves within the first seconds even on a fast machine.
SHORT = ["--steps", "80", "--mtbf-seconds", "2", "--remote-max-seconds", "2", "--async-saves", "2"]


def demo(out: Path, phase: str, cwd: Path) -> tuple[int, str, str]:
    """One torchrun of the demo: (exit status, stdout, stderr)."""
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node=4",
        str(REPO / "examples/train_demo.py"),
        "--out",
        str(out),
        *SHORT,
        phase,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A process group of its own: on a timeout the ranks go too, not only torchrun.
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as run:
        try:
            stdout, stderr = run.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            stdout, stderr = run.communicate()
            pytest.fail(f"the demo's {phase} run took over 240 s:\n{stdout}\n{stderr}")
    return run.returncode, stdout, stderr


def test_the_demo_loses_a_node_and_resumes_bit_exact(tmp_path):
    out = tmp_path / "out"
    status, text, errors = demo(out, "train", tmp_path)
    assert status == 0, text + errors
    assert "TRAIN OK" in text
    # The closing tables: every level, and the blocked time against stock DCP's async_save.
    assert "Levels after 80 steps" in text
    for row in ("1 node-local", "2 partner", "3 remote"):
        assert row in text
    assert "bytegroup" in text
    assert "Training blocked per save" in text
    for row in ("mgr.step", "async_save, MultiLevelWriter", "async_save, stock FileSystemWriter"):
        assert row in text
    assert list(out.glob("node1/partner/step-*")), "no step reached the partner level"
    # The command it suggests works on what it wrote.
    hint = next(line for line in text.splitlines() if "look inside:" in line)
    command = hint.split("look inside:", 1)[1].split("(")[0].split()
    assert command == ["dcp-multilevel", "ls", str(out / "remote")]
    script = Path(sys.executable).parent / "dcp-multilevel"
    listed = subprocess.run(
        [str(script), *command[1:]], check=False, capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    assert "complete" in listed.stdout

    shutil.rmtree(out / "node1")  # node 1 is lost with its disk
    status, text, errors = demo(out, "resume", tmp_path)
    assert status == 0, text + errors
    assert "lost      node(s) [1]" in text
    assert "node 1: brought " in text and "node 1: brought nothing" not in text
    assert "bit-exact with the uninterrupted run, all 4 ranks" in text
    assert "RESUME OK" in text


def _node_loss(out: Path, phase: str, cwd: Path) -> tuple[int, str]:
    """One torchrun of ``make demo-nodeloss``'s partner run: (exit status, output)."""
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node=4",
        str(REPO / "examples/node_loss.py"),
        "--out",
        str(out),
        phase,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        command, cwd=cwd, env=env, text=True, capture_output=True, timeout=240, check=False
    )
    return run.returncode, run.stdout + run.stderr


def test_the_node_loss_demo_saves_and_loads_with_plain_dcp_calls(tmp_path):
    # examples/node_loss.py saves with dcp.save and a new MultiLevelWriter(levels=...)
    # per step, and loads with dcp.load and MultiLevelReader("latest", levels=...).
    out = tmp_path / "out"
    status, text = _node_loss(out, "save", tmp_path)
    assert status == 0 and "SAVE OK" in text, text
    shutil.rmtree(out / "node1")
    status, text = _node_loss(out, "restore", tmp_path)
    assert status == 0 and "RESTORE OK" in text, text
    assert "lost      node(s) [1]" in text
    assert "copied from partner (node 0)" in text, text
