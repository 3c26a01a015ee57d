"""Child process for the delta crash test: resumes from the newest checkpoint, then
saves deltas (first level and a remote level with deltas) until it is SIGKILLed.

Usage: python _delta_child.py L1_DIR REMOTE_DIR MARKER
"""

from __future__ import annotations

import pathlib
import sys

from test_manager_delta import blank, levels, trained

from dcp_multilevel import CheckpointManager


def main() -> None:
    l1, remote, marker = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    mgr = CheckpointManager(levels(l1, remote), drain_policy="wait")
    start = mgr.load_latest(blank())
    step = 0 if start is None else start + 1
    marker.touch()
    while True:
        mgr.save(trained(step), step=step)
        step += 1


if __name__ == "__main__":
    main()
