"""The copy of a state into a buffer set: now, or on a background thread behind a fence.

:func:`plan_copies` walks the state on the training thread: it takes the
snapshot's structure, copies the plain values (step counters, configs) and
lays every poolable tensor out in the buffer set as a view, recording each
copy to make. :func:`run_copies` then moves the bytes, on the training
thread (:func:`copy_into`: both at once) or on a background thread while
training goes on (``StagingConfig(overlap=True)``): then the state may change
only after the copies are done, the *fence* (DCP's ``staging_completion``).

A fence check (``StagingConfig(check_fence=True)``, for debugging) hashes every
source when the copy is planned and every copy when it is made (a tensor
left live, over the budget: once the save wrote it, :func:`check_live`): a
tensor changed in between was changed before the fence, and the save fails with
:class:`~dcp_multilevel.errors.StagingFenceError` naming it, instead of
silently storing a state no step had.
"""

from __future__ import annotations

import copy
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ..errors import StagingFenceError
from .buffers import COPY_PIECE, _aligned, _alignment, pool_source

__all__ = ["Copies", "check_live", "copy_into", "plan_copies", "run_copies", "stream_marks"]


@dataclass
class Copies:
    """The copies a snapshot still needs (``plan_copies``); ``run_copies`` makes them."""

    #: (destination, source) byte pieces of contiguous CPU tensors, any thread may copy.
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    #: (destination, source, name) copied with one ``copy_`` (strided, device tensors).
    whole: list[tuple[torch.Tensor, torch.Tensor, str]] = field(default_factory=list)
    #: (destination, name, hash of the source when planned): the fence check's.
    checks: list[tuple[torch.Tensor, str, str]] = field(default_factory=list)
    #: (live tensor, name, its hash when planned): the fence check's, for the
    #: tensors a save over budget writes from the live state (:func:`check_live`).
    live_checks: list[tuple[torch.Tensor, str, str]] = field(default_factory=list)
    non_blocking: bool = False


def _digest(t: torch.Tensor) -> str:
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    return xxhash.xxh3_64_hexdigest(t.reshape(-1).view(torch.uint8).numpy())


def plan_copies(
    state: Any,
    flat: torch.Tensor | None,
    only: set[int] | None = None,
    check_fence: bool = False,
) -> tuple[Any, Copies]:
    """The snapshot of ``state`` (tensors as views of ``flat``; None: kept live) and
    the copies that fill it. ``only``: ids of the poolable tensors to copy (see
    ``buffers.select_wave``); the others are kept live."""
    offset = 0
    todo = Copies(non_blocking=flat is not None and flat.is_pinned())

    def snap(v: Any, name: str) -> Any:
        nonlocal offset
        if isinstance(v, torch.Tensor):
            local = pool_source(v)
            if local is None:
                # Sparse, quantized, other subclasses: staged the stock way, now.
                return v.detach().to("cpu", copy=True)
            if flat is None or (only is not None and id(v) not in only):
                if check_fence:
                    todo.live_checks.append((local.detach(), name, _digest(local)))
                return v
            n = local.numel() * local.element_size()
            offset = _aligned(offset, _alignment(n))
            dst = flat[offset : offset + n].view(local.dtype).view(local.shape)
            offset += n
            src = local.detach()
            if check_fence:
                todo.checks.append((dst, name, _digest(src)))
            if (
                src.device.type == "cpu"
                and src.is_contiguous()
                and not (src.is_conj() or src.is_neg())
            ):
                if n:
                    whole_src = src.reshape(-1).view(torch.uint8)
                    whole_dst = flat[offset - n : offset]
                    todo.pieces += [
                        (whole_dst[i : i + COPY_PIECE], whole_src[i : i + COPY_PIECE])
                        for i in range(0, n, COPY_PIECE)
                    ]
            else:  # strided, conjugate or device tensors: copy_ resolves them
                todo.whole.append((dst, src, name))
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

    return snap(state, ""), todo


def stream_marks(tensors: list[torch.Tensor]) -> dict[torch.device, Any]:
    """An event on the calling thread's current stream of each CUDA device holding
    one of a state's ``tensors`` (``buffers.iter_tensors``). Recorded on the
    training thread when ``async_save`` is called, it lets copies made on another
    thread start once the work that wrote the state is done, instead of after
    whatever training queued since (that thread's own current stream would be the
    wrong one, too, for a training loop on a stream of its own)."""
    marks = {}
    for device in {t.device for t in tensors if t.is_cuda}:
        marks[device] = torch.cuda.Event()
        marks[device].record(torch.cuda.current_stream(device))
    return marks


def run_copies(
    todo: Copies, pool: Executor | None = None, marks: dict[torch.device, Any] | None = None
) -> None:
    """Make the copies ``plan_copies`` recorded (``pool``: threads for the pieces).

    ``marks``: :func:`stream_marks` taken on the training thread; without them the
    device copies wait for this thread's current streams (this must then be the
    training thread).

    Raises:
        StagingFenceError: with the fence check, a source changed after it was planned.
    """
    _device_copies(todo, marks or {})
    # copy_ into memory touched by an earlier save: no page faults.
    if pool is not None and len(todo.pieces) > 1:
        for _ in pool.map(_copy_piece, todo.pieces):
            pass
    else:
        for piece in todo.pieces:
            _copy_piece(piece)
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


#: One side stream per CUDA device for the staging copies (made on first use).
_SIDE_STREAMS: dict[torch.device, Any] = {}


def _device_copies(todo: Copies, marks: dict[torch.device, Any]) -> None:
    """The ``whole`` copies; from a CUDA device, on a stream of their own: they wait
    for the work that wrote the state (``marks``, else what is already queued on
    the device's current stream), and the training's next kernels do not queue
    behind them. Returns once every copy is done (the buffers then hold the state)."""
    on_cuda = [(d, s) for d, s, _ in todo.whole if s.device.type == "cuda"]
    for dst, src, _ in todo.whole:
        if src.device.type != "cuda":
            dst.copy_(src)
    if not on_cuda:
        return
    sides = []
    for device in {src.device for _, src in on_cuda}:
        side = _SIDE_STREAMS.get(device)
        if side is None:
            side = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
        if device in marks:
            side.wait_event(marks[device])
        else:
            side.wait_stream(torch.cuda.current_stream(device))
        sides.append(side)
    for dst, src in on_cuda:
        side = _SIDE_STREAMS[src.device]
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=todo.non_blocking)
        src.record_stream(side)  # its memory is not reused before the copy ran
    for side in sides:
        side.synchronize()


def _copy_piece(piece: tuple[torch.Tensor, torch.Tensor]) -> None:
    piece[0].copy_(piece[1])
