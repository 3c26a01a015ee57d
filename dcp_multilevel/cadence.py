"""When the manager saves during training: observations, one decision for all ranks, SIGTERM.

``CheckpointManager.step`` calls :meth:`Cadence.tick` at every training
step. The schedule (``schedule/``, pure) decides from an
:class:`~dcp_multilevel.schedule.Observation`; this module builds the
observation and makes the decision the same on every rank:

* a *deterministic* policy (``SavePolicy.deterministic``: the step number
  alone decides, e.g. ``FixedInterval``) is asked on every rank, no
  communication;
* any other policy is asked on rank 0 only (its clock, its measured costs,
  its loss), at *checks*: rank 0's decision, and the step of the next check,
  reach every rank in one all-gather. Between checks nothing is exchanged
  and nothing is saved; rank 0 places the next check where the earliest
  level falls due, and at most ``check_seconds`` of training later.

With ``save_on_sigterm``, a SIGTERM (what Slurm and Kubernetes send before
killing a job) only sets a flag in the handler; the flag travels in the
same all-gather (checks then come at least every ``check_seconds``, also
for deterministic policies), and when any rank got one, every rank saves
that step to the first level, waits for the commit, and leaves with
``SystemExit(128 + SIGTERM)``. The previous handler is restored by
:meth:`Cadence.close` (and before that exit).

Call order (every rank, main thread)::

    cadence = Cadence(policy, levels, survives, ...)    installs the SIGTERM handler
    tick = cadence.tick(step, loss, costs)               each step; collective at checks
    cadence.saved(step, levels)                          after a committed save
    cadence.close()                                      restores the handler
"""

from __future__ import annotations

import collections
import logging
import math
import signal
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import _dist
from .errors import ConfigError
from .levels.options import Level
from .schedule import Decision, LevelState, Observation, SavePolicy

__all__ = ["Cadence", "Costs", "Tick"]

logger = logging.getLogger(__name__)

#: Measured costs on this rank: (first level's blocked seconds per save, or None;
#: level index -> its last drain's seconds; the levels whose drain is running).
Costs = Callable[[], tuple[float | None, dict[int, float], set[int]]]

#: Saves whose median is the first level's cost (as the manager's metrics).
_RECENT_SAVES = 5

#: Weight of the newest step in the step-time average (exponential).
_STEP_WEIGHT = 0.1


def _no_costs() -> tuple[float | None, dict[int, float], set[int]]:
    return None, {}, set()


@dataclass(frozen=True)
class Tick:
    """What one training step asks of the manager."""

    decision: Decision | None  # None: nothing to save (or not a check step)
    stop: bool = False  # a rank got SIGTERM: save to the first level, then exit


