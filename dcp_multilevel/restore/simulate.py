"""What a plan costs, on paper: its rings as copies, and its simulated time.

For tests and benchmarks, and for ``plan.py``'s choice between a ring and
copies on a few nodes (where listing a ring's hops is cheap). Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from .actions import Copy, Link, Rebuild, Ring, participants
from .ring import hops

__all__ = ["expand_rings", "simulated_time"]


def expand_rings(actions: Sequence[Link | Copy | Rebuild | Ring]) -> list[Link | Copy | Rebuild]:
    """``actions`` with each ring as the copies of its hops, in their order (to check or
    simulate a plan at small sizes)."""
    out: list[Link | Copy | Rebuild] = []
    for action in actions:
        if isinstance(action, Ring):
            out += [Copy(action.files[h.index].file, h.level, h.src, h.dst) for h in hops(action)]
        else:
            out.append(action)
    return out


def simulated_time(actions: Sequence[Link | Copy | Rebuild | Ring], files: dict[str, int]) -> int:
    """How long carrying ``actions`` out takes, a byte a time unit: each rank takes its
    own in list order, each action once all its ranks are free (blocking transfers).
    A copy moves its whole file; a rebuild reads its largest file from each source;
    a ring is its hops, in order (``ring.py``: ``nodes x files`` of them).
    For tests and benchmarks (to compare plans), not used by the planner."""
    free: dict[int, int] = {}
    end = 0
    for action in expand_rings(actions):
        if isinstance(action, Copy):
            length = files[action.file]
        elif isinstance(action, Rebuild):
            length = max(files[f] for f in action.brings) * len(action.sources)
        else:
            length = 0
        ranks = participants(action)
        start = max((free.get(r, 0) for r in ranks), default=0)
        for r in ranks:
            free[r] = start + length
        end = max(end, start + length)
    return end
