"""Scheduling priority of background checkpoint threads.

On a node whose cores are all busy, the threads writing an async checkpoint
(and the kernel work their ``write`` calls do: page-cache copies, accounted
to the calling thread) compete with the training loop for CPU. A higher nice
value for those threads lets the training loop win that competition; the
write still gets every idle cycle. Linux schedules threads individually, so
this changes only the calling thread, and threads it starts afterwards
inherit it.

Called by ``Stager.background`` on the thread running an async save's
``write_data`` / ``finish`` (DCP starts that thread for the one save), and by
each drain lane's thread (``levels/lanes.py``), never on the training thread.
"""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["lower_thread_priority"]

logger = logging.getLogger(__name__)


def lower_thread_priority(nice: int) -> bool:
    """Raise the calling thread's nice value to at least ``nice``; True if it is now.

    Never raises: where per-thread priorities are not available (not Linux),
    or the call is refused, the thread keeps its priority and a debug line
    says so. Lowering priority needs no privilege; it cannot be undone
    without one, so call it only on threads that exist for background work.
    """
    if nice <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        if current < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:
        logger.debug("could not lower the priority of thread %d: %s", tid, e)
        return False
    return True
