"""The failure simulator (benchmarks/sim): it reproduces Young's optimum, its
bookkeeping adds up on hand-placed failures, and its invariants hold (hypothesis)."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_multilevel import ConfigError
from dcp_multilevel.schedule import (
    ConvergenceAware,
    Decision,
    FailureClass,
    FailureModel,
    Observation,
    SavePolicy,
    YoungDaly,
    young_interval,
)

# The simulator is a benchmark tool: it lives beside the benchmarks that use it.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from sim import (
    Estimate,
    EverySteps,
    FixedSeconds,
    Job,
    Lookahead,
    PowerLaw,
    Recorded,
    SimLevel,
    Summary,
    YoungDalyAhead,
    best_fixed,
    evaluate,
    simulate,
)
from sim import measured as m
from sim.arrivals import Random

#: Every class of failure, each survived by a different kind of level.
CLASSES = (
    FailureClass("process", 0.2, "first"),
    FailureClass("node", 0.7, "node"),
    FailureClass("job", 0.1, "store"),
)
#: Hand-placed failures need costs that make times easy to follow.
HAND_LEVELS = (
    SimLevel("first", 1.0, 2.0),
    SimLevel("node", 5.0, 4.0),
    SimLevel("store", 20.0, 8.0),
)


class Recording(SavePolicy):
    """Delegates to ``inner`` and keeps every observation (no look-ahead: asked every step)."""

    def __init__(self, inner: SavePolicy) -> None:
        self.inner = inner
        self.seen: list[Observation] = []

    def decide(self, observation):
        self.seen.append(observation)
        return self.inner.decide(observation)


class Odd(SavePolicy):
    """Chooses a level the job does not have."""

    def decide(self, observation):
        return Decision(frozenset({3}), "odd")


def _job(levels=HAND_LEVELS, total_steps=20, step_seconds=10.0, mtbf_hours=1.0, **kw) -> Job:
    return Job(total_steps, step_seconds, levels, FailureModel(mtbf_hours, CLASSES), **kw)


# --------------------------------------------------------------------------- the simulator's check


def test_simulated_optimum_lands_on_young_interval():
    """One level, exponential failures: the best fixed interval of the simulator is
    within a few % of sqrt(2 C MTBF).

    Near its optimum the overhead is flat, so the grid's argmin alone is noisy:
    the optimum comes from the brute force's runs, fitting their blocked share to
    a / P and their lost share to b P + c (P: the interval), so P* = sqrt(a / b).
    The exact optimum for these figures is 1.3 % above Young's (Daly's
    correction); over 10 disjoint seed sets the fit gave 1.3 % +- 1.4 % (sd).
    """
    cost, mtbf = 10.0, 3600.0
    young = young_interval(cost, mtbf)
    job = Job(
        total_steps=360_000,  # 100 h per run: ~100 failures
        step_seconds=1.0,
        levels=(SimLevel("first", cost, 0.0),),
        failures=FailureModel(mtbf / 3600, (FailureClass("crash", 1.0, "first"),)),
    )
    grid = [young * f for f in (0.5, 0.7, 1.0, 1.4, 2.0)]
    found = best_fixed(job, [grid], seeds=24)
    intervals = np.array([combo[0] for combo in found.tried])
    blocked, lost = (
        np.array(
            [
                sum(getattr(r, part) for r in s.runs) / sum(r.useful for r in s.runs)
                for s in found.tried.values()
            ]
        )
        for part in ("blocked", "lost")
    )
    assert sum(len(r.failures) for s in found.tried.values() for r in s.runs) > 10_000
    a, _ = np.linalg.lstsq(np.c_[1 / intervals, np.ones_like(intervals)], blocked, rcond=None)[0]
    b, _ = np.linalg.lstsq(np.c_[intervals, np.ones_like(intervals)], lost, rcond=None)[0]
    assert math.sqrt(a / b) == pytest.approx(young, rel=0.05)
    # The grid's best is one of the three points around Young's interval.
    assert 0.7 * young - 1 <= found.best[0] <= 1.4 * young + 1
    assert found.score[found.best] == min(found.score.values())


def test_young_daly_beats_a_bad_fixed_interval():
    job = m.scenario(16384, m.three_levels(), hours=24.0)
    young_daly = evaluate(job, YoungDaly(job.failures, job.kinds), 6)  # asked every step
    bad = evaluate(job, EverySteps((m.TORCHTITAN_INTERVAL_STEPS,) * 3), 6)
    assert young_daly.fraction.mean + young_daly.fraction.half_width < (
        bad.fraction.mean - bad.fraction.half_width
    )
    assert young_daly.fraction.mean < 0.02
    assert bad.fraction.mean > 0.1


@pytest.mark.parametrize(
    ("fast", "slow"),
    [
        (
            YoungDalyAhead(FailureModel(0.5, CLASSES), ("first", "node", "store")),
            YoungDaly(FailureModel(0.5, CLASSES), ("first", "node", "store")),
        ),
        (FixedSeconds((35.0, 61.0, 400.0)), Recording(FixedSeconds((35.0, 61.0, 400.0)))),
        (FixedSeconds((math.inf, 25.0, 1e9)), Recording(FixedSeconds((math.inf, 25.0, 1e9)))),
        (EverySteps((3, 4, 40)), Recording(EverySteps((3, 4, 40)))),
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_skipping_steps_gives_the_same_run(fast, slow, seed):
    """A policy with look-ahead lets the run skip steps: the run is the same, to the bit."""
    assert isinstance(fast, Lookahead) and not isinstance(slow, Lookahead)
    job = _job(total_steps=3000, step_seconds=3.0, mtbf_hours=0.5, weibull_shape=0.7)
    assert simulate(job, fast, seed=seed) == simulate(job, slow, seed=seed)


# --------------------------------------------------------------------------- bookkeeping by hand


def test_hand_placed_failures_add_up():
    """Step 10 s; saves on level 0 every 2nd step, level 1 every 4th, level 2 every 8th.

    A node loss at t=100 (step 10 under way, 6 s in): level 0 is wiped, the
    level-2 drain of step 8 (84..104) is cancelled, the run restarts from step 8
    on level 1 (drained 84..89): lost 1 step + 6 s, restore 4 s, resumed at 104.
    A job loss at t=200 (step 18 under way, 2 s in): only level 2 survives and
    holds nothing (its drain of step 16, 188..208, is cancelled): restart from
    step 0, lost 17 steps + 2 s. Then 20 steps with 9 saves to the end at t=409.
    """
    policy = Recording(EverySteps((2, 4, 8)))
    run = simulate(_job(), policy, failures=[(100.0, "node"), (200.0, "job")])
    assert (run.blocked, run.lost, run.restore, run.useful) == (17.0, 188.0, 4.0, 200.0)
    assert run.wall == 409.0 == run.useful + run.overhead
    assert run.saves == (17, 8, 4) and run.skipped == (0, 0, 0)
    first, second = run.failures
    assert (first.step, first.checkpoints, first.survivors) == (
        9,
        ((8, 83.0), (8, 83.0), None),
        (1, 2),
    )
    assert (first.level, first.restored_step, first.lost_seconds, first.restore_seconds) == (
        1,
        8,
        16.0,
        4.0,
    )
    assert (second.step, second.checkpoints, second.survivors) == (
        17,
        ((16, 187.0), (16, 187.0), None),
        (2,),
    )
    assert (second.level, second.restored_step, second.lost_seconds) == (None, 0, 172.0)
    # What the policy saw right after the first restart: level 1's checkpoint as fresh
    # as the resumed job (t=104), level 0 wiped, level 2 empty.
    seen = next(o for o in policy.seen if o.time > 100)
    assert (seen.step, seen.time, seen.step_seconds) == (9, 114.0, 10.0)
    assert [(s.last_step, s.last_time) for s in seen.levels] == [
        (None, None),
        (8, 104.0),
        (None, None),
    ]
    assert [(s.cost_seconds, s.restore_seconds) for s in seen.levels] == [(1, 2), (5, 4), (20, 8)]
    # The seconds blocked so far, as the manager counts them (OverheadBound's run-long
    # rule): four 1 s saves (steps 2, 4, 6, 8) before the node loss.
    assert seen.blocked_seconds == 4.0
    assert [o.blocked_seconds for o in policy.seen[:5]] == [0.0, 0.0, 1.0, 1.0, 2.0]
    # With the wall clock instead, it is the time the checkpoint was taken.
    policy = Recording(EverySteps((2, 4, 8)))
    simulate(_job(), policy, failures=[(100.0, "node")], resume_clock="wall")
    seen = next(o for o in policy.seen if o.time > 100)
    assert (seen.levels[1].last_step, seen.levels[1].last_time) == (8, 83.0)


def test_three_accountings_on_hand_placed_failures():
    """Losses 5 -> 1 over steps 0..4, then 1 -> 0 over steps 4..20 (10 s steps): a
    step before step 4 is worth 40 value-seconds (weight 4), a step after 2.5
    (weight 0.25); V(s) = 40 s up to 4, then 160 + 2.5 (s - 4).

    Saves every 6th step (1 s each, restore 2 s). A crash at t=35 (step 3 done,
    5 s into step 4; nothing saved): back to step 0, lost 35 s worth V(3) + 5 s
    at weight 4 = 140. Resumed at 35: saves end at 96 and 157; a crash at t=180
    (step 14 done at 177, 3 s under way) restores step 12 (2 s): lost 23 s worth
    V(14) - V(12) + 3 s at 0.25 = 5.75. Resumed at 182; the last save (step 18)
    ends at 243 and step 20 at 263.
    """
    curve = Recorded((0, 4, 20), (5.0, 1.0, 0.0))
    job = _job(levels=(SimLevel("first", 1.0, 2.0),), loss=curve)
    run = simulate(job, EverySteps((6,)), failures=[(35.0, "process"), (180.0, "process")])
    assert (run.blocked, run.lost, run.restore, run.useful, run.wall) == (
        3.0,
        58.0,
        2.0,
        200.0,
        263.0,
    )
    assert [(f.restored_step, f.lost_seconds) for f in run.failures] == [(0, 35.0), (12, 23.0)]
    assert run.value_lost == pytest.approx(140.0 + 5.75)
    # Plain time: every second is a second.
    assert run.overhead == 63.0
    # Value-weighted: the three saves (steps 6, 12, 18) and the restore (at step 12)
    # happen at weight 0.25.
    assert run.value_overhead == pytest.approx(3 * 0.25 + 2 * 0.25 + 145.75)
    # COCI's: saving and restoring cost their seconds, a failure the value it discards.
    assert run.progress_overhead == pytest.approx(3.0 + 2.0 + 145.75)
    summary = Summary.of([run, run])
    assert summary.progress_fraction.mean == pytest.approx(150.75 / 200.0)
    assert summary.fraction.mean == pytest.approx(63.0 / 200.0)
    # Without a loss curve, all three are the plain overhead.
    flat = simulate(
        _job(levels=(SimLevel("first", 1.0, 2.0),)),
        EverySteps((6,)),
        failures=[(35.0, "process"), (180.0, "process")],
    )
    assert flat.progress_overhead == flat.value_overhead == flat.overhead == 63.0


def test_failures_during_a_save_and_during_a_restore():
    """A crash 2 s into the first save (nothing committed: back to step 0, blocked 2 s,
    lost step 1); a crash 3 s into step 2 (restore step 1, 3 s), and another 2 s into
    that restore (restore again)."""
    job = _job(levels=(SimLevel("first", 5.0, 3.0),), total_steps=2)
    run = simulate(
        job, EverySteps((1,)), failures=[(12.0, "process"), (30.0, "process"), (32.0, "process")]
    )
    assert (run.blocked, run.lost, run.restore, run.wall) == (7.0, 13.0, 5.0, 45.0)
    assert [(f.restored_step, f.lost_seconds, f.restore_seconds) for f in run.failures] == [
        (0, 10.0, 0.0),
        (1, 3.0, 2.0),
        (1, 0.0, 3.0),
    ]


def test_a_class_no_level_survives_restarts_from_step_zero():
    """First level only: a node loss leaves nothing, however fresh the checkpoint."""
    levels = (SimLevel("first", 1.0, 2.0),)
    run = simulate(_job(levels=levels), EverySteps((1,)), failures=[(55.0, "node")])
    (failure,) = run.failures
    assert (failure.survivors, failure.level, failure.restored_step) == ((), None, 0)
    assert failure.checkpoints == ((5, 54.0),) and failure.lost_seconds == 50.0
    assert run.wall == 55.0 + 20 * 10.0 + 19 * 1.0


def test_a_drain_still_running_skips_the_next_save_of_its_level():
    """Saves every step (10 s), a 25 s drain: the drain starts at steps 1, 4, 7."""
    levels = (SimLevel("first", 1.0), SimLevel("store", 25.0))
    policy = Recording(EverySteps((1, 1)))
    run = simulate(_job(levels=levels, total_steps=8), policy, failures=[])
    assert run.saves == (7, 3) and run.skipped == (0, 4)
    assert [o.levels[1].last_step for o in policy.seen] == [None, 1, 1, 1, 4, 4, 4]


def test_observations_carry_the_loss_curve():
    curve = PowerLaw(2.0, 3.0, 0.5, offset=1.0)
    policy = Recording(EverySteps((5,)))
    simulate(_job(levels=(SimLevel("first", 1.0),), total_steps=6, loss=curve), policy, failures=[])
    assert [o.loss for o in policy.seen] == pytest.approx(
        [2 + 3 / math.sqrt(s + 1) for s in range(1, 6)]
    )


def test_early_stop_and_errors():
    job = _job(total_steps=500, stop_probability=1.0)
    runs = [simulate(job, EverySteps((10, 10, 10)), seed=s) for s in range(20)]
    assert all(r.stopped_early == (r.steps < 500) for r in runs)
    assert len({r.steps for r in runs}) > 10
    assert simulate(job, EverySteps((10, 10, 10)), stop_step=500).steps == 500
    with pytest.raises(ConfigError, match=re.escape("stop_step must be in 1..500, got 0")):
        simulate(job, EverySteps((10, 10, 10)), stop_step=0)
    odd = "Odd chose levels [0, 3] at step 1; the job has levels 0..2"
    with pytest.raises(ConfigError, match=re.escape(odd)):
        simulate(job, Odd(), seed=0)
    rack = "failure class 'rack' is not in the job's FailureModel (have ['job', 'node', 'process'])"
    with pytest.raises(ConfigError, match=re.escape(rack)):
        simulate(job, EverySteps((10, 10, 10)), failures=[(5.0, "rack")])
    kind = "SimLevel.kind must be one of ('first', 'node', 'store'), got 'rack'"
    with pytest.raises(ConfigError, match=re.escape(kind)):
        SimLevel("rack", 1.0)


def test_evaluate_starts_every_run_with_a_fresh_policy():
    """A policy that keeps what it observed (the loss curve) must not carry one run's
    history into the next: each seed's run is the run of a new policy."""
    job = _job(total_steps=3000, step_seconds=3.0, mtbf_hours=0.5, loss=m.LOSS)

    def policy():
        return ConvergenceAware(YoungDaly(job.failures, job.kinds))

    summary = evaluate(job, policy(), [0, 1, 2])
    assert summary.runs == tuple(simulate(job, policy(), seed=s) for s in (0, 1, 2))


