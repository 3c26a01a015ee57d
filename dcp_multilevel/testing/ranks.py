"""Run a function on several real ``torch.distributed`` (gloo, CPU) processes.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` new processes,
forked from a fork server that has imported torch and dcp_multilevel once
(``forkserver`` start method with a preload): a new interpreter per rank
would import them again, most of a short test's CPU time per rank.
Each rank still is a process of its own, with the parent's current
environment (sent along, since the fork server keeps the one it started
with), and has never run a collective or opened a process group before
``fn``. Each one joins a gloo process group rendezvousing through a ``FileStore`` in a
private temporary directory (no TCP port to pick, so no port race between
tests running side by side), calls ``fn(rank, world_size, *args)``, destroys
the group and reports back. The return values come back as a list indexed by
rank. Any rank that raises, dies, or does not finish in time fails the call
with :class:`RankError`, whose message holds every failing rank's traceback.

``fn`` and ``args`` cross a process boundary: ``fn`` must be a module-level
function and ``args`` picklable (each child imports the module that defines
``fn``, as with the ``spawn`` start method).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["RankError", "RankTimeoutError", "run_ranks"]

#: After the first rank fails, how long the others get to report before they
#: are killed. Survivors usually fail fast (gloo sees the peer's sockets close),
#: but one blocked in a collective on a live peer would wait out the whole
#: process-group timeout.
FAILURE_GRACE_S = 10.0

#: A child that exited without a report is declared dead after this long: its
#: report, if any, may still be in the queue's pipe when we see the exit code.
_DEAD_AFTER_S = 2.0

#: What the fork server imports before it forks any rank (see the module docstring).
#: It imports nothing that starts threads: forking a process with threads running
#: would copy their locks in whatever state they were.
_PRELOAD = ["torch", "torch.distributed.checkpoint", "dcp_multilevel"]

# Gloo binds to the address the host name resolves to; on CI boxes without a
# resolvable host name that fails. Every rank is on this machine: use loopback.
_LOOPBACK = {"linux": "lo", "darwin": "lo0"}


class RankError(AssertionError):
    """One or more ranks failed; ``failures`` maps rank -> traceback text."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


class RankTimeoutError(RankError, TimeoutError):
    """Some ranks did not finish within the timeout (no rank reported a failure)."""


def _child(
    rank: int,
    *,
    world_size: int,
    store_path: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    reports: Any,
    env: dict[str, str],
) -> None:
    """Entry point of one rank: join the group, run ``fn``, report."""
    # The fork server's environment is the parent's at the server's start, not now.
    os.environ.clear()
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            # Collectives give up before the parent's hard deadline, so a hang
            # usually surfaces as a traceback rather than a kill.
            timeout=timedelta(seconds=timeout),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Pickle once here so an unpicklable result fails this rank with a
        # traceback instead of dying silently in the queue's feeder thread (the
        # queue pickles it again: these are this harness's own processes).
        ForkingPickler.dumps(value)
    # Report everything, CheckpointException (a BaseException) included: the
    # parent turns it into the test failure.
    except BaseException:  # noqa: BLE001
        reports.put((rank, False, traceback.format_exc()))
    else:
        reports.put((rank, True, value))


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Args:
        fn: module-level function run by every rank inside an initialized
            default process group.
        world_size: number of processes.
        *args: extra picklable arguments, the same for every rank.
        timeout: seconds for the whole run, process start-up included; also
            the process group's collective timeout.

    Returns:
        ``fn``'s return value of each rank, indexed by rank.

    Raises:
        RankError: a rank raised or died; the message has every traceback.
        RankTimeoutError: a rank was still running at the deadline.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    iface = _LOOPBACK.get(sys.platform)
    if iface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)  # sent to the children with env
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (first call)
    reports = ctx.Queue()
    name = getattr(fn, "__qualname__", repr(fn))
    with tempfile.TemporaryDirectory(prefix="dcp-ml-ranks-") as tmp:
        store_path = os.path.join(tmp, "filestore")
        procs = [
            ctx.Process(
                target=_child,
                args=(rank,),
                kwargs={
                    "world_size": world_size,
                    "store_path": store_path,
                    "timeout": timeout,
                    "fn": fn,
                    "args": args,
                    "reports": reports,
                    "env": dict(os.environ),
                },
                name=f"{name}-rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        grace = 0.0  # a rank still running when we stop waiting is killed at once
        try:
            for p in procs:
                p.start()
            values, failures, missing = _collect(procs, reports, time.monotonic() + timeout)
            if not missing:
                grace = 5.0  # every rank reported: let them exit on their own
        finally:
            _stop(procs, grace)
            reports.close()
            reports.join_thread()

    header = f"{name} on {world_size} rank(s)"
    if failures:
        parts = [f"rank {r} failed:\n{text}" for r, text in failures.items()]
        if missing:
            parts.append(f"ranks {missing} were killed after the failure above (still running)")
        raise RankError(f"{header}: " + "\n".join(parts), failures)
    if missing:
        raise RankTimeoutError(
            f"{header}: ranks {missing} did not finish within {timeout:g} s (hang?)", {}
        )
    return [values[r] for r in range(world_size)]


def _collect(
    procs: list[Any], reports: Any, deadline: float
) -> tuple[dict[int, Any], dict[int, str], list[int]]:
    """Wait for every rank's report; returns (values, failures, unreported ranks)."""
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}  # in order of arrival: the first is usually the cause
    dead_since: dict[int, float] = {}
    while len(values) + len(failures) < len(procs):
        now = time.monotonic()
        if now >= deadline:
            break
        try:
            rank, ok, payload = reports.get(timeout=min(0.2, deadline - now))
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank in values or rank in failures or p.exitcode is None:
                    continue
                first_seen = dead_since.setdefault(rank, time.monotonic())
                if time.monotonic() - first_seen > _DEAD_AFTER_S:
                    failures[rank] = (
                        f"process exited with code {p.exitcode} without reporting "
                        "(a negative code is the signal that killed it)\n"
                    )
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            continue
        if ok:
            values[rank] = payload
        else:
            failures[rank] = payload
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    missing = [r for r in range(len(procs)) if r not in values and r not in failures]
    return values, failures, missing


def _stop(procs: list[Any], grace: float) -> None:
    """Give children ``grace`` seconds to exit, then terminate (and kill) the rest."""
    started = [p for p in procs if p.pid is not None]
    deadline = time.monotonic() + grace
    for p in started:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in started:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