class Cadence:
    """Decides, the same on every rank, when and where to save (see the module docstring).

    Args:
        policy: the schedule.
        levels: the manager's levels, first first.
        survives: what each level survives (``"first"``, ``"node"``, ``"store"``).
        check_seconds: at most this much training time between two checks.
        save_on_sigterm: install the SIGTERM handler (main thread only).
    """

    def __init__(
        self,
        policy: SavePolicy,
        levels: Sequence[Level],
        survives: Sequence[str],
        *,
        check_seconds: float = 10.0,
        save_on_sigterm: bool = False,
    ) -> None:
        if check_seconds < 0:
            raise ConfigError(f"check_seconds must be >= 0, got {check_seconds!r}")
        self.policy = policy
        self.levels = list(levels)
        self.survives = list(survives)
        self.check_seconds = check_seconds
        self.save_on_sigterm = save_on_sigterm
        self._start: float | None = None
        self._last_return: float | None = None
        self.step_seconds: float | None = None
        self._last: dict[int, tuple[int, float]] = {}  # level -> (step, clock) of its last save
        self._next_check = 0
        self._signalled = False
        self.blocked_seconds = 0.0  # of the clock, the time step() spent saving
        self._save_seconds: collections.deque[float] = collections.deque(maxlen=_RECENT_SAVES)
        self._tick_time: float | None = None
        self._saving = False
        self._previous: Any = None
        if save_on_sigterm:
            if threading.current_thread() is not threading.main_thread():
                raise ConfigError(
                    "save_on_sigterm=True needs the manager built on the main thread (Python "
                    "runs signal handlers there)"
                )
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Only a flag: the save happens at the next step boundary, on every rank at once.
        self._signalled = True
        logger.warning("dcp_multilevel: SIGTERM: saving at the next agreed step, then exiting")

    @property
    def clock(self) -> float:
        """Seconds since the first step on this rank."""
        return 0.0 if self._start is None else time.monotonic() - self._start

    def observation(self, step: int, loss: float | None, costs: Costs) -> Observation:
        """This rank's view of ``step`` (rank 0's is the one decisions are made from)."""
        blocked, drains, busy = costs()
        if self._save_seconds:
            # What step() spent per save, decision and collectives included: the
            # same measure as blocked_seconds, so the overhead bound adds like to like.
            blocked = statistics.median(self._save_seconds)
        states = tuple(
            LevelState(
                i, level,
                last_step=self._last[i][0] if i in self._last else None,
                last_time=self._last[i][1] if i in self._last else None,
                cost_seconds=blocked if i == 0 else drains.get(i),
                survives=self.survives[i],
                busy=i in busy,
            )
            for i, level in enumerate(self.levels)
        )  # fmt: skip
        return Observation(step, self.clock, states, self.step_seconds, loss,
                           self.blocked_seconds)  # fmt: skip

    def tick(self, step: int, loss: float | None, costs: Costs) -> Tick:
        """The decision for ``step`` (collective at check steps; see the module docstring)."""
        now = self._tick_time = time.monotonic()
        if self._start is None:
            self._start = now
        elif self._last_return is not None:
            took = now - self._last_return
            self.step_seconds = took if self.step_seconds is None else (
                (1 - _STEP_WEIGHT) * self.step_seconds + _STEP_WEIGHT * took
            )  # fmt: skip
        deterministic = self.policy.deterministic
        decision: Decision | None = None
        if deterministic:  # the step number decides: no costs to gather
            decision = self.policy.decide(self.observation(step, loss, _no_costs))
        if (deterministic and not self.save_on_sigterm) or step < self._next_check:
            return Tick(decision if decision is not None and decision.levels else None)
        mine: dict[str, Any] = {"sigterm": self._signalled}
        if _dist.rank() == 0:
            if not deterministic:
                decision = self.policy.decide(self.observation(step, loss, costs))
            mine["decision"] = decision
            mine["next_check"] = step + self._gap(decision)
        everyone = _dist.all_gather_object(mine)
        self._next_check = everyone[0]["next_check"]
        decision = everyone[0]["decision"]
        stop = any(part["sigterm"] for part in everyone)
        return Tick(decision if decision is not None and decision.levels else None, stop)

    def _gap(self, decision: Decision | None) -> int:
        """Steps to the next check (rank 0): when a level falls due, within ``check_seconds``."""
        if self.step_seconds is None or self.step_seconds <= 0:
            return 1
        seconds = self.check_seconds if self.save_on_sigterm else math.inf
        if decision is not None and not self.policy.deterministic:
            for index, interval in decision.intervals.items():
                last = self._last[index][1] if index in self._last else 0.0
                seconds = min(seconds, interval - (self.clock - last))
        if not math.isfinite(seconds):
            seconds = self.check_seconds
        return max(1, int(seconds / self.step_seconds))

    def saved(self, step: int, levels: Sequence[int]) -> None:
        """Record a committed save of ``step`` to ``levels`` (every rank, same arguments)."""
        for index in levels:
            self._last[index] = (step, self.clock)
        self._saving = True

    def stepped(self) -> None:
        """Mark the end of the manager's work in this step (step times exclude saving;
        the time of a save adds to ``blocked_seconds``)."""
        self._last_return = time.monotonic()
        if self._saving and self._tick_time is not None:
            took = self._last_return - self._tick_time
            self.blocked_seconds += took
            self._save_seconds.append(took)
        self._saving = False

    def close(self) -> None:
        """Restore the SIGTERM handler that was there before."""
        if self.save_on_sigterm and self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
