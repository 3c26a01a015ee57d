"""Metrics of checkpoint saves and drains: Python objects, log lines, a stream.

Every :class:`SaveMetrics` (one per ``CheckpointManager.save`` on each rank)
and every drain's :class:`~dcp_multilevel.levels.DrainResult` becomes one
record, a flat JSON-able dict::

    {"kind": "save", "rank": 0, "step": 100, "level": "file:///nvme/run1",
     "bytes": 1634000000, "seconds": 0.84, "gbps": 1.95, "blocked_seconds": 0.86,
     "waited_seconds": 0.0, "drains_started": ["s3://b/run1"], "drains_skipped": [],
     "drains_queued": [], "staging_bytes": 0, "staging_peak_bytes": 0,
     "unix": 1763712000.1}
    {"kind": "drain", "rank": 0, "step": 100, "level": "s3://b/run1",
     "bytes": 612000000, "seconds": 7.9, "gbps": 0.077, "lag_seconds": 8.1,
     "queued_seconds": 0.0, "committed": true, "skipped": false, "superseded_by": null,
     "error": null, "bytes_read": 1634000000,
     "files_verbatim": 0, "files_encoded": 26, "unix": 1763712008.2}

and each load (``CheckpointManager.load_latest`` / ``load``) one more::

    {"kind": "load", "rank": 0, "step": 100, "plan_seconds": 0.05, "bring_seconds": 0.19,
     "read_seconds": 0.06, "sources": {"file:///nvme/run1/step-100": 14},
     "received": {"partner:/nvme/{node}/partner (node 0)": 2}, "unix": 1763712100.4}

A :class:`MetricsSink` hands each record to the user's callback and/or appends
it as one JSON line to a file. Records come from the thread that produced
them: save records from the training thread, drain records from the drain's
background thread.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MetricsSink", "SaveMetrics"]

logger = logging.getLogger(__name__)


@dataclass
class SaveMetrics:
    """One ``save`` on this rank: what blocked training, and what was sent where.

    Attributes:
        step: the saved step.
        level: URL of the first level (where ``save`` committed).
        bytes_written: bytes this rank stored on the first level.
        blocked_seconds: the first level's commit (``dcp.save``), on this rank.
        waited_seconds: time ``save`` then waited for a running drain (policy
            ``"wait"``), plus the first level's retention; training is blocked for
            ``blocked_seconds + waited_seconds`` in all.
        drains_started / drains_skipped: higher levels this step was sent to, or
            skipped on because their previous drain was still running (policy
            ``"skip"``).
        drains_queued: of ``drains_started``, the levels where this step waits
            behind a running drain (policy ``"latest"``: a newer due step may
            supersede it; the drain record says so).
    """

    step: int
    level: str
    bytes_written: int
    blocked_seconds: float
    drains_started: list[str] = field(default_factory=list)
    drains_skipped: list[str] = field(default_factory=list)
    drains_queued: list[str] = field(default_factory=list)
    waited_seconds: float = 0.0
    #: Async saves: host bytes the staging buffers hold (pinned with CUDA), and the
    #: most they ever held, on this rank (flat over saves: the buffers are reused).
    staging_bytes: int = 0
    staging_peak_bytes: int = 0

    @property
    def seconds(self) -> float:
        """All the time this save blocked training: the commit and what followed it.
        The one measure of a save's cost (metrics, the schedule's overhead bound)."""
        return self.blocked_seconds + self.waited_seconds

    @property
    def gbps(self) -> float:
        """First-level write throughput of this rank, in GB/s (10**9 bytes)."""
        return self.bytes_written / self.blocked_seconds / 1e9 if self.blocked_seconds else 0.0

    def record(self, rank: int) -> dict[str, Any]:
        """This save as a metrics record (see the module docstring)."""
        return {
            "kind": "save",
            "rank": rank,
            "step": self.step,
            "level": self.level,
            "bytes": self.bytes_written,
            "seconds": self.blocked_seconds,
            "gbps": self.gbps,
            "blocked_seconds": self.seconds,
            "waited_seconds": self.waited_seconds,
            "drains_started": list(self.drains_started),
            "drains_skipped": list(self.drains_skipped),
            "drains_queued": list(self.drains_queued),
            "staging_bytes": self.staging_bytes,
            "staging_peak_bytes": self.staging_peak_bytes,
            "unix": time.time(),
        }


class MetricsSink:
    """Delivers metrics records to a callback and/or a JSON-lines file.

    Args:
        path: file to append one JSON object per line to. ``{rank}`` in the
            path is replaced by the rank, giving each rank its own file;
            without it only rank 0 writes (ranks sharing one file would
            interleave their lines). None: no file.
        callback: called with every record on every rank, from the thread that
            produced it (the drain's background thread for drain records); it
            must be quick and thread-safe. Its exceptions are logged, never
            raised into a save or a drain.
        rank: this process's rank.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        callback: Callable[[dict[str, Any]], None] | None,
        rank: int,
    ) -> None:
        self._callback = callback
        self._path: str | None = None
        if path is not None:
            text = os.fspath(path)
            if "{rank}" in text:
                self._path = text.replace("{rank}", str(rank))
            elif rank == 0:
                self._path = text
        self._lock = threading.Lock()

    def emit(self, record: dict[str, Any]) -> None:
        """Deliver one record (thread-safe)."""
        if self._callback is not None:
            try:
                self._callback(record)
            except Exception as e:  # noqa: BLE001 - metrics must never break a save
                logger.warning("dcp_multilevel: the on_metrics callback failed: %r", e)
        if self._path is not None:
            line = json.dumps(record, sort_keys=True) + "\n"
            with self._lock:
                try:
                    parent = os.path.dirname(self._path)
                    if parent:
                        os.makedirs(parent, exist_ok=True)
                    with open(self._path, "a", encoding="utf-8") as f:
                        f.write(line)
                except OSError as e:
                    logger.warning("dcp_multilevel: cannot append metrics to %s: %s", self._path, e)
