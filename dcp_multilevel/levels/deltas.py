"""Delta levels: per level, the delta history (what the runtime stored there) and what
the next save there is coded against.

Every rank keeps the same history: it records the decisions every rank took
alike (the first level's save, each drain submitted), never an outcome only
one rank saw. A reference that turns out to be unusable (missing, damaged,
another save) makes that save whole where it is read, so a history that is
wrong about it costs bytes, never data. Retention asks :meth:`DeltaHistory.refs`
for the references of the steps a level holds: the history where it knows,
else the checkpoint's manifest (steps saved before a restart).

Thread-safety: drains record and retention reads from the drain worker while
the main thread saves, so every method takes the lock.

**The rules** (pure, no I/O: :func:`next_reference`, :func:`needed`): which checkpoint
the next save is coded against, and which checkpoints the kept ones need.

A level with ``keyframe_every=N`` (``docs/delta.md``) stores every N-th
checkpoint whole (a keyframe) and the others as deltas against an earlier
checkpoint on the same level: the last keyframe (``delta_against="keyframe"``)
or the level's previous checkpoint (``"previous"``). The manager keeps, per
level, the history of what it stored there in save order, ``(step,
reference step or None)``, the same on every rank; these rules turn it into
the next save's reference. A reference that turns out to be missing or
damaged when the save reads it makes that save whole (the writer and the
drain check), so the history only steers, it never has to be right.

Retention keeps every checkpoint a kept one needs: :func:`needed` closes a
set of steps under "is the reference of".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

from .. import _dist
from ..errors import DcpMultilevelError
from .base import LevelDriver
from .config import Level

__all__ = ["DeltaHistory", "needed", "next_reference"]


logger = logging.getLogger(__name__)


class DeltaHistory:
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
        # Per level, how many saves :meth:`stored` recorded: `refs` reads a manifest
        # outside the lock, and a save of the same step recorded meanwhile (saved
        # again) makes what it read stale; it caches only if the count did not move.
        self._stores: dict[int, int] = dict.fromkeys(self._read, 0)

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
                self._stores[index] += 1

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
                stores = self._stores[index]
            try:
                ref = self._drivers[index].checkpoint(step).manifest().reference_step
            except (DcpMultilevelError, OSError) as e:
                with self._lock:
                    ref = dict(self._history[history_of]).get(step)
                logger.debug("reference of step %d unread (%s); history says %s", step, e, ref)
                out[step] = ref
                continue
            with self._lock:
                if self._stores[index] == stores:  # else stale: read again next time
                    self._read[index][step] = ref
            out[step] = ref
        return out


def next_reference(
    history: Sequence[tuple[int, int | None]],
    keyframe_every: int | None,
    against: str = "keyframe",
    present: Iterable[int] | None = None,
) -> int | None:
    """The step the next save on the level is coded against, or None (a keyframe).

    ``history``: ``(step, reference)`` of the level's checkpoints in save order
    (reference None: a keyframe). ``present``: the steps still on the level
    (None: all of the history); a chain through a missing step starts over.
    """
    if keyframe_every is None or keyframe_every <= 1 or not history:
        return None
    alive = {s for s, _ in history} if present is None else set(present)
    keyframes = [i for i, (s, ref) in enumerate(history) if ref is None]
    if not keyframes or history[keyframes[-1]][0] not in alive:
        return None
    last = keyframes[-1]
    if len(history) - last >= keyframe_every:  # the keyframe and N - 1 deltas: a new one
        return None
    if against == "keyframe":
        return history[last][0]
    # "previous": the newest, if its whole chain back to the keyframe is still there.
    refs = dict(history)
    step: int | None = history[-1][0]
    while step is not None:
        if step not in alive:
            return None
        step = refs.get(step)
    return history[-1][0]


def needed(keep: Iterable[int], refs: Mapping[int, int | None]) -> set[int]:
    """``keep`` and every step one of them needs: its reference, that one's, and so on.

    ``refs``: each step's reference (None or absent: stored whole).
    """
    out: set[int] = set()
    todo = list(keep)
    while todo:
        step = todo.pop()
        if step in out:
            continue
        out.add(step)
        ref = refs.get(step)
        if ref is not None:
            todo.append(ref)
    return out
