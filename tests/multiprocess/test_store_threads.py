"""Two threads of one rank use the c10d store at once (two levels' drains do): a ``set``
on one must not wait behind a ``wait`` on the other. torchrun's TCPStore client serves
one request at a time; each thread gets its own (``_dist._store``). Before, the
``make demo`` drains of a partner and a remote level hung until their timeout.

Each ``set`` is made only once the other thread is known to be inside its ``wait``:
its request sent, blocked in the kernel on the reply (``/proc``: the thread's
current system call), so the test never passes by the set coming first.
"""

from __future__ import annotations

import platform
import socket
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from dcp_multilevel import _dist
from dcp_multilevel.testing import run_ranks

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.machine() != "x86_64",
    reason="reads x86-64 Linux system call numbers from /proc",
)

#: x86-64 system calls a store client blocks in while it waits for its reply:
#: poll, ppoll, recvfrom, recvmsg, read, select, pselect6, epoll_wait, epoll_pwait.
_WAITING_CALLS = {7, 271, 45, 47, 0, 23, 270, 232, 281}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _blocked_on_its_reply(thread_id: int) -> bool:
    """Whether native thread ``thread_id`` of this process sits in a blocking read."""
    with open(f"/proc/self/task/{thread_id}/syscall") as f:
        first = f.read().split()[0]  # "running" while it runs
    return first.isdigit() and int(first) in _WAITING_CALLS


def _once_blocked(thread_id: int, alive) -> None:
    """Return once ``thread_id`` is blocked on its reply; fail if it finished first."""
    while not _blocked_on_its_reply(thread_id):
        assert alive(), "the waiting thread returned before the key was set"
        time.sleep(0.001)  # polling a state, not timing anything


def _job(rank: int, world: int, port: int) -> str:
    # A TCPStore-backed group, as torchrun makes (run_ranks' own is a FileStore).
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    got: list[object] = []
    if rank == 0:
        _dist.store_set("warm", 0)  # this (main) thread's client exists
        # A lane thread waits for a key that this rank's main thread sets.
        connected = threading.Event()
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                _dist._store()  # its own client, connected before it waits
                connected.set()
                got.extend(_dist.store_wait_get(["k"], 20))
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        assert connected.wait(30)
        _once_blocked(waiter.native_id, waiter.is_alive)  # inside wait(), request sent
        _dist.store_set("k", {"from": "main"})  # with one shared client: blocked 20 s
        waiter.join()
        assert not errors, errors
        # Another thread sets what the main thread waits for, both on this rank.
        main = threading.get_native_id()
        waiting = threading.Event()

        def set_later() -> None:
            waiting.wait()
            _once_blocked(main, lambda: True)
            _dist.store_set("k2", 2)

        setter = threading.Thread(target=set_later)
        setter.start()
        waiting.set()  # the setter sets only once this thread is inside wait()
        got += _dist.store_wait_get(["k2"], 20)
        setter.join()
    dist.barrier()
    return repr(got)


def test_a_set_on_one_thread_does_not_wait_behind_a_wait_on_another(tmp_path):
    out = run_ranks(_job, 2, _free_port(), timeout=120)
    assert out[0] == repr([{"from": "main"}, 2]), out