# --------------------------------------------------------------------------- invariants


@st.composite
def jobs(draw):
    kinds = sorted(
        draw(st.lists(st.sampled_from(("first", "node", "store")), min_size=1, max_size=3)),
        key=("first", "node", "store").index,
    )
    levels = tuple(SimLevel(k, draw(st.floats(0, 30)), draw(st.floats(0, 30))) for k in kinds)
    shares = draw(st.lists(st.integers(0, 5), min_size=3, max_size=3).filter(sum))
    classes = tuple(
        FailureClass(c.name, s / sum(shares), c.survived_by)
        for c, s in zip(CLASSES, shares, strict=True)
    )
    return Job(
        total_steps=draw(st.integers(1, 400)),
        step_seconds=draw(st.floats(0.5, 20)),
        levels=levels,
        failures=FailureModel(draw(st.floats(0.02, 2.0)), classes),
        weibull_shape=draw(st.sampled_from((None, 0.6, 1.5))),
        stop_probability=draw(st.sampled_from((0.0, 0.5))),
        loss=draw(st.sampled_from((None, PowerLaw(1.7, 4.0, 0.28, offset=20.0)))),
    )


def _policy(job: Job, choice: int, scale: float) -> SavePolicy:
    n = len(job.levels)
    return [
        YoungDalyAhead(job.failures, job.kinds),
        YoungDaly(job.failures, job.kinds),
        FixedSeconds(tuple(scale * (i + 1) for i in range(n))),
        EverySteps(tuple(max(1, round(scale / 10)) * (i + 1) for i in range(n))),
    ][choice]


