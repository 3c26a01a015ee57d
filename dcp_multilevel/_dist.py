"""The only module that touches torch.distributed.

Collectives on the trainer's group run on the caller's (main) thread only. Background threads
coordinate through the c10d store (``store_set`` / ``store_wait_get``), never
through the trainer's process group: a collective issued from a background
thread can interleave with the trainer's own and deadlock. Bulk bytes between
nodes (partner copies, parity, restores) go point to point over a group of
our own (:func:`new_group`), used by one thread at a time.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .errors import WaitTimeoutError

__all__ = [
    "all_gather_object",
    "broadcast_bytes",
    "broadcast_object",
    "gather_bytes",
    "is_active",
    "new_group",
    "pickled_size",
    "rank",
    "rank0_decides",
    "recv_bytes",
    "send_bytes",
    "store_add",
    "store_delete",
    "store_get_nowait",
    "store_set",
    "store_wait_get",
    "world_size",
]


def is_active() -> bool:
    """True when a default process group is initialized."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_active() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_active() else 1


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (main thread only)."""
    if not is_active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int) -> Any:
    """Rank ``src``'s ``obj`` on every rank (main thread only)."""
    if not is_active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


T = TypeVar("T")


def rank0_decides(decide: Callable[[], T]) -> T:
    """Rank 0's ``decide()``, on every rank (main thread only; collective).

    For what one rank must choose for all: a drain to skip, the steps
    retention removes, a manifest only rank 0's node holds. Only rank 0 calls
    ``decide``; without a process group, this process does.
    """
    value = decide() if rank() == 0 else None
    return broadcast_object(value, 0) if world_size() > 1 else value  # type: ignore[return-value]


_THREAD = threading.local()


def _store() -> dist.Store:
    """The default group's c10d store, through a client of this thread's own.

    A store client serves one request at a time, and ``wait`` holds it until its
    keys arrive: drains of two levels (two lane threads) sharing one client would
    block each other's ``set`` on every rank until the timeout (seen with torchrun's
    TCPStore). A clone is a new connection to the same store.
    """
    default = dist.distributed_c10d._get_default_store()
    if getattr(_THREAD, "base", None) is not default:
        try:
            mine = default.clone()
        except (AttributeError, RuntimeError, NotImplementedError):  # a store that cannot
            mine = default
        _THREAD.base, _THREAD.store = default, mine
    return _THREAD.store


def store_set(key: str, value: Any) -> None:
    """Publish a JSON value under ``key`` (safe from any thread)."""
    _store().set(key, json.dumps(value))


def store_wait_get(keys: list[str], timeout_s: float) -> list[Any]:
    """Wait until every key is set, then return their JSON values (any thread)."""
    store = _store()
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as e:  # c10d's timeout (DistStoreError), or a store that went away
        raise WaitTimeoutError(
            f"rank {rank()} waited {timeout_s:g} s for {', '.join(keys)} in the c10d store, in "
            f"vain ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e
    return [json.loads(store.get(k)) for k in keys]


def store_get_nowait(key: str) -> Any | None:
    """The JSON value under ``key``, or None when it is not set yet (any thread)."""
    store = _store()
    if not store.check([key]):
        return None
    return json.loads(store.get(key))


def store_add(key: str, amount: int) -> int:
    """Add ``amount`` to the counter under ``key`` (made at 0); its new value (any thread)."""
    return int(_store().add(key, amount))


def store_delete(key: str) -> None:
    """Remove ``key`` from the store, if it is there (any thread)."""
    _store().delete_key(key)


def new_group(timeout_s: float) -> Any:
    """A new gloo group over every rank, for bulk bytes; None without a process group.

    Collective: every rank creates its groups in the same order (e.g. while
    constructing a manager). Gloo moves CPU tensors whatever the trainer's
    backend is (NCCL cannot).
    """
    if not is_active():
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def send_bytes(buf: memoryview | bytearray, dst: int, group: Any) -> None:
    """Send ``buf`` to rank ``dst`` over ``group`` (blocks until it is received).

    Pass a writable buffer: a read-only one (``bytes``) is copied first, since
    torch sends tensors, and a tensor over read-only memory is one torch warns
    about (the warning would reach the user's log).
    """
    if len(buf):
        if memoryview(buf).readonly:
            buf = bytearray(buf)
        dist.send(torch.frombuffer(buf, dtype=torch.uint8), dst, group=group)


def recv_bytes(buf: memoryview | bytearray, src: int, group: Any) -> None:
    """Receive exactly ``len(buf)`` bytes from rank ``src`` over ``group`` into ``buf``."""
    if len(buf):
        dist.recv(torch.frombuffer(buf, dtype=torch.uint8), src, group=group)


# Why these two beside the object collectives: ``all_gather_object`` (and
# ``gather_object``) pad every rank's pickle to the largest one's, so a receiver
# gets ranks x the largest object even where most ranks send next to nothing
# (a node's lowest rank carrying the node's files, the others none). These move
# exactly the bytes sent: a receiver gets the sum, not ranks x the maximum.


def gather_bytes(payload: bytes, dst: int, group: Any) -> list[bytes] | None:
    """Every rank's ``payload`` at rank ``dst``, in rank order; None on the others.

    Collective over ``group`` (one of :func:`new_group`'s, every rank; main thread).
    The lengths first (one gather, 8 bytes a rank), then each non-empty payload
    point to point, so ``dst`` receives ``8 * ranks`` plus the payloads' sum.
    """
    if not is_active():
        return [bytes(payload)]
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in ranks] if me == dst else None
    dist.gather(size, sizes, dst=dst, group=group)
    if me != dst:
        send_bytes(bytearray(payload), dst, group)
        return None
    assert sizes is not None
    out: list[bytes] = []
    for r, n in zip(ranks, sizes, strict=True):
        if r == dst:
            out.append(bytes(payload))
            continue
        buf = bytearray(int(n.item()))
        recv_bytes(buf, r, group)
        out.append(bytes(buf))
    return out


def broadcast_bytes(payload: bytes | None, src: int, group: Any) -> bytes:
    """Rank ``src``'s ``payload`` on every rank (the others pass None). Collective over
    ``group`` (one of :func:`new_group`'s; main thread): the length (8 bytes), then
    the bytes, unpadded."""
    if not is_active():
        return bytes(payload or b"")
    mine = dist.get_rank() == src
    size = torch.tensor([len(payload or b"") if mine else 0], dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    n = int(size.item())
    if n == 0:
        return b""
    if mine:
        buf = torch.frombuffer(bytearray(payload or b""), dtype=torch.uint8)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src, group=group)
    return bytes(payload or b"") if mine else buf.numpy().tobytes()


def pickled_size(obj: Any) -> int:
    """The bytes the object collectives (:func:`all_gather_object`,
    :func:`broadcast_object`) send for ``obj``: its pickle, as torch makes it
    (for counting what a collective moves; no process group needed)."""
    f = io.BytesIO()
    dist.distributed_c10d._pickler(f).dump(obj)
    return f.tell()
