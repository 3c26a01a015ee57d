"""Convergence-aware intervals: protect fast progress more than slow progress.

COCI (FGCS 2024) observes that training yields diminishing returns, and that
exploratory runs are often stopped early: the loss gained early is worth more
than the same time's gain later, and checkpointing by convergence progress
instead of evenly cut fault-tolerance overhead by up to 40 % (serial) and
61 % (data parallel) in their runs. :class:`ConvergenceAware` applies that idea
to any interval policy, from the loss the trainer reports and nothing else:
the progress rate is how fast the loss falls (per second); while it falls
faster than its average so far (early training), intervals shrink; once it
falls slower (a plateau), they grow:

    weight   = recent rate / mean rate since the first observed loss
    interval = inner interval / sqrt(weight), within [1/4, 4] times the inner one

(the square root: in Young's formula the interval goes with the square root
of the time at risk's cost). Without losses (or before two), intervals are
the inner policy's. The policy keeps the losses it has seen: it is pure given
the sequence of observations, which is the same on every rank.
"""

from __future__ import annotations

import math
from typing import Any

from .base import Observation
from .intervals import AdjustedPolicy, Interval, IntervalPolicy, scaled

__all__ = ["ConvergenceAware"]


class ConvergenceAware(AdjustedPolicy):
    """Scale ``inner``'s intervals by the loss curve's progress (see the module docstring).

    Args:
        inner: the policy whose intervals are scaled.
        window: how many of the newest observed losses give the recent rate.
        limits: the scaling stays within ``[1/limits, limits]``.
    """

    def __init__(self, inner: IntervalPolicy, *, window: int = 8, limits: float = 4.0) -> None:
        self.inner = inner
        self.window = max(2, window)
        self.limits = limits
        self._losses: list[tuple[float, float]] = []  # (time, loss), as observed

    def _observe(self, observation: Observation) -> None:
        loss = observation.loss
        if loss is None or not math.isfinite(loss):
            return
        if self._losses and observation.time <= self._losses[-1][0]:
            return  # the same instant again (asked twice for one step)
        self._losses.append((observation.time, loss))

    def weight(self) -> float | None:
        """Recent progress rate over the mean one (None until there is a trend)."""
        if len(self._losses) < 3:
            return None
        (t0, l0), (t1, l1) = self._losses[0], self._losses[-1]
        mean = (l0 - l1) / (t1 - t0)
        recent_start = self._losses[-min(self.window, len(self._losses))]
        recent = (recent_start[1] - l1) / (t1 - recent_start[0])
        if mean <= 0:  # no progress on average: nothing to weigh
            return None
        return max(1.0 / self.limits**2, min(self.limits**2, max(recent, 0.0) / mean))

    def intervals(self, observation: Observation) -> tuple[dict[int, Interval], dict[str, Any]]:
        """``inner``'s intervals divided by ``sqrt(weight)``."""
        self._observe(observation)
        intervals, inputs = self.inner.intervals(observation)
        weight = self.weight()
        if weight is None:
            return intervals, {**inputs, "progress_weight": None}
        inputs = {**inputs, "progress_weight": weight, "loss": observation.loss}
        return scaled(intervals, 1.0 / math.sqrt(weight), "convergence"), inputs
