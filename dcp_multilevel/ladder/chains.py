"""A ladder's delta chains: per level, what it stored there and what the next
save there is coded against (``keyframes.py`` holds the rules).

Every rank keeps the same history: it records the decisions every rank took
alike (the first level's save, each drain submitted), never an outcome only
one rank saw. A reference that turns out to be unusable (missing, damaged,
another save) makes that save whole where it is read, so a history that is
wrong about it costs bytes, never data. Retention asks :meth:`DeltaChains.refs`
for the references of the steps a level holds: the history where it knows,
else the checkpoint's manifest (steps saved before a restart).

Thread-safety: drains record and retention reads from the drain worker while
the main thread saves, so every method takes the lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from .. import _dist
from ..errors import DcpMultilevelError
from ..levels import LevelDriver
from ..levels.options import Level
from .keyframes import next_reference

__all__ = ["DeltaChains"]

logger = logging.getLogger(__name__)


class DeltaChains:
    """The delta history of every level with ``keyframe_every > 1``."""

    def __init__(self, levels: Sequence[Level], drivers: Sequence[LevelDriver]) -> None:
        self._levels = list(levels)
        self._drivers = list(drivers)
        self._lock = threading.Lock()
        self._history: dict[int, list[tuple[int, int | None]]] = {
            i: [] for i, level in enumerate(levels) if level.deltas
        }
        self._gone: dict[int, set[int]] = {i: set() for i in self._history}
        # Levels between nodes copy the first level's files as they are: its deltas
        # keep their references there too (read from the copies' manifests).
        self._mirrors = {
            i for i, d in enumerate(drivers) if i > 0 and d.node_local and 0 in self._history
        }
        self._read: dict[int, dict[int, int | None]] = {
            i: {} for i in (*self._history, *self._mirrors)
        }

    def enabled(self, index: int) -> bool:
        """Whether level ``index`` stores deltas."""
        return index in self._history

    def reference(self, index: int) -> int | None:
        """The step the next save on level ``index`` is coded against (None: whole)."""
        if index not in self._history:
            return None
        level = self._levels[index]
        with self._lock:
            history = self._history[index]
            present = {s for s, _ in history} - self._gone[index]
            return next_reference(history, level.keyframe_every, level.delta_against, present)

    def stored(self, index: int, step: int, reference: int | None) -> None:
        """Record that ``step`` went to level ``index`` against ``reference`` (None: whole)."""
        if index in self._history:
            with self._lock:
                history = self._history[index]
                history[:] = [(s, r) for s, r in history if s != step]  # saved again
                history.append((step, reference))
                self._gone[index].discard(step)
                self._read[index].pop(step, None)  # a manifest read before is stale now

    def removed(self, index: int, steps: Iterable[int]) -> None:
        """Record that retention removed ``steps`` from level ``index`` (every rank must
        record the same removals: the first level's, which rank 0 broadcasts)."""
        if index in self._history:
            with self._lock:
                self._gone[index].update(steps)
                self._prune(index, lambda s: s not in self._gone[index])

    def retained(self, index: int, steps: Iterable[int]) -> None:
        """Retention left ``steps`` on level ``index``: forget what is known of the
        others, so the books grow with what a level holds, not with the run."""
        keep = set(steps)
        with self._lock:
            if index in self._read:
                self._read[index] = {s: r for s, r in self._read[index].items() if s in keep}
            if index in self._history:
                self._prune(index, keep.__contains__)

    def _prune(self, index: int, holds: Callable[[int], bool]) -> None:
        """Under the lock: drop the history before its last keyframe of steps the level
        no longer ``holds``. :func:`next_reference` reads only from the last keyframe
        on, so every rank's next reference stays the same whichever ranks prune."""
        history = self._history[index]
        keyframes = [k for k, (_, ref) in enumerate(history) if ref is None]
        start = keyframes[-1] if keyframes else 0
        history[:] = [(s, r) for k, (s, r) in enumerate(history) if k >= start or holds(s)]
        self._gone[index] &= {s for s, _ in history}

    def resume(self, index: int, history: Sequence[tuple[int, int | None]]) -> None:
        """Start level ``index``'s history over from what it holds (after a restart:
        ``(step, reference)`` of its committed steps, from their manifests)."""
        if index in self._history:
            with self._lock:
                self._history[index] = list(history)
                self._gone[index] = set()

    def resume_from_levels(self, upto: int) -> None:
        """After a restart: each delta level's history from the manifests of the steps
        it holds up to ``upto`` (rank 0 reads them, every rank takes the same), so the
        next saves go on with the chain instead of starting a keyframe. Collective."""
        levels = list(self._history)
        if not levels:
            return

        def read() -> dict[int, list[tuple[int, int | None]]]:
            histories = {}
            for i in levels:
                try:
                    steps = [s for s in self._drivers[i].steps() if s <= upto]
                except OSError as e:  # the chain starts over: costs bytes, never data
                    logger.warning("dcp_multilevel: listing %s failed: %s", self._levels[i].url, e)
                    continue
                histories[i] = sorted(self.refs(i, steps).items())
            return histories

        for i, history in _dist.rank0_decides(read).items():
            self.resume(i, history)

    def holds_first_level_deltas(self, index: int) -> bool:
        """Whether level ``index`` holds the first level's deltas as they are (a level
        between nodes above a first level with deltas): it needs their references."""
        return index in self._mirrors

    def refs(self, index: int, steps: Iterable[int]) -> dict[int, int | None]:
        """Each of ``steps``' reference step on level ``index`` (as its manifest says,
        read once per step; the history stands in where the manifest cannot be read:
        the first level's for a level holding its deltas as they are)."""
        if index not in self._read:
            return {}
        history_of = 0 if index in self._mirrors else index
        out: dict[int, int | None] = {}
        for step in steps:
            with self._lock:
                if step in self._read[index]:
                    out[step] = self._read[index][step]
                    continue
            try:
                ref = self._drivers[index].checkpoint(step).manifest().reference_step
            except (DcpMultilevelError, OSError) as e:
                with self._lock:
                    ref = dict(self._history[history_of]).get(step)
                logger.debug("reference of step %d unread (%s); history says %s", step, e, ref)
                out[step] = ref
                continue
            with self._lock:
                self._read[index][step] = ref
            out[step] = ref
        return out
