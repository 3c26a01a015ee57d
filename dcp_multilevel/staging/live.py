"""The over-budget handshake: which items a save writes from the live state, and when
they are all written.

An async save over its staging budget leaves some tensors live (not copied):
the writer writes those first, straight from the training state, and
``async_save`` returns once they are all in their data files (see
``stager.py``); with ``StagingConfig(overlap=True)`` it returns at once, and
its :class:`LiveFence` (DCP's ``staging_completion``) completes then. The
writer asks its :class:`~.stager.BackgroundSave` which of its plan's items
are live, and counts them down as it writes them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

__all__ = ["LiveCountdown", "LiveFence", "live_items"]


def live_items(
    items: Iterable[WriteItem], planner: SavePlanner, live: frozenset[int]
) -> set[MetadataIndex]:
    """Indexes of the tensor items whose data is still the training state's memory.

    ``live``: storage pointers of the tensors staging left uncopied.
    """
    if not live:
        return set()
    found = set()
    for item in items:
        if item.type != WriteItemType.BYTE_IO:
            data = planner.resolve_data(item)
            if (
                isinstance(data, torch.Tensor)
                and data.numel()
                and data.untyped_storage().data_ptr() in live
            ):
                found.add(item.index)
    return found


class LiveCountdown:
    """Calls ``done`` once every index in ``pending`` was written (thread-safe).

    With nothing pending, ``done`` runs at once.
    """

    def __init__(self, pending: set[MetadataIndex], done: Callable[[], None]) -> None:
        self._pending = set(pending)
        self._done = done
        self._lock = threading.Lock()
        if not self._pending:
            done()

    def written(self, index: MetadataIndex) -> None:
        """The item ``index`` is in its data file (any writing thread)."""
        if not self._pending:
            return
        with self._lock:
            if index not in self._pending:
                return
            self._pending.discard(index)
            last = not self._pending
        if last:
            self._done()


class LiveFence(Future):
    """What ``stage`` returns with ``overlap``: the fence completes once the copies
    are made and, over budget, once the live tensors are written too, yet the
    save's own thread needs the staged dict before it can write them.

    DCP (torch 2.13) uses one future for both: its save thread calls
    ``result()`` first, and ``async_save`` turns the same future's completion
    into ``staging_completion``. So :meth:`result` answers with the staged
    dict as soon as the copies are made (:meth:`hand_over`), while the future
    completes (``set_result``, or :meth:`fail`) then, or, over budget, only
    when the stager sees the live tensors released.

    Call order: stager's copy thread ``hand_over`` (or ``fail``) -> DCP's save
    thread ``result()`` -> stager's copy thread ``complete()`` once released
    (or ``set_exception``). With a device snapshot ``complete()`` comes first,
    once the state was read on the device: DCP's done-callback then asks for
    the result before there is a staged dict (see :meth:`result`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._staged: Future[Any] = Future()
        #: The first thread to ask for the staged dict: DCP's thread for this save.
        self.reader: threading.Thread | None = None
        #: Set once DCP wrapped this future for ``staging_completion``, the last step
        #: of ``async_save`` (torch 2.13): the training thread is about to return.
        self.armed = threading.Event()
        #: Set once the fence is complete, failed or not, and its callbacks ran (DCP's
        #: staging_completion is done then too); waited on without holding the
        #: fence, and through it the staged dict.
        self.completed = threading.Event()
        # The thread running complete(), while the done-callbacks run (see result).
        self._completing: threading.Thread | None = None

    def set_result(self, result: Any) -> None:
        """As ``Future``'s, then sets :attr:`completed`."""
        super().set_result(result)
        self.completed.set()

    def set_exception(self, exception: BaseException | None) -> None:
        """As ``Future``'s, then sets :attr:`completed`."""
        super().set_exception(exception)
        self.completed.set()

    def add_done_callback(self, fn: Callable[[Future[Any]], object]) -> None:
        """As ``Future``'s, and sets :attr:`armed`."""
        super().add_done_callback(fn)
        self.armed.set()

    def hand_over(self, staged: Any) -> None:
        """The copies are made: the save's thread may take ``staged`` and write."""
        self._staged.set_result(staged)

    def complete(self) -> None:
        """The state may change now (once; later calls do nothing)."""
        if not self.done():
            self._completing = threading.current_thread()
            try:
                self.set_result(None)
            finally:
                self._completing = None

    def fail(self, error: BaseException) -> None:
        """The copies failed: the fence (unless already complete: a check after a
        device snapshot) and then the save's thread raise ``error`` (the fence
        first: once the save failed, ``staging_completion`` is done too)."""
        if not self.done():
            self.set_exception(error)
        self._staged.set_exception(error)

    def result(self, timeout: float | None = None) -> Any:
        """The staged dict, once the copies are made (not once the fence is done);
        raises the fence's error once it failed. Asked from a done-callback while
        :meth:`complete` runs, it answers None at once."""
        if threading.current_thread() is self._completing:
            # DCP's callback turning the fence into staging_completion asks for the
            # result, on the thread completing it. With a device snapshot that is
            # before the copies to the host are made, by this very thread: waiting
            # for the staged dict would never end. The callback only needs success.
            return None
        if self.reader is None:
            self.reader = threading.current_thread()
        if self.done() and (error := self.exception(0)) is not None:
            raise error
        return self._staged.result(timeout)
