"""MultiLevelWriter: DCP's StorageWriter for dcp_multilevel checkpoints.

Save path (see ``docs/format.md``)::

    all ranks     reset(checkpoint_id) -> set_up_storage_writer -> prepare_local_plan
    coordinator   prepare_global_plan: refuse to overwrite (unless asked)
    all ranks     write_data: raw tensor bytes -> data/<rank>-<n>.<token>.bin
                  (token: fresh per rank and save), each file written under a
                  temporary name, fsynced, renamed
    coordinator   finish: manifest.json written last, atomically (the commit),
                  then every data file the new manifest does not name is deleted

With a ``reference`` (a committed sibling checkpoint), each tensor chunk is
stored as the smallest of raw, coded, or coded XOR the reference's bytes at
the same place (a delta chunk); the reference's bytes are read beside the
chunk being coded, never whole (``checkpoint/reference.py``, ``docs/delta.md``).

DCP calls ``finish`` only when ``write_data`` succeeded on every rank, so a
failure anywhere leaves no new manifest, and the old one (if any) untouched.

With ``levels``, the path names a step (``step-<N>``): the writer writes and
commits it on the first level, and the process's runtime for those levels
sends it on to the others in the background (``level_saves.py``).

Each save's health: each rank's report, and the record the coordinator commits
(``health/``, ``format/health.py``). DCP gathers every rank's write results to
the coordinator's ``finish``; each rank's
:class:`~dcp_multilevel.health.RankReport` travels with them as one more
result, under a name no item has, and the coordinator takes the reports out
before it commits::

    every rank    write_data -> results + [rank_report(...)]
    coordinator   finish     -> take_reports(results) -> Health in the manifest

Each rank's data files, coded and written: ``write_data`` calls
:func:`write_rank`, which cuts its rank's items into buckets, one data file
each; :func:`write_file` writes one of them, coding chunks ahead in the
writer's codec pool while it hashes and writes (``codecs/pipeline.py``), and
storing each chunk as raw, coded, or coded XOR the reference's bytes
(``checkpoint/save_reference.py``). It reads the writer's codec, buffers and
reference as the writer set them up.

A store's ``OSError`` while making, writing or publishing a data file becomes a
:class:`~dcp_multilevel.errors.CheckpointWriteError` naming the file, the
checkpoint, the rank and (with levels) the first level: DCP shows each rank's
error inside its ``CheckpointException``, where a bare ``NotADirectoryError``
says neither which save nor which rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import uuid
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing, contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import levels as levels_pkg
from .._phases import reached
from ..checkpoint import StoredCheckpoint, new_save_id
from ..checkpoint.pinned import release_pinned
from ..checkpoint.save_reference import SaveReference
from ..checkpoint.sources import object_record, tensor_of
from ..checkpoint.streams import StreamMarks
from ..codecs import BufferPool, EncodeJob, codec_for, encode_items, item_layout
from ..codecs.options import Compression
from ..errors import (
    CheckpointExistsError,
    CheckpointWriteError,
    ConfigError,
    DcpMultilevelError,
)
from ..format import Hasher, ItemLocation, data_file_path, dtype_name
from ..format.tensor_bytes import byte_view
from ..health import REPORT_FQN, Checks, Health, RankReport, Tally, count, count_on_device, rule_for
from ..levels.config import Level
from ..planning import balance
from ..staging import BackgroundSave, Stager, StagingConfig
from ..staging.buffers import HostBufferPool
from ..staging.live import LiveCountdown
from ..stores import Store, WriteHandle, store_for
from .arguments import check_arguments
from .planner import write_item_nbytes

if TYPE_CHECKING:  # the levels machinery loads only for a writer given levels
    from ..levels.follower import SaveTicket
    from ..levels.saves import LevelSaves
    from ..levels.topology import Topology

__all__ = ["MultiLevelWriter"]

logger = logging.getLogger("dcp_multilevel.writer")


# The logger users configure, named as documented (the writer's).


def rank_report(
    checks: Checks,
    rank: int,
    coordinator: bool,
    planner: SavePlanner,
    loss: float | None,
    tally: Tally | None,
) -> WriteResult:
    """This rank's health report, as a write result (see the module docstring).

    The custom checks see the planner's state: the state as staged, whose bytes
    were written. The coordinator adds what its planner's replica check found.
    """
    state = getattr(planner, "state_dict", None) or {}
    report = checks.report(rank, state, loss, tally or Tally())
    if coordinator and getattr(planner, "verify_replicas", False):
        found = tuple(getattr(planner, "health_findings", ()) or ())
        report = RankReport(rank, (*report.checked, "replicas"), (*report.findings, *found))
    return WriteResult(index=MetadataIndex(REPORT_FQN), size_in_bytes=0, storage_data=report)


def take_reports(results: Sequence[Sequence[WriteResult]]) -> tuple[list[Any], Health | None]:
    """Every rank's write results without the reports, and the health record they
    make (None when no rank sent one: another writer's results)."""
    items, reports = [], []
    for rank_results in results:
        for wr in rank_results:
            if isinstance(wr.storage_data, RankReport):
                reports.append(wr.storage_data)
            else:
                items.append(wr)
    if not reports:
        return items, None
    checked = [c for r in reports for c in r.checked]
    return items, Health.merged(checked, [f for r in reports for f in r.findings])


def replaces_quarantined(checkpoint: StoredCheckpoint) -> bool:
    """Whether the committed ``checkpoint`` a save is about to replace is quarantined:
    a run resumed from an older, clean step saves its steps again over the poisoned
    ones (logged; the manifest swap keeps the old one loadable until the new one
    commits). False when it is clean, or its manifest cannot be read."""
    try:
        manifest = checkpoint.manifest()
    except (DcpMultilevelError, OSError):
        return False
    if manifest.quarantined:
        logger.warning(
            "dcp_multilevel: replacing %s, quarantined (%s)",
            checkpoint.url,
            manifest.health.reason(),
        )  # type: ignore[union-attr]
    return manifest.quarantined


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


# The logger users configure, named as documented (not after this module).


class MultiLevelWriter(StorageWriter, AsyncStager):
    """Write a DCP checkpoint to ``path`` as raw bytes + a JSON manifest.

    Args:
        path: checkpoint location (a directory path or URL). May be replaced per
            save by ``dcp.save(..., checkpoint_id=...)``. With ``levels``: the
            step, ``"step-<N>"`` (the same name below every level's root), or
            that name below the first level's root.
        levels: save to several levels (:class:`~dcp_multilevel.Level`, fastest
            first; ``docs/levels.md``): ``dcp.save`` returns once the first level
            committed the step; the others receive it in the background, each
            every ``every``-th save of this level list (partner copies, parity,
            remote drains; deltas, retention). Writers and readers given the same
            levels share them, in the whole process; ``dcp_multilevel.wait()``
            waits for the drains. Construction is then collective (every rank, in
            the same order). The first level's ``codec``, ``storage_options`` and
            ``overwrite`` are the writer's.
        topology: with ``levels``: which node each rank is on (default: each
            rank's environment: ``DCP_ML_NODE``, else ``GROUP_RANK``, else
            ``NODE_RANK``, else ``RANK // LOCAL_WORLD_SIZE``, else node 0;
            ``docs/levels.md``, "Nodes").
        due: with ``levels``: the higher levels each save goes to (indices into
            ``levels``), instead of their ``every``.
        overwrite: allow replacing a committed checkpoint at ``path``. The old
            one stays loadable until the new one commits (atomic manifest swap).
        thread_count: data files written in parallel per rank.
        sync_files: fsync data and manifest before publishing them. Leave on
            unless the storage is scratch: without it a crash can commit a
            manifest that points at data the OS never wrote.
        codec: compress tensor data: ``None`` (default: local disk is faster
            than compression), ``"bytegroup"``, ``"zstd"``, a third-party codec
            name, or a :class:`~dcp_multilevel.Compression` with level,
            chunk size and threads. Non-tensor values are stored uncompressed.
        storage_options: options for a remote location's store and fsspec
            backend (``retries``, ``spool_dir``, s3fs ``key``/``endpoint_url``...).
        staging: how ``dcp.async_save`` stages through this writer (an
            ``AsyncStager``): :class:`~dcp_multilevel.staging.StagingConfig`
            (default: no budget, wait; ``docs/async.md``).
        stock_hint: also write a ``.metadata`` (default): tools that probe for it
            see a checkpoint, and stock DCP's reader fails naming ours; a pickle
            that scanners flag, ``False`` omits it (``docs/interop.md``).
        reference: store tensor chunks as deltas against this committed
            checkpoint where that is smaller (a path or URL, or a
            :class:`~dcp_multilevel.checkpoint.StoredCheckpoint`). It must be a
            sibling directory of ``path`` (``run/step-8`` for ``run/step-9``)
            and stay there while this checkpoint is kept: loading a delta reads
            it. Needs a ``codec``. Items whose dtype, shape or placement
            changed, non-tensor values, and items this process cannot read in
            the reference are stored whole.
        extra: plain-JSON values the coordinator records in the manifest
            (``Manifest.extra``; the manager keeps its schedule's state there).
            Loads do not depend on them; drains carry them along.
        checks: the health checks every save runs (default: all on,
            :class:`~dcp_multilevel.Checks`; ``Checks.off()``: none). A save
            they find poisoned is committed *quarantined*: with ``levels``,
            it stays on the first level, retention counts it last and a
            load of the newest step passes over it (``docs/health.md``).
        loss: this save's training loss, judged by ``checks.loss`` (set it per
            save on a reused writer; keep one ``Checks`` across saves, whose
            loss rule remembers the losses it saw).

    Raises:
        ConfigError: on an invalid option.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        levels: Sequence[Level] | None = None,
        topology: Topology | None = None,
        due: Sequence[int] | None = None,
        overwrite: bool = False,
        thread_count: int = 1,
        sync_files: bool = True,
        codec: Compression | str | None = None,
        storage_options: dict[str, Any] | None = None,
        staging: StagingConfig | None = None,
        stock_hint: bool = True,
        reference: str | os.PathLike[str] | StoredCheckpoint | None = None,
        extra: dict[str, Any] | None = None,
        checks: Checks | None = None,
        loss: float | None = None,
    ) -> None:
        super().__init__()
        check_arguments(
            "MultiLevelWriter",
            path=(path, "path"),
            overwrite=(overwrite, "bool"),
            sync_files=(sync_files, "bool"),
            stock_hint=(stock_hint, "bool"),
            storage_options=(storage_options, "options"),
            extra=(extra, "options"),
        )
        if checks is not None and not isinstance(checks, Checks):
            raise ConfigError(f"MultiLevelWriter(checks=...) takes a Checks, got {checks!r}")
        #: The health checks every save runs (``docs/health.md``).
        self.checks = checks if checks is not None else Checks()
        #: The next save's training loss (judged by ``checks.loss``; None: none given).
        self.loss = loss
        #: What the last committed save's checks found (the coordinator's; None before).
        self.health: Health | None = None
        self._levels: LevelSaves | None = None
        if levels is not None:
            self._levels = levels_pkg.LevelSaves.of(
                levels,
                topology,
                due,
                codec=codec,
                storage_options=storage_options,
                reference=reference,
            )
        elif topology is not None or due is not None:
            raise ConfigError("MultiLevelWriter: topology and due go with levels=[...]")
        elif path is None:
            raise ConfigError("MultiLevelWriter needs a path (or levels=[...])")
        if self._levels is not None:  # the first level's options are the writer's
            first = self._levels.runtime.first
            codec, storage_options = first.codec, first.storage_options
            overwrite = overwrite or first.overwrite
        self.extra = dict(extra or {})
        #: With ``levels``: the higher levels the next save goes to (None: their ``every``).
        self.due = None if due is None else list(due)
        try:  # the coordinator writes it into the manifest at the commit
            json.dumps(self.extra, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"MultiLevelWriter extra must be plain JSON: {e}") from None
        self._stager = Stager(staging)
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ConfigError(f"thread_count must be an integer >= 1, got {thread_count!r}")
        self.overwrite = overwrite
        self.thread_count = thread_count
        self.sync_files = sync_files
        self.storage_options = dict(storage_options or {})
        self.stock_hint = stock_hint
        self.compression = Compression.of(codec)
        # Resolve now: an unknown codec is a configuration error, not a failed save.
        self._codec = codec_for(self.compression) if self.compression else None
        if reference is not None:
            warnings.warn(
                "MultiLevelWriter(reference=...) is deprecated: deltas are a level's "
                "(levels=[Level(root, codec='bytegroup', keyframe_every=N)], docs/delta.md); "
                "reference goes in the next major release",
                DeprecationWarning,
                stacklevel=2,
            )
        if reference is not None and self._codec is None:
            raise ConfigError(
                f"MultiLevelWriter({os.fspath(path)!r}, reference=...) stores deltas, which "
                "are coded: pass a codec too (codec='bytegroup')"
            )
        if reference is not None and not isinstance(reference, StoredCheckpoint):
            reference = StoredCheckpoint.at(reference, storage_options)
        self.reference: StoredCheckpoint | None = reference
        self._delta = (
            SaveReference(reference, self.storage_options) if reference is not None else None
        )
        self._codec_pool: ThreadPoolExecutor | None = None
        # Coded-chunk payloads, reused across chunks and saves: each part is
        # written (copied by the store) before the next one is coded into it.
        self._payload_buffers = BufferPool() if self._codec is not None else None
        self.path: str | None = None
        if path is not None:
            self._set_path(path)
        if self._levels is not None:  # after the path: a reference is the step's sibling
            reference = self._levels.reference()  # collective
            if reference is not None:
                self.reference = reference
                self._delta = SaveReference(reference, self.storage_options)
        #: The id of the save being made (or last made): DCP's ``storage_meta().save_id``,
        #: the manifest's ``save_id`` and the reader's ``storage_meta.save_id``.
        self.save_id = new_save_id()
        self._committed_id: str | None = None
        self._allowed_globals: list[Any] | None = None  # see stage()
        self._check_reference()  # again per save: checkpoint_id may move the path
        self.rank = 0
        self.is_coordinator = True
        #: Bytes this rank stored in its last write_data (for metrics).
        self.bytes_written = 0
        #: Tensor items this rank stored with delta chunks in its last write_data.
        self.delta_items = 0

    #: DCP calls synchronize_staging right after it submitted a save: an
    #: over-budget save returns from async_save only once its live tensors are written.
    _synchronize_after_execute = True

    def __getstate__(self) -> dict[str, Any]:
        # AsyncCheckpointerType.PROCESS pickles the writer to DCP's daemon process:
        # thread pools stay here; the stager pickles only what the daemon needs.
        if self._levels is not None:
            raise ConfigError(
                "dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS) "
                "with MultiLevelWriter(levels=...): the levels' drains run in this process, "
                "which DCP's daemon would never tell that a save committed; use "
                "AsyncCheckpointerType.THREAD (the default)"
            )
        state = dict(self.__dict__)
        state["_codec_pool"] = None
        state["_payload_buffers"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._allowed_globals:  # in DCP's daemon: what the training process allowed
            torch.serialization.add_safe_globals(self._allowed_globals)

    # ------------------------------------------------------------------ staging (AsyncStager)

    @property
    def staging_pool(self) -> HostBufferPool | None:
        """The stager's host buffer pool (None before the first async save)."""
        return self._stager.pool

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into the stager's host buffers (training thread)."""
        # The types the caller allowed for weights_only loading, as of this save: in
        # PROCESS mode the value check runs in DCP's daemon, which has not got them.
        self._allowed_globals = list(torch.serialization.get_safe_globals())
        if self._levels is not None:
            self._levels.staging(self._delta is not None)
        return self._stager.stage(state_dict, checkpoint_id=self.checkpoint_id)

    def synchronize_staging(self) -> None:
        """Right after DCP submitted the save: over budget, wait for its live tensors."""
        self._stager.synchronize()

    def close(self) -> None:
        """Free the buffers no save is using, and the page-locked blocks synchronous
        saves from a CUDA device left cached; the writer can still be used after."""
        self._stager.close()
        release_pinned()

    # ------------------------------------------------------------------ lifecycle

    def _set_path(self, path: str | os.PathLike[str]) -> None:
        if self._levels is not None:
            step = self._levels.step
            path = self._levels.location(path)
            if step is not None and self._levels.step != step and self._delta is not None:
                # The reference was chosen for the step this writer was built for.
                self.reference = self._delta = None
                self._levels.reference_step = None
        self.path = os.fspath(path)
        self.checkpoint = StoredCheckpoint.at(self.path, self.storage_options, sync=self.sync_files)

    @property
    def ticket(self) -> SaveTicket | None:
        """With ``levels``: the last save's ticket (``levels/follower.py``)."""
        return self._levels.ticket if self._levels is not None else None

    def _reporting(self, outcome: str | None) -> contextlib.AbstractContextManager:
        """:meth:`LevelSaves.reporting` with levels; nothing without."""
        if self._levels is None:
            return contextlib.nullcontext()
        return self._levels.reporting(outcome)

    @property
    def store(self) -> Store:
        """The store the checkpoint is written to."""
        return self.checkpoint.store

    @property
    def checkpoint_id(self) -> str:
        """The location this writer saves to (with levels: on the first level)."""
        return self.path or ""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a save (at ``checkpoint_id``, when given); claims an async save's staging."""
        # DCP's first call of a save given a checkpoint_id: an async save's background
        # part begins here, waiting for this writer's earlier saves before the path
        # changes or any collective runs.
        self._stager.claim(checkpoint_id=os.fspath(checkpoint_id or self.checkpoint_id))
        if checkpoint_id:
            self._set_path(checkpoint_id)
        self.save_id = new_save_id()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Note this rank; refuse ``use_collectives=False`` (one coordinator commits for all)."""
        if not kwargs.get("use_collectives", True):
            raise ConfigError(
                "MultiLevelWriter needs dcp.save(..., use_collectives=True) (the default): "
                "the checkpoint is committed once, by the coordinator, for all ranks"
            )
        self.rank = int(kwargs.get("rank") or 0)
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> StorageMeta:
        """This save's location and ``save_id`` (the id the commit records, as stock's).

        Claims an async save's staging at the latest.
        """
        # DCP's first call of every save (reset only comes with a checkpoint_id): an
        # async save's background part begins here at the latest, before the planner
        # is set up (see Stager.claim; again on the same thread it changes nothing).
        self._stager.claim(checkpoint_id=self.checkpoint_id)
        if self._committed_id == self.save_id:
            # The same writer saving again without reset(): stock reuses the id, but
            # ours names one save (copies between levels and delta references match
            # saves by it), so the next save gets its own.
            self.save_id = new_save_id()
        if self._levels is not None:
            self._levels.begin(self.extra, self.due, self.overwrite)
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The plan unchanged, once every tensor's dtype is known to be storable."""
        # Fail before any byte is written if a tensor cannot be stored.
        with self._reporting(None):
            for item in plan.items:
                if item.tensor_data is not None:
                    dtype_name(item.tensor_data.properties.dtype, fqn=item.index.fqn)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The plans unchanged; :class:`CheckpointExistsError` before overwriting unasked.

        Replaced without asking: a quarantined checkpoint, and with ``levels`` a step
        newer than the one the last load resumed from that the load passed over as not
        restorable (a timeline that no longer exists; ``docs/levels.md``, "After a
        crash"). With ``levels``, every rank hears of a refusal (no drain waits for it).
        """
        with self._reporting(None):
            self._refuse_overwrite()
            self._check_reference()  # a reference that is no sibling fails before any write
        return plans

    def _refuse_overwrite(self) -> None:
        """:class:`CheckpointExistsError` when the save would replace a committed
        checkpoint unasked (see :meth:`prepare_global_plan`)."""
        if self.overwrite:
            return
        newer = self._levels.refusal() if self._levels is not None else None
        if not self.checkpoint.is_committed():
            if newer is None:
                return
        elif replaces_quarantined(self.checkpoint) or (
            self._levels is not None and self._levels.replacing(self.checkpoint, self.save_id)
        ):
            return
        # "Checkpoint already exists": the words stock's FileSystemWriter raises
        # and callers (training stacks) match.
        raise CheckpointExistsError(
            f"Checkpoint already exists at {self.checkpoint.url} and overwrite=False: "
            "refusing to replace it. "
            + (f"{newer} " if newer else "")
            + "Save to a new location, or pass MultiLevelWriter(..., overwrite=True) to "
            "replace it (the old one stays loadable until the new one commits).",
            checkpoint=self.checkpoint.url,
        )

    def _check_reference(self) -> None:
        if self._delta is not None and self.path is not None:
            self._delta.name_for(self.checkpoint)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items to its own data files; the future is complete."""
        # An async save's thread writes at background priority; failures are recorded.
        with (
            self._reporting("written"),
            self._stager.background("write_data", rank=self.rank) as save,
        ):
            return self._write_data(plan, planner, save)

    def _write_data(
        self, plan: SavePlan, planner: SavePlanner, save: BackgroundSave
    ) -> Future[list[WriteResult]]:
        """This rank's data files; the returned future is complete."""
        tally = Tally() if self.checks.nonfinite else None
        results = write_rank(self, plan, planner, save, tally)
        reached("write", self._levels.step if self._levels is not None else None)
        self.bytes_written = sum(r.size_in_bytes for r in results)
        self.delta_items = sum(r.storage_data.reference is not None for r in results)
        results.append(
            rank_report(self.checks, self.rank, self.is_coordinator, planner, self.loss, tally)
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit (coordinator): the manifest written last, then stale files swept."""
        with (
            self._reporting("committed"),
            self._stager.background("finish", rank=self.rank),
        ):
            self._finish(metadata, results)

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The commit: the manifest, written last; then the sweep of stale files."""
        locations: dict[MetadataIndex, ItemLocation] = {}
        files: dict[str, int] = {}
        written, health = take_reports(results)
        for wr in written:
            loc: ItemLocation = wr.storage_data
            locations[wr.index] = loc
            files[loc.file] = max(files.get(loc.file, 0), loc.offset + loc.length)
        self.checkpoint.commit(
            metadata,
            locations,
            files,
            save_id=self.save_id,
            world_size=len(results),
            reference=self._delta and self._delta.checked(self.checkpoint, locations),
            extra=self.extra,
            stock_hint=self.stock_hint,
            health=health,
        )
        self._committed_id = self.save_id
        self.health = health
        if health is not None and health.quarantined:
            logger.warning(
                "dcp_multilevel: %s is committed QUARANTINED: %s",
                self.checkpoint.url,
                health.reason(),
            )
            if self._levels is not None:
                self._levels.quarantined(health.reason())
        # dcp.save returns this metadata: its storage_meta names the save, as stock's.
        metadata.storage_meta = StorageMeta(checkpoint_id=self.path, save_id=self.save_id)
        self.checkpoint.sweep(keep=files)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True when a store can be built for ``checkpoint_id`` (any path or known URL)."""
        try:
            store_for(checkpoint_id)
        except (ValueError, LookupError):
            return False
        return True

    # ------------------------------------------------------------------ internals

    def _pool(self) -> ThreadPoolExecutor | None:
        """The codec pool (None: code inline), reused across saves.

        ``threads - 1`` workers: the writing thread codes too (see
        ``encode_items``), so ``threads`` threads code in all.
        """
        c = self.compression
        if c is not None and c.threads > 1 and self._codec_pool is None:
            # Its threads exit with the process.
            self._codec_pool = ThreadPoolExecutor(c.threads - 1, thread_name_prefix="dcp-ml-codec")
        return self._codec_pool
