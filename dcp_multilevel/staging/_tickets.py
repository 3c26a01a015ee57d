"""Tickets: one per async save, from ``Stager.stage`` until its background part ends.

Life of a ticket, and which thread moves it on::

    training thread     created by Stager.stage (stager_thread); its staged dict is
                        handed to DCP
    background thread   claimed: ``thread`` is set once, under the stager's lock, by
                        the thread that runs the save (Stager.claim from the writer's
                        first call, or pickling of the staged dict in PROCESS mode);
                        from the writer's first call to its finish, its current
                        CUDA streams follow the ticket's ``marks``
                        ``released`` set once the live tensors are no longer read
    any                 done: the claiming thread ended, or DCP dropped the staged
                        dict (``dropped``, set by a weakref finalizer)

Each ``async_save`` runs on a fresh thread of its own (DCP starts a
single-thread executor per save and shuts it down after), so the claiming
thread ending means the save ended, whether it failed or not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..checkpoint.streams import StreamMarks
from .buffers import iter_tensors, pool_source

__all__ = ["POLL_S", "StagedDict", "Ticket", "claimed_by", "mark_dropped", "uncopied_storages"]

#: Poll interval while waiting for a ticket that no thread has claimed yet.
POLL_S = 0.005


def _nothing() -> None:
    pass


class Ticket:
    """One async save: its place in line, its live tensors, who runs it.

    Args:
        seq: position among this stager's saves (saves commit in this order).
        checkpoint_id: the writer's location when it was staged (for messages).
    """

    def __init__(self, seq: int, checkpoint_id: str) -> None:
        self.seq = seq
        self.checkpoint_id = checkpoint_id
        #: Over budget: some tensors stay live and are written from the training
        #: state (see ``Stager.synchronize``); set when the wave is chosen, before
        #: the staged dict is handed over.
        self.write_through = False
        #: Storage pointers of those live tensors: set when the snapshot is laid
        #: out, before the save's thread can claim the ticket.
        self.live: frozenset[int] = frozenset()
        #: The thread that staged it: a claim from this thread is a synchronous save.
        self.stager_thread = threading.current_thread()
        #: The thread running its background part (None: not claimed yet).
        self.thread: threading.Thread | None = None
        self.dropped = False
        #: The save no longer reads the live tensors: every one is written, or
        #: its write_data ended (released training either way).
        self.released = threading.Event()
        #: With the fence check: raises StagingFenceError once the live tensors are
        #: written if one changed since it was staged (``copies.check_live``).
        self.check_live: Callable[[], None] | None = None
        #: Where the GPU work that wrote the state ends (recorded by ``stage``).
        self.marks = StreamMarks()
        #: Puts back the claiming thread's CUDA streams (``StreamMarks.adopt``).
        self.restore_streams: Callable[[], None] = _nothing

    @property
    def claimed(self) -> bool:
        """Its background part began (a thread claimed it)."""
        return self.thread is not None

    def done(self) -> bool:
        """Nothing of this save runs any more: its buffers may be reused."""
        return self.dropped or (self.thread is not None and not self.thread.is_alive())

    def wait_claimed(self, deadline: float) -> bool:
        """Wait until claimed or done; False if ``deadline`` (monotonic) passed first."""
        while not (self.claimed or self.done()):
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def wait_done(self, deadline: float) -> bool:
        """Wait until done; False if ``deadline`` (monotonic) passed first."""
        while not self.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.thread is not None:
                self.thread.join(min(left, 0.1))
            else:
                time.sleep(min(left, POLL_S))
        return True


class StagedDict(dict):
    """The staged copy handed to DCP; weak-referenceable, so that its release is seen.

    Pickled (PROCESS mode) it becomes a plain dict. Pickling runs on the
    background thread that sends the save to DCP's daemon process, first
    calling ``on_send(ticket)``: that is how that thread claims the save.
    """

    __slots__ = ("__weakref__", "_on_send", "_ticket")

    def __init__(
        self, items: dict[Any, Any], ticket: Ticket, on_send: Callable[[Ticket], None]
    ) -> None:
        super().__init__(items)
        self._ticket = ticket
        self._on_send = on_send

    def __reduce__(self):
        self._on_send(self._ticket)
        return (dict, (dict(self),))


def uncopied_storages(state: Any, staged: Any) -> frozenset[int]:
    """Storage pointers of the tensors ``staged`` still shares with ``state``."""
    # A staged value that is the very object of the live state was not copied.
    live = {id(t) for t in iter_tensors(state)}
    kept = [
        src if (src := pool_source(t)) is not None else t
        for t in iter_tensors(staged)
        if id(t) in live
    ]
    return frozenset(t.untyped_storage().data_ptr() for t in kept if t.numel())


def claimed_by(tickets: list[Ticket], thread: threading.Thread) -> Ticket | None:
    """The ticket among ``tickets`` that ``thread`` claimed and DCP has not dropped."""
    # A save DCP dropped is over even if its thread lives on (an executor that
    # reused its thread for the next save would otherwise find the old ticket).
    return next((t for t in tickets if t.thread is thread and not t.dropped), None)


def mark_dropped(ticket: Ticket) -> None:
    """The staged dict's finalizer: DCP dropped it, so no save follows."""
    ticket.dropped = True
