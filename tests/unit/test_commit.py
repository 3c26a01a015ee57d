"""Commit semantics: a checkpoint exists iff its manifest does; nothing committed is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import rank_errors
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_multilevel import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    MultiLevelReader,
    MultiLevelWriter,
)

HERE = Path(__file__).parents[1]  # tests/


def _state(value: float) -> dict:
    return {f"t{i}": torch.full((256, 1024), value + i) for i in range(20)}


def _assert_loads(path, value: float) -> None:
    target = {f"t{i}": torch.zeros(256, 1024) for i in range(20)}
    dcp.load(target, storage_reader=MultiLevelReader(path))
    for i in range(20):
        assert torch.equal(target[f"t{i}"], torch.full((256, 1024), value + i)), f"t{i}"


def _data_files(path: Path) -> list[str]:
    return sorted(os.listdir(path / "data"))


def test_saving_over_a_checkpoint_is_refused_by_default(tmp_path):
    dcp.save(_state(1), storage_writer=MultiLevelWriter(tmp_path / "c"))
    before = (tmp_path / "c" / "manifest.json").read_bytes()
    with pytest.raises(CheckpointException) as info:
        dcp.save(_state(2), storage_writer=MultiLevelWriter(tmp_path / "c"))
    (err,) = rank_errors(info.value)
    assert isinstance(err, CheckpointExistsError) and isinstance(err, FileExistsError)
    # Stock's FileSystemWriter raises RuntimeError("Checkpoint already exists and ..."):
    # callers that match its type or words match ours too.
    assert isinstance(err, RuntimeError)
    assert str(err) == (
        f"Checkpoint already exists at file://{tmp_path}/c and overwrite=False: refusing to "
        "replace it. Save to a new location, or pass MultiLevelWriter(..., overwrite=True) to "
        "replace it (the old one stays loadable until the new one commits)."
    )
    assert (tmp_path / "c" / "manifest.json").read_bytes() == before
    assert _data_files(tmp_path / "c") == [f.split("/")[1] for f in json.loads(before)["files"]]
    _assert_loads(tmp_path / "c", 1)


def test_overwrite_replaces_atomically_and_deletes_old_data_after_commit(tmp_path):
    path = tmp_path / "c"
    dcp.save(_state(1), storage_writer=MultiLevelWriter(path))
    (old_file,) = _data_files(path)
    dcp.save(_state(2), storage_writer=MultiLevelWriter(path, overwrite=True))
    (new_file,) = _data_files(path)
    assert new_file != old_file
    manifest = json.loads((path / "manifest.json").read_text())
    assert list(manifest["files"]) == [f"data/{new_file}"]
    _assert_loads(path, 2)


class _FailingPlanner(DefaultSavePlanner):
    def resolve_data(self, write_item):
        if write_item.index.fqn == "t7":
            raise OSError(28, "No space left on device (injected)")
        return super().resolve_data(write_item)


def test_failed_overwrite_keeps_the_old_checkpoint_intact(tmp_path):
    path = tmp_path / "c"
    dcp.save(_state(1), storage_writer=MultiLevelWriter(path))
    before = (path / "manifest.json").read_bytes()
    with pytest.raises(CheckpointException) as info:
        dcp.save(
            _state(2),
            storage_writer=MultiLevelWriter(path, overwrite=True),
            planner=_FailingPlanner(),
        )
    assert "No space left on device (injected)" in str(rank_errors(info.value)[0])
    assert (path / "manifest.json").read_bytes() == before
    _assert_loads(path, 1)
    # The failed save's temporary file was removed.
    leftovers = [p for p in (path / "data").rglob("*") if p.is_file()]
    manifest = json.loads(before)
    assert sorted(str(p.relative_to(path)) for p in leftovers) == sorted(manifest["files"])


def _run_and_kill(path: Path, marker: Path, overwrite: bool) -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "_crash_child.py"),
            str(path),
            str(marker),
            str(int(overwrite)),
        ],
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, f"child exited early with {child.returncode}"
            assert time.monotonic() < deadline, "child never reached write_data"
            time.sleep(0.05)
        # Proof that the kill lands mid-write: a half-written temporary data file exists.
        assert any(".tmp-" in p.name for p in path.rglob("*")), list(path.rglob("*"))
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
def test_sigkill_during_write_data_leaves_previous_checkpoint_and_no_new_one(tmp_path):
    previous, new = tmp_path / "step-100", tmp_path / "step-200"
    dcp.save(_state(1), storage_writer=MultiLevelWriter(previous))

    _run_and_kill(new, tmp_path / "marker", overwrite=False)

    _assert_loads(previous, 1)
    with pytest.raises(CheckpointNotFoundError):
        MultiLevelReader(new).read_metadata()
    # The next save to the same place succeeds and sweeps the crash leftovers.
    dcp.save(_state(3), storage_writer=MultiLevelWriter(new))
    _assert_loads(new, 3)
    assert [f"data/{f}" for f in _data_files(new)] == list(
        json.loads((new / "manifest.json").read_text())["files"]
    )
    assert not [p for p in new.rglob("*") if ".tmp-" in p.name]


@pytest.mark.slow
def test_sigkill_during_an_overwrite_leaves_the_old_checkpoint_loadable(tmp_path):
    path = tmp_path / "c"
    dcp.save(_state(1000), storage_writer=MultiLevelWriter(path))
    before = (path / "manifest.json").read_bytes()

    _run_and_kill(path, tmp_path / "marker", overwrite=True)

    assert (path / "manifest.json").read_bytes() == before
    _assert_loads(path, 1000)
