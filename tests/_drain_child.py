"""Child process for the drain crash test: commits step 1 remotely, then stalls
inside the slow upload of step 2 (the parent SIGKILLs it there).

Usage: python _drain_child.py L1_DIR REMOTE_DIR MARKER
"""

from __future__ import annotations

import pathlib
import sys

import _faulty_fs  # noqa: F401 - registers faulty://
from test_manager import state

from dcp_multilevel import CheckpointManager, Level


def main() -> None:
    l1, remote_dir, marker = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    fast = Level(
        f"faulty://{remote_dir}/run",
        storage_options={"target_protocol": "file", "target_options": {"auto_mkdir": True}},
    )
    mgr = CheckpointManager([Level(l1), fast], drain_policy="wait")
    mgr.save(state(1), step=1)
    mgr.close()  # the same first level, other levels: one list at a time per process
    slow_options = {
        "target_protocol": "file",
        "target_options": {"auto_mkdir": True},
        "delay": {"put_file": 30.0},
        "announce": {"put_file": str(marker)},  # the parent's gate: the upload began
        "skip_instance_cache": True,
    }
    slow = Level(fast.url, storage_options=slow_options)
    mgr = CheckpointManager([Level(l1), slow], drain_policy="wait")
    mgr.save(state(2), step=2)
    mgr.wait()


if __name__ == "__main__":
    main()
