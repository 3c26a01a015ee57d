"""A save whose data files cannot be written says which file, checkpoint, rank and
level (``CheckpointWriteError``), inside DCP's ``CheckpointException``."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import run_ranks
from torch.distributed.checkpoint.api import CheckpointException

from dcp_multilevel import DcpMultilevelError, Level, MultiLevelWriter
from dcp_multilevel.errors import CheckpointWriteError

#: What a rank's data file is called (``format/layout.py``): rank, file index, token.
_DATA_FILE = re.compile(r"data/(\d+)-0\.[0-9a-f]{16}\.bin")


def _below_a_file(tmp_path: Path) -> Path:
    """A directory path no process can create: its parent is a regular file."""
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")
    return blocker / "run"


def _failures(info: pytest.ExceptionInfo[CheckpointException]) -> dict[int, BaseException]:
    return {rank: failure[0] for rank, failure in info.value.failures.items()}


def test_a_checkpoint_path_below_a_file_names_the_file_checkpoint_and_rank(tmp_path):
    root = _below_a_file(tmp_path)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(8)}, storage_writer=MultiLevelWriter(root / "ckpt"))
    (error,) = _failures(info).values()
    assert isinstance(error, CheckpointWriteError)
    assert isinstance(error, OSError)
    assert isinstance(error, DcpMultilevelError)
    assert _DATA_FILE.fullmatch(error.file) and error.file.startswith("data/0-")
    assert str(error) == (
        f"rank 0 could not write data file {error.file} of checkpoint file://{root}/ckpt: "
        f"NotADirectoryError: [Errno 20] Not a directory: '{root}/ckpt/data'. Make the "
        "checkpoint's path a directory this rank can write, with room for the checkpoint, "
        "or save elsewhere."
    )
    assert (error.checkpoint, error.rank, error.level) == (f"file://{root}/ckpt", 0, None)
    assert error.errno == errno.ENOTDIR
    assert isinstance(error.__cause__, NotADirectoryError)


def _level_message(rank: int, file: str, root: Path) -> str:
    return (
        f"rank {rank} could not write data file {file} of step 1 on the first level {root} "
        f"(file://{root}/step-1): NotADirectoryError: [Errno 20] Not a directory: "
        f"'{root}/step-1/data'. Make the first level's root a directory every rank can "
        "write on its node, with room for the checkpoint, or give the first Level another url."
    )


def test_an_unwritable_first_level_names_the_level_step_and_rank(tmp_path):
    root = _below_a_file(tmp_path)
    writer = MultiLevelWriter("step-1", levels=[Level(str(root))])
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(8)}, storage_writer=writer)
    (error,) = _failures(info).values()
    assert isinstance(error, CheckpointWriteError)
    assert str(error) == _level_message(0, error.file, root)
    assert (error.level, error.rank) == (str(root), 0)


def _unwritable_level_job(rank: int, world: int, root: str) -> dict[int, tuple[str, str, str]]:
    writer = MultiLevelWriter("step-1", levels=[Level(root)])
    try:
        dcp.save({f"w{rank}": torch.full((8,), float(rank))}, storage_writer=writer)
    except CheckpointException as e:
        return {r: (type(f[0]).__name__, str(f[0]), f[0].file) for r, f in e.failures.items()}
    raise AssertionError("the save into a path below a file succeeded")


@pytest.mark.multiprocess
def test_each_rank_names_itself_when_the_first_level_is_unwritable(tmp_path):
    root = _below_a_file(tmp_path)
    seen = run_ranks(_unwritable_level_job, 2, str(root), timeout=120)
    assert seen[0] == seen[1]  # DCP hands every rank every rank's failure
    for rank, (kind, message, file) in seen[0].items():
        assert kind == "CheckpointWriteError"
        assert file.startswith(f"data/{rank}-")
        assert message == _level_message(rank, file, root)
    assert sorted(seen[0]) == [0, 1]
