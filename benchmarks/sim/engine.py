"""The discrete-event simulation of one training run under one save policy.

The run, step by step, as the manager will drive a policy:

1. A training step takes ``step_seconds``. At its end the policy sees an
   :class:`~dcp_multilevel.schedule.Observation` (step, the job's clock,
   ``step_seconds``, the loss curve's loss, the seconds blocked saving so
   far, and per level a
   :class:`~dcp_multilevel.schedule.LevelState`: its newest save's step and
   clock time, its cost and restore time) and returns a
   :class:`~dcp_multilevel.schedule.Decision`.
2. A decision with levels saves: training stops for the first level's
   ``cost_seconds`` (blocked), then each higher level chosen starts a drain
   of that step which runs ``cost_seconds`` in the background and holds the
   checkpoint once it ends. A level whose previous drain still runs skips
   this one (the manager's ``drain_policy="skip"``): its state is unchanged.
   A level's state shows a drain from its start; a restore needs it ended.
3. A failure (``arrivals.py``) of a class first survived by kind ``k`` wipes
   the levels below ``k``, cancels every running drain and restarts the job
   from the newest checkpoint left on any level (the fastest such level on a
   tie; step 0 when none is left), which takes that level's
   ``restore_seconds``. A failure during a save or a restore interrupts it.
4. Progress computed since that checkpoint (whole steps and the step under
   way) is lost and computed again. The policy then sees the levels left,
   their checkpoint times moved so that the restored one is as fresh as the
   resumed job (``simulate(resume_clock=...)``); a wiped level has none.

Every second of the job's clock is either a step that counts (its steps in
the end: ``useful``), blocked by a save, lost, or restoring, so
``wall = useful + blocked + lost + restore`` holds exactly (up to rounding)
and ``overhead = blocked + lost + restore``. The run ends on reaching its last
step (no final save), or its stop step for an exploratory run stopped early.

Each second of overhead also counts at the value of the progress it delays
or discards (``loss.py``): ``value_*`` fields, in seconds weighted by the
next step's share of the run's value (1 on average). ``value_lost`` is the
value of the steps a failure discards (``V(reached) - V(restored)``) plus the
step under way at its weight: with ``blocked`` and ``restore`` as seconds it
makes COCI's accounting (``RunResult.progress_overhead``).

Speed: a policy that implements :class:`~sim.policies.Lookahead`
(it says when it will next decide to save, if nothing is saved before) lets
the run skip the steps in between without asking; every other policy is
asked at every step. Both give the same run.
"""

from __future__ import annotations

import math

import numpy as np

from dcp_multilevel.errors import ConfigError
from dcp_multilevel.schedule.base import Decision, LevelState, Observation, SavePolicy

from .arrivals import Arrivals, Failure, Injected, Random
from .model import Job
from .policies import Lookahead
from .results import FailureRecord, RunResult

__all__ = ["simulate"]


class _Value:
    """Value time of each step: linear (no loss curve) or from the curve."""

    def __init__(self, job: Job) -> None:
        self.dt = job.step_seconds
        self.table = None if job.loss is None else job.loss.value_seconds(job.total_steps, self.dt)
        self.losses = None
        if job.loss is not None:
            self.losses = job.loss.losses(np.arange(job.total_steps + 1)).tolist()
        self.last = job.total_steps

    def at(self, step: int) -> float:
        """Value time of having reached ``step``."""
        return step * self.dt if self.table is None else float(self.table[step])

    def weight(self, step: int) -> float:
        """Weight of a second spent at progress ``step`` (the next step's value share)."""
        if self.table is None:
            return 1.0
        s = min(step, self.last - 1)
        return float(self.table[s + 1] - self.table[s]) / self.dt


