"""Progress of one conversion: bytes done out of a total fixed at the start."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Progress", "ProgressCallback"]

#: ``progress(done_bytes, total_bytes)``; called from the converting thread or
#: a writer's thread, never concurrently.
ProgressCallback = Callable[[int, int], None]


class Progress:
    """Counts tensor bytes through the passes of a conversion and reports them.

    ``total`` counts every tensor byte once per pass (decoding the source into
    scratch is one pass, writing the target another), so ``done`` only grows
    and reaches ``total`` exactly when the conversion ends.
    """

    def __init__(self, total: int, callback: ProgressCallback | None) -> None:
        self.total = total
        self.done = 0
        self._callback = callback
        # Writers may resolve items from several threads.
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        """``nbytes`` more are done (capped at the total)."""
        with self._lock:
            self.done = min(self.total, self.done + nbytes)
            if self._callback is not None:
                self._callback(self.done, self.total)

    def reach(self, done: int) -> None:
        """At least ``done`` bytes are done (for passes that count bytes written)."""
        with self._lock:
            done = min(self.total, done)
            if done > self.done:
                self.done = done
                if self._callback is not None:
                    self._callback(self.done, self.total)

    def finish(self) -> None:
        """The conversion is complete: report ``total`` (once more, if already there)."""
        with self._lock:
            self.done = self.total
            if self._callback is not None:
                self._callback(self.done, self.total)
