"""What a failed ``dcp.load`` through our reader shows: DCP's log of it is one line,
our error's message reaches the caller, and other readers' logs are left alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

#: A single-process load that fails; prints the message DCP's CheckpointException carries.
_LOAD = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from dcp_multilevel import Level, MultiLevelReader

    where, how = sys.argv[1], sys.argv[2]
    if how == "path":
        reader = MultiLevelReader(where)
    elif how == "latest":
        reader = MultiLevelReader("latest", levels=[Level(where)])
    else:
        reader = dcp.FileSystemReader(where)
    try:
        dcp.load({"w": torch.zeros(2)}, storage_reader=reader)
    except CheckpointException as e:
        (error, _), = e.failures.values()
        print(f"{type(error).__name__}: {error}")
    """
)


def _load(where: str, how: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore:torch.distributed is disabled:UserWarning",
            "-c",
            _LOAD,
            where,
            how,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


@pytest.mark.parametrize(
    ("how", "message"),
    [
        (
            "path",
            "no committed checkpoint at file://{where}: manifest.json is missing (a save "
            "that did not finish leaves none). Check the path, or load an earlier checkpoint.",
        ),
        (
            "latest",
            "no level holds a checkpoint ({where}): nothing to load. Start fresh, or check "
            "the levels' locations.",
        ),
    ],
)
def test_a_failed_load_logs_one_line_and_the_caller_gets_our_message(tmp_path, how, message):
    where = str(tmp_path / "nothing")
    message = message.format(where=where)
    done = _load(where, how)
    assert done.stderr == (
        f"dcp.load could not read the checkpoint's metadata: CheckpointNotFoundError: {message}\n"
    )
    assert done.stdout == (
        f"AssertionError: metadata is None; global metadata read failed: {message}\n"
    )


def test_other_readers_failures_keep_dcps_log(tmp_path):
    done = _load(str(tmp_path / "nothing"), "stock")
    assert "Global metadata is not found. Falling back to rank local metadata." in done.stderr
    assert "Traceback (most recent call last):" in done.stderr