@settings(max_examples=150, deadline=None)
@given(jobs(), st.integers(0, 3), st.floats(5, 2000), st.integers(0, 2**32 - 1))
def test_invariants(job, choice, scale, seed):
    # Hostile jobs (failures faster than saves and restores) would never end: cap them.
    run = simulate(job, _policy(job, choice, scale), seed=seed, max_failures=300)
    assert not run.gave_up or len(run.failures) >= 300
    # Never negative, and every second of the clock accounted for.
    for part in ("blocked", "lost", "restore", "value_blocked", "value_lost", "value_restore"):
        assert getattr(run, part) >= 0
    assert run.progress_overhead == pytest.approx(run.blocked + run.restore + run.value_lost)
    assert run.wall == pytest.approx(run.useful + run.overhead, rel=1e-9, abs=1e-6)
    assert run.stopped_early or run.gave_up or run.steps == job.total_steps
    assert run.lost == pytest.approx(sum(f.lost_seconds for f in run.failures))
    assert run.restore == pytest.approx(sum(f.restore_seconds for f in run.failures))
    for f in run.failures:
        cls = next(c for c in job.failures.classes if c.name == f.name)
        survivors = [i for i, lv in enumerate(job.levels) if lv.survives(cls.survived_by)]
        assert f.survivors == tuple(survivors)
        # Lost work: never more than the time since the last save on any surviving level.
        for i in f.survivors:
            if f.checkpoints[i] is not None:
                assert f.lost_seconds <= f.time - f.checkpoints[i][1] + 1e-6
        # A class no level survives (or survivors holding nothing) loses everything.
        if not any(f.checkpoints[i] for i in f.survivors):
            assert (f.level, f.restored_step, f.restore_seconds) == (None, 0, 0.0)
            assert f.lost_seconds == pytest.approx(f.step * job.step_seconds, abs=job.step_seconds)
        else:
            held = [f.checkpoints[i][0] for i in f.survivors if f.checkpoints[i] is not None]
            assert f.restored_step == max(held)
    # Deterministic for a seed.
    assert simulate(job, _policy(job, choice, scale), seed=seed, max_failures=300) == run


