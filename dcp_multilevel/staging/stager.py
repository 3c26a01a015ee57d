"""Async-save staging: a bounded, reused host buffer pool behind DCP's stager protocol.

``dcp.async_save(sd, storage_writer=W)`` uses ``W`` as its stager when ``W`` is
an :class:`~torch.distributed.checkpoint.staging.AsyncStager`. Order of calls
(torch 2.13, every rank, see ``state_dict_saver.async_save``)::

    training thread   W.stage(sd)              copy sd into a free buffer set, return the copy
                      executor.execute_save()  hand the copy to a background thread/process
                      W.synchronize_staging()  returns (over budget: once live data is written)
    background        THREAD:  W.reset() ... W.write_data() -> W.finish() on this object
                      PROCESS: the copy and W are pickled to DCP's daemon process,
                               which runs the same save on its copy of W

Buffers: at most two sets (double buffering: save N is written from one while
save N+1 stages into the other), each a flat host tensor allocated once and
reused; tensors are staged with ``copy_`` into views of it (touched memory is
~8x faster to fill than fresh memory, which is what ``clone()`` gets).

In flight: at most one save is written at a time per writer; one more may be
staged and queued behind it. A third ``async_save`` while both sets are taken
waits (``in_flight="wait"``) or raises :class:`SaveInFlightError`
(``"raise"``). A queued save's background part waits for the earlier one
before its first collective, so saves commit in order.

Budget: the pool never holds more than ``budget_bytes``. A state that does not
fit is saved in two waves: the largest tensors that fit are staged, the others
stay live. The writer writes the live ones first, straight from the training
state, and ``async_save`` returns once they are written; the staged wave is
written in the background. Extra memory stays within the budget plus the
writer's chunk. Live tensors need THREAD mode: with PROCESS the whole staged
copy must cross to the daemon process.

Failures: a background failure raises in the future DCP returns and, once, from
the next ``async_save`` with this writer (:class:`AsyncSaveError`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from ..errors import AsyncSaveError, ConfigError, SaveInFlightError
from ._priority import lower_thread_priority
from .buffers import HostBufferPool, copy_into, iter_tensors, select_wave, staged_nbytes
from .config import StagingConfig

__all__ = ["AsyncStagingMixin", "background_step"]

logger = logging.getLogger(__name__)

#: Bytes of the shared failure record a PROCESS-mode daemon copy writes into.
_STATUS_BYTES = 4096
#: Thread names of DCP 2.13's THREAD and PROCESS executors (one fresh thread per save).
_EXECUTOR_PREFIXES = ("AsyncCheckpointExecutor", "ThreadPoolExecutor")
#: How long a queued save waits for the one before it to be picked up.
_POLL_S = 0.005


# --------------------------------------------------------------------------- tickets


class _Ticket:
    """One async save: its buffer set, and who runs it in the background.

    ``thread`` is the background thread running the save (THREAD mode) or
    sending it to DCP's daemon process (PROCESS mode): each async_save gets a
    fresh single-thread executor that exits after the save, so the thread
    ending means the save finished, whether it failed or not.
    """

    def __init__(self, seq: int, write_through: bool) -> None:
        self.seq = seq
        self.write_through = write_through
        self.stager_thread = threading.current_thread()
        self.thread: threading.Thread | None = None
        self.started = False  # its background part began (reset / pickling)
        self.dropped = False  # DCP let go of the staged dict
        self.written = threading.Event()  # this rank's write_data returned
        #: Storage pointers of the tensors written through from the live state.
        self.live: frozenset[int] = frozenset()
        self.live_written = threading.Event()  # every live tensor is in its data file

    def claimed(self) -> bool:
        return self.thread is not None or self.dropped

    def done(self) -> bool:
        return self.dropped or (self.thread is not None and not self.thread.is_alive())

    def wait_done(self, deadline: float) -> bool:
        while not self.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.thread is not None:
                self.thread.join(min(left, 0.1))
            else:
                time.sleep(min(left, _POLL_S))
        return True


class _StagedDict(dict):
    """The staged copy handed to DCP; weak-referenceable, so its release is seen.

    Pickled (PROCESS mode) it becomes a plain dict; pickling happens in the
    background thread that sends it, which is how that thread is identified.
    """

    __slots__ = ("__weakref__", "_stager", "_ticket")

    def __reduce__(self):
        stager, ticket = self._stager, self._ticket
        # Claim first: the sending thread ending then marks this save done either way.
        stager._claim(ticket)
        if ticket.write_through:
            raise ConfigError(
                "this state does not fit the staging budget and is written through from "
                "the live tensors, which needs AsyncCheckpointerType.THREAD; with PROCESS the "
                "whole staged copy must fit: raise StagingConfig(budget_bytes=...)"
            )
        return (dict, (dict(self),))


# --------------------------------------------------------------------------- the mixin


class _StagingState:
    def __init__(self, config: StagingConfig) -> None:
        pin = config.pin_memory if config.pin_memory is not None else torch.cuda.is_available()
        self.config = config
        self.pool = HostBufferPool(config.budget_bytes, pin=pin, shared=config.shared_memory)
        self.lock = threading.Lock()
        self.tickets: list[_Ticket] = []
        self.seq = 0
        self.failure: str | None = None
        # Written by a PROCESS-mode daemon copy of the writer (shared memory).
        self.status = torch.zeros(_STATUS_BYTES, dtype=torch.uint8).share_memory_()
        # copy_ releases the GIL: while the training thread waits for staging anyway,
        # more cores copy (threads exit with the process).
        self.copier = (
            ThreadPoolExecutor(config.copy_threads, thread_name_prefix="dcp-ml-stage")
            if config.copy_threads > 1
            else None
        )


class AsyncStagingMixin(AsyncStager):
    """DCP's :class:`AsyncStager` protocol over a :class:`HostBufferPool` (see module docs).

    A host class calls ``_init_staging(config)`` in ``__init__``,
    ``_claim_for_background()`` first thing in ``reset``, and wraps
    ``write_data`` and ``finish`` with :func:`background_step`.
    """

    _synchronize_after_execute = True
    #: Attributes dropped when the writer is pickled to DCP's daemon process.
    _transient_attrs: tuple[str, ...] = ("_staging",)

    def _init_staging(self, config: StagingConfig | None) -> None:
        self._staging_config = config or StagingConfig()
        self._staging: _StagingState | None = None
        self._status: torch.Tensor | None = None  # set in a daemon copy only
        self._current: _Ticket | None = None
        self._threads_before: tuple[threading.Thread, ...] = ()

    @property
    def staging_pool(self) -> HostBufferPool | None:
        """The buffer pool (None before the first async save)."""
        return self._staging.pool if self._staging is not None else None

    # -- training thread

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into a free buffer set; see the module docs."""
        st = self._staging
        if st is None:
            if self._status is not None:
                raise ConfigError("a daemon-process copy of the writer cannot stage")
            st = self._staging = _StagingState(self._staging_config)
            self._status = st.status
        self._raise_failure(st)
        cfg = st.config
        deadline = time.monotonic() + cfg.wait_timeout_s
        # The save before must have started in the background before this one is
        # queued: DCP's PROCESS executor starts its daemon on the first save, and a
        # second save submitted meanwhile would start another one.
        for t in list(st.tickets):
            while not t.started and not t.done():
                if time.monotonic() > deadline:
                    raise SaveInFlightError(self._busy_message("never started", cfg))
                time.sleep(_POLL_S)
        nbytes = staged_nbytes(state_dict)
        wave: set[int] | None = None  # None: stage every tensor
        if not st.pool.fits(nbytes):
            # Two waves: what the budget holds is staged; the rest is written
            # first, straight from the live tensors, while this thread waits.
            wave, nbytes = select_wave(state_dict, st.pool.budget_bytes or 0)
        write_through = wave is not None
        buffers = None
        while nbytes:
            with st.lock:
                st.tickets = [t for t in st.tickets if not t.done()]
                buffers = st.pool.try_acquire(nbytes)
            if buffers is not None:
                break
            if cfg.in_flight == "raise":
                raise SaveInFlightError(self._busy_message("is still being written", cfg))
            oldest = st.tickets[0] if st.tickets else None
            if oldest is None:
                time.sleep(_POLL_S)
            if (oldest is None or not oldest.wait_done(deadline)) and time.monotonic() > deadline:
                raise SaveInFlightError(self._busy_message("did not finish in time", cfg))
        st.seq += 1
        ticket = _Ticket(st.seq, write_through)
        flat = buffers.flat if buffers is not None else None
        staged = _StagedDict(copy_into(state_dict, flat, st.copier, only=wave))
        if write_through:
            ticket.live = _uncopied_storages(state_dict, staged)
        staged._ticket = ticket
        staged._stager = self
        if buffers is not None:
            buffers.owner = ticket
        weakref.finalize(staged, _mark_dropped, ticket)
        with st.lock:
            st.tickets.append(ticket)
        self._current = ticket
        self._threads_before = tuple(threading.enumerate())
        return staged

    def synchronize_staging(self) -> None:
        """Called by ``async_save`` right after it submitted the save.

        Identifies the background thread DCP just started for this save (each
        async_save starts one), and blocks an over-budget save until its live tensors are written.
        """
        t, st = self._current, self._staging
        if t is None or st is None:
            return
        if t.thread is None:
            new = [x for x in threading.enumerate() if x not in self._threads_before]
            if len(new) > 1:  # another thread started meanwhile: keep DCP's executors
                new = [x for x in new if x.name.startswith(_EXECUTOR_PREFIXES)]
            if len(new) == 1:
                t.thread = new[0]
        self._threads_before = ()
        if t.write_through:
            # Released once every live tensor is written (the writer's
            # live-first order), or when the whole write ended.
            while not (t.live_written.wait(0.05) or t.written.is_set()):
                if t.done():
                    break

    def close(self) -> None:
        """Free the buffers no save is using; the writer can still be used after."""
        if self._staging is not None:
            with self._staging.lock:
                self._staging.pool.close()

    # -- background

    def _claim_for_background(self) -> None:
        """Called first in ``reset``: wait for this writer's earlier saves.

        In a DCP executor thread that ``synchronize_staging`` did not identify
        (not expected), take the oldest unclaimed save.
        """
        st = self._staging
        if st is None:
            return
        me = threading.current_thread()
        with st.lock:
            mine = next((t for t in st.tickets if t.thread is me), None)
            if mine is None:
                mine = next((t for t in st.tickets if not t.claimed()), None)
                if mine is not None and mine.stager_thread is me:
                    mine = None  # a synchronous dcp.save on the training thread
                elif mine is not None:
                    mine.thread = me
            if mine is not None:
                mine.started = True
        self._wait_for_earlier(mine)

    def _claim(self, ticket: _Ticket) -> None:
        """Pickling to DCP's daemon (PROCESS): the sending thread runs this save."""
        if ticket.thread is None:
            ticket.thread = threading.current_thread()
        ticket.started = True
        self._wait_for_earlier(ticket)

    def _wait_for_earlier(self, ticket: _Ticket | None) -> None:
        st = self._staging
        deadline = time.monotonic() + st.config.wait_timeout_s
        with st.lock:
            earlier = [t for t in st.tickets if ticket is None or t.seq < ticket.seq]
        for t in earlier:
            if t is not ticket and not t.wait_done(deadline):
                raise SaveInFlightError(self._busy_message("did not finish in time", st.config))

    def _ticket_of_this_thread(self) -> _Ticket | None:
        st = self._staging
        if st is None:
            return None
        me = threading.current_thread()
        with st.lock:
            return next((t for t in st.tickets if t.thread is me), None)

    def _live_storages(self) -> frozenset[int]:
        """Storage pointers of live tensors this thread's save writes through (or none)."""
        t = self._ticket_of_this_thread()
        return t.live if t is not None else frozenset()

    def _note_live_written(self) -> None:
        """The writer wrote every live tensor: the training thread may go on."""
        t = self._ticket_of_this_thread()
        if t is not None:
            t.live_written.set()

    def _note_failure(self, step: str, exc: BaseException, ticket: _Ticket | None) -> None:
        text = f"{step} failed on rank {getattr(self, 'rank', '?')}: {type(exc).__name__}: {exc}"
        if self._staging is None and self._status is not None:
            # A daemon-process copy: tell the training process through shared memory.
            raw = text.encode("utf-8", "replace")[: _STATUS_BYTES - 8]
            self._status[8 : 8 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            self._status[4:8] = torch.tensor([len(raw)], dtype=torch.int32).view(torch.uint8)
            self._status[0] = 1
        elif ticket is not None:
            self._staging.failure = text

    def _raise_failure(self, st: _StagingState) -> None:
        text, st.failure = st.failure, None
        if st.status[0].item():
            n = int(st.status[4:8].view(torch.int32).item())
            text = bytes(st.status[8 : 8 + n].tolist()).decode("utf-8", "replace")
            st.status[0] = 0
        if text is not None:
            where = getattr(self, "checkpoint_id", None)
            raise AsyncSaveError(
                f"the previous async save with this writer failed in the background ({text}); "
                "nothing of it was committed. Fix the cause and save again; this error is "
                "raised once.",
                checkpoint=where,
            )

    def _busy_message(self, what: str, cfg: StagingConfig) -> str:
        return (
            f"async save to {getattr(self, 'checkpoint_id', '?')}: an earlier save with this "
            f"writer {what} (policy in_flight={cfg.in_flight!r}, "
            f"wait_timeout_s={cfg.wait_timeout_s}); at most one save is written and one "
            "queued per writer. Wait for the returned future before saving again, or use "
            'StagingConfig(in_flight="wait").'
        )

    # -- pickling to DCP's daemon process

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self._transient_attrs:
            state[name] = None
        state["_current"] = None
        state["_threads_before"] = ()
        return state


def _uncopied_storages(state: dict[str, Any], staged: dict[str, Any]) -> frozenset[int]:
    """Storage pointers of the tensors ``staged`` still shares with ``state``."""
    # A staged value that is the very object of the live state was not copied.
    live = {id(t) for t in iter_tensors(state)}
    return frozenset(
        t.untyped_storage().data_ptr() for t in iter_tensors(staged) if id(t) in live and t.numel()
    )


def _mark_dropped(ticket: _Ticket) -> None:
    ticket.dropped = True


def background_step(method):
    """Wrap a writer step that runs in the background: record failures, note completion.

    Failures are recorded only for async saves (a synchronous ``dcp.save``
    raises to its caller already). ``write_data`` may return a pending future:
    its outcome is recorded when it completes.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        step = method.__name__
        ticket = self._ticket_of_this_thread()  # None: not an async save in this process
        daemon_copy = self._staging is None and self._status is not None  # PROCESS mode
        if step == "write_data" and (ticket is not None or daemon_copy):
            # The thread (DCP starts one per async save) only writes this save.
            lower_thread_priority(self._staging_config.background_nice)
        try:
            result = method(self, *args, **kwargs)
        except BaseException as e:
            self._note_failure(step, e, ticket)
            raise
        if step == "write_data" and isinstance(result, torch.futures.Future):

            def done(fut: torch.futures.Future) -> None:
                try:
                    fut.value()
                except Exception as e:  # noqa: BLE001  (recorded; DCP raises it from wait())
                    self._note_failure(step, e, ticket)
                if ticket is not None:
                    ticket.written.set()

            # Runs at once when the future is complete already.
            result.add_done_callback(done)
        return result

    return wrapper
