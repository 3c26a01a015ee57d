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

:class:`Profile` (``bench_manager.py``): seconds in the library's read,
checksum, codec, spool-write and upload calls, apart for the caller's thread
and the manager's drain threads. It wraps the package's internals (the only
place the benchmarks touch private modules), in this process only.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

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


class Profile:
    """Seconds spent in wrapped library calls, per phase and per thread kind
    (``main`` or ``drain``). Wraps them while used as a context manager."""

    #: Thread name prefixes of the drain (its worker, copy, upload and codec threads).
    DRAIN_THREADS = ("dcp-ml-drain", "dcp-ml-copy", "dcp-ml-upload", "dcp-ml-recode")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._undo: list[Callable[[], None]] = []

    def add(self, phase: str, seconds: float) -> None:
        name = threading.current_thread().name
        who = "drain" if name.startswith(self.DRAIN_THREADS) else "main"
        with self._lock:
            self.seconds[who][phase] += seconds

    def take(self, who: str = "main") -> dict[str, float]:
        """The seconds per phase of ``who`` since the last take (all reset)."""
        with self._lock:
            out = dict(self.seconds.get(who, {}))
            self.seconds.clear()
            return out

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - t0)

        setattr(owner, name, timed_call)
        self._undo.append(lambda: setattr(owner, name, original))

    def __enter__(self) -> Profile:
        import dcp_multilevel.checkpoint.items as items_mod
        import dcp_multilevel.codecs.pipeline as pipeline_mod
        import dcp_multilevel.levels.transfer as transfer_mod
        import dcp_multilevel.stores.local as local_mod
        import dcp_multilevel.writer as writer_mod
        from dcp_multilevel.stores import remote as remote_mod

        # Hashing what is written, and verifying what is read (the one verified
        # read of checkpoint/items.py serves loads and drains alike).
        for mod, phase in (
            (transfer_mod, "hash output"),
            (writer_mod, "hash output"),
            (items_mod, "verify checksum"),
        ):
            self._time_hasher(mod, phase)
        self.wrap(local_mod._LocalReadHandle, "read_into", "read L1")
        self.wrap(items_mod, "decode_frames", "decode")
        # Summed over the codec pool's threads: may exceed the wall time.
        self.wrap(pipeline_mod, "encode_chunk", "encode chunks (pool threads)")
        # The remote store's spool handle (the drain and the direct path write nothing else).
        handle = getattr(remote_mod, "FdWriteHandle", None) or getattr(
            remote_mod, "_SpoolWriteHandle", None
        )
        if handle is not None:
            self.wrap(handle, "write", "spool write")
        self.wrap(remote_mod.RemoteStore, "put_file", "upload data (put_file)")
        self.wrap(remote_mod.RemoteStore, "write_atomic", "upload manifest")
        return self

    def _time_hasher(self, mod: Any, phase: str) -> None:
        """Count the time ``mod``'s Hasher spends in ``update`` as ``phase``."""
        prof, original = self, mod.Hasher

        class TimedHasher(original):
            __slots__ = ()

            def update(self, data: Any) -> None:
                t0 = time.perf_counter()
                super().update(data)
                prof.add(phase, time.perf_counter() - t0)

        mod.Hasher = TimedHasher
        self._undo.append(lambda: setattr(mod, "Hasher", original))

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()
