"""``benchmarks/gpu_check.py`` in its CPU mode, as ``make gpu-check`` runs it without CUDA.

The check is the script people run on a GPU machine; here it must run end to
end (round trips bit-exact, then a short benchmark) and fail loudly when a
round trip fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict, str]:
    out = tmp_path / "report.json"
    r = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--dir",
            str(tmp_path / "ck"),
            "--json",
            str(out),
            *args,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )
    return r.returncode, json.loads(out.read_text()), r.stdout + r.stderr


def test_cpu_mode_round_trips_and_benchmark(tmp_path: Path) -> None:
    rc, report, log = _run(tmp_path, "--rounds", "1", "--steps", "4", "--every", "2")
    assert rc == 0, log[-3000:]
    checks = {r["check"]: r["ok"] for r in report["roundtrips"]}
    assert len(checks) == 7 and all(checks.values()), checks
    bench = report["bench"]
    assert bench["rounds"] == 1 and not bench["errors"]
    assert set(bench["methods"]) == {
        "ours",
        "ours-overlap",
        "ours-nocopy",
        "manager",
        "stock",
        "stock-best",
    }
    assert report["load"]["load"]["ours"]["s"] > 0
    assert "function calls" in report["load"]["profile"]  # where the load's time went
    assert "| ours |" in log  # the table people paste
    if sys.platform.startswith("linux"):  # the machine's busy time comes from /proc/stat
        assert all(m["cpu_per_save_s"] is not None for m in bench["methods"].values())


def test_methods_can_be_chosen_and_unknown_ones_are_named(tmp_path: Path) -> None:
    rc, report, log = _run(
        tmp_path, "--rounds", "1", "--steps", "2", "--every", "2", "--methods", "ours,stock-best"
    )
    assert rc == 0, log[-3000:]
    assert set(report["bench"]["methods"]) == {"ours", "stock-best"}
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--methods", "ours,fastest"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--methods: unknown ['fastest']" in r.stderr


def test_a_failed_round_trip_fails_the_check(tmp_path: Path) -> None:
    # A reader that flips one byte of every tensor it loads: the check must notice.
    hook = tmp_path / "sitecustomize.py"
    hook.write_text(
        "import torch\n"
        "import dcp_multilevel.plugin.reader as r\n"
        "orig = r.MultiLevelReader.read_data\n"
        "def read_data(self, plan, planner):\n"
        "    fut = orig(self, plan, planner)\n"
        "    for item in plan.items:\n"
        "        t = planner.resolve_tensor(item) if item.type.name == 'TENSOR' else None\n"
        "        if t is not None and t.numel():\n"
        "            t.reshape(-1)[:1].view(torch.uint8).bitwise_xor_(1)\n"
        "    return fut\n"
        "r.MultiLevelReader.read_data = read_data\n"
    )
    pythonpath = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    rc, report, log = _run(tmp_path, "--skip-bench", env={"PYTHONPATH": pythonpath})
    assert rc == 1, log[-3000:]
    failed = [r["check"] for r in report["roundtrips"] if not r["ok"]]
    assert "save/load (dcp.save, BalancedSavePlanner)" in failed
    assert "round trip(s) failed" in log


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