class _Run:
    """The state of one run; :meth:`run` plays it out."""

    def __init__(
        self,
        job: Job,
        policy: SavePolicy,
        arrivals: Arrivals,
        stop: int,
        rebase: bool,
        max_failures: int,
    ) -> None:
        self.job, self.policy, self.arrivals, self.stop = job, policy, arrivals, stop
        self.rebase, self.max_failures = rebase, max_failures
        self.dt = job.step_seconds
        self.n = len(job.levels)
        self.configs = tuple(level.config(i) for i, level in enumerate(job.levels))
        self.classes = {c.name: c for c in job.failures.classes}
        self.value = _Value(job)
        self.lookahead = isinstance(policy, Lookahead)
        # Newest complete checkpoint per level, (step, time); running drain, (step, time, end).
        self.done: list[tuple[int, float] | None] = [None] * self.n
        self.running: list[tuple[int, float, float] | None] = [None] * self.n
        self.step = 0
        # Times of steps are seg_time + (step - seg_step) * dt in every code path, so a
        # run that skips steps (look-ahead) computes the very same clock as one that
        # does not.
        self.seg_time, self.seg_step = 0.0, 0
        self.blocked = self.lost = self.restore = 0.0
        self.v_blocked = self.v_lost = self.v_restore = 0.0
        self.saves = [0] * self.n
        self.skipped = [0] * self.n
        self.records: list[FailureRecord] = []
        self.states = self._states()

    # ------------------------------------------------------------------ bookkeeping

    def time_at(self, step: int) -> float:
        return self.seg_time + (step - self.seg_step) * self.dt

    def _states(self) -> tuple[LevelState, ...]:
        out = []
        for i, level in enumerate(self.job.levels):
            newest = self.running[i] or self.done[i]
            out.append(
                LevelState(
                    i,
                    self.configs[i],
                    None if newest is None else newest[0],
                    None if newest is None else newest[1],
                    level.cost_seconds,
                    level.restore_seconds,
                    survives=level.kind,
                    busy=self.running[i] is not None,
                )
            )
        return tuple(out)

    def _settle(self, now: float) -> None:
        """Drains that ended by ``now`` hold their checkpoint."""
        for i, drain in enumerate(self.running):
            if drain is not None and drain[2] <= now:
                self.done[i] = (drain[0], drain[1])
                self.running[i] = None

    # ------------------------------------------------------------------ the run

    def run(self) -> None:
        quiet_until = -math.inf  # the policy will not save before this time (look-ahead)
        while self.step < self.stop and len(self.records) < self.max_failures:
            target = self.step + 1
            if quiet_until > self.time_at(target):
                target = self._first_step_at(quiet_until)
            failure = self.arrivals.peek()
            if failure.time < self.time_at(target):
                self._advance_to_failure(failure)
                quiet_until = -math.inf
                continue
            self.step = target
            if self.step >= self.stop:
                break
            now = self.time_at(self.step)
            if any(r is not None and r[2] <= now for r in self.running):
                self._settle(now)  # a drain ended: its level is no longer busy
                self.states = self._states()
            obs = Observation(
                self.step,
                now,
                self.states,
                self.dt,
                None if self.value.losses is None else self.value.losses[self.step],
                # What the manager counts: every second blocked saving so far, saves
                # interrupted by a failure included (OverheadBound's run-long rule).
                blocked_seconds=self.blocked,
            )
            decision = self.policy.decide(obs)
            if decision.levels:
                self._save(decision, obs)
                quiet_until = -math.inf
            elif self.lookahead:
                quiet_until = self.policy.quiet_until(obs)  # type: ignore[attr-defined]

    def _first_step_at(self, quiet_until: float) -> int:
        """The first step that ends at or after ``quiet_until`` (less a relative 1e-9,
        so that a policy's own rounding never has it due a step earlier), at most
        the stop step."""
        if quiet_until >= self.time_at(self.stop):  # inf included
            return self.stop
        limit = quiet_until - 1e-9 * max(1.0, abs(quiet_until))
        now = self.time_at(self.step)
        step = self.step + max(1, math.ceil((limit - now) / self.dt))
        # The clock of a step is time_at(): settle on its answer, not on the division's.
        while step > self.step + 1 and self.time_at(step - 1) >= limit:
            step -= 1
        while self.time_at(step) < limit:
            step += 1
        return min(step, self.stop)

    def _advance_to_failure(self, failure: Failure) -> None:
        """Run the steps completed before ``failure``, then fail (the step under way is lost)."""
        # The steps that end at or before the failure complete.
        k = max(0, int((failure.time - self.time_at(self.step)) // self.dt))
        while k > 0 and self.time_at(self.step + k) > failure.time:
            k -= 1
        while self.time_at(self.step + k + 1) <= failure.time:
            k += 1
        self.step += k
        self._fail(partial=failure.time - self.time_at(self.step))

    def _save(self, decision: Decision, obs: Observation) -> None:
        chosen = sorted(decision.levels)
        if chosen[-1] >= self.n or chosen[0] < 0:
            raise ConfigError(
                f"{type(self.policy).__name__} chose levels {chosen} at step {obs.step}; "
                f"the job has levels 0..{self.n - 1}"
            )
        cost = self.job.levels[0].cost_seconds
        weight = self.value.weight(self.step)
        failure = self.arrivals.peek()
        if failure.time < obs.time + cost:  # the save is interrupted: not committed
            self.blocked += failure.time - obs.time
            self.v_blocked += (failure.time - obs.time) * weight
            self._fail(partial=0.0)
            return
        self.blocked += cost
        self.v_blocked += cost * weight
        now = obs.time + cost
        self._settle(now)
        self.done[0] = (obs.step, obs.time)
        self.saves[0] += 1
        for i in chosen[1:]:
            if self.running[i] is not None:
                self.skipped[i] += 1
                continue
            self.running[i] = (obs.step, obs.time, now + self.job.levels[i].cost_seconds)
            self.saves[i] += 1
        self.seg_time, self.seg_step = now, self.step
        self.states = self._states()

    def _fail(self, partial: float) -> None:
        """The next failure strikes now, after ``partial`` seconds of the step under way
        (or of nothing: a save or restore was under way); restart, restore."""
        while True:
            failure = self.arrivals.pop()
            cls = self.classes.get(failure.name)
            if cls is None:
                raise ConfigError(
                    f"failure class {failure.name!r} is not in the job's FailureModel "
                    f"(have {sorted(self.classes)})"
                )
            self._settle(failure.time)
            survivors = tuple(
                i for i, level in enumerate(self.job.levels) if level.survives(cls.survived_by)
            )
            checkpoints = tuple(self.done)
            restart = max(
                ((self.done[i][0], -i) for i in survivors if self.done[i] is not None),
                default=None,
            )
            level = None if restart is None else -restart[1]
            restored = 0 if restart is None else restart[0]
            lost = (self.step - restored) * self.dt + partial
            self.lost += lost
            self.v_lost += (
                self.value.at(self.step)
                - self.value.at(restored)
                + partial * self.value.weight(self.step)
            )
            for i in range(self.n):
                if i not in survivors:
                    self.done[i] = None
                self.running[i] = None
            reached, self.step = self.step, restored
            cost = 0.0 if level is None else self.job.levels[level].restore_seconds
            following = self.arrivals.peek()
            spent = min(cost, following.time - failure.time)
            self.restore += spent
            self.v_restore += spent * self.value.weight(restored)
            self.records.append(
                FailureRecord(
                    failure.time,
                    failure.name,
                    reached,
                    checkpoints,
                    survivors,
                    level,
                    restored,
                    lost,
                    spent,
                )
            )
            partial = 0.0
            if following.time < failure.time + cost:
                continue  # struck again while restoring
            resumed = failure.time + cost
            if self.rebase and level is not None:
                # The restored checkpoint is as fresh as the resumed job: the clock of
                # every checkpoint left moves by the same amount (the gaps between them
                # are progress the job still holds).
                shift = resumed - self.done[level][1]
                self.done = [None if d is None else (d[0], d[1] + shift) for d in self.done]
            self.seg_time, self.seg_step = resumed, restored
            self.states = self._states()
            return

    def result(self, stopped_early: bool) -> RunResult:
        useful = self.step * self.dt
        wall = self.time_at(self.step)
        return RunResult(
            steps=self.step,
            stopped_early=stopped_early,
            gave_up=self.step < self.stop,
            wall=wall,
            useful=useful,
            blocked=self.blocked,
            lost=self.lost,
            restore=self.restore,
            value_useful=self.value.at(self.step),
            value_blocked=self.v_blocked,
            value_lost=self.v_lost,
            value_restore=self.v_restore,
            saves=tuple(self.saves),
            skipped=tuple(self.skipped),
            failures=tuple(self.records),
        )


def simulate(
    job: Job,
    policy: SavePolicy,
    *,
    seed: int | np.random.SeedSequence = 0,
    failures: list[Failure] | list[tuple[float, str]] | None = None,
    stop_step: int | None = None,
    resume_clock: str = "rebased",
    max_failures: int = 100_000,
) -> RunResult:
    """Run ``job`` once under ``policy``.

    Args:
        job: the job (levels, costs, failure rates, early stop, loss curve).
        policy: the save policy (pure: the same one may serve many runs).
        seed: seeds the failure arrivals (one stream per class) and the early
            stop (its own stream), so a seed gives the same failures to every policy.
        failures: failures placed by hand ``(time, class name)`` instead of drawn.
        stop_step: stop the run at this step instead of drawing the early stop.
        resume_clock: what a policy sees of the checkpoints left after a restart:
            ``"rebased"`` (default): the restored checkpoint's time is the time
            the job resumed, and the older ones keep their distance to it (so
            ``time - last_time`` is the progress at risk, as Young/Daly
            assume); ``"wall"``: the clock times at which they were taken (a
            time-based policy then saves again soon after a restart).
        max_failures: give up once this many failures struck (``RunResult.gave_up``): a
            job whose failures come faster than it can save and restore never ends.

    Returns:
        The run's :class:`RunResult`.
    """
    seq = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    arrivals_seed, stop_seed = seq.spawn(2)
    if failures is not None:
        arrivals: Arrivals = Injected(failures)
    else:
        arrivals = Random(job.failures, job.weibull_shape, arrivals_seed)
    stop = job.total_steps
    if stop_step is not None:
        if not 1 <= stop_step <= job.total_steps:
            raise ConfigError(f"stop_step must be in 1..{job.total_steps}, got {stop_step!r}")
        stop = stop_step
    elif job.stop_probability > 0:
        gen = np.random.default_rng(stop_seed)
        if gen.random() < job.stop_probability:
            stop = int(gen.integers(1, job.total_steps + 1))
    if resume_clock not in ("rebased", "wall"):
        raise ConfigError(f"resume_clock must be 'rebased' or 'wall', got {resume_clock!r}")
    run = _Run(job, policy, arrivals, stop, resume_clock == "rebased", max_failures)
    run.run()
    return run.result(stopped_early=stop < job.total_steps)
