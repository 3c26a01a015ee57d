"""The ladder: one level list bound in this process, shared by writers, readers and managers.

- ``registry.py``: :func:`ladder_for` (one ladder per level list, made on
  first use), :func:`wait` (``dcp_multilevel.wait()``), :func:`newest_step`,
  the exit hook.
- ``ladder.py``: :class:`Ladder`, composing the parts below.
- ``binding.py``: the levels checked, their drivers bound, the topology.
- ``naming.py``: which step a writer's or reader's path names.
- ``commits.py``: what follows each save's commit, on every rank, in order.
- ``drains.py``: which drains a save starts, after a restart, after a restore.
- ``holdings.py``: what each level holds (one lock), and the retention that follows.
- ``retention.py``: :class:`RetentionRules`, the pure rules (``dcp-multilevel gc`` runs them too).
- ``chains.py``: each delta level's history; ``keyframes.py``: its pure rules.
"""

from .ladder import LEVELS_KEY, Ladder
from .naming import LATEST, step_of
from .registry import ladder_for, ladders, newest_step, release, wait

__all__ = [
    "LATEST",
    "LEVELS_KEY",
    "Ladder",
    "ladder_for",
    "ladders",
    "newest_step",
    "release",
    "step_of",
    "wait",
]
