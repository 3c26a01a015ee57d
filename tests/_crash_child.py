"""Child process for the crash tests: saves, and stalls inside write_data.

Usage: python _crash_child.py PATH MARKER OVERWRITE(0|1)

After a few items are written it creates MARKER and sleeps, so the parent can
SIGKILL it while a data file is half-written.
"""

from __future__ import annotations

import pathlib
import sys
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_multilevel import MultiLevelWriter


class StallingPlanner(DefaultSavePlanner):
    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = pathlib.Path(marker)
        self.resolved = 0

    def resolve_data(self, write_item):
        self.resolved += 1
        if self.resolved == 6:
            self.marker.touch()
            time.sleep(600)
        return super().resolve_data(write_item)


def main() -> None:
    path, marker, overwrite = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    state = {f"t{i}": torch.full((256, 1024), float(i + 1000)) for i in range(20)}
    dcp.save(
        state,
        storage_writer=MultiLevelWriter(path, overwrite=overwrite),
        planner=StallingPlanner(marker),
    )


if __name__ == "__main__":
    main()
