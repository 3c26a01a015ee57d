"""Young/Daly: the checkpoint interval that minimises expected lost time.

For a save that costs ``C`` seconds and failures arriving at random with mean
time ``M`` between them, Young (1974) gave the interval ``sqrt(2 C M)``;
Daly (2006) refined it to ``sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + C / 18M) - C``
for ``C < 2M`` (and ``M`` otherwise). :class:`YoungDaly` applies it per level:
level ``i`` covers the failures it is the lowest to survive
(``failures.FailureModel.covered_by``), and its cost is the training time
the save blocks (the first level's, measured; a higher level is drained in
the background from a first-level save), never less than its drain's
measured duration (a new drain cannot start before the last one ended).
"""

from __future__ import annotations

import math

from .base import Decision, LevelState, Observation, SavePolicy
from .failures import FailureModel

__all__ = ["YoungDaly", "daly_interval", "young_interval"]


def young_interval(cost: float, mtbf: float) -> float:
    """Young's interval ``sqrt(2 * cost * mtbf)`` (seconds)."""
    return math.sqrt(2.0 * cost * mtbf)


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's higher-order interval (seconds); ``mtbf`` when ``cost >= 2 * mtbf``."""
    if cost >= 2.0 * mtbf:
        return mtbf
    ratio = cost / (2.0 * mtbf)
    return math.sqrt(2.0 * cost * mtbf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost


class YoungDaly(SavePolicy):
    """A save goes to each level once its Young/Daly interval has passed since its last.

    Args:
        failures: the failure rates by class.
        kinds: what each level survives, first level first (``"first"``,
            ``"node"``, ``"store"``; see ``failures.py``).
        formula: ``"daly"`` (default) or ``"young"``.
        default_cost: seconds assumed for a level whose cost is not measured yet.
    """

    def __init__(
        self,
        failures: FailureModel,
        kinds: tuple[str, ...],
        *,
        formula: str = "daly",
        default_cost: float = 1.0,
    ) -> None:
        self.failures = failures
        self.kinds = tuple(kinds)
        self.formula = {"daly": daly_interval, "young": young_interval}[formula]
        self.default_cost = default_cost

    def interval(self, state: LevelState, first: LevelState, rate: float) -> float:
        """The interval in seconds for one level (``inf`` for a level no failure needs)."""
        if rate <= 0:
            return math.inf
        blocked = first.cost_seconds if first.cost_seconds is not None else self.default_cost
        chosen = self.formula(blocked, 1.0 / rate)
        if state.index > 0 and state.cost_seconds is not None:
            chosen = max(chosen, state.cost_seconds)
        return chosen

    def decide(self, observation: Observation) -> Decision:
        """Levels whose interval has passed (a level never saved to is due at once)."""
        rates = self.failures.covered_by(self.kinds)
        first = observation.levels[0]
        intervals = {s.index: self.interval(s, first, rates[s.index]) for s in observation.levels}
        chosen = frozenset(
            s.index
            for s in observation.levels
            if s.last_time is None or observation.time - s.last_time >= intervals[s.index]
        )
        inputs = {"cost_seconds": first.cost_seconds, "rates_per_hour": {
            str(i): r * 3600.0 for i, r in rates.items()}}  # fmt: skip
        return Decision(chosen, "young-daly", inputs, intervals)