# --------------------------------------------------------------------------- parts


@pytest.mark.parametrize("shape", [None, 0.7, 2.0])
def test_arrivals_have_the_class_means(shape):
    model = FailureModel(1.0, CLASSES)
    arrivals = Random(model, shape, np.random.SeedSequence(7))
    times: dict[str, list[float]] = {c.name: [] for c in CLASSES}
    while len(times["process"]) < 4000:
        f = arrivals.pop()
        times[f.name].append(f.time)
    for c in CLASSES:
        gaps = np.diff([0.0, *times[c.name]])
        assert gaps.mean() == pytest.approx(3600 / c.share, rel=0.06)


def test_loss_curves_value_early_progress_more():
    curve = PowerLaw.chinchilla(params=70e9, tokens_per_step=2e6, offset=200)
    assert curve.c == 0.28 and curve.a == pytest.approx(1.69 + 406.4 / 70e9**0.34)
    value = curve.value_seconds(1000, 2.0)
    assert value[0] == 0 and value[-1] == pytest.approx(2000) and np.all(np.diff(value) > 0)
    assert value[100] > 2 * value[-1] / 10  # the first 10 % of the steps: over 20 % of the value
    # A noisy recorded curve counts the best loss so far: progress never loses value.
    noisy = Recorded((0, 10, 20, 30), (5.0, 3.0, 4.0, 2.0))
    assert np.all(np.diff(noisy.value_seconds(30, 1.0)) >= 0)
    flat = Recorded((0, 10), (1.0, 1.0))
    assert flat.value_seconds(10, 2.0) == pytest.approx(np.arange(11) * 2.0)


