"""A rank's data files of a :class:`~dcp_multilevel.MultiLevelWriter` save: coded and written.

The writer's ``write_data`` calls :func:`write_rank`, which cuts its rank's
items into buckets, one data file each; :func:`write_file` writes one of them,
coding chunks ahead in the writer's codec pool while it hashes and writes
(``codecs/pipeline.py``), and storing each chunk as raw, coded, or coded XOR
the reference's bytes (``checkpoint/save_reference.py``). It reads the
writer's codec, buffers and reference as the writer set them up.

A store's ``OSError`` while making, writing or publishing a data file becomes a
:class:`~dcp_multilevel.errors.CheckpointWriteError` naming the file, the
checkpoint, the rank and (with levels) the first level: DCP shows each rank's
error inside its ``CheckpointException``, where a bare ``NotADirectoryError``
says neither which save nor which rank.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing, contextmanager
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..checkpoint.sources import object_record, tensor_of
from ..checkpoint.streams import StreamMarks
from ..codecs import EncodeJob, encode_items, item_layout
from ..errors import CheckpointWriteError, DcpMultilevelError
from ..format import Hasher, ItemLocation, data_file_path
from ..format.tensor_bytes import byte_view
from ..health import Tally, count, count_on_device, rule_for
from ..planning import balance
from ..staging import BackgroundSave
from ..staging.live import LiveCountdown
from ..stores import WriteHandle
from .planner import write_item_nbytes

if TYPE_CHECKING:
    from .writer import MultiLevelWriter

__all__ = ["write_file", "write_rank"]

#: Bytes counted (non-finite values) then hashed at a time: still in cache for the hash.
_COUNT_SLICE = 1 << 20

#: Chunks in flight per codec thread: enough to keep every thread busy while
#: the writer thread hashes and writes (a few MiB each; bounds memory).
_WINDOW_PER_THREAD = 3


def write_rank(
    writer: MultiLevelWriter,
    plan: SavePlan,
    planner: SavePlanner,
    save: BackgroundSave,
    tally: Tally | None,
) -> list[WriteResult]:
    """This rank's part of a save: its items cut into ``writer.thread_count`` data
    files, written in parallel (:func:`write_file` each)."""
    # File names come from this rank alone: DCP's plan caching can replay a
    # cached plan, so storage_data from the coordinator may be stale.
    token = uuid.uuid4().hex[:16]
    sizes = [write_item_nbytes(item) for item in plan.items]
    buckets = [[plan.items[i] for i in group] for group in balance(sizes, writer.thread_count)]
    # An async save over its staging budget left some tensors live (see
    # staging/stager.py): write those first, and let training go on once they are.
    live = save.live_items(plan.items, planner)
    if live:
        for bucket in buckets:
            bucket.sort(key=lambda item: item.index not in live)
    countdown = save.countdown(live)
    jobs = [(data_file_path(writer.rank, n, token), b) for n, b in enumerate(buckets)]
    # resolve_data may be called from several threads; DefaultSavePlanner's
    # lookup is a dict read, but torch.save of BYTE_IO items is not reentrant-safe
    # for every object, so that part is serialized.
    lock = threading.Lock()
    # Where the work that wrote the state ends, on this thread's current stream
    # (an async save's background thread follows its stage-time marks): the
    # writing threads read device tensors after it (checkpoint/streams.py).
    args = (planner, lock, countdown, tally, StreamMarks.here())
    if len(jobs) <= 1:
        return [r for job in jobs for r in write_file(writer, *job, *args)]
    with ThreadPoolExecutor(len(jobs), thread_name_prefix="dcp-ml-write") as pool:
        futures = [pool.submit(write_file, writer, *job, *args) for job in jobs]
        return [r for f in futures for r in f.result()]


def write_file(
    writer: MultiLevelWriter,
    path: str,
    items: list[WriteItem],
    planner: SavePlanner,
    lock: threading.Lock,
    countdown: LiveCountdown,
    tally: Tally | None = None,
    marks: StreamMarks | None = None,
) -> list[WriteResult]:
    """Write ``items`` to one data file, coding ahead in the pool while writing.

    ``encode_items`` keeps a window of chunks from this item and the next
    ones in the codec pool, so coding overlaps the hashing and writing
    done here; memory stays bounded by that window. With a ``tally``, each
    floating-point item's non-finite values are counted on the way: a raw
    item's slice by slice just before the hash reads it, a coded item's chunk by
    chunk on the coding thread, a CUDA tensor's on its device. Device tensors are
    read after ``marks`` (none: after this thread's current stream).
    """
    results = []
    c = writer.compression
    pool = writer._pool()
    streams = ExitStack()  # the reference's data files, while their items are coded
    coded = encode_items(
        _jobs(writer, path, items, planner, lock, streams, tally),
        writer._codec,
        chunk_size=c.chunk_size if c else 0,
        pool=pool,
        window=_WINDOW_PER_THREAD * c.threads if c and pool else 1,
        buffers=writer._payload_buffers,
    )
    # (coded is lazy: the items are resolved and read in the loop, following the marks)
    with (
        (marks or StreamMarks()).following(),
        _data_file(writer, path) as out,
        streams,
        closing(coded),
    ):
        pad_for = getattr(out, "pad_for", None)  # a direct-I/O file (stores/_direct.py)
        for job, parts in coded:
            if pad_for is not None and job.layout is None:
                with _writing(writer, path):
                    pad_for(job.view)  # a big tensor then goes to the disk uncopied
            start = out.tell()
            hasher = Hasher()
            rule = job.count_rule if job.layout is None else None
            for piece in parts:
                if rule is not None:  # raw: each slice counted, then hashed from cache
                    n = 0
                    for at in range(0, len(piece), _COUNT_SLICE):
                        piece_slice = piece[at : at + _COUNT_SLICE]
                        n += count(piece_slice, rule)
                        hasher.update(piece_slice)
                    tally.add(job.key.index.fqn, n)  # type: ignore[union-attr]
                else:
                    hasher.update(piece)
                with _writing(writer, path):
                    out.write(piece)
            length = out.tell() - start
            transforms = () if job.layout is None else (writer._codec.descriptor,)  # type: ignore[union-attr]
            raw = len(job.view)
            src = job.reference
            ref = src.loc.checksum if src is not None and src.used else None  # type: ignore[attr-defined]
            loc = ItemLocation(path, start, length, raw, hasher.hexdigest(), transforms, ref)
            results.append(WriteResult(index=job.key.index, size_in_bytes=length, storage_data=loc))
            countdown.written(job.key.index)
    return results


@contextmanager
def _data_file(writer: MultiLevelWriter, path: str) -> Iterator[WriteHandle]:
    """``writer.store.open_write(path)``: its ``OSError`` making the file or publishing
    it on exit as :func:`_unwritable`'s error; errors of the block pass unchanged."""
    inside: BaseException | None = None
    try:
        with writer.store.open_write(path) as out:
            try:
                yield out
            except BaseException as e:
                inside = e
                raise
    except OSError as e:
        if e is inside or isinstance(e, DcpMultilevelError):
            raise
        raise _unwritable(writer, path, e) from e


@contextmanager
def _writing(writer: MultiLevelWriter, path: str) -> Iterator[None]:
    """A write to the data file ``path``: its ``OSError`` as :func:`_unwritable`'s error."""
    try:
        yield
    except OSError as e:
        if isinstance(e, DcpMultilevelError):
            raise
        raise _unwritable(writer, path, e) from e


def _unwritable(writer: MultiLevelWriter, path: str, error: OSError) -> CheckpointWriteError:
    """What could not be written, where, by which rank, and what to do (the module docstring)."""
    checkpoint = writer.checkpoint.url
    saves = writer._levels
    if saves is None:
        level = None
        where = f"checkpoint {checkpoint}"
        todo = (
            "Make the checkpoint's path a directory this rank can write, with room for the "
            "checkpoint, or save elsewhere"
        )
    else:
        level = saves.runtime.first.url
        where = f"step {saves.step} on the first level {level} ({checkpoint})"
        todo = (
            "Make the first level's root a directory every rank can write on its node, "
            "with room for the checkpoint, or give the first Level another url"
        )
    err = CheckpointWriteError(
        f"rank {writer.rank} could not write data file {path} of {where}: "
        f"{type(error).__name__}: {error}. {todo}.",
        checkpoint=checkpoint,
        file=path,
        rank=writer.rank,
        level=level,
    )
    err.errno = error.errno
    return err


def _jobs(
    writer: MultiLevelWriter,
    path: str,
    items: list[WriteItem],
    planner: SavePlanner,
    lock: threading.Lock,
    streams: ExitStack,
    tally: Tally | None,
) -> Iterator[EncodeJob]:
    """Each item's bytes and how to store them, resolved as the coder asks for them.

    A framed item the reference holds alike gets its reference stream
    (opened here, closed by ``streams`` at the latest). With a ``tally``: how
    its non-finite values are counted (see :func:`write_file`).
    """
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            record = object_record(planner, item, lock)
            yield EncodeJob(item, record, None, f"item {item.index.fqn!r} of {path}")
        else:
            data = planner.resolve_data(item)
            rule = rule_for(item.tensor_data.properties.dtype) if tally is not None else None
            counted = None
            if rule is not None and isinstance(data, torch.Tensor) and data.is_cuda:
                counted = count_on_device(data)  # before tensor_of's copy waits for the device
                rule = None
            tensor = tensor_of(item, data)
            if counted is not None:  # (on this thread's stream, as the copy)
                tally.add(item.index.fqn, counted.result())  # type: ignore[union-attr]
            view = byte_view(tensor)
            layout = item_layout(view, tensor.dtype, writer._codec, writer.compression)
            source = (
                writer._delta.stream_of(writer.checkpoint, item, streams)
                if layout is not None and writer._delta is not None
                else None
            )
            name = f"item {item.index.fqn!r} of {path}"
            observe = None
            if rule is not None and layout is not None:
                fqn = item.index.fqn

                def observe(
                    chunk: memoryview, fqn: str = fqn, rule: tuple[int, int] = rule
                ) -> None:
                    tally.add(fqn, count(chunk, rule))  # type: ignore[union-attr]

            yield EncodeJob(item, view, layout, name, source, observe, rule)
