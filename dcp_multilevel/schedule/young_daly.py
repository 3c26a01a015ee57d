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
from typing import Any

from ..errors import ConfigError
from .base import Observation
from .failures import FailureModel
from .intervals import Interval, IntervalPolicy

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


class YoungDaly(IntervalPolicy):
    """A save goes to each level once its Young/Daly interval has passed since its last.

    Args:
        failures: the failure rates by class.
        kinds: what each level survives, first level first (``"first"``,
            ``"node"``, ``"store"``; see ``failures.py``); default: each
            observed level's ``survives``.
        formula: ``"daly"`` (default) or ``"young"``.
        default_cost: seconds assumed for the first level's save until one is measured.
    """

    def __init__(
        self,
        failures: FailureModel,
        kinds: tuple[str, ...] | None = None,
        *,
        formula: str = "daly",
        default_cost: float = 1.0,
    ) -> None:
        if formula not in ("daly", "young"):
            raise ConfigError(f"formula must be 'daly' or 'young', got {formula!r}")
        self.failures = failures
        self.kinds = tuple(kinds) if kinds is not None else None
        self.formula = formula
        self.default_cost = default_cost

    def _kinds(self, observation: Observation) -> tuple[str, ...]:
        if self.kinds is not None:
            return self.kinds
        kinds = tuple(s.survives for s in observation.levels)
        if any(k is None for k in kinds):
            raise ConfigError(
                "YoungDaly needs to know what each level survives: pass kinds=(...) or "
                "observations whose levels say it (LevelState.survives)"
            )
        return kinds  # type: ignore[return-value]

    def intervals(self, observation: Observation) -> tuple[dict[int, Interval], dict[str, Any]]:
        """Per level: the formula on the first level's blocked cost and the mean time
        between the failures the level covers (never shorter than its drain)."""
        rates = self.failures.covered_by(self._kinds(observation))
        first = observation.levels[0]
        blocked = first.cost_seconds if first.cost_seconds is not None else self.default_cost
        formula = daly_interval if self.formula == "daly" else young_interval
        out = {}
        for state in observation.levels:
            rate = rates.get(state.index, 0.0)
            if rate <= 0:
                out[state.index] = Interval(math.inf, "no-failures")
                continue
            seconds, rule = formula(blocked, 1.0 / rate), "young-daly"
            if state.index > 0 and state.cost_seconds is not None and state.cost_seconds > seconds:
                seconds, rule = state.cost_seconds, "drain-duration"
            out[state.index] = Interval(seconds, rule)
        inputs = {
            "blocked_seconds": blocked,
            "rates_per_hour": {str(i): r * 3600.0 for i, r in sorted(rates.items())},
        }
        return out, inputs
