"""The save-decision point: which levels take a save, and when.

Two ways to answer, one interface:

* :meth:`SavePolicy.due` ``(index, level, step)``: a fixed rule per level
  above the first (the first takes every save). The manager asks it once
  per level at each ``save``, and again when it decides what the first level
  must keep (a step due on a level it is not on yet is kept) and what to
  drain again after a restart: answers for a past step must not change.
* :meth:`SavePolicy.decide` ``(observation)``: an adaptive rule (measured
  save costs, failure rates, the loss curve, the clock) decides at each
  training step which levels, the first included, take a save of it, and
  says why (:class:`Decision`). The default answers from ``due`` (the first
  level every step, the others when ``due``).

Call order and contract (every rank, main thread)::

    policy.load_state(state)          after the manager loaded a checkpoint
                                      that kept one (rank 0's ``state()``)
    policy.decide(observation)        at each training step (the failure
                                      simulator, ``benchmarks/sim``, calls it too)
    policy.state()                    at each save (rank 0)
    policy.due(index, level, step)    for each level index >= 1, at each save,
                                      at retention and at load_latest

Every rank must take the same decision: a diverging one would hang the
collective save. Policies are pure (no I/O, no torch.distributed), so the
same :class:`Observation` gives the same :class:`Decision` on every rank;
the caller makes the observations identical (values agreed at the last
save). Time is the job's clock in seconds, as the caller counts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..levels.config import Level

__all__ = ["Decision", "LevelState", "Observation", "SavePolicy"]


@dataclass(frozen=True)
class LevelState:
    """What a policy knows of one level at one step.

    Attributes:
        index: the level's position (0: the first level).
        level: its configuration (``every``, ...).
        last_step / last_time: the newest save that went to it (None: none yet).
        cost_seconds: measured cost of one save there: for the first level the
            training time a save blocks; for a higher level its drain's seconds
            (background: it blocks training only through the first level's
            save it starts from). None until measured.
        restore_seconds: measured (or estimated) time to restore from it; None if unknown.
        busy: a copy to it is still running (a save sent there now would be
            skipped: interval policies leave it out until it is done).
        survives: the failures it survives (``schedule/failures.py``): ``"first"``
            (a process crash: the node's own disk), ``"node"`` (a lost node:
            copies on other nodes) or ``"store"`` (anything: a store elsewhere).
    """

    index: int
    level: Level
    last_step: int | None = None
    last_time: float | None = None
    cost_seconds: float | None = None
    restore_seconds: float | None = None
    survives: str | None = None
    busy: bool = False


@dataclass(frozen=True)
class Observation:
    """The inputs of one decision (identical on every rank).

    Attributes:
        step: the training step that just finished (a save would hold it).
        time: the job's clock at that step, in seconds.
        step_seconds: the measured mean time of one training step (None: unknown).
        loss: the training loss at this step, if the caller gives it.
        levels: every level's state, first level first.
        blocked_seconds: of ``time``, the seconds training was blocked saving
            (None: not tracked).
    """

    step: int
    time: float
    levels: tuple[LevelState, ...]
    step_seconds: float | None = None
    loss: float | None = None
    blocked_seconds: float | None = None


@dataclass(frozen=True)
class Decision:
    """Which levels take a save of the observed step, and why.

    ``levels`` holds level indexes; a non-empty set always includes 0 (a
    higher level is drained from the first level's copy). ``policy`` names
    the rule that fired, ``inputs`` what it used (costs, rates, loss),
    ``intervals`` the interval in seconds it chose per level (for the
    metrics record that makes each decision explainable).
    """

    levels: frozenset[int]
    policy: str
    inputs: dict[str, Any] = field(default_factory=dict)
    intervals: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.levels and 0 not in self.levels:
            object.__setattr__(self, "levels", self.levels | {0})

    def record(self) -> dict[str, Any]:
        """This decision as a metrics record (JSON-able)."""
        return {
            "kind": "decision",
            "levels": sorted(self.levels),
            "policy": self.policy,
            "inputs": dict(self.inputs),
            "intervals": {str(k): v for k, v in sorted(self.intervals.items())},
        }


class SavePolicy:
    """Decides which levels take a save (see the module docstring).

    A subclass implements :meth:`due` (a fixed rule) or :meth:`decide` (an
    adaptive one), or both.
    """

    #: True when the step number alone decides (the same on every rank with no
    #: exchange); otherwise the manager asks rank 0 and sends its decision.
    deterministic: bool = False

    def due(self, index: int, level: Level, step: int) -> bool:
        """Whether the save of ``step`` goes to ``level`` (the ``index``-th, 1 and up)."""
        raise NotImplementedError(
            f"{type(self).__name__} decides from observations (decide()), not per step "
            "(due()): use it where the manager passes observations"
        )

    def state(self) -> dict[str, Any] | None:
        """What this policy learnt from its observations, as plain JSON (None: nothing),
        so that a restarted job goes on where it stopped: the manager keeps it with
        each save (``Manifest.extra``) and gives it to :meth:`load_state` after a load."""
        return None

    def load_state(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state` returned (another process's, from a checkpoint).

        Raises:
            ValueError: ``state`` is not what this policy writes (the caller
                then starts the policy afresh).
        """
        raise ValueError(f"a {type(self).__name__} keeps no state")

    def decide(self, observation: Observation) -> Decision:
        """The levels that take a save of ``observation.step``; default: from :meth:`due`."""
        chosen = {
            state.index
            for state in observation.levels[1:]
            if self.due(state.index, state.level, observation.step)
        }
        return Decision(frozenset(chosen | {0}), type(self).__name__)
