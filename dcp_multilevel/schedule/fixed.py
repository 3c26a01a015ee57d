"""The fixed-interval policy: every ``level.every``-th step goes to a level."""

from __future__ import annotations

from ..levels.config import Level
from .base import Decision, Observation, SavePolicy

__all__ = ["FixedInterval"]


class FixedInterval(SavePolicy):
    """A step goes to a level when it is a multiple of that level's ``every``.

    The default policy of :class:`~dcp_multilevel.CheckpointManager`;
    what torchtitan's ``interval`` and Orbax's ``save_interval_steps`` do.
    """

    deterministic = True

    def due(self, index: int, level: Level, step: int) -> bool:
        """``step % level.every == 0``."""
        return step % level.every == 0

    def decide(self, observation: Observation) -> Decision:
        """Every level whose ``every`` divides the step (the first level's too)."""
        chosen = {
            s.index for s in observation.levels if self.due(s.index, s.level, observation.step)
        }
        return Decision(frozenset(chosen), "fixed-interval")

    def __repr__(self) -> str:
        return "FixedInterval()"
