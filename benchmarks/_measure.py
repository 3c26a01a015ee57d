"""Timing: alternating rounds, timed phases on a quiet CPU, medians and spread.

The machines these benchmarks run on are shared and noisy. Every benchmark
therefore alternates the configurations it compares (:func:`rounds`), reports
medians of the repeats (:func:`median`) with the samples or their spread, and
records how much of the CPU other processes used while it measured
(:class:`PhaseTimer`).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

GB = 1e9  # decimal, as disks and bandwidth figures are quoted
MB = 1e6

T = TypeVar("T")


# --------------------------------------------------------------------------- rounds and stats


def rotated(entries: Sequence[T], rep: int) -> list[T]:
    """``entries`` in the order of round ``rep``: rotated by one every round, so that
    no entry always runs right after the same neighbour (two entries alternate)."""
    shift = rep % max(1, len(entries))
    return [*entries[shift:], *entries[:shift]]


def rounds(entries: Sequence[T], repeat: int) -> Iterator[tuple[int, T]]:
    """``(round, entry)`` for ``repeat`` rounds over ``entries``, each :func:`rotated`."""
    for rep in range(repeat):
        for entry in rotated(entries, rep):
            yield rep, entry


def median(values: Iterable[float]) -> float:
    """The median; NaN for no values."""
    values = list(values)
    return statistics.median(values) if values else float("nan")


def spread(values: Iterable[float], digits: int = 2) -> str:
    """``"min to max"`` of the samples."""
    values = list(values)
    return f"{min(values):.{digits}f} to {max(values):.{digits}f}"


def gbps(nbytes: int, seconds: float) -> float:
    """Bandwidth in GB/s (decimal)."""
    return nbytes / GB / seconds if seconds > 0 else float("inf")


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Run ``fn`` once; return (wall seconds by ``time.perf_counter``, its result)."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def timed_each(items: Iterable[T]) -> Iterator[tuple[float, T]]:
    """Each item of ``items`` with the seconds it took to produce (for generators)."""
    it = iter(items)
    while True:
        start = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            return
        yield time.perf_counter() - start, item


# --------------------------------------------------------------------------- CPU contention


@dataclass(frozen=True)
class CpuSnapshot:
    wall: float  # perf_counter seconds
    user: float  # user-mode CPU seconds of all processes (from /proc/stat), NaN if unknown
    ours: float  # user-mode CPU seconds of this process (all threads)
    ours_sys: float  # system-mode CPU seconds of this process


def cpu_snapshot() -> CpuSnapshot:
    """Machine-wide and own CPU time now, to tell how much other processes ran.

    Machine-wide user time only: the kernel's writeback and I/O work done for
    *our* saves and loads runs in kernel threads and would otherwise count as
    someone else's.
    """
    user = float("nan")
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        user = (fields[0] + fields[1]) / os.sysconf("SC_CLK_TCK")  # user + nice
    except (OSError, ValueError, IndexError):
        pass
    own = os.times()
    return CpuSnapshot(time.perf_counter(), user, own.user, own.system)


def machine_busy_s() -> float | None:
    """CPU seconds this machine's cores spent busy since boot (Linux ``/proc/stat``:
    user, nice, system, irq and softirq; not idle, iowait or time stolen by the
    hypervisor). The kernel's writeback for our saves counts; None elsewhere."""
    try:
        with open("/proc/stat") as f:
            t = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (t[0] + t[1] + t[2] + t[5] + t[6]) / os.sysconf("SC_CLK_TCK")


def other_cpu_fraction(before: CpuSnapshot, after: CpuSnapshot) -> float:
    """Share of the machine's CPU capacity other processes used (in user mode) in between.

    0.0 on an otherwise idle machine; 0.5 means one of two cores was busy elsewhere.
    """
    capacity = (os.cpu_count() or 1) * (after.wall - before.wall)
    if capacity <= 0:
        return float("nan")
    others = (after.user - before.user) - (after.ours - before.ours)
    return max(0.0, others / capacity)


def wait_for_idle(
    *, threshold: float = 0.1, window: float = 0.5, timeout: float = 60.0
) -> float | None:
    """Block until other processes use less than ``threshold`` of the CPU over ``window``.

    Returns the seconds waited, or None if the machine stayed busy for ``timeout``.
    """
    start = time.perf_counter()
    while True:
        before = cpu_snapshot()
        time.sleep(window)
        if other_cpu_fraction(before, cpu_snapshot()) < threshold:
            return time.perf_counter() - start
        if time.perf_counter() - start >= timeout:
            return None


@dataclass(frozen=True)
class Phase(Generic[T]):
    """One timed call: wall seconds, its result, and the CPU time around it."""

    seconds: float
    result: T
    other_cpu: float  # share of the machine's CPU other processes used meanwhile
    user_s: float  # this process's CPU seconds, user mode (all threads)
    sys_s: float  # this process's CPU seconds, system mode (the kernel's write path)


class PhaseTimer:
    """Times phases, each started after a garbage collection and after waiting up to
    ``wait_idle`` seconds for other processes to go quiet (0: do not wait)."""

    def __init__(self, wait_idle: float = 0.0) -> None:
        self.wait_idle = wait_idle
        self.busy_waits = 0  # phases that started although the machine stayed busy

    def __call__(self, fn: Callable[[], T], *, not_before: float | None = None) -> Phase[T]:
        """Run ``fn`` once, timed. ``not_before``: a ``time.perf_counter()`` value
        before which it does not start."""
        gc.collect()
        if self.wait_idle > 0 and wait_for_idle(timeout=self.wait_idle) is None:
            self.busy_waits += 1
        if not_before is not None:
            time.sleep(max(0.0, not_before - time.perf_counter()))
        before = cpu_snapshot()
        seconds, result = timed(fn)
        after = cpu_snapshot()
        return Phase(
            seconds,
            result,
            other_cpu_fraction(before, after),
            after.ours - before.ours,
            after.ours_sys - before.ours_sys,
        )

    def warning(self, disturbed: Iterable[str]) -> str | None:
        """The line that says which measurements other processes disturbed, if any."""
        disturbed = list(disturbed)
        if not (disturbed or self.busy_waits):
            return None
        return (
            "WARNING: other processes used > 10% of the CPU during the timed phases of "
            f"{', '.join(disturbed) or '-'}; {self.busy_waits} phases started on a busy "
            "machine after --wait-idle ran out. These numbers are disturbed."
        )


class PythonSteps:
    """Python-bound training steps on the CPU (small in-place ops: each is Python and
    a dispatch, as queuing a kernel is), about 10 ms each on the VM. What a save's
    own threads take from such a thread through the GIL is its *steal*
    (``bench_blocked.py``, ``bench_gil_calls.py``)."""

    def __init__(self) -> None:
        import torch  # only the benchmarks that step need it

        self.xs = [torch.zeros(16) for _ in range(64)]
        self.alone = self.baseline()

    def one(self) -> float:
        t0 = time.perf_counter()
        for _ in range(60):
            for x in self.xs:
                x.add_(1.0)
        return time.perf_counter() - t0

    def baseline(self) -> float:
        """A step's time with nothing else running (median of 15); also kept as ``alone``."""
        self.alone = statistics.median(self.one() for _ in range(15))
        return self.alone

    def until(self, done: Callable[[], bool], at_least: int) -> float:
        """Steps until ``done()`` (at least ``at_least``): seconds beyond ``alone``."""
        extra, n = 0.0, 0
        while n < at_least or not done():
            extra += self.one() - self.alone
            n += 1
        return extra
