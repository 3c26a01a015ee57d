"""MultiLevelReader: DCP's StorageReader for dcp_multilevel checkpoints.

A reader loads ONE checkpoint, which may be stored as several copies on
different levels (node-local disk first, then slower ones). Each copy has its
own manifest, encoding and file layout; their DCP metadata must be identical.

Load path::

    all ranks     reset(checkpoint_id) -> read_metadata: the manifest of the first
                  copy, in order, that has a valid one -> set_up_storage_reader
                  -> prepare_local_plan
    coordinator   prepare_global_plan (unchanged: DCP's planner reshards)
    all ranks     read_data: from that copy, per file (or runs of a file's items,
                  one per thread), items sorted by offset, into the destination
                  tensors or scratch (``checkpoint/destinations.py``); every item
                  verified against its checksum before it is committed (fail
                  closed). Items missing, truncated or corrupt are read again from
                  the next copy (its manifest loaded and checked then), and so on.

Each rank chooses copies on its own: the reader runs no collective. Which
checkpoint every rank loads is the caller's agreement, except with
``levels``: then the ranks agree on the step, a lost node's files are
brought back before it is read, and the copies are the levels' (collective:
``level_reads.py``).
Non-tensor objects are vetted with ``torch.load(weights_only=True)`` before
DCP's planner sees them (its ``load_bytes`` unpickles with ``weights_only=False``).

Before any byte is read, the reader checks its options and the checkpoint it
is about to read (:func:`checked_fallbacks`, :func:`warn_if_quarantined`).

Each data file is read in runs: :func:`split_runs` cuts a copy's reads, per
file in offset order, into as many runs as there are threads; :func:`read_file`
reads one run from one copy, each item into its destination
(``checkpoint/destinations.py``) and verified before it is committed. What
failed is returned, not raised: the reader reads it from the next copy.

DCP's log of a failed metadata read is kept to one line. ``dcp.load``
(torch's ``state_dict_loader.py``) catches whatever
``StorageReader.read_metadata`` raises, logs "Global metadata is not found.
Falling back to rank local metadata." with the whole traceback (a warning on
that module's logger, the root logger in torch 2.13), and then raises a
``CheckpointException`` that carries the error's message. For
:class:`~dcp_multilevel.MultiLevelReader` the fallback does not exist (its
``read_metadata`` takes no ``rank``) and the traceback repeats what the
exception says. Its ``read_metadata`` is therefore wrapped in
:func:`one_line_in_dcp_log`: when it raises, :class:`FailedMetadataLine` is put
on that logger (once), and turns a record whose exception came out of the
wrapper into one line naming the error. Every other record passes unchanged,
other readers' failures included.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing
from types import CodeType
from typing import TYPE_CHECKING, Any, TypeVar

from torch.distributed.checkpoint import state_dict_loader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import levels as levels_pkg
from ..checkpoint import StoredCheckpoint, new_save_id
from ..checkpoint.destinations import Bounce, destination
from ..checkpoint.fallback import Failure, Trail, item_name, unusable_copy
from ..checkpoint.pinned import release_pinned
from ..checkpoint.reference import ReferenceFiles
from ..checkpoint.streams import StreamMarks
from ..errors import ConfigError, CorruptCheckpointError, DcpMultilevelError, ManifestError
from ..format import MANIFEST_NAME, ItemLocation, Manifest
from ..levels.config import Level
from ..stores import Store
from .arguments import check_arguments

if TYPE_CHECKING:  # the levels machinery loads only for a reader given levels
    from ..levels.loads import LevelLoads
    from ..levels.topology import Topology

__all__ = ["MultiLevelReader"]

logger = logging.getLogger("dcp_multilevel.reader")


# The logger users configure, named as documented (the reader's).


def checked_fallbacks(
    fallbacks: Sequence[str | os.PathLike[str]],
    options: Sequence[dict[str, Any] | None] | None,
) -> tuple[list[str | os.PathLike[str]], list[dict[str, Any] | None]]:
    """The fallbacks as a list, and one storage options entry per fallback.

    Raises:
        ConfigError: a single location given as ``fallbacks``, or not one options
            entry per fallback.
    """
    if isinstance(fallbacks, (str, bytes, os.PathLike)):
        raise ConfigError(
            f"fallbacks must be a sequence of locations, got the single location "
            f"{fallbacks!r}; pass fallbacks=[{fallbacks!r}]"
        )
    fallbacks = list(fallbacks)
    options = [None] * len(fallbacks) if options is None else list(options)
    if len(options) != len(fallbacks):
        raise ConfigError(
            f"fallback_storage_options has {len(options)} entries for "
            f"{len(fallbacks)} fallbacks; give one (a dict or None) per fallback"
        )
    return fallbacks, options


def warn_if_quarantined(manifest: Manifest, url: str) -> None:
    """Warn that the checkpoint at ``url`` is quarantined (``docs/health.md``): its
    checks found poisoned state; it is read all the same, as asked."""
    if manifest.quarantined:
        logger.warning(
            "dcp_multilevel: loading %s, which is QUARANTINED: %s", url, manifest.health.reason()
        )  # type: ignore[union-attr]


T = TypeVar("T")


class FailedMetadataLine(logging.Filter):
    """Turns a record about an exception raised through ``code`` into one line.

    Args:
        code: the code object whose frame marks the exceptions to shorten (the
            wrapper of :func:`one_line_in_dcp_log`).
    """

    def __init__(self, code: CodeType) -> None:
        super().__init__()
        self.code = code

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or not any(
            frame.f_code is self.code for frame, _ in traceback.walk_tb(exc.__traceback__)
        ):
            return True
        text = str(exc)
        # The first line: with fallbacks the message goes on listing every copy tried.
        record.msg = "dcp.load could not read the checkpoint's metadata: %s: %s"
        record.args = (type(exc).__name__, text.splitlines()[0] if text else "")
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        return True


_lock = threading.Lock()  # two readers failing at once put one filter on the logger


def one_line_in_dcp_log(read_metadata: Callable[[Any], T]) -> Callable[[Any], T]:
    """``read_metadata``, whose failures ``dcp.load`` logs in one line (module docstring)."""

    # Only ``self``: DCP passes ``rank=`` to a read_metadata that takes keywords.
    @functools.wraps(read_metadata)
    def wrapper(self: Any) -> T:
        try:
            return read_metadata(self)
        except Exception:
            _install(wrapper.__code__)
            raise

    return wrapper


def _install(code: CodeType) -> None:
    """Put a :class:`FailedMetadataLine` for ``code`` on the logger ``dcp.load`` logs a
    failed metadata read on, unless one is there (nothing if torch has no such logger)."""
    target = getattr(state_dict_loader, "logger", None)
    if not isinstance(target, logging.Logger):
        return
    with _lock:
        if not any(isinstance(f, FailedMetadataLine) and f.code is code for f in target.filters):
            target.addFilter(FailedMetadataLine(code))


#: Errors that condemn one copy of an item (or of a whole file) but not the
#: load: the item is read from the next copy. Corruption and missing files are
#: OSErrors, and so are I/O failures (EIO, a remote that stays down); a
#: ManifestError here means the copy's item needs a codec that is not installed.
COPY_ERRORS = (OSError, ManifestError)


def read_file(
    copy: StoredCheckpoint,
    file: str,
    reqs: list[tuple[int, ReadItem, ItemLocation]],
    planner: LoadPlanner,
    codec_pool: Callable[[], ThreadPoolExecutor | None],
    window: int,
    marks: StreamMarks | None = None,
) -> tuple[int, list[Failure]]:
    """Read ``reqs`` (sorted by offset) from one data file; (served, failures).

    ``codec_pool`` gives the pool coded items are decoded in (None: inline) when
    the first one comes; ``window``: chunks in flight while decoding. Copies
    into device tensors are queued after ``marks`` (none: after this thread's
    current stream); the caller waits for them (``StreamMarks.finish``).
    """
    served = 0
    failures: list[Failure] = []
    limit = max(loc.offset + loc.length for _, _, loc in reqs)
    with ExitStack() as stack:
        stack.enter_context((marks or StreamMarks()).following())
        try:
            handle = stack.enter_context(copy.open_data(file, reqs[0][1].storage_index.fqn, limit))
        except COPY_ERRORS as e:
            return 0, [Failure(i, req, file, e, whole_file=True) for i, req, _ in reqs]
        references = stack.enter_context(closing(ReferenceFiles()))
        references.plan(copy, [(req.storage_index, loc) for _, req, loc in reqs])
        bounce = Bounce()  # blocks allocated at its first CUDA item
        stack.callback(bounce.drain)  # the load ends once its copies are done
        for n, (i, req, loc) in enumerate(reqs):
            # Outside the try: a destination of the wrong shape is wrong for
            # every copy, and so is an object refused by weights_only loading.
            landing = destination(copy, req, loc, planner, bounce)
            try:
                if landing.out is None:
                    copy.read_stored(
                        handle, req.storage_index.fqn, loc, landing.blocks, landing.on_block
                    )
                else:
                    copy.read_item(
                        handle,
                        req.storage_index,
                        loc,
                        landing.out,
                        pool=codec_pool(),
                        window=window,
                        references=references,
                    )
            except COPY_ERRORS as e:
                if isinstance(e, (CorruptCheckpointError, ManifestError)):
                    failures.append(Failure(i, req, file, e, whole_file=False))
                    continue
                # An I/O error (EIO, a remote that stays down): do not wait out
                # the retries of every further item of this file on this copy.
                failures += [Failure(j, r, file, e, whole_file=True) for j, r, _ in reqs[n:]]
                break
            landing.commit()
            served += 1
    return served, failures


def split_runs(
    jobs: list[tuple[str, list[tuple[int, ReadItem, ItemLocation]]]], threads: int
) -> list[tuple[str, list[tuple[int, ReadItem, ItemLocation]]]]:
    """``jobs`` (per file, items in offset order) cut into more runs of adjacent items
    while there are fewer than ``threads``: the largest run is halved by bytes. A
    checkpoint written as one file per rank is then read by several threads."""
    jobs = list(jobs)
    while len(jobs) < threads:
        splittable = [j for j in range(len(jobs)) if len(jobs[j][1]) > 1]
        if not splittable:
            break
        k = max(splittable, key=lambda j: sum(loc.length for _, _, loc in jobs[j][1]))
        file, reqs = jobs.pop(k)
        half, seen, cut = sum(loc.length for _, _, loc in reqs) / 2, 0, 1
        for n, (_, _, loc) in enumerate(reqs[:-1], start=1):
            seen += loc.length
            cut = n
            if seen >= half:
                break
        jobs += [(file, reqs[:cut]), (file, reqs[cut:])]
    return jobs


# The logger users configure, named as documented (not after this module).


class MultiLevelReader(StorageReader):
    """Read a dcp_multilevel checkpoint from ``path``, falling back to other copies.

    Args:
        path: the fastest copy of the checkpoint (directory path or URL, e.g.
            node-local ``/nvme/run1/step-100``). May be replaced per load by
            ``dcp.load(..., checkpoint_id=...)`` (only by another spelling of
            the same location when ``fallbacks`` are given). With ``levels``:
            the step, ``"step-<N>"`` (or that name below the first level's
            root), or ``"latest"`` / None: the newest step every rank can read.
        levels: load from several levels (:class:`~dcp_multilevel.Level`, the
            writer's; ``docs/levels.md``): the ranks agree on the step, files a
            node lacks (a lost node) are brought back from the partner or
            erasure level first, then each item is read from the fastest level
            whose copy checks out. Construction and ``dcp.load`` are then
            collective (every rank).
        topology: with ``levels``: which node each rank is on (default: as the writer's,
            each rank's environment, ``DCP_ML_NODE``, else ``GROUP_RANK``, else ``NODE_RANK``,
            else ``RANK // LOCAL_WORLD_SIZE``, else node 0: ``docs/levels.md``, "Nodes").
        allow_quarantined: with ``levels`` and no step: load the newest step even
            when it is quarantined (``docs/health.md``; default: pass over those).
        fallbacks: other copies of the SAME checkpoint on slower levels, in the
            order to try them (e.g. ``["s3://bucket/run1/step-100"]``). They may
            use other codecs and file layouts; their DCP metadata must equal
            that of the copy in use, or they are not used.
        thread_count: data files read (and chunks decoded) in parallel per rank.
        storage_options: options for the store of ``path``.
        fallback_storage_options: options for the store of each fallback, one
            entry (a dict or None) per fallback; default: none for any.
        primary_manifest: the content of ``path``'s ``manifest.json`` when this
            process cannot read it there (a node-local level: the manifest is on
            rank 0's node, which sends it; see ``CheckpointManager``). It is
            validated as if read from ``path``; data files this process cannot
            see there are read from the fallbacks (a file absent there is then
            expected, not damage: no warning).

    Attributes:
        last_load_sources: after :meth:`read_data`, how many of this rank's
            items each copy served: ``{copy URL: item count}``, in the order
            of the copies, only copies that served at least one item (e.g.
            ``{"file:///nvme/run1/step-100": 41, "s3://bucket/run1/step-100": 1}``).
        metadata_source: URL of the copy whose manifest :meth:`read_metadata`
            used, None before.

    Loading needs no other option: each copy's manifest says what is where.
    A copy is used for an item only if the item's bytes match their checksum:
    unverified bytes are never committed. Problems that make the load go to
    another copy are logged as warnings on the ``dcp_multilevel.reader`` logger.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        levels: Sequence[Level] | None = None,
        topology: Topology | None = None,
        allow_quarantined: bool = False,
        fallbacks: Sequence[str | os.PathLike[str]] = (),
        thread_count: int = 1,
        storage_options: dict[str, Any] | None = None,
        fallback_storage_options: Sequence[dict[str, Any] | None] | None = None,
        primary_manifest: bytes | None = None,
    ) -> None:
        super().__init__()
        check_arguments(
            "MultiLevelReader",
            path=(path, "path"),
            allow_quarantined=(allow_quarantined, "bool"),
            storage_options=(storage_options, "options"),
        )
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ConfigError(f"thread_count must be an integer >= 1, got {thread_count!r}")
        if fallbacks:
            warnings.warn(
                "MultiLevelReader(fallbacks=...) is deprecated: give the copies as levels "
                "(MultiLevelReader('step-<N>', levels=[Level(fast), Level(slow), ...]), "
                "docs/levels.md); fallbacks go in the next major release",
                DeprecationWarning,
                stacklevel=2,
            )
        fallbacks, fallback_storage_options = checked_fallbacks(fallbacks, fallback_storage_options)
        self.thread_count = thread_count
        self.storage_options = dict(storage_options or {})
        self._fallbacks = [
            StoredCheckpoint.at(loc, opts)
            for loc, opts in zip(fallbacks, fallback_storage_options, strict=True)
        ]
        self._decode_pool: ThreadPoolExecutor | None = None
        self.last_load_sources: dict[str, int] = {}
        self._copies: list[StoredCheckpoint] = []
        self._primary_manifest = primary_manifest
        #: With ``levels``: the loads through them (``loads.restore.step``: the step
        #: agreed; ``loads.last_restore``: what was brought onto this rank's node).
        self.loads: LevelLoads | None = None
        if levels is not None:
            levels_pkg.LevelLoads.refuse(fallbacks, primary_manifest)
            runtime = levels_pkg.runtime_for(levels, topology=topology, who="MultiLevelReader")
            self.loads = levels_pkg.LevelLoads(runtime, path)
            self.loads.allow_quarantined = allow_quarantined
            self.path = self.loads.location
            self._new_load()
        elif path is None:
            raise ConfigError("MultiLevelReader needs a path (or levels=[...])")
        else:
            self._primary_url = StoredCheckpoint.at(path, self.storage_options).url
            self._set_path(path)
        self._new_load_id()

    def _set_path(self, path: str | os.PathLike[str]) -> None:
        primary = StoredCheckpoint.at(path, self.storage_options)
        if self._primary_manifest is not None and primary.url == self._primary_url:
            primary = StoredCheckpoint.at(
                path, self.storage_options, manifest_bytes=self._primary_manifest
            )
        if self._fallbacks and self._copies:
            old = self._copies[0].url
            if primary.url != old:
                raise ConfigError(
                    f"this MultiLevelReader reads checkpoint {old} with fallbacks "
                    f"{[c.url for c in self._fallbacks]}; dcp.load(checkpoint_id=...) asked "
                    f"for {primary.url}, whose copies it does not know. Build a "
                    "MultiLevelReader for that checkpoint (with its own fallbacks)."
                )
        self.path = primary.location
        self._copies = [primary, *self._fallbacks]
        self._new_load()

    def _new_load(self) -> None:
        """Forget every copy's manifest: the next read_metadata looks again."""
        for copy in self._copies:
            copy.forget()
        self._base: int | None = None  # index of the copy whose manifest steers the load
        self._trail = Trail(self._copies[0].url if self._copies else self.path)
        self.metadata_source: str | None = None

    def _new_load_id(self) -> None:
        #: This load's id, as stock readers' (new at construction and at each reset);
        #: ``read_metadata().storage_meta.load_id`` carries it.
        self.load_id = new_save_id()

    @property
    def checkpoint_id(self) -> str:
        """The location of the first copy (the one this reader tries first)."""
        return self.path

    @property
    def store(self) -> Store:
        """The store of the first copy."""
        return self._copies[0].store

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """The URLs of the fallback copies, in the order they are tried."""
        return tuple(c.url for c in self._fallbacks)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load: forget every copy's manifest; ``checkpoint_id`` moves the first copy.

        Raises:
            ConfigError: with fallbacks, ``checkpoint_id`` names another checkpoint.
        """
        if checkpoint_id and self.loads is not None:
            self.loads.aim(checkpoint_id)
            self.path = self.loads.location
            self._new_load()
        elif checkpoint_id:
            self._set_path(checkpoint_id)
        else:
            self._new_load()
        self._new_load_id()

    # Deliberately no **kwargs: DCP then does not retry with rank-local metadata
    # files, which dcp_multilevel never writes.
    @one_line_in_dcp_log
    def read_metadata(self) -> Metadata:
        """The DCP metadata from the first copy, in order, with a valid manifest.

        A copy without one is skipped with a warning. When no copy has one, the
        error is the first copy's, or the first error that is not "missing"
        when some copy exists but is damaged; with fallbacks its message lists
        every copy tried and why it failed.

        Raises:
            CheckpointNotFoundError: no copy has a manifest.
            ManifestError: a copy's manifest is invalid (and no copy is usable).
            OSError: a copy's storage could not be read (and no copy is usable);
                ``dcp.load`` logs it in one line (module docstring).
        """
        if self.loads is not None:  # collective: the step agreed, what a node lacks back
            copies, self._primary_manifest = self.loads.prepare()
            self._copies = self.loads.checkpoints(copies, self._copies, self._primary_manifest)
            self.path = self.loads.location
        self._new_load()
        for i, copy in enumerate(self._copies):
            try:
                manifest = copy.manifest()
            except (DcpMultilevelError, OSError) as e:
                after = self._copies[i + 1].url if i + 1 < len(self._copies) else None
                self._trail.skip(copy.url, e, after)
                continue
            self._base = i
            self.metadata_source = copy.url
            if self.loads is None:  # (with levels, the runtime chose the step knowingly)
                warn_if_quarantined(manifest, copy.url)
            md = manifest.metadata
            md.storage_meta = StorageMeta(
                checkpoint_id=copy.location, save_id=manifest.save_id, load_id=self.load_id
            )
            return md
        raise self._trail.no_usable_copy()

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Check that ``metadata`` is what :meth:`read_metadata` returned; nothing else to set up.

        Raises:
            ConfigError: ``metadata`` did not come from this reader's read_metadata.
        """
        if self._base is None or metadata.storage_data is not self._manifest().locations:
            # DCP hands back what read_metadata returned; anything else was not
            # validated by us and must not steer reads.
            raise ConfigError(
                "MultiLevelReader.set_up_storage_reader got metadata that its own "
                "read_metadata() did not return; call read_metadata() first"
            )

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """``plan`` unchanged: items are located through the manifest when they are read."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """``plans`` unchanged: each rank reads its own items, from copies it chooses."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan``, each from the first copy that has it intact.

        With ``levels`` (collective): what this rank reads of other ranks' files is
        brought first, and a read that fails on damaged first-level files is tried
        once more after intact copies were fetched from other nodes.

        Raises:
            CorruptCheckpointError, OSError, ManifestError: an item could not be
                read from any copy; the error is the last copy's (with fallbacks,
                its message names every copy tried and why each failed).
            UnsafeObjectError: a non-tensor object is refused by weights_only loading.
        """
        if self._base is None:
            raise ConfigError("MultiLevelReader.read_data called before read_metadata")
        levels = self.loads
        if levels is None:
            self._read_items(plan, planner)
        else:
            if self._primary_manifest is not None:  # the step is on the first level
                indices = [req.storage_index for req in plan.items]
                self._copies = levels.checkpoints(levels.complete(indices), self._copies)
            with levels.runtime.restorer.phase("read"):
                failed = self._try_read(plan, planner)
                if levels.repaired(failed is not None) and failed is not None:
                    failed = self._try_read(plan, planner)
            levels.finished(failed is None, self.last_load_sources)
            if failed is not None:
                raise failed
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _try_read(self, plan: LoadPlan, planner: LoadPlanner) -> Exception | None:
        """:meth:`_read_items`, its error returned: every rank must go on to the next
        collective whatever its read did."""
        try:
            self._read_items(plan, planner)
        except Exception as e:  # noqa: BLE001 - raised after the collectives
            return e
        return None

    def _read_items(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read every item of ``plan`` from the copies, in order (see :meth:`read_data`)."""
        assert self._base is not None
        self.last_load_sources = {}
        self._trail.items.clear()
        pending = list(enumerate(plan.items))
        for ci in range(self._base, len(self._copies)):
            if not pending:
                break
            copy = self._copies[ci]
            after = self._copies[ci + 1].url if ci + 1 < len(self._copies) else None
            unusable = unusable_copy(copy, self._copies[self._base]) if ci > self._base else None
            if unusable is not None:
                self._trail.unusable(copy.url, unusable, [i for i, _ in pending], after)
                continue
            if ci == 0 and self._primary_manifest is not None:
                pending, absent = self._split_absent(copy, pending)
            else:
                absent = []
            served, failures = self._read_from(copy, pending, planner)
            if served:
                self.last_load_sources[copy.url] = served
            self._trail.failed(copy.url, failures, after)
            pending = [(f.index, f.req) for f in sorted(failures + absent, key=lambda f: f.index)]
        release_pinned()  # CUDA destinations' pinned scratch
        if pending:
            raise self._trail.unreadable(pending)
        if len(self.last_load_sources) > 1:
            logger.info(
                "dcp_multilevel: loaded %d item(s) of %s: %s",
                len(plan.items),
                self._copies[0].url,
                ", ".join(f"{n} from {url}" for url, n in self.last_load_sources.items()),
            )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` holds a committed checkpoint (its manifest exists).

        False, not an error, for a location no installed store can open; an
        error reading the store (e.g. ``RemoteStoreError``) propagates.
        """
        try:
            return StoredCheckpoint.at(checkpoint_id).is_committed()
        except (ValueError, LookupError):
            return False

    # ------------------------------------------------------------------ copies

    def _manifest(self) -> Manifest:
        assert self._base is not None
        return self._copies[self._base].manifest()

    # ------------------------------------------------------------------ reading

    def _split_absent(
        self, copy: StoredCheckpoint, items: list[tuple[int, ReadItem]]
    ) -> tuple[list[tuple[int, ReadItem]], list[Failure]]:
        """``items`` whose data file ``copy`` (a node's own view of a node-local level)
        holds, and a failure for each of the others, recorded but not logged: the
        node was never meant to hold them (the next copies serve them)."""
        try:
            present = copy.data_files()
        except OSError:
            return items, []
        locations = copy.manifest().locations
        keep, absent = [], []
        for i, req in items:
            loc = locations.get(req.storage_index)
            if loc is None or loc.file in present:
                keep.append((i, req))
                continue
            err = FileNotFoundError(f"data file {loc.file} is not on this node's copy {copy.url}")
            absent.append(Failure(i, req, loc.file, err, whole_file=True))
        for f in absent:
            self._trail.items[f.index].append((copy.url, f.error, True))
        return keep, absent

    def _read_from(
        self, copy: StoredCheckpoint, items: list[tuple[int, ReadItem]], planner: LoadPlanner
    ) -> tuple[int, list[Failure]]:
        """Read ``items`` from ``copy``, per file in offset order; (served, failures)."""
        locations = copy.manifest().locations
        per_file: dict[str, list[tuple[int, ReadItem, ItemLocation]]] = defaultdict(list)
        failures: list[Failure] = []
        for i, req in items:
            loc = locations.get(req.storage_index)
            if loc is None:  # unreachable: every copy's metadata was compared
                err = ManifestError(
                    f"{copy.url} stores no item {item_name(req)}", checkpoint=copy.url
                )
                failures.append(Failure(i, req, MANIFEST_NAME, err, whole_file=False))
                continue
            per_file[loc.file].append((i, req, loc))
        jobs = [(f, sorted(reqs, key=lambda r: r[2].offset)) for f, reqs in per_file.items()]
        jobs = split_runs(jobs, self.thread_count)
        # Copies into device tensors: after the caller's queued work, done on return.
        marks = StreamMarks.here()
        decoding = (self._codec_pool, 2 * self.thread_count, marks)
        try:
            if self.thread_count == 1 or len(jobs) <= 1:
                results = [read_file(copy, *job, planner, *decoding) for job in jobs]
            else:
                workers = min(self.thread_count, len(jobs))
                with ThreadPoolExecutor(workers, thread_name_prefix="dcp-ml-read") as pool:
                    futures = [pool.submit(read_file, copy, *j, planner, *decoding) for j in jobs]
                    results = [f.result() for f in futures]
        finally:
            marks.finish()
        for _, job_failures in results:
            failures.extend(job_failures)
        failures.sort(key=lambda f: f.index)
        return sum(served for served, _ in results), failures

    def _codec_pool(self) -> ThreadPoolExecutor | None:
        if self.thread_count == 1:
            return None
        if self._decode_pool is None:
            self._decode_pool = ThreadPoolExecutor(
                self.thread_count, thread_name_prefix="dcp-ml-decode"
            )
        return self._decode_pool
