"""The copy of a state into a buffer set: now, or on a background thread behind a fence.

:func:`plan_copies` walks the state: it takes the snapshot's structure,
copies the plain values (step counters, configs) and lays every poolable
tensor out in the buffer set as a view, issuing the copies from CUDA devices
(:class:`DeviceCopies`, on a side stream) and recording the others.
:func:`run_copies` then moves the host bytes and waits for the device ones.
Both run on the training thread (:func:`copy_into`: both at once), or on a
background thread while training goes on (``StagingConfig(overlap=True)``;
the :class:`~..checkpoint.streams.StreamMarks` taken on the training thread
tell the side streams what to wait for): then the state may change only
after the copies are done, the *fence* (DCP's ``staging_completion``).

A fence check (``StagingConfig(check_fence=True)``, for debugging) hashes every
source when the copy is planned and every copy when it is made (a tensor
left live, over the budget: once the save wrote it, :func:`check_live`): a
tensor changed in between was changed before the fence, and the save fails with
:class:`~dcp_multilevel.errors.StagingFenceError` naming it, instead of
silently storing a state no step had.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ..checkpoint.streams import StreamMarks
from ..errors import StagingFenceError
from ..format.tensor_bytes import byte_view, value_tensor
from .buffers import COPY_PIECE, KeptViews, _aligned, pool_source
from .device import DeviceSnapshot, side_stream

__all__ = ["Copies", "check_live", "copy_into", "plan_copies", "run_copies"]


@dataclass
class Copies:
    """The copies a snapshot still needs (``plan_copies``); ``run_copies`` makes them."""

    #: (destination, source) of contiguous CPU tensors, same dtype and shape, each of
    #: at most COPY_PIECE bytes: small tensors as they are, bigger ones and bool ones
    #: as byte pieces. Copied in batches (``torch._foreach_copy_``) by any thread.
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    #: (destination, source, name) copied with one ``copy_`` (strided CPU tensors).
    whole: list[tuple[torch.Tensor, torch.Tensor, str]] = field(default_factory=list)
    #: The copies from CUDA devices, already issued while the snapshot was laid out.
    device: DeviceCopies | None = None
    #: (destination, name, hash of the source when planned): the fence check's.
    checks: list[tuple[torch.Tensor, str, str]] = field(default_factory=list)
    #: (live tensor, name, its hash when planned): the fence check's, for the
    #: tensors a save over budget writes from the live state (:func:`check_live`).
    live_checks: list[tuple[torch.Tensor, str, str]] = field(default_factory=list)


def _digest(t: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(byte_view(value_tensor(t)))


def plan_copies(
    state: Any,
    flat: torch.Tensor | None,
    only: set[int] | None = None,
    check_fence: bool = False,
    marks: StreamMarks | None = None,
    snapshot: DeviceSnapshot | None = None,
    views: KeptViews | None = None,
) -> tuple[Any, Copies]:
    """The snapshot of ``state`` (tensors as views of ``flat``; None: kept live) and
    the copies that fill it. ``only``: ids of the poolable tensors to copy (see
    ``buffers.select_wave``); the others are kept live. ``views``: the views of
    ``flat`` the last snapshot in it used (``BufferSet.views``), reused where a
    tensor lands at the same place with the same dtype and shape.

    Copies from a CUDA device are issued here, as each view is laid out, so the
    bus is busy from the first tensor on (:class:`DeviceCopies`; ``marks``:
    where the training's work ends, taken on its thread, needed when this is
    not the training thread;
    ``snapshot``: GPU memory reserved for this save, ``device.py``);
    :func:`run_copies` makes the rest and waits for all."""
    offset = 0
    pinned = flat is not None and flat.is_pinned()
    todo = Copies(device=DeviceCopies(marks or StreamMarks(), pinned, snapshot))
    typed: dict[torch.dtype, torch.Tensor] = {}  # flat viewed as each dtype, once
    # Torch calls are what a background thread must keep few: each gives the GIL
    # away and takes it back from a training thread that calls torch too, which
    # slows that thread by several times what the calls take alone
    # (benchmarks/bench_gil_calls.py); a save of the same state into the same
    # buffer set finds its views here.
    kept = views if views is not None else KeptViews()
    kept.begin()

    def view_at(start: int, like: torch.Tensor) -> torch.Tensor:
        return kept.get((start, like.dtype, like.shape), lambda: _new_view(start, like))

    def _new_view(start: int, like: torch.Tensor) -> torch.Tensor:
        # One as_strided of flat seen as the dtype: a slice and two views are three
        # torch calls per tensor, each one more for async_save to block on.
        size = like.dtype.itemsize
        as_dtype = typed.get(like.dtype)
        if as_dtype is None:
            usable = flat.numel() - flat.numel() % size
            as_dtype = typed[like.dtype] = flat[:usable].view(like.dtype)
        shape = like.shape
        strides = like.stride() if like.is_contiguous() else _contiguous_strides(shape)
        # as_strided's offset counts from the storage's start, not the view's: a
        # pinned set is a page-aligned slice of a bigger allocation (buffers.py).
        return as_dtype.as_strided(shape, strides, as_dtype.storage_offset() + start // size)

    def snap(v: Any, name: str) -> Any:
        nonlocal offset
        if isinstance(v, torch.Tensor):
            local = pool_source(v)
            if local is None:
                # Sparse, quantized, other subclasses: staged the stock way, now
                # (from a device: after the work that wrote it, see to_host).
                if v.device.type == "cuda":
                    return todo.device.to_host(v)
                return v.detach().to("cpu", copy=True)
            if flat is None or (only is not None and id(v) not in only):
                if check_fence:
                    todo.live_checks.append((local.detach(), name, _digest(local)))
                return v
            n = local.numel() * local.element_size()
            offset = _aligned(offset)
            dst = view_at(offset, local)
            offset += n
            src = local
            if check_fence:
                todo.checks.append((dst, name, _digest(src)))
            if src.is_cpu and src.is_contiguous() and not (src.is_conj() or src.is_neg()):
                if n and n <= COPY_PIECE and src.dtype != torch.bool:
                    # Same dtype, both contiguous: copy_ moves the bits (NaN payloads too).
                    todo.pieces.append((dst, src))
                elif n:  # as bytes: a bool copy_ would rewrite bytes other than 0 and 1
                    src = src.detach()
                    whole_dst = flat[offset - n : offset]
                    whole_src = src.reshape(-1).view(torch.uint8)
                    if n <= COPY_PIECE:  # no slices: each view costs microseconds
                        todo.pieces.append((whole_dst, whole_src))
                    else:  # in pieces, for the copy threads
                        todo.pieces += [
                            (whole_dst[i : i + COPY_PIECE], whole_src[i : i + COPY_PIECE])
                            for i in range(0, n, COPY_PIECE)
                        ]
            elif src.is_cuda:
                todo.device.issue(dst, src)
            elif src.dtype == torch.bool:  # strided: as bytes, as above
                todo.whole.append((dst.view(torch.uint8), src.detach().view(torch.uint8), name))
            else:  # strided or conjugate: copy_ resolves them
                todo.whole.append((dst, src.detach(), name))
            if local is not v:  # a DTensor: its shard in the buffer, its layout kept
                return type(v)(dst, v._spec, requires_grad=False)  # as DCP's own staging does
            return dst
        if isinstance(v, dict):
            return {k: snap(x, f"{name}/{k}") for k, x in v.items()}
        if isinstance(v, list):
            return [snap(x, f"{name}/{i}") for i, x in enumerate(v)]
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return tuple(snap(x, f"{name}/{i}") for i, x in enumerate(v))
        # Plain values (step counters, RNG state, configs) are part of the snapshot.
        return copy.deepcopy(v)

    try:
        return snap(state, ""), todo
    except BaseException:
        todo.device.wait()  # no copy may still land in buffers given back
        raise


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def run_copies(
    todo: Copies, pool: Executor | None = None, on_fence: Callable[[], None] | None = None
) -> None:
    """Make the copies ``plan_copies`` recorded (``pool``: threads for the pieces) and
    wait for those it issued from CUDA devices: then the buffers hold the state.
    ``on_fence`` is called once every source was read, before the copies from a
    device snapshot to the host are done (only where there are such copies).

    Raises:
        StagingFenceError: with the fence check, a source changed after it was planned.
    """
    if todo.device is not None:
        todo.device.fence()
    for dst, src, _ in todo.whole:
        dst.copy_(src)
    # copy_ into memory touched by an earlier save: no page faults. One job per
    # COPY_PIECE bytes, not per tensor: a future per tensor costs more than the
    # copy of a small tensor, and a model and its optimizer have many small ones.
    jobs = _jobs(todo.pieces)
    if pool is not None and len(jobs) > 1:
        for _ in pool.map(_copy_pieces, jobs):
            pass
    else:
        for job in jobs:
            _copy_pieces(job)
    if todo.device is not None:
        if on_fence is not None and todo.device.later:
            todo.device.wait_fenced()
            on_fence()
        todo.device.wait()
    _fail_changed(todo.checks, "copied them")


def check_live(todo: Copies) -> None:
    """With the fence check: once the live tensors are written, whether they changed.

    Raises:
        StagingFenceError: a live tensor changed after the save was planned.
    """
    _fail_changed(todo.live_checks, "wrote them from the live state")


def _fail_changed(checks: list[tuple[torch.Tensor, str, str]], doing: str) -> None:
    changed = [name for t, name, before in checks if _digest(t) != before]
    if changed:
        raise StagingFenceError(
            f"{len(changed)} tensor(s) of the state changed while the async save {doing} "
            f"(e.g. {changed[0]!r}): with StagingConfig(overlap=True), wait for the save's "
            "staging_completion before the next optimizer step (or any in-place change); "
            "this save is not committed"
        )


def copy_into(
    state: Any,
    flat: torch.Tensor | None,
    pool: Executor | None = None,
    only: set[int] | None = None,
) -> Any:
    """A snapshot of ``state``, copied now: :func:`plan_copies` then :func:`run_copies`."""
    out, todo = plan_copies(state, flat, only)
    run_copies(todo, pool)
    return out


class DeviceCopies:
    """Copies from CUDA devices, each on the staging side stream of its device
    (:func:`~.device.side_stream`): it first waits for the work that wrote the
    state (the training thread's ``marks``, else the calling thread's current
    stream), and the training's next kernels do not queue behind the copies.
    Tensors the buffers cannot hold (sparse, quantized, other subclasses) are
    copied there too, at once (:meth:`to_host`).
    With a :class:`~.device.DeviceSnapshot`, a tensor that fits is copied
    within its device first, and to the host only after the fence
    (:meth:`fence`).

    Copies are queued in batches, one ``torch._foreach_copy_`` per device and
    :data:`ISSUE_BYTES` (each torch call on the overlap thread costs training
    a GIL hand-off). The sources are held until :meth:`wait`, so their memory
    is not reused while a copy may still read it.

    Call order: ``issue`` and ``to_host`` for each tensor (any one thread), then
    ``fence`` once, then ``wait_fenced`` and ``wait`` (in either order).
    """

    def __init__(
        self,
        marks: StreamMarks,
        non_blocking: bool,
        snapshot: DeviceSnapshot | None = None,
    ) -> None:
        self.marks = marks
        self.non_blocking = non_blocking
        self.snapshot = snapshot
        self.sides: dict[torch.device, Any] = {}
        #: (host destination, its copy on the device): copied after the fence.
        self.later: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._fenced: list[Any] = []
        # Per device, not yet queued: (destination, source) to the host, and
        # within the device; their bytes.
        self._to_host: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._on_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._pending_bytes: dict[torch.device, int] = {}
        self._held: list[torch.Tensor] = []  # what queued copies read or write

    def _side(self, device: torch.device) -> Any:
        """The device's side stream, told to wait for the state's work (once)."""
        side = self.sides.get(device)
        if side is None:
            side = self.sides[device] = side_stream(device)
            mark = self.marks.events.get(device)
            if mark is not None:
                side.wait_event(mark)
            else:
                side.wait_stream(torch.cuda.current_stream(device))
        return side

    def to_host(self, v: torch.Tensor) -> torch.Tensor:
        """A host copy of ``v`` (a CUDA tensor the buffers cannot hold), made now on
        the side stream: after the work that wrote it, whichever thread this is."""
        side = self._side(v.device)
        with torch.cuda.stream(side), torch.no_grad():
            out = v.detach().to("cpu", copy=True)
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()  # (a subclass's copy may not have waited: v is held till then)
        return out

    def issue(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` (queued in a batch; pinned: without waiting)."""
        device = src.device
        self._side(device)
        if src.is_conj() or src.is_neg():
            # A conjugate or negative view's memory is not its values, and the
            # batched copy within a device moves memory; the one to the host would
            # fix the values up on the host, racing a non-blocking copy. Resolved
            # first, on the side stream (held: the copies read it).
            self._held.append(src)
            with torch.cuda.stream(self.sides[device]), torch.no_grad():
                src = src.resolve_conj().resolve_neg()
        if src.dtype == torch.bool:
            # As bytes, as on the CPU: a bool copy kernel may rewrite bytes other
            # than 0 and 1 (a mask viewed from raw bytes), and the save keeps bits.
            src, dst = src.view(torch.uint8), dst.view(torch.uint8)
        on_device = self.snapshot.take(src) if self.snapshot is not None else None
        if on_device is None:
            self._to_host.setdefault(device, []).append((dst, src))
        else:
            self._on_device.setdefault(device, []).append((on_device, src))
            self.later.append((dst, on_device))
        self._held.append(src)
        pending = self._pending_bytes.get(device, 0) + src.nbytes
        self._pending_bytes[device] = pending
        if pending >= ISSUE_BYTES:  # the bus is busy while the rest is laid out
            self._queue(device)

    def _queue(self, device: torch.device) -> None:
        to_host = self._to_host.pop(device, [])
        on_device = self._on_device.pop(device, [])
        self._pending_bytes[device] = 0
        with torch.cuda.stream(self.sides[device]), torch.no_grad():
            if on_device:
                torch._foreach_copy_([d for d, _ in on_device], [s for _, s in on_device])
            if to_host:
                dsts, srcs = [d for d, _ in to_host], [s for _, s in to_host]
                torch._foreach_copy_(dsts, srcs, non_blocking=self.non_blocking)

    def fence(self) -> None:
        """After the last ``issue``: queue what is left, mark where each side stream
        has read the state, then queue the copies from the device snapshot to the
        host behind it."""
        for device, side in self.sides.items():
            self._queue(device)
            event = torch.cuda.Event()
            event.record(side)
            self._fenced.append(event)
            later = [(dst, d) for dst, d in self.later if d.device == device]
            if later:  # (self.later holds the places until this object goes)
                with torch.cuda.stream(side), torch.no_grad():
                    torch._foreach_copy_(
                        [dst for dst, _ in later],
                        [d for _, d in later],
                        non_blocking=self.non_blocking,
                    )

    def wait_fenced(self) -> None:
        """Return once every tensor of the state was read (it may change now)."""
        for event in self._fenced:
            event.synchronize()

    def wait(self) -> None:
        """Return once every queued copy is done, to the host too; let the sources go.
        (After a failed layout: nothing queued since is left running either.)"""
        for side in self.sides.values():
            side.synchronize()
        self._held.clear()


#: Bytes of copies from one device queued together (see :class:`DeviceCopies`).
ISSUE_BYTES = 64 << 20


def _jobs(
    pieces: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``pieces`` in order, cut into runs of at least ``COPY_PIECE`` bytes (the last
    may be less): a piece of a big tensor is a run of its own."""
    jobs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    run: list[tuple[torch.Tensor, torch.Tensor]] = []
    nbytes = 0
    for piece in pieces:
        run.append(piece)
        nbytes += piece[0].nbytes
        if nbytes >= COPY_PIECE:
            jobs.append(run)
            run, nbytes = [], 0
    if run:
        jobs.append(run)
    return jobs


def _copy_pieces(job: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    # One torch call for the whole job (no autograd: the sources may need grad).
    with torch.no_grad():
        torch._foreach_copy_([dst for dst, _ in job], [src for _, src in job])
