"""The fixed-interval policy: every ``level.every``-th step goes to a level."""

from __future__ import annotations

from ..levels.options import Level
from .base import SavePolicy

__all__ = ["FixedInterval"]


class FixedInterval(SavePolicy):
    """A step goes to a level when it is a multiple of that level's ``every``.

    The default policy of :class:`~dcp_multilevel.manager.CheckpointManager`;
    what torchtitan's ``interval`` and Orbax's ``save_interval_steps`` do.
    """

    def due(self, index: int, level: Level, step: int) -> bool:
        """``step % level.every == 0``."""
        return step % level.every == 0

    def __repr__(self) -> str:
        return "FixedInterval()"
