"""When failures strike a simulated job: drawn per class, or given.

Each failure class of a :class:`~dcp_multilevel.schedule.FailureModel` is its
own renewal process on the job's clock (wall time, restarts included), with
a mean time between its failures of ``mtbf / share``: exponential, or Weibull
of a given shape with the same mean. The arrivals do not depend on what the
job does, so every policy run with the same seed meets the same failures
(common random numbers: comparisons between policies are less noisy than
their overheads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dcp_multilevel.errors import ConfigError
from dcp_multilevel.schedule.failures import FailureModel

__all__ = ["Arrivals", "Failure", "Injected", "Random"]

_BATCH = 256  # draws per class at a time (fewer numpy calls)


@dataclass(frozen=True, order=True)
class Failure:
    """One failure: when (the job's clock, seconds) and of which class (its name)."""

    time: float
    name: str


_NEVER = Failure(math.inf, "")


class Arrivals:
    """The failures of one run in clock order (:meth:`peek` the next, :meth:`pop` it)."""

    def peek(self) -> Failure:
        """The next failure (time ``inf`` when there is none)."""
        raise NotImplementedError

    def pop(self) -> Failure:
        """The next failure, consumed."""
        raise NotImplementedError


class Random(Arrivals):
    """Failures drawn per class from ``model``: exponential (``shape=None``) or Weibull.

    Args:
        model: the failure rates by class.
        shape: Weibull shape parameter, or ``None`` for exponential inter-arrival times.
        seed: a ``numpy.random.SeedSequence`` (or an int); each class draws
            from its own child stream.
    """

    def __init__(
        self, model: FailureModel, shape: float | None, seed: np.random.SeedSequence | int
    ) -> None:
        if shape is not None and not shape > 0:
            raise ConfigError(f"Weibull shape must be > 0, got {shape!r}")
        seq = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
        streams = seq.spawn(len(model.classes))  # one per class, live or not: stable seeds
        live = [i for i, c in enumerate(model.classes) if c.share > 0]
        self._classes = [model.classes[i] for i in live]
        self._gens = [np.random.default_rng(streams[i]) for i in live]
        self._means = [model.mtbf_hours * 3600.0 / c.share for c in self._classes]
        self._scale = 1.0 if shape is None else 1.0 / math.gamma(1.0 + 1.0 / shape)
        self._shape = shape
        self._buffers: list[list[float]] = [[] for _ in self._classes]
        self._next = [self._draw(i) for i in range(len(self._classes))]
        self._head = self._earliest()

    def _draw(self, i: int) -> float:
        """The next inter-arrival time of class ``i`` (seconds)."""
        if not self._buffers[i]:
            gen = self._gens[i]
            if self._shape is None:
                batch = gen.exponential(self._means[i], _BATCH)
            else:
                batch = gen.weibull(self._shape, _BATCH) * (self._means[i] * self._scale)
            self._buffers[i] = batch[::-1].tolist()  # pop() from the end keeps draw order
        return self._buffers[i].pop()

    def _earliest(self) -> Failure:
        if not self._next:
            return _NEVER
        i = min(range(len(self._next)), key=self._next.__getitem__)
        return Failure(self._next[i], self._classes[i].name)

    def peek(self) -> Failure:
        """The next failure, not consumed."""
        return self._head

    def pop(self) -> Failure:
        """The next failure, consumed (its class's next arrival is drawn)."""
        failure = self._head
        if self._next:
            i = min(range(len(self._next)), key=self._next.__getitem__)
            self._next[i] += self._draw(i)
            self._head = self._earliest()
        return failure


class Injected(Arrivals):
    """Failures placed by hand (tests, replayed traces)."""

    def __init__(self, failures: list[Failure] | list[tuple[float, str]]) -> None:
        self._failures = sorted(Failure(float(t), str(n)) for t, n in failures)
        self._at = 0

    def peek(self) -> Failure:
        """The next placed failure (none left: one that never comes), not consumed."""
        return self._failures[self._at] if self._at < len(self._failures) else _NEVER

    def pop(self) -> Failure:
        """The next placed failure, consumed."""
        failure = self.peek()
        self._at += 1
        return failure
