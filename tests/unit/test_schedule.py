"""Save-decision policies (pure): the Young/Daly closed forms, failure rates from the
published figures, and decisions from observations."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_multilevel import ConfigError, Level
from dcp_multilevel.schedule import (
    ConvergenceAware,
    Decision,
    FailureClass,
    FailureModel,
    FixedInterval,
    Interval,
    LevelState,
    Observation,
    OverheadBound,
    ProgressValue,
    SavePolicy,
    Schedule,
    TimeBounds,
    YoungDaly,
    daly_interval,
    young_interval,
)
from dcp_multilevel.schedule.progress import KEPT_POINTS

LEVELS = (Level("/l1"), Level("partner:/p", replicas=2), Level("s3://b/r", every=4))


def _obs(time: float, last: list[float | None], costs: list[float | None], step: int = 10):
    states = tuple(
        LevelState(i, LEVELS[i], None if t is None else 0, t, c)
        for i, (t, c) in enumerate(zip(last, costs, strict=True))
    )
    return Observation(step, time, states)


def test_young_and_daly_closed_forms():
    assert young_interval(10, 28800) == pytest.approx(math.sqrt(2 * 10 * 28800))
    # Daly's refinement: slightly shorter than Young's for a small cost ratio...
    c, m = 10.0, 28800.0
    r = c / (2 * m)
    expected = math.sqrt(2 * c * m) * (1 + math.sqrt(r) / 3 + r / 9) - c
    assert daly_interval(c, m) == pytest.approx(expected)
    assert daly_interval(c, m) == pytest.approx(young_interval(c, m), rel=0.02)
    # ...and the mean time between failures itself once a save costs 2 M or more.
    assert daly_interval(100, 40) == 40


def test_failure_rates_reproduce_the_published_figures():
    assert FailureModel.for_gpus(1024).mtbf_hours == pytest.approx(7.9)
    assert FailureModel.for_gpus(16384).mtbf_hours == pytest.approx(1.8)
    model = FailureModel(8.0)
    per_hour = {i: r * 3600 for i, r in model.covered_by(("first", "node", "store")).items()}
    assert per_hour == pytest.approx({0: 0.21 / 8, 1: 0.78 / 8, 2: 0.01 / 8})
    # Without a node-local level, node losses are the remote's to cover.
    per_hour = {i: r * 3600 for i, r in model.covered_by(("first", "store")).items()}
    assert per_hour == pytest.approx({0: 0.21 / 8, 1: 0.79 / 8})
    with pytest.raises(ConfigError, match="shares must add up to 1"):
        FailureModel(8.0, (FailureClass("node", 0.5, "node"),))
    with pytest.raises(ConfigError, match="survived_by must be one of"):
        FailureClass("odd", 1.0, "rack")


def test_young_daly_saves_each_level_once_its_interval_passed():
    model = FailureModel(8.0)
    policy = YoungDaly(model, ("first", "node", "store"))
    # Nothing saved yet: the intervals count from the start of the job.
    first = policy.decide(_obs(0.0, [None, None, None], [None, None, None]))
    assert first.levels == frozenset() and first.policy == "young-daly"
    assert policy.decide(_obs(1e6, [None, None, None], [None, None, None])).levels == {0, 1, 2}
    costs = [2.0, 30.0, 5000.0]  # the remote's drain takes longer than its interval
    rates = model.covered_by(("first", "node", "store"))
    expected = {i: daly_interval(2.0, 1 / rates[i]) for i in range(3)}
    expected[2] = max(expected[2], 5000.0)
    decision = policy.decide(_obs(10.0, [0.0, 0.0, 0.0], costs))
    assert decision.levels == frozenset()
    assert decision.intervals == pytest.approx(expected)
    # The node level covers most failures: its interval is the shortest.
    assert expected[1] < expected[0] < expected[2]
    later = policy.decide(_obs(expected[1] + 1, [0.0, 0.0, 0.0], costs))
    assert later.levels == {0, 1}  # a level above the first always brings the first
    assert later.record()["intervals"]["1"] == pytest.approx(expected[1])
    assert later.inputs["rules"] == {"0": "young-daly", "1": "young-daly", "2": "drain-duration"}


def test_a_level_whose_copy_is_still_running_is_not_chosen():
    policy = YoungDaly(FailureModel(8.0), ("first", "node", "store"))
    states = tuple(LevelState(i, LEVELS[i], 0, 0.0, 2.0, busy=i == 2) for i in range(3))
    assert policy.decide(Observation(10, 1e7, states)).levels == {0, 1}


def test_bounds_on_intervals_and_which_rule_fired():
    model = FailureModel(8.0)
    inner = YoungDaly(model, ("first", "node", "store"))
    costs = [600.0, 30.0, 600.0]  # a slow first level: Young/Daly would block > 3.5 %
    bounded = OverheadBound(inner, target=0.035)
    intervals, _ = bounded.intervals(_obs(0.0, [0.0] * 3, costs))
    assert intervals[0] == Interval(600.0 / 0.035, "overhead-bound")
    decision = bounded.decide(_obs(600.0 / 0.035, [0.0] * 3, costs))
    assert 0 in decision.levels and "overhead-bound" in decision.policy
    clamped = TimeBounds(inner, min_seconds={1: 3600.0}, max_seconds={2: 3000.0})
    intervals, _ = clamped.intervals(_obs(0.0, [0.0] * 3, [2.0, 30.0, 600.0]))
    assert intervals[1] == Interval(3600.0, "time-floor")  # Young/Daly: ~384 s
    assert intervals[2] == Interval(3000.0, "time-ceiling")  # Young/Daly: ~3394 s
    with pytest.raises(ConfigError, match="min_seconds 10 is more than max_seconds 5"):
        TimeBounds(inner, 10, 5).intervals(_obs(0.0, [0.0] * 3, costs))
    with pytest.raises(ConfigError, match="overhead target must be in"):
        OverheadBound(inner, 0)


@settings(max_examples=100, deadline=None)
@given(
    st.floats(0.01, 1000),
    st.floats(0.05, 50),
    st.floats(0, 1e4),
    st.floats(0, 1e5),
    st.floats(0, 1e5),
    st.floats(0, 1e5),
)
def test_bounded_policies_never_save_closer_than_the_floor_nor_wait_past_the_ceiling(
    cost, mtbf_hours, floor, extra, last, now
):
    ceiling = floor + extra
    policy = TimeBounds(OverheadBound(YoungDaly(FailureModel(mtbf_hours))), floor, ceiling)
    now = max(now, last)
    states = tuple(
        LevelState(i, LEVELS[i], 0, last, cost, survives=k)
        for i, k in enumerate(("first", "node", "store"))
    )
    decision = policy.decide(Observation(10, now, states))
    for i in range(3):
        if i in decision.levels:
            assert now - last >= floor
        if now - last >= ceiling:
            assert i in decision.levels


@settings(max_examples=100, deadline=None)
@given(
    st.floats(0.01, 100),
    st.floats(0.1, 100),
    st.lists(st.floats(0, 1e5), min_size=3, max_size=3),
    st.floats(0, 1e5),
)
def test_young_daly_never_saves_a_level_before_its_interval(cost, mtbf_hours, last, now):
    policy = YoungDaly(FailureModel(mtbf_hours), ("first", "node", "store"))
    now = max(now, *last)
    decision = policy.decide(_obs(now, list(last), [cost, cost, cost]))
    for i in range(3):
        if i in decision.levels and i > 0:
            assert now - last[i] >= decision.intervals[i]
        if now - last[i] >= decision.intervals[i]:
            assert i in decision.levels


class EveryThird(SavePolicy):
    def due(self, index, level, step):
        return step % 3 == 0


def test_a_per_step_rule_decides_through_due():
    decision = EveryThird().decide(_obs(0.0, [None] * 3, [None] * 3, step=6))
    assert decision == Decision(frozenset({0, 1, 2}), "EveryThird")
    decision = EveryThird().decide(_obs(0.0, [None] * 3, [None] * 3, step=7))
    assert decision.levels == {0}  # the first level takes every step's save
    assert not EveryThird.deterministic  # asked on rank 0, sent to the others


def test_fixed_intervals_pace_every_level_the_first_included():
    policy = FixedInterval()
    assert policy.deterministic
    levels = (Level("/l1", every=2), Level("partner:/p", replicas=2, every=3), LEVELS[2])
    obs = [
        Observation(s, 0.0, tuple(LevelState(i, lv) for i, lv in enumerate(levels)))
        for s in range(9)
    ]
    assert [sorted(policy.decide(o).levels) for o in obs] == [
        [0, 1, 2],
        [],
        [0],
        [0, 1],
        [0, 2],
        [],
        [0, 1],
        [],
        [0, 2],
    ]


def test_convergence_aware_intervals_grow_as_progress_slows():
    inner = YoungDaly(FailureModel(8.0), ("first", "node", "store"))
    policy = ConvergenceAware(inner)
    scales = []
    for k in range(1, 60):
        t = 600.0 * k
        loss = 2.0 + 8.0 * (t / 600.0) ** -0.5  # a power-law training curve
        obs = Observation(k, t, _obs(t, [0.0] * 3, [2.0, 30.0, 600.0]).levels, loss=loss)
        intervals, inputs = policy.intervals(obs)
        base, _ = inner.intervals(obs)
        scales.append(intervals[0].seconds / base[0].seconds)
        if inputs["progress_weight"] is not None:
            assert intervals[0].rule == "young-daly+convergence"
    assert scales[0] == 1.0  # no trend yet: the inner policy's intervals
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(scales[2:]))  # progress slows
    assert 1.0 < scales[-1] <= 4.0
    # A flat loss carries no progress to weigh: the inner intervals stand.
    flat = ConvergenceAware(inner)
    for k in range(1, 10):
        obs = Observation(k, 60.0 * k, _obs(0, [0.0] * 3, [2.0] * 3).levels, loss=3.0)
        assert flat.intervals(obs)[1]["progress_weight"] is None


def test_schedule_auto_composes_the_policies():
    policy = Schedule.auto(mtbf_hours=8, convergence=True, min_seconds=60, max_seconds=86400)
    assert isinstance(policy, TimeBounds)
    assert isinstance(policy.inner, OverheadBound)
    assert isinstance(policy.inner.inner, ProgressValue)
    assert policy.inner.inner.horizon_hours == 24.0
    assert isinstance(policy.inner.inner.inner, YoungDaly)
    states = tuple(
        LevelState(i, LEVELS[i], 0, 0.0, 2.0, survives=k)
        for i, k in enumerate(("first", "node", "store"))
    )
    decision = policy.decide(Observation(100, 1e5, states, loss=1.0))
    assert decision.levels == {0, 1, 2} and decision.record()["kind"] == "decision"
    assert Schedule.auto(gpus=16384).inner.failures.mtbf_hours == pytest.approx(1.8)
    assert isinstance(Schedule.auto(mtbf_hours=8).inner, YoungDaly)  # convergence off by default
    with pytest.raises(ConfigError, match="needs the job's failure rate"):
        Schedule.auto()


def test_the_overhead_bound_spaces_saves_of_every_level():
    # A cheap remote interval would bring a first-level save with it every time.
    policy = OverheadBound(YoungDaly(FailureModel(0.001), ("first", "node", "store")))
    costs = [0.1, 0.5, 0.5]
    intervals, _ = policy.intervals(_obs(0.0, [0.0] * 3, costs))
    assert all(v.seconds >= 0.1 / 0.035 for v in intervals.values())
    # Level 2 last saved long ago, but the last save of any level was 1 s ago.
    assert policy.decide(_obs(100.0, [99.0, 99.0, 0.0], costs)).levels == frozenset()
    assert policy.decide(_obs(110.0, [99.0, 99.0, 0.0], costs)).levels >= {0, 2}


def test_the_overhead_bound_pays_back_a_save_that_took_longer_than_its_cost():
    policy = OverheadBound(YoungDaly(FailureModel(0.001), ("first", "node", "store")))
    costs = [0.1, 0.5, 0.5]
    spaced = _obs(110.0, [99.0, 99.0, 0.0], costs)  # 11 s since the last save: spaced enough
    assert policy.decide(spaced).levels >= {0, 2}
    # The run so far blocked 3.8 s of 110 s (a slow first save): one more 0.1 s save
    # would make it 3.9 / 110.1 = 3.54 % > 3.5 %, so the bound waits...
    slow = dataclasses.replace(spaced, blocked_seconds=3.8)
    decision = policy.decide(slow)
    assert decision.levels == frozenset() and decision.policy == "overhead-bound"
    # ...until the run's time brings it back under: (3.8 + 0.1) / (t + 0.1) <= 0.035.
    later = dataclasses.replace(slow, time=3.9 / 0.035)
    assert policy.decide(later).levels >= {0, 2}
    assert policy.decide(dataclasses.replace(slow, blocked_seconds=3.7)).levels >= {0, 2}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.01, 5.0), min_size=2, max_size=20), st.floats(0.02, 0.2))
def test_the_overhead_bound_holds_after_every_save_but_for_the_newest_estimate_error(costs, target):
    # Saves really cost ``costs``; the policy knows the previous save's (as the
    # manager's median of recent saves). After every save but the first (nothing
    # measured before it), blocked / time is under target, over by at most the
    # newest save's underestimate; an overestimate never lets it over.
    level = Level("/l1")
    policy = OverheadBound(YoungDaly(FailureModel(0.001), ("first",)), target)
    time, blocked, last, measured = 0.0, 0.0, None, None
    for cost in costs:
        while True:
            time += 0.25  # decision points (training steps) every 0.25 s
            state = LevelState(0, level, None if last is None else 0, last, measured)
            if policy.decide(Observation(1, time, (state,), blocked_seconds=blocked)).levels:
                break
        time += cost
        blocked += cost
        if measured is not None:
            slack = (1 - target) * max(0.0, cost - measured)
            assert blocked <= target * time + slack + 1e-9
        last, measured = time, cost


def _curve(step: float) -> float:
    """A Chinchilla-shaped loss: 1.8 + 4 (s + 200) ** -0.28."""
    return 1.8 + 4.0 * (step + 200.0) ** -0.28


def _true_weight(step: float, total: int) -> float:
    """The progress rate at ``step`` relative to its mean over ``total`` steps."""
    rate = 0.28 * 4.0 * (step + 200.0) ** -1.28
    return rate * total / (_curve(0) - _curve(total))


def _feed(policy, steps, step_seconds=6.0, losses=_curve):
    inner = policy.inner
    out = []
    for s in steps:
        t = s * step_seconds
        obs = Observation(
            s, t, _obs(t, [0.0] * 3, [0.239, 1.7, 2.1]).levels, step_seconds, loss=losses(s)
        )
        intervals, inputs = policy.intervals(obs)
        out.append((s, intervals, inner.intervals(obs)[0], inputs))
    return out


def test_progress_value_divides_intervals_by_the_root_of_the_progress_rate():
    total = 14_400  # 24 h of 6 s steps: the default horizon is the run's true length
    inner = YoungDaly(FailureModel(1.8), ("first", "node", "store"))
    seen = _feed(ProgressValue(inner), range(1, total))
    # Too few steps for a trend: the inner policy's intervals.
    assert seen[0][3]["progress_weight"] is None and seen[0][1] == seen[0][2]
    for _, intervals, base, inputs in seen[100::1000]:
        w = inputs["progress_weight"]
        assert intervals[1].seconds == pytest.approx(base[1].seconds / math.sqrt(w))
        assert intervals[1].rule == "young-daly+progress"
    estimated = np.array([inputs["progress_weight"] or 1.0 for *_, inputs in seen])
    true = np.array([_true_weight(s, total) for s, *_ in seen])
    # Shorter intervals early, longer on the plateau, never growing shorter again.
    assert estimated[20] > 16 and estimated[-1] < 0.5
    assert np.all(np.diff(estimated[20::50]) <= 1e-9)
    # The estimate leaves out the gain to come, so it overstates the rate early
    # (up to 10x in the first 1 % of the run); from 5 % of the run on it is
    # within 2.5x (near the end the assumed horizon, twice the steps reached,
    # is twice the run's).
    assert np.all((estimated / true)[total // 20 :] < 2.5)
    assert np.all((estimated / true)[total // 20 :] > 0.5)
    # What matters is the cost: to first order, a second at true rate w costs
    # sqrt(w) at the best interval, (sqrt(e) + w / sqrt(e)) / 2 at the interval for
    # an estimate e, and (1 + w) / 2 at Young/Daly's (docs/schedule.md).
    best = np.mean(np.sqrt(true))
    ours = np.mean((np.sqrt(estimated) + true / np.sqrt(estimated)) / 2)
    young_daly = np.mean((1 + true) / 2)
    # Here: 0.76 at best, 0.84 ours, 1 for Young/Daly.
    assert best < ours < 1.15 * best and ours < 0.85 * young_daly


def test_progress_value_goes_on_from_the_curve_a_checkpoint_kept():
    """state() -> JSON -> load_state() into a new process's policy: the same
    decisions from there on; a long curve is thinned to KEPT_POINTS points and
    its estimate stays within a few per cent."""
    inner = YoungDaly(FailureModel(1.8), ("first", "node", "store"))
    short, resumed = ProgressValue(inner), ProgressValue(inner)
    _feed(short, range(1, 600))
    resumed.load_state(json.loads(json.dumps(short.state(), allow_nan=False)))
    assert _feed(resumed, range(600, 900)) == _feed(short, range(600, 900))
    long, thinned = ProgressValue(inner), ProgressValue(inner)
    _feed(long, range(1, 6000))
    state = long.state()
    assert len(state["own"]["steps"]) == KEPT_POINTS
    assert state["own"]["steps"][0] == 1 and state["own"]["steps"][-1] == 5999
    thinned.load_state(state)
    for (_, got, _, a), (_, want, _, b) in zip(
        _feed(thinned, range(6000, 7000, 50)), _feed(long, range(6000, 7000, 50)), strict=True
    ):
        assert a["progress_weight"] == pytest.approx(b["progress_weight"], rel=0.03)
        assert got[1].seconds == pytest.approx(want[1].seconds, rel=0.02)
    # The composed schedule keeps it where ProgressValue sits.
    auto = Schedule.auto(mtbf_hours=8, convergence=True)
    assert auto.state() is None  # nothing seen yet
    # What is not such a state is refused (the manager then starts the policy afresh).
    for bad in (
        {"policy": "TimeBounds"},
        {"policy": "ProgressValue", "own": {"steps": [2, 1], "losses": [1.0, 1.0]}},
        {"policy": "ProgressValue", "own": {"steps": [1], "losses": []}},
    ):
        with pytest.raises(ValueError):
            ProgressValue(inner).load_state(bad)
    with pytest.raises(ValueError, match="keeps no state"):
        inner.load_state({"anything": 1})


def test_progress_value_keeps_progress_not_repeats_and_no_trend_no_change():
    inner = YoungDaly(FailureModel(1.8), ("first", "node", "store"))
    policy = ProgressValue(inner)
    _feed(policy, range(1, 400))
    before = _feed(policy, [399])[0][3]["progress_weight"]
    # Back to step 300 after a restart (the losses of steps seen again), then on.
    _feed(policy, range(300, 400), losses=lambda s: 99.0)
    assert policy._steps[-1] == 399 and _feed(policy, [399])[0][3]["progress_weight"] == before
    # A flat loss, or no loss at all, carries no progress to weigh.
    for losses in (lambda s: 3.0, lambda s: None, lambda s: math.nan):
        seen = _feed(ProgressValue(inner), range(1, 200), losses=losses)
        assert all(i == b and inputs["progress_weight"] is None for _, i, b, inputs in seen)
    # Two policies fed the same observations decide the same (every rank).
    a, b = ProgressValue(inner), ProgressValue(inner)
    assert _feed(a, range(1, 500, 7)) == _feed(b, range(1, 500, 7))
    with pytest.raises(ConfigError, match=r"horizon_hours must be > 0, got 0"):
        ProgressValue(inner, horizon_hours=0)
    with pytest.raises(ConfigError, match=r"window must be in \(0, 0.5\], got 0.7"):
        ProgressValue(inner, window=0.7)


@settings(max_examples=100, deadline=None)
@given(
    st.floats(0.01, 1000),
    st.floats(0.05, 50),
    st.floats(0, 1e4),
    st.floats(0, 1e5),
    st.floats(0, 1e5),
    st.floats(0, 1e5),
    st.integers(0, 3000),
    st.floats(0.01, 3.0),
)
def test_progress_value_inside_the_bounds_never_saves_closer_than_the_floor_nor_past_the_ceiling(
    cost, mtbf_hours, floor, extra, last, now, seen, exponent
):
    # The progress rate scales the intervals by up to 16x either way: the bounds
    # still hold, whatever loss curve came before.
    ceiling = floor + extra
    progress = ProgressValue(YoungDaly(FailureModel(mtbf_hours)))
    policy = TimeBounds(OverheadBound(progress), floor, ceiling)
    now = max(now, last)
    states = tuple(
        LevelState(i, LEVELS[i], 0, last, cost, survives=k)
        for i, k in enumerate(("first", "node", "store"))
    )
    for s in range(1, seen, 7):  # the losses seen before
        progress.intervals(Observation(s, 0.0, states, 1.0, loss=2 + (s + 10.0) ** -exponent))
    step = max(seen, 1)
    decision = policy.decide(
        Observation(step, now, states, 1.0, loss=2 + (step + 10.0) ** -exponent)
    )
    for i in range(3):
        if i in decision.levels:
            assert now - last >= floor
        if now - last >= ceiling:
            assert i in decision.levels


def test_the_package_exports_schedule_and_every_public_name():
    # The README and docs/schedule.md import Schedule from the package itself.
    import dcp_multilevel
    from dcp_multilevel import Schedule
    from dcp_multilevel.schedule import Schedule as Inner

    assert Schedule is Inner and "Schedule" in dcp_multilevel.__all__
    missing = [n for n in dcp_multilevel.__all__ if not hasattr(dcp_multilevel, n)]
    assert missing == []
