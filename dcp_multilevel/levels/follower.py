"""After a save: what every rank does once the first level committed it, in save order.

DCP calls the writer's ``finish`` (the commit) on its coordinator only: the
other ranks never hear from DCP that a save committed, yet each must send
its own files on to the higher levels. :class:`Follower` tells them, and runs
what follows a commit on every rank alike, in save order, in one background
thread per runtime (the follower):

- each save has a :class:`SaveTicket`, begun when DCP starts the save (the
  writer's ``storage_meta``, every rank) and numbered in the order saves
  begin: the same number on every rank, since a process runs the saves of
  one level list one at a time (an async save is finished before the next
  one starts, as DCP's ``async_save`` expects);
- its outcome is published once through the c10d store under
  ``dcp_multilevel/runtime/<runtime>/<n>/end``: ``committed`` by rank 0 right after
  its commit (inside ``finish``: before any rank's ``dcp.save`` returns), or
  ``failed`` by a rank whose part failed (its ``write_data``, rank 0's
  ``finish``) before it raises;
- the follower waits for its oldest ticket's outcome; for a committed save
  rank 0 decides what follows (``decide``: which drains, first-level
  retention) and publishes it under ``.../<n>/decision``; every rank then
  applies it (``apply``), so the same drains are submitted in the same order
  everywhere.

Each rank counts itself under ``.../<n>/applied`` once it applied a save;
rank 0 removes the save's values from the store once every rank has, so the
store keeps none per save.

A failure the writer sees in any of its calls (planning included: the
coordinator's ``prepare_global_plan`` refusing to overwrite) is published as
``failed`` like a failed write. A ticket whose save ended without an outcome
(a planner or a peer failed outside the writer) is dropped once its DCP call
is known to be over: when the next save begins, when the thread that began
it has ended (DCP runs each ``async_save`` on a thread of its own, which
ends with the save), or at :meth:`Follower.abandon` for the saves of the
calling thread (``wait`` after a synchronous ``dcp.save``). The follower
never uses the trainer's process group (see ``_dist.py``); without one, or
with one rank, nothing goes through the store.

No wait here is without a bound: :meth:`Follower.settle` and the follower's
wait for rank 0's decision give up after ``timeout_s`` with a
:class:`~dcp_multilevel.errors.WaitTimeoutError` naming the steps and the
rank, and a follower that cannot join in ``timeout_s`` at close is logged.

Call order::

    ticket = commits.begin(step, due, reference, count)   every rank, as DCP starts a save
    commits.written(ticket)                                every rank: its write_data succeeded
    commits.failed(ticket, error)                          a rank whose part failed
    commits.committed(ticket)                              rank 0, after the commit
    commits.settle(ticket, timeout_s)                      any thread: wait until applied
    commits.abandon()                                      wait(): drop this thread's dead saves
    commits.close()
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import _dist
from .._phases import reached
from ..errors import (
    BrokenChainError,
    CorruptCheckpointError,
    DcpMultilevelError,
    WaitTimeoutError,
)
from .dispatch import Sent

__all__ = ["Follower", "SaveTicket"]

logger = logging.getLogger(__name__)

#: How often, at most, the follower looks for an outcome another rank publishes (a
#: store ``wait`` that times out would log a warning from c10d every time).
_POLL_MAX_S = 0.05

#: How often the follower looks whether the thread that began a save without an
#: outcome has ended (nothing notifies it when a thread ends).
_THREAD_POLL_S = 0.05


@dataclass(eq=False)
class SaveTicket:
    """One save of a runtime, as this rank follows it (see the module docstring).

    The follower and the saving threads share it: ``state``, ``over``,
    ``outcome`` and ``done`` change under the follower's condition only.
    """

    seq: int  # the runtime's n-th save in this process: the same n on every rank
    step: int
    due: tuple[int, ...]  # the higher levels the step is due on
    reference: int | None  # the first-level step its deltas are coded against
    count: int  # saves of the level list so far, this one included (``every`` counts them)
    #: The thread that began it: DCP's thread for an async save, which ends with the save.
    thread: threading.Thread = field(default_factory=threading.current_thread)
    state: str = "begun"  # begun -> written -> committed | failed
    over: bool = False  # its DCP call has ended on this rank
    outcome: str | None = None  # once settled: "committed", "failed" or "dropped"
    why: str | None = None  # why it failed
    reference_failed: bool = False  # it failed because its delta reference did
    quarantine: str | None = None  # committed quarantined: why (``format/health.py``)
    committed_unix: float = 0.0
    sent: Sent = field(default_factory=Sent)  # where the follower sent the step
    #: Seconds the follower spent deciding and applying (retention, policy "wait").
    seconds: float = 0.0
    done: bool = False

    def ended(self) -> bool:
        """Its DCP call is over on this rank (known over, or its thread has ended)."""
        return self.over or not self.thread.is_alive()

    def describe(self) -> str:
        return f"step {self.step} (save {self.seq} of the levels, {self.state})"


class Follower:
    """The follower of one runtime (see the module docstring).

    Args:
        key: names the runtime's values in the c10d store (the same on every rank).
        timeout_s: how long a rank waits for rank 0's decision.
        decide: rank 0, the follower's thread: ``decide(ticket)`` for a committed save,
            a JSON value every rank applies.
        apply: every rank, the follower's thread: ``apply(ticket, decision)`` once
            its outcome is known (``decision`` None unless it committed).
        name: the levels, for messages.
    """

    def __init__(
        self,
        key: str,
        timeout_s: float,
        decide: Callable[[SaveTicket], dict[str, Any]],
        apply: Callable[[SaveTicket, dict[str, Any] | None], None],
        name: str | None = None,
    ) -> None:
        self.key = key
        #: The levels, in messages (``key`` when not given).
        self.name = name or key
        self.timeout_s = timeout_s
        self._decide = decide
        self._apply = apply
        # Guards the queue, the tickets' states and `_closed`: saving threads begin
        # and end tickets while the follower waits on them. Callbacks and store
        # calls never run under it.
        self._cond = threading.Condition()
        self._queue: deque[SaveTicket] = deque()  # begun, not yet applied; oldest first
        self._seq = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._unswept: deque[SaveTicket] = deque()  # rank 0: applied, values still stored

    @property
    def _shared(self) -> bool:
        return _dist.world_size() > 1

    def _path(self, ticket: SaveTicket, what: str) -> str:
        return f"dcp_multilevel/runtime/{self.key}/{ticket.seq}/{what}"

    # ------------------------------------------------------------------ saving threads

    def begin(
        self, step: int, due: tuple[int, ...], reference: int | None, count: int
    ) -> SaveTicket:
        """A save of ``step`` starts on this rank; the saves begun before it are over."""
        with self._cond:
            if self._closed:
                raise DcpMultilevelError(f"the levels are closed: step {step} cannot be saved")
            for older in self._queue:
                older.over = True
            ticket = SaveTicket(self._seq, step, tuple(due), reference, count)
            self._seq += 1
            self._queue.append(ticket)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, daemon=True, name=f"dcp-ml-commits-{self.key}"
                )
                self._thread.start()
            self._cond.notify_all()
        return ticket

    def written(self, ticket: SaveTicket) -> None:
        """This rank's ``write_data`` succeeded: the outcome is up to the others now."""
        with self._cond:
            if ticket.state == "begun":
                ticket.state = "written"
                self._cond.notify_all()

    def failed(self, ticket: SaveTicket, error: BaseException) -> None:
        """This rank's part of the save failed: tell every rank (before raising)."""
        why = f"{type(error).__name__}: {error}"
        reference = isinstance(error, (BrokenChainError, CorruptCheckpointError))
        self._end(ticket, {"end": "failed", "why": why, "reference": reference})

    def committed(self, ticket: SaveTicket) -> None:
        """Rank 0: the first level committed the save (quarantined: ``ticket.quarantine``
        says why, and every rank hears it)."""
        value: dict[str, Any] = {"end": "committed", "unix": time.time()}
        if ticket.quarantine is not None:
            value["quarantine"] = ticket.quarantine
        self._end(ticket, value)

    def _end(self, ticket: SaveTicket, value: dict[str, Any]) -> None:
        if self._shared:
            # Published before this rank returns or raises: when any rank's dcp.save
            # is over, the outcome of its save is there for every rank to read.
            _dist.store_set(self._path(ticket, "end"), value)
        with self._cond:
            self._take_end(ticket, value)
            self._cond.notify_all()

    @staticmethod
    def _take_end(ticket: SaveTicket, value: dict[str, Any]) -> None:
        """Under the condition: ``ticket``'s published outcome."""
        ticket.state = value["end"]
        ticket.why = value.get("why")
        ticket.reference_failed = bool(value.get("reference"))
        ticket.quarantine = value.get("quarantine", ticket.quarantine)
        ticket.committed_unix = float(value.get("unix", time.time()))

    # ------------------------------------------------------------------ any thread

    def settle(self, ticket: SaveTicket | None = None, timeout_s: float | None = None) -> None:
        """Wait until ``ticket`` (None: every save begun so far) has been applied.

        Raises:
            WaitTimeoutError: not applied within ``timeout_s`` (None: the follower's
                ``timeout_s``), naming the saves still open.
        """
        bound = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        with self._cond:
            targets = [ticket] if ticket is not None else list(self._queue)
            while not all(t.done for t in targets) and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    open_ = ", ".join(t.describe() for t in targets if not t.done)
                    raise WaitTimeoutError(
                        f"rank {_dist.rank()} waited {bound:g} s for the outcome of {open_} "
                        f"on the levels {self.name}, in vain: a save that neither committed "
                        "nor failed on every rank (a rank stopped in it?). Raise the bound "
                        "(DCP_ML_TIMEOUT_S) if saves take longer"
                    )
                self._cond.wait(left)

    def abandon(self) -> None:
        """The calling thread's saves are over (its ``dcp.save`` calls have returned):
        a save of it that never got an outcome never will."""
        me = threading.current_thread()
        with self._cond:
            for ticket in self._queue:
                if ticket.thread is me:
                    ticket.over = True
            self._cond.notify_all()

    def pending(self) -> list[SaveTicket]:
        """The saves begun and not yet applied, oldest first."""
        with self._cond:
            return list(self._queue)

    def close(self) -> None:
        """Stop the follower once the saves begun are applied (or dropped)."""
        with self._cond:
            for ticket in self._queue:
                ticket.over = True
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.timeout_s)
            if thread.is_alive():
                logger.error(
                    "dcp_multilevel: the follower of the levels %s did not stop within %g s; "
                    "left open: %s",
                    self.name,
                    self.timeout_s,
                    ", ".join(t.describe() for t in self.pending()),
                )

    # ------------------------------------------------------------------ the follower

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                ticket = self._queue[0]
            outcome = self._outcome(ticket)
            if outcome == "committed":
                reached("commit", ticket.step)
            t0 = time.perf_counter()
            try:
                decision = self._decision(ticket) if outcome == "committed" else None
                self._apply(ticket, decision)
            except Exception as e:  # noqa: BLE001 - the follower must go on to the next save
                logger.error(
                    "dcp_multilevel: after step %d: %s: %s", ticket.step, type(e).__name__, e
                )
            if self._shared:
                self._sweep(ticket)
            with self._cond:
                ticket.outcome = outcome
                ticket.seconds = time.perf_counter() - t0
                ticket.done = True
                self._queue.popleft()
                self._cond.notify_all()

    def _outcome(self, ticket: SaveTicket) -> str:
        """Wait for ``ticket``'s outcome: "committed", "failed" or "dropped"."""
        delay = 0.002
        while True:
            with self._cond:
                if ticket.state in ("committed", "failed"):
                    return ticket.state
                if ticket.state == "begun" or not self._shared:
                    if ticket.ended():
                        return "dropped"
                    self._cond.wait(_THREAD_POLL_S)
                    continue
                over = ticket.ended()
            # Written here; the outcome comes from another rank, through the store.
            value = _dist.store_get_nowait(self._path(ticket, "end"))
            with self._cond:
                if value is not None:
                    self._take_end(ticket, value)
                    continue
                if over:  # its call is over and no rank published an outcome
                    return "dropped"
                self._cond.wait(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    def _sweep(self, ticket: SaveTicket) -> None:
        """Count ``ticket`` applied on this rank; rank 0 removes the values of the saves
        every rank has applied (none of them reads those any more)."""
        try:
            _dist.store_add(self._path(ticket, "applied"), 1)
            if _dist.rank() != 0:
                return
            self._unswept.append(ticket)
            world = _dist.world_size()
            while (
                self._unswept
                and _dist.store_add(self._path(self._unswept[0], "applied"), 0) >= world
            ):
                old = self._unswept.popleft()
                for what in ("end", "decision", "applied"):
                    _dist.store_delete(self._path(old, what))
        except RuntimeError as e:  # housekeeping: a store that cannot delete keeps them
            logger.debug(
                "dcp_multilevel: the store keeps the values of step %d: %s", ticket.step, e
            )

    def _decision(self, ticket: SaveTicket) -> dict[str, Any]:
        """Rank 0's decision for a committed save, on every rank."""
        key = self._path(ticket, "decision")
        if _dist.rank() == 0:
            try:
                value = self._decide(ticket)
            except Exception as e:  # noqa: BLE001 - every rank must hear of it
                value = {"error": f"{type(e).__name__}: {e}"}
            if self._shared:
                _dist.store_set(key, value)
            return value
        (value,) = _dist.store_wait_get([key], self.timeout_s)
        return value
