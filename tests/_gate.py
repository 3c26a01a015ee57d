"""A save planner that holds a save in its writing until the test lets it go."""

from __future__ import annotations

import threading

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner


class GatedPlanner(DefaultSavePlanner):
    """Writes nothing until ``gate`` is set (at most 60 s)."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def resolve_data(self, write_item):
        assert self.gate.wait(60)
        return super().resolve_data(write_item)
