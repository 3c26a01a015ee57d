"""Stream order: reads of live device state after the work that wrote it, copies
into device destinations done before a load returns.

Training queues its GPU work on the stream current on its thread, often a
stream of its own. A save or a load does part of its work on other threads
(the writer's and reader's threads, DCP's background thread of an async save,
the staging thread), whose current stream is the device's default stream:
nothing orders it after the training's stream, so a copy queued there could
read a tensor before the kernels writing it ran, or write a destination that
queued kernels still read. So:

- :meth:`StreamMarks.here`, on the caller's thread when ``save``,
  ``async_save`` (``stage``) or ``load`` is called, records an event on its
  current stream of every device in use: where the work the save must follow
  ends.
- :meth:`StreamMarks.following`, on any thread: until it exits, each marked
  device's current stream is this save's or load's stream there, which waits
  for the mark. Every read (counts, digests, copies to the host) and every copy
  into a destination queued meanwhile comes after that work, whichever thread
  queues it. :meth:`StreamMarks.adopt` does the same for the rest of a
  thread's part of a save (DCP's background thread, whose planner reads the
  state between the writer's calls).
- :meth:`StreamMarks.finish`: wait for all of it (a load's copies are done
  when the load returns).

What such a stream reads must stay alive until the read is done: the
allocator knows only the stream that allocated a tensor, and would hand its
memory to the training's next allocation at once. The copies here hold their
sources until they are waited for (``sources.tensor_of`` waits for each
copy; ``staging/copies.DeviceCopies`` holds them until its ``wait``).

Without CUDA in use every call returns at once and changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["StreamMarks", "devices_in_use"]


class StreamMarks:
    """Where the GPU work a save or a load must follow ends, per device.

    Call order: :meth:`here` on the caller's thread, once per save or load;
    then, on any threads, :meth:`following` (or :meth:`adopt`) around the
    work; :meth:`finish` once that work is queued, where it must be done
    before returning.

    Args:
        events: per CUDA device, an event recorded where the work ends.
    """

    def __init__(self, events: dict[torch.device, Any] | None = None) -> None:
        self.events: dict[torch.device, Any] = dict(events or {})
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()

    @classmethod
    def here(cls, state: Any = None) -> StreamMarks:
        """Marks on the calling thread's current stream of each device in use
        (``state``: its tensors, walked only where torch cannot say which
        devices are in use, see :func:`devices_in_use`)."""
        if not torch.cuda.is_initialized():  # then no tensor is on a CUDA device
            return cls()
        events = {}
        for device in devices_in_use(state):
            events[device] = torch.cuda.Event()
            events[device].record(torch.cuda.current_stream(device))
        return cls(events)

    def __bool__(self) -> bool:
        return bool(self.events)

    def stream(self, device: torch.device) -> Any:
        """This save's or load's stream on ``device``, after its mark (made once)."""
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
                stream.wait_event(self.events[device])
            return stream

    @contextmanager
    def following(self) -> Iterator[None]:
        """On this thread, until exit: each marked device's current stream is
        :meth:`stream` (nothing happens without marks)."""
        restore = self.adopt()
        try:
            yield
        finally:
            restore()

    def adopt(self) -> Callable[[], None]:
        """Make :meth:`stream` this thread's current stream of each marked device
        until the returned function is called (on this thread), which puts the
        ones before back."""
        if not self.events:
            return lambda: None
        device_before = torch.cuda.current_device()
        before = [torch.cuda.current_stream(d) for d in self.events]
        for device in self.events:
            torch.cuda.set_stream(self.stream(device))
        torch.cuda.set_device(device_before)  # (setting a stream sets its device)

        def restore() -> None:
            for stream in before:
                torch.cuda.set_stream(stream)
            torch.cuda.set_device(device_before)

        return restore

    def finish(self) -> None:
        """Return once everything queued on this save's or load's streams is done."""
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.synchronize()


def devices_in_use(state: Any = None) -> set[torch.device]:
    """The CUDA devices this process made a context on (asking creates none): a
    tensor on a device means a context there. It asks once per device,
    where walking the state costs a step per tensor. A torch without
    that query has ``state`` walked (torch's pytree: nested dicts, lists and
    tuples), and the current device counted."""
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is not None:
        try:
            count = torch.cuda.device_count()
            return {torch.device("cuda", i) for i in range(count) if has_context(i)}
        except (RuntimeError, TypeError):  # a private query that changed: walk
            pass
    found = {torch.device("cuda", torch.cuda.current_device())}
    return found | {
        t.device for t in tree_leaves(state) if isinstance(t, torch.Tensor) and t.is_cuda
    }
