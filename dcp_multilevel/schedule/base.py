"""The save-decision point: which levels take the save of a step.

A :class:`SavePolicy` answers, for every level above the first (the first
takes every save), whether the save of ``step`` goes there. The manager asks
it once per level at each save, and again when it decides what the first
level must keep (a step due on a level it is not on yet is kept) and what
to drain again after a restart.

Call order and contract (every rank, main thread)::

    policy.due(index, level, step)    for each level index >= 1, at each save,
                                      at retention and at load_latest

Every rank must take the same decision for the same inputs: a diverging
decision would hang the collective part of a drain. Answers for a past step
must not change (retention and resumed drains ask again later). Policies
are pure: no I/O, no torch.distributed.
"""

from __future__ import annotations

import abc

from ..levels.options import Level

__all__ = ["SavePolicy"]


class SavePolicy(abc.ABC):
    """Decides which levels take the save of a step (see the module docstring)."""

    @abc.abstractmethod
    def due(self, index: int, level: Level, step: int) -> bool:
        """Whether the save of ``step`` goes to ``level`` (the ``index``-th, 1 and up)."""
