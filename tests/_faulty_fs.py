"""A fault-injecting fsspec filesystem for tests: ``faulty://`` over a real filesystem.

``FaultyFileSystem`` is a real :class:`fsspec.AbstractFileSystem` registered as
the ``faulty`` protocol. Every operation is delegated, explicitly, to a real
target filesystem (``memory`` by default, or ``s3`` against the test server)
after a fault check that can fail it with a connection error::

    RemoteStore("faulty://root", target_protocol="memory",
               fail_first={"put_file": 2},       # the first 2 uploads fail
               fail_rate={"cat_file": 0.3},      # 30% of reads fail (seeded)
               truncate_puts=1)                  # the first upload loses its last byte

Paths are handed to the target unchanged, so ``faulty://bucket/key`` over s3
writes ``s3://bucket/key``. ``calls`` and ``injected`` count, per operation,
the calls seen and the faults injected.
"""

from __future__ import annotations

import pathlib
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

__all__ = ["OPERATIONS", "FaultyFileSystem"]

#: The longest a ``wait_for`` gate holds a call before failing it (no test hangs forever).
WAIT_FOR_S = 120.0

#: ``record`` name -> (operation, thread name) of every call, in order (this process).
CALLS: dict[str, list[tuple[str, str]]] = {}

#: Operation names that faults can target (the delegated methods).
OPERATIONS = ("info", "ls", "cat_file", "pipe_file", "put_file", "rm", "rm_file", "open")


class FaultyFileSystem(AbstractFileSystem):
    """Delegates to ``target_protocol``'s filesystem, failing chosen calls.

    Args:
        target_protocol: the real filesystem underneath (``"memory"``, ``"s3"``, ...).
        target_options: its storage options.
        fail_first: operation -> how many of its first calls fail.
        fail_rate: operation -> fraction of its calls that fail (seeded, reproducible).
        seed: seed of the ``fail_rate`` draws.
        error: builds the exception to raise from a message (default ConnectionError).
        truncate_puts: how many of the first ``put_file``/``pipe_file`` calls
            store the data one byte short (as a broken proxy would), reporting success.
        delay: operation -> seconds each call sleeps first (a slow link).
        wait_for: operation -> a file path: each call first waits until that file
            exists (a link that stalls until the test lets it go; works across
            processes), at most ``WAIT_FOR_S`` seconds, then fails.
        announce: operation -> a file path each call creates as it starts, before any
            delay (a gate the test waits at: "the upload has begun", across processes).
        record: a name: every call appends ``(operation, thread name)`` to
            ``CALLS[record]`` as it starts (which thread touched the remote).
    """

    protocol = ("faulty",)

    def __init__(
        self,
        target_protocol: str = "memory",
        target_options: dict[str, Any] | None = None,
        fail_first: dict[str, int] | None = None,
        fail_rate: dict[str, float] | None = None,
        seed: int = 0,
        error: Callable[[str], BaseException] = ConnectionError,
        truncate_puts: int = 0,
        delay: dict[str, float] | None = None,
        wait_for: dict[str, str] | None = None,
        announce: dict[str, str] | None = None,
        record: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        unknown = (set(fail_first or {}) | set(fail_rate or {})) - set(OPERATIONS)
        if unknown:
            raise ValueError(f"unknown operations {sorted(unknown)}; known: {OPERATIONS}")
        self.target = fsspec.filesystem(
            target_protocol, skip_instance_cache=True, **(target_options or {})
        )
        self.fail_first = dict(fail_first or {})
        self.fail_rate = dict(fail_rate or {})
        self.error = error
        self.truncate_puts = truncate_puts
        self.delay = dict(delay or {})
        self.wait_for = dict(wait_for or {})
        self.announce = dict(announce or {})
        self.record = record
        self.calls: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _fault(self, op: str, path: Any) -> None:
        """Count a call of ``op``; raise the configured error if it is chosen to fail."""
        if self.record is not None:
            CALLS.setdefault(self.record, []).append((op, threading.current_thread().name))
        if self.announce.get(op):
            pathlib.Path(self.announce[op]).touch()
        if self.delay.get(op):
            time.sleep(self.delay[op])
        if self.wait_for.get(op):
            gate = pathlib.Path(self.wait_for[op])
            deadline = time.monotonic() + WAIT_FOR_S
            while not gate.exists():
                if time.monotonic() > deadline:
                    raise self.error(f"{op} waited {WAIT_FOR_S} s for {gate} ({path})")
                time.sleep(0.01)
        with self._lock:
            self.calls[op] += 1
            n = self.calls[op]
            fail = n <= self.fail_first.get(op, 0)
            rate = self.fail_rate.get(op, 0.0)
            # Draw even when fail_first already decided, so the sequence stays reproducible.
            if rate and self._rng.random() < rate:
                fail = True
            if fail:
                self.injected[op] += 1
        if fail:
            raise self.error(f"injected fault: {op} call {n} ({path})")

    def _truncating(self) -> bool:
        with self._lock:
            if self.truncate_puts > 0:
                self.truncate_puts -= 1
                return True
            return False

    # Explicit delegation, one method per operation the store uses.

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self._fault("info", path)
        return self.target.info(path, **kwargs)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        self._fault("ls", path)
        return self.target.ls(path, detail=detail, **kwargs)

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        self._fault("cat_file", path)
        return self.target.cat_file(path, start=start, end=end, **kwargs)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self._fault("pipe_file", path)
        if self._truncating():
            value = value[:-1]
        self.target.pipe_file(path, value, mode=mode, **kwargs)

    def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> None:
        self._fault("put_file", rpath)
        if self._truncating():
            with open(lpath, "rb") as f:
                self.target.pipe_file(rpath, f.read()[:-1])
        else:
            self.target.put_file(lpath, rpath, **kwargs)

    def rm(self, path: str, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._fault("rm", path)
        self.target.rm(path, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path: str) -> None:
        self._fault("rm_file", path)
        self.target.rm_file(path)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.target.invalidate_cache(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        self._fault("open", path)
        return self.target.open(path, mode, **kwargs)


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
