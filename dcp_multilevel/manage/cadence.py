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

A restarted job goes on with the schedule where it stopped: rank 0's
:meth:`Cadence.state` (the job's clock, each level's last save, the
blocked time, the policy's :meth:`~dcp_multilevel.schedule.SavePolicy.state`)
is kept in the manifest of every save, and :meth:`Cadence.resume` takes it
back after a load, on every rank alike.

Call order (every rank, main thread)::

    cadence = Cadence(policy, levels, survives, ...)    installs the SIGTERM handler
    cadence.resume(state, step)                          after a load (state: None or
                                                         what state() kept with step)
    tick = cadence.tick(step, loss, costs)               each step; collective at checks
    cadence.state(step, levels)                          rank 0, before saving step
    cadence.saved(step, levels, seconds)                 after a committed save (seconds:
                                                         what it blocked, as its metrics say)
    cadence.close()                                      restores the handler
"""

from __future__ import annotations

import collections
import json
import logging
import math
import signal
import statistics
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _dist
from ..errors import ConfigError
from ..levels.config import Level
from ..schedule import Decision, LevelState, Observation, SavePolicy

__all__ = ["Cadence", "Costs", "Tick"]

logger = logging.getLogger(__name__)

#: Measured costs on this rank: (level index -> its last drain's seconds; the
#: levels whose drain is running). The first level's cost is what saves blocked,
#: as :meth:`Cadence.saved` is told (the save's metrics: one measure everywhere).
Costs = Callable[[], tuple[dict[int, float], set[int]]]

#: Saves whose median is the first level's cost (as the manager's metrics).
_RECENT_SAVES = 5

#: Weight of the newest step in the step-time average (exponential).
_STEP_WEIGHT = 0.1


def _no_costs() -> tuple[dict[int, float], set[int]]:
    return {}, set()


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
        self._offset = 0.0  # the clock when this process started counting (a resumed job's)
        self._last_return: float | None = None
        self.step_seconds: float | None = None
        self._last: dict[int, tuple[int, float]] = {}  # level -> (step, clock) of its last save
        self._next_check = 0
        self._signalled = False
        self.blocked_seconds = 0.0  # of the clock, the time saves blocked training
        self._save_seconds: collections.deque[float] = collections.deque(maxlen=_RECENT_SAVES)
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
        """The job's training seconds: since the first step on this rank, plus the
        clock of the checkpoint a resumed job started from."""
        return self._offset + (0.0 if self._start is None else time.monotonic() - self._start)

    def state(self, step: int, levels: Sequence[int]) -> dict[str, Any]:
        """What a restart needs to go on with the schedule, as plain JSON, for a save of
        ``step`` to ``levels`` that is about to start (rank 0's is kept)."""
        last = {i: [s, t] for i, (s, t) in self._last.items()}
        for index in levels:
            last[index] = [step, self.clock]
        policy = None
        try:
            policy = self.policy.state()
            json.dumps(policy, allow_nan=False)  # the manifest must take it
        except Exception as e:  # noqa: BLE001 - a third-party policy: the save goes on
            logger.warning("dcp_multilevel: schedule %r gave no state to keep: %s", self.policy, e)
            policy = None
        return {
            "clock": self.clock,
            "blocked_seconds": self.blocked_seconds,
            "step_seconds": self.step_seconds,
            "save_seconds": list(self._save_seconds),
            "last": {str(i): v for i, v in sorted(last.items())},
            "policy": policy,
        }

    def resume(
        self, state: dict[str, Any] | None, step: int, held: Collection[int] | None = None
    ) -> None:
        """Go on from ``state`` (:meth:`state` of the loaded checkpoint, ``step``; None:
        it kept none, a checkpoint of an older version). Every rank, same arguments.
        ``held``: the levels that still hold a checkpoint up to ``step`` (None: all);
        the others were wiped and have no last save.

        The clock goes on from the one the checkpoint was taken at, so the loaded
        step's save is the newest, and older ones keep their distance to it
        (the simulator's ``resume_clock="rebased"``, docs/schedule.md).

        A state that does not fit (another policy, a damaged value) is logged and
        the schedule starts afresh: it never fails a load.
        """
        self._start = self._last_return = None
        self._next_check = 0
        if state is None:
            return
        try:
            clock = float(state["clock"])
            last = {
                int(i): (int(s), float(t))
                for i, (s, t) in state["last"].items()
                if 0 <= int(i) < len(self.levels)
                and int(s) <= step
                and (held is None or int(i) in held)
            }
            blocked = float(state["blocked_seconds"])
            step_seconds = state["step_seconds"]
            saves = [float(x) for x in state["save_seconds"]]
            if not all(math.isfinite(x) and x >= 0 for x in (clock, blocked, *saves)):
                raise ValueError("a negative or non-finite time")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            logger.warning(
                "dcp_multilevel: step %d kept a schedule state this version cannot read (%s); "
                "the schedule starts afresh",
                step,
                e,
            )
            return
        if state.get("policy") is not None:
            try:
                self.policy.load_state(state["policy"])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                logger.warning(
                    "dcp_multilevel: step %d kept the state of another schedule (%s); %r "
                    "starts afresh",
                    step,
                    e,
                    self.policy,
                )
        self._offset, self._last, self.blocked_seconds = clock, last, blocked
        self.step_seconds = None if step_seconds is None else float(step_seconds)
        self._save_seconds.clear()
        self._save_seconds.extend(saves)
        logger.info("dcp_multilevel: schedule resumed at step %d (clock %.0f s)", step, clock)

    def observation(self, step: int, loss: float | None, costs: Costs) -> Observation:
        """This rank's view of ``step`` (rank 0's is the one decisions are made from)."""
        drains, busy = costs()
        # The median of recent saves, the same measure as blocked_seconds, so that
        # the overhead bound adds like to like.
        blocked = statistics.median(self._save_seconds) if self._save_seconds else None
        states = tuple(
            LevelState(
                i,
                level,
                last_step=self._last[i][0] if i in self._last else None,
                last_time=self._last[i][1] if i in self._last else None,
                cost_seconds=blocked if i == 0 else drains.get(i),
                survives=self.survives[i],
                busy=i in busy,
            )
            for i, level in enumerate(self.levels)
        )
        return Observation(step, self.clock, states, self.step_seconds, loss, self.blocked_seconds)

    def tick(self, step: int, loss: float | None, costs: Costs) -> Tick:
        """The decision for ``step`` (collective at check steps; see the module docstring)."""
        now = time.monotonic()
        if self._start is None:
            self._start = now
        elif self._last_return is not None:
            took = now - self._last_return
            self.step_seconds = (
                took
                if self.step_seconds is None
                else ((1 - _STEP_WEIGHT) * self.step_seconds + _STEP_WEIGHT * took)
            )
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

    def saved(self, step: int, levels: Sequence[int], seconds: float | None) -> None:
        """Record a committed save of ``step`` to ``levels`` (every rank, same arguments)
        that blocked training ``seconds`` (its metrics' ``seconds``); None: no new save
        (an async save's drains, started once it committed)."""
        for index in levels:
            self._last[index] = (step, self.clock)
        if seconds is not None:
            self.blocked_seconds += seconds
            self._save_seconds.append(seconds)

    def waited(self, seconds: float) -> None:
        """Training also waited ``seconds`` for the last save (an async save's commit)."""
        self.blocked_seconds += seconds
        if self._save_seconds:
            self._save_seconds[-1] += seconds

    def stepped(self) -> None:
        """Mark the end of the manager's work in this step (step times exclude it)."""
        self._last_return = time.monotonic()

    def close(self) -> None:
        """Restore the SIGTERM handler that was there before."""
        if self.save_on_sigterm and self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
