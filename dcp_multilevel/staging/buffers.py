"""Host buffers for async-save staging: a pool of at most two flat buffers, and the copy.

A buffer set is one flat ``uint8`` host tensor; a staged state is a structure
of views into it, each tensor at a 64-byte aligned offset. A direct-I/O file
takes a big tensor's whole pages from the buffer wherever it sits (the file
is padded so that the tensor lies as far past a block as its memory lies past
a page: ``stores/_direct.py``), so nothing here is aligned to pages. Filling
memory that an earlier save touched runs at memcpy speed; fresh memory
(``clone()``) pays a page fault per page on top. Pinned sets are page-locked at exactly their
size, not at the power of two CUDA's host allocator rounds to (*Page-locked memory* below).

Call order in ``Stager.stage``, on the training thread (with overlap, on the
overlap thread): ``iter_tensors`` (the walk, once) -> ``staged_nbytes`` (and
``select_wave`` over a budget) -> ``HostBufferPool.try_acquire`` (under the
stager's lock, as is ``close``) -> the set's ``owner`` becomes the save's
ticket -> the copies into the set (``copies.py``: ``plan_copies`` then
``run_copies``). A set is busy until that owner is done; the threads writing
saves finish owners and never call into the pool.

Page-locked memory: ``torch.empty(n, pin_memory=True)`` goes through CUDA's
caching host allocator, which rounds every request up to a power of two: a
4.3 GB set would pin 8.6 GB, and a budget of N bytes could pin up to 2N per set
(pytorch/pytorch#150517). The buffer sets live as long as the writer, so that
allocator's caching buys them nothing: :func:`pinned_empty` takes ordinary host
memory, page-aligned, and registers exactly its pages with CUDA
(``cudaHostRegister``), falling back to the caching allocator where registering
fails. The registration is undone when the returned set is collected, before
its memory can be freed (:func:`unpin_when_collected`); :func:`registered_bytes`
counts what is registered.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "ALIGN",
    "COPY_PIECE",
    "BufferSet",
    "HostBufferPool",
    "KeptViews",
    "Owner",
    "iter_tensors",
    "pinned_empty",
    "pool_source",
    "registered_bytes",
    "select_wave",
    "staged_nbytes",
    "unpin_when_collected",
]

log = logging.getLogger(__name__)


#: Byte alignment of each tensor in a buffer set (cache line; every dtype fits).
ALIGN = 64
#: Largest piece one copy job moves (pieces of big tensors go to different threads).
COPY_PIECE = 16 << 20


class Owner(Protocol):
    """The save a buffer set is lent to; the set is free again once it is done."""

    def done(self) -> bool:
        """True once the save no longer needs the buffer set."""
        ...


class KeptViews:
    """The views of a buffer one save laid out, for the next save of the same state.

    Making a view is a torch call, and each torch call on a save's thread costs
    a training thread that calls torch a GIL hand-off
    (``benchmarks/bench_gil_calls.py``). A key says what makes two views the
    same (the place in the buffer, dtype and shape). Call order, one save at a
    time: :meth:`begin`, then :meth:`get` per tensor; :meth:`discard` and
    :meth:`clear` when the buffer behind some views goes away.
    """

    __slots__ = ("_last", "_now")

    def __init__(self) -> None:
        self._last: dict[tuple[Any, ...], torch.Tensor] = {}
        self._now: dict[tuple[Any, ...], torch.Tensor] = {}

    def begin(self) -> None:
        """A save starts laying out: the last one's views are the ones to reuse."""
        if self._now:
            self._last, self._now = self._now, {}

    def get(self, key: tuple[Any, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The last save's view for ``key``, else ``make()``; kept for the next save."""
        view = self._last.get(key)
        if view is None:
            view = make()
        self._now[key] = view
        return view

    def discard(self, drop: Callable[[tuple[Any, ...]], bool]) -> None:
        """Forget the views whose key ``drop`` names (their buffer is being replaced)."""
        self._last = {k: v for k, v in self._last.items() if not drop(k)}
        self._now = {k: v for k, v in self._now.items() if not drop(k)}

    def clear(self) -> None:
        self._last.clear()
        self._now.clear()

    def laid_out(self) -> dict[tuple[Any, ...], torch.Tensor]:
        """The views the current save laid out so far (a copy)."""
        return dict(self._now)


class BufferSet:
    """One flat host buffer; ``owner`` is the save it is lent to (None: free);
    ``views``: the tensors' places in it, kept for the next save
    (``copies.plan_copies``)."""

    __slots__ = ("__weakref__", "flat", "owner", "views")

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.owner: Owner | None = None
        self.views = KeptViews()

    @property
    def capacity(self) -> int:
        return self.flat.numel()

    def busy(self) -> bool:
        return self.owner is not None and not self.owner.done()


class HostBufferPool:
    """At most two flat host buffers, allocated on demand and reused.

    A set is replaced (freed, then allocated larger) only when a bigger state
    arrives; the total never exceeds ``budget_bytes``.
    """

    MAX_SETS = 2

    def __init__(self, budget_bytes: int | None, *, pin: bool, shared: bool) -> None:
        self.budget_bytes = budget_bytes
        self.pin = pin
        self.shared = shared
        self.sets: list[BufferSet] = []
        #: Bytes ever allocated, and the most held at once (for tests and metrics).
        self.allocated_total = 0
        self.peak_bytes = 0

    @property
    def held_bytes(self) -> int:
        """Bytes held by all buffer sets, busy or free."""
        return sum(s.capacity for s in self.sets)

    def fits(self, nbytes: int) -> bool:
        """Whether a state of ``nbytes`` can be staged whole under the budget."""
        return self.budget_bytes is None or nbytes <= self.budget_bytes

    def try_acquire(self, nbytes: int) -> BufferSet | None:
        """A free set of at least ``nbytes``, or None while busy sets leave no room."""
        free = [s for s in self.sets if not s.busy()]
        fitting = [s for s in free if s.capacity >= nbytes]
        if fitting:
            return min(fitting, key=lambda s: s.capacity)
        busy_bytes = sum(s.capacity for s in self.sets if s.busy())
        if self.budget_bytes is not None and busy_bytes + nbytes > self.budget_bytes:
            return None
        if free:  # too small for this state: free them first, so the peak stays bounded
            self.sets = [s for s in self.sets if s.busy()]
        elif len(self.sets) >= self.MAX_SETS:
            return None
        flat, registered = self._allocate(nbytes)
        new = BufferSet(flat)
        unpin_when_collected(new, registered, nbytes)
        self.sets.append(new)
        return new

    def _allocate(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """A buffer of ``nbytes`` and its CUDA registration (0: none)."""
        registered = 0
        if self.pin and not self.shared:  # shared wins: DCP's daemon process needs it
            flat, registered = pinned_empty(nbytes)
        else:
            flat = torch.empty(nbytes, dtype=torch.uint8)
            if self.shared:
                flat.share_memory_()
        self.allocated_total += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes + nbytes)
        return flat, registered

    def close(self) -> None:
        """Free every set no save is using (busy ones stay until their save is done)."""
        self.sets = [s for s in self.sets if s.busy()]


def pool_source(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose bytes a buffer set takes for ``t``: ``t`` itself (a plain
    strided tensor or parameter: the snapshot is a plain tensor, as a detached
    copy would be), or a DTensor's local shard (FSDP2's parameters and optimizer
    state: the snapshot is a DTensor around the buffer's view); None for what is
    staged the stock way (sparse, quantized, other subclasses)."""
    if type(t) not in _PLAIN:
        local = getattr(t, "_local_tensor", None)
        if local is None or not _is_dtensor(t):
            return None
        t = local
    if type(t) in _PLAIN and t.layout == torch.strided and not t.is_quantized:
        return t
    return None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t) is DTensor


def _poolable(t: torch.Tensor) -> bool:
    return pool_source(t) is not None


def _nbytes(t: torch.Tensor) -> int:
    """The bytes ``t`` takes in a buffer set (a DTensor: its local shard's)."""
    src = pool_source(t)
    return 0 if src is None else src.numel() * src.element_size()


def iter_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a nested state, in the order ``copy_into`` visits them (a
    list of them is a state of its own: walk once, pass the list on).

    A loop with a stack, not recursive generators: ``async_save`` blocks for this
    walk, several times longer the recursive way (a generator frame per level,
    resumed for every tensor below it)."""
    out: list[torch.Tensor] = []
    stack = [state]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            stack.extend(reversed(v.values()))
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
    return out


def staged_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes a buffer set needs for the poolable ones of ``tensors`` (``iter_tensors``)."""
    total = 0
    for t in tensors:  # inlined: async_save blocks for this loop
        if (src := pool_source(t)) is not None:
            total = -(-total // ALIGN) * ALIGN + src.nbytes
    return _aligned(total)


def select_wave(tensors: Iterable[torch.Tensor], capacity: int) -> tuple[set[int], int]:
    """The ones of an over-budget state's ``tensors`` to stage: ``(ids, bytes needed)``.

    First fit, largest first, within ``capacity`` bytes: the tensors left out
    are written straight from the live state while the training thread waits,
    so staging the most bytes keeps that wait shortest.
    """
    chosen: set[int] = set()
    total = 0
    for t in sorted(filter(_poolable, tensors), key=lambda t: -_nbytes(t)):
        n = _nbytes(t)
        # Each staged tensor may cost up to ALIGN - 1 bytes of padding before it.
        if n and total + n + ALIGN <= capacity:
            chosen.add(id(t))
            total += n + ALIGN
    return chosen, _aligned(total) if chosen else 0


def _aligned(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


PAGE = 4096
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class _Registered:
    """Bytes registered by this module and not yet unregistered (any thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes = 0

    def add(self, n: int) -> None:
        with self.lock:
            self.bytes += n


_registered = _Registered()


def registered_bytes() -> int:
    """Host bytes this process page-locked for buffer sets, not counted by
    ``torch.cuda.host_memory_stats()`` (for metrics and benchmarks)."""
    return _registered.bytes


def pinned_empty(nbytes: int) -> tuple[torch.Tensor, int]:
    """A page-aligned ``uint8`` host tensor of ``nbytes``, page-locked, and the pointer
    registered with CUDA (0: it came from the caching allocator instead; nothing
    to undo). Pass both to :func:`unpin_when_collected`."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    flat = raw[start : start + nbytes]
    try:
        # Portable: pinned for every device's context, as torch's pinned memory is
        # (a process may stage tensors of several GPUs). torch's binding marks a
        # failure handled (CUDA's last error is cleared).
        err: Any = int(
            torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), nbytes, _REGISTER_PORTABLE)
        )
    except Exception as e:  # noqa: BLE001 - no CUDA runtime here: torch's pinning says why
        err = e
    if err != 0:
        log.info("cudaHostRegister of %d bytes failed (%s): pinning through torch", nbytes, err)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), 0
    _registered.add(nbytes)
    return flat, flat.data_ptr()


def unpin_when_collected(owner: Any, ptr: int, nbytes: int) -> None:
    """Undo ``pinned_empty``'s registration of ``ptr`` when ``owner`` (which holds the
    tensor) is collected: weak-reference callbacks run before its attributes are
    released, so the pages are unregistered before the memory can be freed."""
    if ptr:
        weakref.finalize(owner, _unregister, ptr, nbytes)


def _unregister(ptr: int, nbytes: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)
    _registered.add(-nbytes)
