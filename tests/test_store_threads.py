"""Two threads of one rank use the c10d store at once (two levels' drains do): a ``set``
on one must not wait behind a ``wait`` on the other. torchrun's TCPStore client serves
one request at a time; each thread gets its own (``_dist._store``). Before, the
``make demo`` drains of a partner and a remote level hung until their timeout."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import torch.distributed as dist

from dcp_multilevel import _dist
from dcp_multilevel.testing import run_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(rank: int, world: int, port: int) -> str:
    # A TCPStore-backed group, as torchrun makes (run_ranks' own is a FileStore).
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    got: list[object] = []
    if rank == 0:
        # A lane thread waits for a key that this rank's main thread sets.
        waiter = threading.Thread(target=lambda: got.extend(_dist.store_wait_get(["k"], 20)))
        waiter.start()
        waiter.join(0.3)  # the waiter is inside wait() by now
        _dist.store_set("k", {"from": "main"})  # blocked until the wait timed out, before
        waiter.join(30)
        # Another thread sets what the main thread waits for, both on this rank.
        setter = threading.Thread(target=lambda: _dist.store_set("k2", 2))
        setter.start()
        got += _dist.store_wait_get(["k2"], 20)
        setter.join()
    dist.barrier()
    return repr(got)


def test_a_set_on_one_thread_does_not_wait_behind_a_wait_on_another(tmp_path):
    out = run_ranks(_job, 2, _free_port(), timeout=120)
    assert out[0] == repr([{"from": "main"}, 2]), out
