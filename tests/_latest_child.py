"""Child process for the crash tests of the default drain policy: commits step 1
remotely, then saves STEPS while the remote's uploads stall (the first one's drain
is inside its upload, the later ones wait behind it); the parent SIGKILLs it there.

Usage: python _latest_child.py L1_DIR REMOTE_DIR MARKER STEPS   (STEPS: "2" or "2,3")
"""

from __future__ import annotations

import pathlib
import sys

import _faulty_fs  # noqa: F401 - registers faulty://
from test_drain_latest import state

from dcp_multilevel import CheckpointManager, Level


def main() -> None:
    l1, remote_dir, marker = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    steps = [int(s) for s in sys.argv[4].split(",")]
    options = {
        "target_protocol": "file",
        "target_options": {"auto_mkdir": True},
        "skip_instance_cache": True,
    }
    url = f"faulty://{remote_dir}/run"
    mgr = CheckpointManager([Level(l1, keep=1), Level(url, storage_options=options)])
    mgr.save(state(1), step=1)
    mgr.wait()
    mgr.close()
    never = {**options, "wait_for": {"put_file": str(marker) + ".never"}}
    mgr = CheckpointManager([Level(l1, keep=1), Level(url, storage_options=never)])
    for step in steps:
        mgr.save(state(step), step=step)
    marker.touch()
    mgr.wait()  # never returns: killed


if __name__ == "__main__":
    main()
