"""A backlog of calls that a thread pool and its consumer share: whoever is free runs
the oldest one not yet started (the codec pipeline's chunk coding, ``pipeline.py``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

__all__ = ["Backlog", "Task"]


class Task:
    """One call to run, by a pool thread or by the consumer, whichever comes first."""

    __slots__ = ("args", "done", "error", "fn", "result")

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn = fn
        self.args = args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        # Everything, as concurrent.futures does: the consumer raises it where it surfaces.
        except BaseException as e:  # noqa: BLE001
            self.error = e
        finally:
            self.done.set()


class Backlog:
    """Chunks submitted and not yet started, taken oldest first by pool threads and the consumer.

    Whenever the consumer would wait for a chunk, it codes the oldest chunk
    no thread has started instead. With a pool of ``threads`` workers and a
    consumer that only waited and wrote, one thread more than the coding
    threads was runnable. With as many cores as coders, a pool of one thread
    fewer plus a consumer that codes keeps every core coding and none waiting
    for one: it saves checkpoints somewhat faster than a full pool beside a
    consumer that waits, and a full pool beside a coding consumer is no
    faster than that (``benchmarks/bench_codecs.py`` times the saves).
    """

    def __init__(self, pool: Executor) -> None:
        self._pool = pool
        self._tasks: deque[Task] = deque()
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Task:
        """Queue ``fn(*args)``; a pool thread or :meth:`result` runs it."""
        task = Task(fn, args)
        with self._lock:
            self._tasks.append(task)
        self._pool.submit(self._run_oldest)
        return task

    def _take_oldest(self) -> Task | None:
        with self._lock:
            return self._tasks.popleft() if self._tasks else None

    def _run_oldest(self) -> None:
        task = self._take_oldest()
        if task is not None:  # else the consumer took it, or the coding was cancelled
            task.run()

    def result(self, task: Task) -> Any:
        """``task``'s result (or error); runs it here when no thread has started it."""
        # Code the oldest chunks not yet started (``task`` first, if it is one)
        # rather than wait for ``task``.
        while not task.done.is_set():
            other = self._take_oldest()
            if other is None:
                task.done.wait()
                break
            other.run()
        if task.error is not None:
            raise task.error
        return task.result

    def cancel(self) -> None:
        """Drop every chunk not yet started (the pool's calls then return at once)."""
        with self._lock:
            self._tasks.clear()