def test_coci_bound_is_the_mean_root_of_the_progress_rate():
    # Flat: every step worth the same, nothing to gain over Young/Daly.
    assert Recorded((0, 10), (1.0, 1.0)).coci_bound(100) == pytest.approx(1.0)
    # Linear loss: w = 1 at every step, the same.
    assert Recorded((0, 100), (2.0, 1.0)).coci_bound(100) == pytest.approx(1.0)
    # All progress in the first quarter: w = 4 there, 0 after; mean(sqrt(w)) = 2 / 4.
    front = Recorded((0, 25, 100), (2.0, 1.0, 1.0))
    assert front.progress_rates(100) == pytest.approx([4.0] * 25 + [0.0] * 75)
    assert front.coci_bound(100) == pytest.approx(0.5)
    # The benchmark's Chinchilla-shaped curve over 72 h of 6 s steps (docs/schedule.md).
    assert m.LOSS.coci_bound(43_200) == pytest.approx(0.673, abs=5e-4)


def test_estimates_and_the_brute_force_grid():
    e = Estimate.of([1.0, 2.0, 3.0])
    assert (e.mean, e.half_width) == pytest.approx((2.0, 1.96 / math.sqrt(3)))
    r = Estimate.ratio([1.0, 3.0], [10.0, 10.0])
    assert r.mean == pytest.approx(0.2)
    job = _job(total_steps=300)
    found = best_fixed(job, [[20.0, 50.0], [30.0], [1000.0]], seeds=2)
    # A first-level interval at or above another level's never fires on its own.
    assert set(found.tried) == {(20.0, 30.0, 1000.0), (math.inf, 30.0, 1000.0)}
    assert found.best == min(found.score, key=found.score.__getitem__)
