"""Where the time of a save goes: per-phase seconds from wrapped calls.

Nothing is replaced: every wrapped call goes to the real implementation.

:class:`Clock` (``bench_planner.py``): one ``dcp.save`` on one rank. Wraps a
planner class and a storage-writer class in subclasses that add up wall time
per phase, and wraps ``os.fsync`` (which both our writer and DCP's
``FileSystemWriter`` call) for the time spent flushing. Phases (seconds, this rank):

- ``local plan``: ``create_local_plan`` (planner and writer).
- ``global plan``: the coordinator's ``create_global_plan`` (0 elsewhere).
- ``resolve``: ``resolve_data`` calls (state-dict lookups, views of pieces).
- ``write``: ``write_data`` minus ``resolve`` and ``fsync`` (copies, hashing,
  ``write`` system calls).
- ``fsync``: ``os.fsync`` calls during ``write_data`` and ``finish``.
- ``finish``: the coordinator's ``finish`` minus its fsyncs (metadata/manifest).
- ``other``: the rest of ``dcp.save`` (collectives, waiting for other ranks).

"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("local plan", "global plan", "resolve", "write", "fsync", "finish", "other")


class Clock:
    """Seconds per phase for one save, plus the wrapped ``os.fsync``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._fsync = os.fsync

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    @contextmanager
    def counting_fsync(self) -> Iterator[None]:
        real = self._fsync

        def fsync(fd: int) -> None:
            with self.span("fsync"):
                real(fd)

        os.fsync = fsync
        try:
            yield
        finally:
            os.fsync = real

    def phases(self, total: float) -> dict[str, float]:
        """Exclusive seconds per phase (see the module docstring); they sum to ``total``."""
        s = self.seconds
        out = {
            "local plan": s["local plan"],
            "global plan": s["global plan"],
            "resolve": s["resolve"],
            "write": s["write_data"] - s["resolve"] - s["fsync in write"],
            "fsync": s["fsync"],
            "finish": s["finish"] - (s["fsync"] - s["fsync in write"]),
        }
        out["other"] = total - sum(out.values())
        return out


def timed_planner(cls: type, clock: Clock) -> type:
    class Timed(cls):
        def create_local_plan(self):
            with clock.span("local plan"):
                return super().create_local_plan()

        def create_global_plan(self, all_plans):
            with clock.span("global plan"):
                return super().create_global_plan(all_plans)

        def resolve_data(self, write_item):
            with clock.span("resolve"):
                return super().resolve_data(write_item)

    Timed.__name__ = f"Timed{cls.__name__}"
    return Timed


def timed_writer(cls: type, clock: Clock) -> type:
    class Timed(cls):
        def prepare_local_plan(self, plan):
            with clock.span("local plan"):
                return super().prepare_local_plan(plan)

        def write_data(self, plan, planner):
            before = clock.seconds["fsync"]
            with clock.span("write_data"):
                fut = super().write_data(plan, planner)
                fut.wait()
            clock.seconds["fsync in write"] += clock.seconds["fsync"] - before
            return fut

        def finish(self, metadata, results):
            with clock.span("finish"):
                return super().finish(metadata, results)

    Timed.__name__ = f"Timed{cls.__name__}"
    return Timed
