"""The stager a :class:`~dcp_multilevel.MultiLevelWriter` owns for ``dcp.async_save``.

The writer is DCP's :class:`~torch.distributed.checkpoint.staging.AsyncStager`
and calls its :class:`Stager` explicitly. Order of calls for one
``dcp.async_save(sd, storage_writer=W)`` (torch 2.13, every rank, see
``state_dict_saver.async_save``)::

    training thread    W.stage(sd)          -> stage(sd, checkpoint_id=)  raise an earlier
                                               failure once; wait for the save before to
                                               begin and for a free buffer set; copy (with
                                               overlap: mark the CUDA streams, return a
                                               future; the overlap thread waits for the
                                               buffers and copies, behind the fence)
                       DCP starts a thread for this save and hands it the staged copy
                       W.synchronize_staging -> synchronize()  over budget: block until the
                                               live tensors are written (with overlap
                                               DCP does not call it: the fence, a
                                               LiveFence, completes then)
    background thread  W.reset(id) if DCP got a checkpoint_id, W.storage_meta() always
      (THREAD)                              -> claim(checkpoint_id=)  take this save, wait
                                               for the earlier ones (before any collective)
                       W.write_data, W.finish -> with background(step, rank=) as save
      (PROCESS)        pickling the staged copy to DCP's daemon process claims it; the
                       daemon runs the same calls on its copy of W, whose Stager only
                       lowers priority and records failures (see ``__getstate__``)

A synchronous ``dcp.save`` with the same writer makes the background calls on
its own thread: on the thread that staged the saves it claims none of them and
waits for all of them.

How a save's background thread is known: it claims the oldest unclaimed
ticket in its first writer call, and the ticket records
``threading.current_thread()``. ``stage`` waits until the save before was
claimed before it queues another, so at most one ticket is ever unclaimed:
the one the next background thread takes. A writer is used by one training
thread: a synchronous save from yet another thread, made while an async save
is staged but not yet claimed, would be taken for that save's background
thread.

A background thread that dies before its first writer call (in PROCESS mode:
DCP's daemon process failed to start) never claims its save. That save holds
its buffer set until DCP drops the staged copy (its future keeps it, through
the error's traceback), and the next ``stage`` waits for it to begin for at
most ``wait_timeout_s``, then raises :class:`SaveInFlightError` saying so
(as does ``synchronize`` when that save was over budget).

Buffers (:mod:`.buffers`): at most two sets, reused (double buffering). Budget:
a state larger than ``budget_bytes`` is saved in two waves, the tensors left
out written first from the live state while ``async_save`` waits (with
``overlap``: while training goes on, until the fence; ``budget_bytes=0``
copies nothing). The stager's state in the training process (its buffers,
tickets and threads: :class:`StagingState`) is made by its first ``stage``.

Failures: raised from DCP's future, and once more, as :class:`AsyncSaveError`,
from the next ``async_save`` with this writer. The :class:`FailureRecord` keeps
a background failure until it is reported, once, to the training thread: a
background step of an async save fails -> ``note`` (on DCP's background thread,
or in DCP's daemon process on its unpickled copy); the next ``Stager.stage`` on
the training thread -> ``take``, which returns it once. The record is a
fixed-size tensor in shared memory, so the copy that DCP's PROCESS mode pickles
to its daemon process writes where the training process reads (torch shares a
tensor's storage when it is pickled to a child). Layout: byte 0 set when a
failure is recorded, bytes 4-8 the text's length (int32), then the UTF-8 text,
cut at :data:`RECORD_BYTES`. The stager's errors (:func:`raise_failure`,
:func:`busy_message`, :func:`never_began_message`) say the save, the policy and
what to do.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..checkpoint.streams import StreamMarks
from ..errors import AsyncSaveError, ConfigError, SaveInFlightError
from ._priority import lower_thread_priority
from ._steps import StepFence
from ._tickets import POLL_S, StagedDict, Ticket, claimed_by, mark_dropped, uncopied_storages
from .background import BackgroundSave
from .buffers import BufferSet, HostBufferPool, iter_tensors, select_wave, staged_nbytes
from .config import StagingConfig
from .copies import Copies, check_live, plan_copies, run_copies
from .device import DeviceSnapshot
from .live import LiveFence

__all__ = ["Stager"]


#: Longest the overlap thread waits for ``async_save`` to arm a save's fence before
#: it copies anyway (a caller of ``stage`` other than DCP may never arm it).
_ARMED_WAIT_S = 0.02


class Stager:
    """Async-save staging over a reused host buffer pool (see module docs for call order).

    Args:
        config: budget, in-flight policy and threads; default :class:`StagingConfig()`.
    """

    def __init__(self, config: StagingConfig | None = None) -> None:
        self.config = config or StagingConfig()
        self._staging: StagingState | None = None  # made by the first stage()
        self._failures: FailureRecord | None = None  # made with it; shared with the daemon
        self._in_daemon = False  # this is the copy in DCP's daemon process
        self._last: Ticket | None = None  # the last staged save (for synchronize)
        self._steps = StepFence()  # with overlap: optimizer steps wait for the last fence

    @property
    def pool(self) -> HostBufferPool | None:
        """The host buffer pool (None before the first async save)."""
        return self._staging.pool if self._staging is not None else None

    # -- training thread

    def stage(
        self, state_dict: dict[str, Any], *, checkpoint_id: str
    ) -> dict[str, Any] | Future[dict[str, Any]]:
        """Copy ``state_dict`` into a free buffer set and return the copy; with
        ``overlap``, a :class:`LiveFence` of it: the copies run on a background
        thread, and DCP answers ``async_save`` with an ``AsyncSaveResponse``
        whose ``staging_completion`` is the fence (over budget, it also waits
        until the live tensors are written).

        ``checkpoint_id``: the writer's location, for messages.

        Raises:
            AsyncSaveError: the previous async save failed in the background (once).
            SaveInFlightError: no buffer set freed up (policy ``in_flight``; with
                ``overlap``, the fence raises it instead), or the save before
                never began its background part.
        """
        if self._in_daemon:
            raise ConfigError("a daemon-process copy of the writer cannot stage")
        st = self._staging
        if st is None:
            st = self._staging = StagingState(self.config)
            self._failures = FailureRecord()
        raise_failure(self._failures, checkpoint_id)
        cfg = self.config
        deadline = time.monotonic() + cfg.wait_timeout_s
        # The saves before must have begun in the background before this one is
        # queued: DCP's PROCESS executor starts its daemon on the first save, and a
        # second save submitted meanwhile would start another one. It also keeps
        # at most one ticket unclaimed, the one the next background thread takes.
        for t in list(st.tickets):
            if not t.wait_claimed(deadline):
                raise SaveInFlightError(never_began_message(checkpoint_id, self.config))
        st.seq += 1
        ticket = Ticket(st.seq, checkpoint_id)
        # Where the GPU work that wrote the state ends: every later read of it, on
        # whichever thread, waits for that (checkpoint/streams.py).
        ticket.marks = StreamMarks.here(state_dict)
        with st.lock:
            st.tickets.append(ticket)
        self._last = ticket
        try:
            if st.overlapper is None:
                copied, todo = self._lay_out(state_dict, ticket, deadline, ticket.marks)
                run_copies(todo, st.copier)
                return self._staged(copied, ticket)
            if cfg.check_fence:  # it hashes the state as it is now
                planned = self._lay_out(state_dict, ticket, deadline, ticket.marks)
                fence = self._behind_the_fence(lambda: planned, ticket, deadline)
            else:
                # Overlap: async_save only marks where the GPU work that wrote the
                # state ends; the walk, the wait for buffers and the snapshot's layout
                # (a view per tensor: a cost that grows with the tensors) run on the
                # overlap thread, while training goes on.
                fence = self._behind_the_fence(
                    lambda: self._lay_out(state_dict, ticket, deadline, ticket.marks),
                    ticket,
                    deadline,
                )
            self._steps.guard(fence.completed)
            return fence
        except BaseException:
            ticket.dropped = True  # no save follows: its buffers are free again
            raise

    def _lay_out(
        self,
        state_dict: dict[str, Any],
        ticket: Ticket,
        deadline: float,
        marks: StreamMarks | None = None,
    ) -> tuple[dict[str, Any], Copies]:
        """Take a buffer set for ``ticket`` and lay the snapshot out in it (issuing
        the device copies as it goes, after ``marks``).

        Raises:
            SaveInFlightError: no buffer set freed up (see :meth:`_acquire`).
        """
        tensors = iter_tensors(state_dict)
        nbytes = staged_nbytes(tensors)
        wave: set[int] | None = None  # None: stage every tensor
        if not self._staging.pool.fits(nbytes):
            # Two waves: what the budget holds is staged; the rest is written
            # first, straight from the live tensors, while async_save waits
            # (with overlap: behind the fence).
            wave, nbytes = select_wave(tensors, self._staging.pool.budget_bytes or 0)
            ticket.write_through = True
        buffers = self._acquire(nbytes, ticket, deadline) if nbytes else None
        snapshot = self._staging.device if wave is None and buffers is not None else None
        if snapshot is not None:
            with self._staging.lock:
                snapshot.reserve(tensors)
        copied, todo = plan_copies(
            state_dict,
            buffers.flat if buffers is not None else None,
            only=wave,
            check_fence=self.config.check_fence,
            marks=marks,
            snapshot=snapshot,
            views=buffers.views if buffers is not None else None,
        )
        if wave is not None:
            ticket.live = uncopied_storages(state_dict, copied)
        if todo.live_checks:
            ticket.check_live = lambda: check_live(todo)
        return copied, todo

    def _acquire(self, nbytes: int, ticket: Ticket, deadline: float) -> BufferSet:
        """A free buffer set of ``nbytes`` lent to ``ticket``; waits for the earlier
        saves to end while both sets are theirs (policy ``in_flight``).

        Raises:
            SaveInFlightError: policy ``"raise"`` and no set is free, or none
                freed up by ``deadline``.
        """
        st, cfg = self._staging, self.config
        while True:
            with st.lock:
                st.tickets = [t for t in st.tickets if not t.done()]
                buffers = st.pool.try_acquire(nbytes)
                if buffers is not None:
                    buffers.owner = ticket
                    return buffers
                earlier = next((t for t in st.tickets if t.seq < ticket.seq), None)
            if cfg.in_flight == "raise":
                raise SaveInFlightError(
                    busy_message(ticket.checkpoint_id, "is still being written", self.config)
                )
            if earlier is None:
                time.sleep(POLL_S)
            if (earlier is None or not earlier.wait_done(deadline)) and time.monotonic() > deadline:
                raise SaveInFlightError(
                    busy_message(ticket.checkpoint_id, "did not finish in time", self.config)
                )

    def _behind_the_fence(
        self,
        plan: Callable[[], tuple[dict[str, Any], Any]],
        ticket: Ticket,
        deadline: float,
    ) -> LiveFence:
        """Overlap: on the overlap thread, lay out the snapshot (``plan``, which issues
        the device copies as it goes), make the copies, hand the save
        its dict, and complete the fence; over budget, once the live tensors are
        written too.

        One thread does this, in order, for each save: over budget, the next
        save's copies wait for this save's fence.
        """
        st = self._staging
        fence = LiveFence()

        def copy_then_watch() -> None:
            # Python here takes the GIL from the training thread, which still has to
            # finish async_save (starting at once blocked it several times longer):
            # begin once async_save made the fence its staging_completion.
            fence.armed.wait(_ARMED_WAIT_S)
            try:
                copied, todo = plan()
                # With a device snapshot the fence completes once the state was read,
                # before its copy reaches the host.
                run_copies(todo, st.copier, on_fence=fence.complete)
            except BaseException as e:  # noqa: BLE001 - handed to the future, as DCP's would
                ticket.dropped = True  # never claimed: its buffers are free again
                fence.fail(e)
                return
            fence.hand_over(self._staged(copied, ticket))
            # Released: every live tensor written, or write_data ended. A save whose
            # thread ended without either (it failed first) reads nothing any more.
            while ticket.write_through and not ticket.released.wait(0.05):
                reader = fence.reader
                if ticket.done() or (reader is not None and not reader.is_alive()):
                    break
                if not ticket.claimed and time.monotonic() > deadline:
                    fence.set_exception(
                        SaveInFlightError(never_began_message(ticket.checkpoint_id, self.config))
                    )
                    return
            fence.complete()

        st.overlapper.submit(copy_then_watch)
        return fence

    def _staged(self, copied: dict[str, Any], ticket: Ticket) -> StagedDict:
        staged = StagedDict(copied, ticket, self._claim_sent)
        weakref.finalize(staged, mark_dropped, ticket)
        return staged

    def synchronize(self) -> None:
        """Right after DCP submitted the last staged save: over budget, wait for its live tensors.

        Returns once the writer wrote every live tensor (it writes them first),
        its ``write_data`` ended, or the save ended.

        Raises:
            SaveInFlightError: the save's background part did not begin within
                ``wait_timeout_s`` (its thread failed first).
        """
        t = self._last
        if t is None or not t.write_through:
            return
        deadline = time.monotonic() + self.config.wait_timeout_s
        while not t.released.wait(0.05):
            if t.done():
                return
            if not t.claimed and time.monotonic() > deadline:
                raise SaveInFlightError(never_began_message(t.checkpoint_id, self.config))

    def close(self) -> None:
        """Free the buffers no save is using, and the device snapshot's; optimizer
        steps no longer wait for the last fence. The stager can still be used after."""
        self._steps.release()
        if self._staging is not None:
            with self._staging.lock:
                self._staging.pool.close()
                if self._staging.device is not None:
                    self._staging.device.close()

    # -- background thread

    def claim(self, *, checkpoint_id: str) -> None:
        """A save's first writer call: claim it for this thread; wait for the earlier saves.

        Called from the writer's ``reset`` and ``storage_meta``, whichever
        comes first (DCP calls ``reset`` only with a ``checkpoint_id``), on
        the thread running the save; again on the same thread it changes
        nothing. The thread that staged the saves (a synchronous ``dcp.save``)
        claims none and waits for all. ``checkpoint_id``: for messages.

        Raises:
            SaveInFlightError: an earlier save did not end within ``wait_timeout_s``.
        """
        st = self._staging
        if st is None:  # no async save yet, or the daemon's copy (one save at a time)
            return
        me = threading.current_thread()
        with st.lock:
            mine = claimed_by(st.tickets, me)
            if mine is None:
                oldest = next((t for t in st.tickets if not t.claimed and not t.done()), None)
                if oldest is not None and oldest.stager_thread is not me:
                    oldest.thread = me
                    mine = oldest
                    # This thread's reads of the live state (the planner's digests,
                    # the writer's copies) follow the work that wrote it, until the
                    # save's finish.
                    mine.restore_streams = mine.marks.adopt()
        self._wait_for_earlier(mine, checkpoint_id)

    def _claim_sent(self, ticket: Ticket) -> None:
        """PROCESS mode: the staged copy is being pickled by the thread sending it."""
        with self._staging.lock:
            if ticket.thread is None:
                ticket.thread = threading.current_thread()
        self._wait_for_earlier(ticket, ticket.checkpoint_id)
        if ticket.write_through:
            ticket.dropped = True  # no save follows: async_save and its fence return
            raise ConfigError(
                "this state does not fit the staging budget and is written through from "
                "the live tensors, which needs AsyncCheckpointerType.THREAD; with PROCESS the "
                "whole staged copy must fit: raise StagingConfig(budget_bytes=...)"
            )

    @contextlib.contextmanager
    def background(self, step: str, *, rank: int) -> Iterator[BackgroundSave]:
        """Run one background step of a save (``write_data``, ``finish``) inside this.

        For an async save (a ticket claimed by this thread, or any save in
        DCP's daemon process) the thread's priority is lowered first (it
        exists for this save only), and a failure is recorded for the next
        ``stage``. Leaving the step releases an over-budget ``async_save``.
        ``step`` and ``rank`` name the failure.
        """
        ticket = self._ticket_of_this_thread()
        is_async = ticket is not None or self._in_daemon
        if is_async:
            lower_thread_priority(self.config.background_nice)
        try:
            yield BackgroundSave(ticket)
        except BaseException as e:
            if is_async and self._failures is not None:
                self._failures.note(f"{step} failed on rank {rank}: {type(e).__name__}: {e}")
            raise
        finally:
            if ticket is not None:
                ticket.released.set()
                if step == "finish":
                    ticket.restore_streams()

    def _ticket_of_this_thread(self) -> Ticket | None:
        st = self._staging
        if st is None:
            return None
        with st.lock:
            return claimed_by(st.tickets, threading.current_thread())

    def _wait_for_earlier(self, ticket: Ticket | None, checkpoint_id: str) -> None:
        st = self._staging
        deadline = time.monotonic() + self.config.wait_timeout_s
        with st.lock:
            earlier = [t for t in st.tickets if ticket is None or t.seq < ticket.seq]
        for t in earlier:
            if not t.wait_done(deadline):
                raise SaveInFlightError(
                    busy_message(checkpoint_id, "did not finish in time", self.config)
                )

    # -- pickling to DCP's daemon process (PROCESS mode)

    def __getstate__(self) -> dict[str, Any]:
        # Only what the daemon's copy needs: the config (background_nice) and the
        # shared failure record. Buffers, tickets and threads stay here.
        return {"config": self.config, "failures": self._failures}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"])
        self._failures = state["failures"]
        # A writer that never staged (DCP was given another async_stager) has no
        # record: its copy treats saves as synchronous, as the original does.
        self._in_daemon = self._failures is not None


class StagingState:
    """A stager's state in the training process, made by its first ``stage``."""

    def __init__(self, config: StagingConfig) -> None:
        pin = config.pin_memory if config.pin_memory is not None else torch.cuda.is_available()
        self.pool = HostBufferPool(config.budget_bytes, pin=pin, shared=config.shared_memory)
        # Guards tickets and the pool (stage and close, on the training thread,
        # against claim, on background threads).
        self.lock = threading.Lock()
        self.tickets: list[Ticket] = []
        self.seq = 0
        # copy_ releases the GIL: while the training thread waits for staging anyway,
        # more cores copy (threads exit with the process).
        self.copier = (
            ThreadPoolExecutor(config.copy_threads, thread_name_prefix="dcp-ml-stage")
            if config.copy_threads > 1
            else None
        )
        # overlap: one thread runs each save's copies, in order, behind its fence.
        self.overlapper = (
            ThreadPoolExecutor(1, thread_name_prefix="dcp-ml-overlap") if config.overlap else None
        )
        # GPU memory for the state's copy on its device (guarded by ``lock`` for close).
        self.device = (
            DeviceSnapshot(config.device_snapshot_bytes) if config.device_snapshot_bytes else None
        )


#: Bytes of the shared record (the text is cut to fit).
RECORD_BYTES = 4096
_HEADER = 8


class FailureRecord:
    """The last background failure of a stager's async saves (see module docs)."""

    def __init__(self) -> None:
        self._shared = torch.zeros(RECORD_BYTES, dtype=torch.uint8).share_memory_()
        # Serializes note/take in this process; a daemon copy writes while no
        # other save of this writer runs (saves run one at a time).
        self._lock = threading.Lock()

    def note(self, text: str) -> None:
        """Record ``text`` (replacing any earlier failure not taken yet)."""
        raw = text.encode("utf-8", "replace")[: RECORD_BYTES - _HEADER]
        with self._lock:
            if raw:
                body = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                self._shared[_HEADER : _HEADER + len(raw)] = body
            self._shared[4:8] = torch.tensor([len(raw)], dtype=torch.int32).view(torch.uint8)
            self._shared[0] = 1  # last: a reader sees the flag after the text

    def take(self) -> str | None:
        """The recorded failure, once; None if none was recorded since the last take."""
        with self._lock:
            if not self._shared[0].item():
                return None
            n = int(self._shared[4:8].view(torch.int32).item())
            text = bytes(self._shared[_HEADER : _HEADER + n].tolist()).decode("utf-8", "replace")
            self._shared[0] = 0
        return text

    def __getstate__(self) -> dict[str, torch.Tensor]:
        return {"shared": self._shared}

    def __setstate__(self, state: dict[str, torch.Tensor]) -> None:
        self._shared = state["shared"]
        self._lock = threading.Lock()


def raise_failure(failures: FailureRecord | None, checkpoint_id: str) -> None:
    """Raise the recorded background failure, once, as :class:`AsyncSaveError`.

    Raises:
        AsyncSaveError: a background step of an earlier async save failed.
    """
    text = failures.take() if failures is not None else None
    if text is not None:
        raise AsyncSaveError(
            f"the previous async save with this writer failed in the background ({text}); "
            "nothing of it was committed. Fix the cause and save again; this error is "
            "raised once.",
            checkpoint=checkpoint_id,
        )


def busy_message(checkpoint_id: str, what: str, cfg: StagingConfig) -> str:
    """An earlier save holds the buffers: ``what`` it did (or did not do) in time."""
    return (
        f"async save to {checkpoint_id}: an earlier save with this writer {what} (policy "
        f"in_flight={cfg.in_flight!r}, wait_timeout_s={cfg.wait_timeout_s}); at most one "
        "save is written and one queued per writer. Wait for the returned future before "
        'saving again, or use StagingConfig(in_flight="wait").'
    )


def never_began_message(checkpoint_id: str, cfg: StagingConfig) -> str:
    """An earlier save's background part never made its first writer call."""
    return (
        f"async save to {checkpoint_id}: an earlier async save with this writer did not "
        f"begin writing within wait_timeout_s={cfg.wait_timeout_s}: DCP's "
        "background thread failed before its first call to the writer (in PROCESS mode: "
        "DCP's daemon process did not start). That save's future holds the error; drop "
        "the future to free its buffers, then save again."
    )
