"""Remote store: checkpoint files in any fsspec location (``s3://``, ``gs://``, ``az://``,
``memory://``, ...), the durable last level.

Object stores have no rename, so a file cannot be written under a temporary
name and renamed into place, and s3fs file objects have no ``fileno()``. This
store therefore publishes every file with a single upload of complete content:

* ``open_write`` spools the caller's bytes to a local temporary file (under
  ``spool_dir``; see *Spool files* below) and uploads it on clean exit with
  ``fs.put_file`` (s3fs sends a file under two parts as one PUT, a larger one
  as a multipart upload of :data:`S3_PART_BYTES` parts, :data:`S3_PARTS_IN_FLIGHT`
  at a time, that it aborts on failure). An error inside the
  block uploads nothing. Spooling is what makes retries possible: the caller
  hands its bytes over incrementally and cannot replay them, but a spool file
  can be uploaded again, as a whole, as often as needed.
* After every upload the stored object's size is compared with the bytes
  written; a mismatch counts as a failed attempt (the file is uploaded again),
  and a mismatch that persists removes the broken object and raises.
* Every operation is retried on transient errors (connection resets, timeouts,
  5xx-style ``OSError`` from the backend) with capped exponential backoff and
  jitter. Errors that retrying cannot fix (missing object, access denied, bad
  arguments) are raised at once, unchanged; an endpoint that refuses the
  connection or whose host name does not resolve raises
  :class:`RemoteStoreError` at once; transient errors that outlast the retries
  become :class:`RemoteStoreError` too (``_retry.py`` classifies errors and
  runs the retry loop). On S3 these are the only attempts: botocore's and
  s3fs's own retries are turned off (one attempt per call), so a failing call
  costs one request, not botocore's five, each behind a backoff of its own.

Commit on this store is "manifest written last" (``supports_atomic_rename`` is
False): a crash can leave data objects without a manifest, never a manifest
without its data. Incomplete multipart uploads of a crashed process are
invisible but billed on S3 until aborted; give buckets an
``AbortIncompleteMultipartUpload`` lifecycle rule.

Spool files, the local copies of files being written: an object store cannot
take a file piece by piece and have it appear whole, and an upload that fails
must be sent again from the start; the caller hands its bytes over once. So
the store spools each file to local disk (:func:`spool_file`) and uploads the
spool as a whole. A process that dies mid-write leaves its spool behind:
:func:`sweep_spools` removes those. A spool file is named
``dcp-ml-spool-<pid>-<random>``: the pid tells a live writer's spool from
garbage.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib
import logging
import os
import posixpath
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from fsspec.asyn import AsyncFileSystem, sync
from fsspec.core import url_to_fs

from ..errors import ConfigError, RegistryError, RemoteStoreError
from ._retry import (
    UploadSizeMismatch,
    backoff_delay,
    one_attempt_client,
    one_attempt_options,
    retry,
)
from .base import FdWriteHandle, Store

__all__ = ["SPOOL_PREFIX", "RemoteStore", "spool_file", "sweep_spools"]


logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Lookups in flight at once in :meth:`RemoteStore.existing` (discovery of a root's
#: steps): enough to hide a round trip of tens of milliseconds behind the others,
#: few enough to stay far below S3's request rate per prefix. The client's own
#: connection pool may allow fewer (s3fs: botocore's 10, unless the storage option
#: ``config_kwargs={"max_pool_connections": 64}`` raises it).
_LOOKUPS_IN_FLIGHT = 64

#: S3 uploads (s3fs ``put_file``): parts of this size, this many in flight. s3fs sends
#: 50 MiB parts one at a time by default; smaller parts side by side keep the
#: connection busy while the server stores the previous ones (``bench_s3.py``
#: measures the save). Storage options ``upload_part_bytes`` and
#: ``upload_parts_in_flight`` set them.
S3_PART_BYTES = 8 << 20
S3_PARTS_IN_FLIGHT = 4
_S3 = ("s3", "s3a")

#: Largest ranged GET issued by ``read_into``: bounds the transient copy held
#: in memory per read while keeping requests large enough to run at full speed.
_READ_CHUNK = 64 << 20


class _RemoteReadHandle:
    __slots__ = ("_path", "_rpath", "_store", "size")

    def __init__(self, store: RemoteStore, path: str, rpath: str, size: int) -> None:
        self._store = store
        self._path = path
        self._rpath = rpath
        self.size = size

    def read_into(self, offset: int, out: memoryview) -> int:
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        end = min(offset + len(out), self.size)
        pos = offset
        fs = self._store.fs
        while pos < end:
            stop = min(end, pos + _READ_CHUNK)
            data = self._store._retry(
                "read",
                self._path,
                lambda p=pos, s=stop: fs.cat_file(self._rpath, start=p, end=s),
            )
            if not data:
                break  # the object shrank since it was opened: short read, caller checks
            data = memoryview(data)[: stop - pos]
            out[pos - offset : pos - offset + len(data)] = data
            pos += len(data)
        return max(0, pos - offset)


class RemoteStore(Store):
    """A store at an fsspec URL: ``s3://bucket/prefix``, ``gs://...``, ``memory://...``.

    Args:
        url: the root of the store. Objects are stored at ``<url>/<path>``.
        retries: extra attempts after a transient failure (so ``retries + 1``
            attempts in all); 0 disables retrying. A refused connection or an
            unknown host is never retried. On S3 the client retries nothing itself
            unless ``config_kwargs={"retries": {...}}`` sets botocore's retries
            (a connection attempt waits up to s3fs's ``connect_timeout``, 5 s,
            unless ``config_kwargs={"connect_timeout": ...}`` says otherwise).
        backoff: seconds before the first retry; doubled for every further one.
        backoff_max: cap on one wait, in seconds. Each wait is drawn uniformly
            from ``[d/2, d]`` (jitter: ranks that failed together do not retry in
            lockstep), where ``d = min(backoff_max, backoff * 2 ** (n - 1))``.
        spool_dir: local directory for files being written before their upload
            (default: the system temporary directory). Needs room for the files
            written concurrently; put it on node-local disk, not tmpfs, for
            large checkpoints.
        sync: accepted for interface parity with the local store and ignored: an
            object store has made an object durable when its upload returns.
        **storage_options: passed to the fsspec filesystem (s3fs: ``key``,
            ``secret``, ``client_kwargs={"endpoint_url": ...}``, ...). Without
            them the backend's own configuration applies (for S3: the
            ``AWS_*`` environment variables, including ``AWS_ENDPOINT_URL``).

    Raises:
        ConfigError: on an invalid option or a URL fsspec cannot open.
        RegistryError: when the fsspec backend for the URL's scheme is not installed.

    Reads go through ranged GETs; an object is assumed not to change while it
    is open (data files have unique names and are never rewritten; manifests
    are read whole with one request).
    """

    supports_atomic_rename = False
    prefers_large_reads = True

    def __init__(
        self,
        url: str,
        *,
        retries: int = 5,
        backoff: float = 0.2,
        backoff_max: float = 10.0,
        spool_dir: str | os.PathLike[str] | None = None,
        sync: bool = True,
        **storage_options: Any,
    ) -> None:
        del sync  # see the docstring: uploads are durable when they return
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise ConfigError(f"RemoteStore retries must be an integer >= 0, got {retries!r}")
        if not isinstance(backoff, (int, float)) or backoff < 0:
            raise ConfigError(f"RemoteStore backoff must be a number >= 0, got {backoff!r}")
        if not isinstance(backoff_max, (int, float)) or backoff_max < backoff:
            raise ConfigError(
                f"RemoteStore backoff_max must be a number >= backoff ({backoff!r}), "
                f"got {backoff_max!r}"
            )
        self.retries = retries
        self.backoff = float(backoff)
        self.backoff_max = float(backoff_max)
        self.spool_dir = os.fspath(spool_dir) if spool_dir is not None else None
        url = os.fspath(url)
        self._url = url.rstrip("/") if not url.endswith("://") else url
        scheme = url.split("://", 1)[0] if "://" in url else url
        part = storage_options.pop("upload_part_bytes", S3_PART_BYTES)
        parts = storage_options.pop("upload_parts_in_flight", S3_PARTS_IN_FLIGHT)
        #: Extra arguments of every ``fs.put_file`` (S3: its parts, sent side by side).
        self._put_options: dict[str, Any] = {}
        if scheme in _S3:
            self._put_options = {"chunksize": part, "max_concurrency": parts}
            storage_options = _without_upload_checksums(storage_options)
        storage_options = one_attempt_options(scheme, storage_options)
        try:
            # fsspec hands out one filesystem per set of options (and process):
            # stores built per save share its client and connection pool, which
            # takes hundreds of milliseconds to create. Its listing cache is
            # invalidated before every lookup below, so sharing cannot serve
            # stale answers. ``skip_instance_cache=True`` opts out.
            self.fs, root = url_to_fs(url, **storage_options)
        except ImportError as e:
            raise RegistryError(
                f"remote store {self._url} needs the fsspec backend for {scheme!r}, which "
                f"cannot be imported: {e}"
            ) from e
        except ValueError as e:
            raise ConfigError(f"remote store {self._url}: fsspec cannot open this URL: {e}") from e
        self._root = root.rstrip("/")
        one_attempt_client(scheme, self.fs)

    @property
    def url(self) -> str:
        """The root URL as given, without a trailing ``/``."""
        return self._url

    # ------------------------------------------------------------------ Store API

    @contextmanager
    def open_write(self, path: str) -> Iterator[FdWriteHandle]:
        """Spool the written bytes locally, then upload them as :meth:`put_file` does.

        Raises:
            RemoteStoreError: on exit, when the upload keeps failing.
        """
        with spool_file(self.spool_dir) as (fd, spool):
            handle = FdWriteHandle(fd)
            try:
                yield handle
            finally:
                os.close(fd)
            self.put_file(spool, path)

    def put_file(self, local_path: str | os.PathLike[str], path: str) -> None:
        """Upload the local file ``local_path`` to ``path`` (retried, size-checked).

        The fast path for copying files that are already on local disk (e.g. a
        committed L1 checkpoint): no spool copy is made.

        Raises:
            RemoteStoreError: when the upload keeps failing; a wrongly sized
                object it left behind is removed first.
        """
        local_path = os.fspath(local_path)
        size = os.path.getsize(local_path)
        rpath = self._path(path)

        def attempt() -> None:
            self.fs.put_file(local_path, rpath, **self._put_options)
            self._check_size(path, rpath, size)

        self._upload(path, rpath, attempt)

    def write_atomic(self, path: str, data: bytes) -> None:
        """Upload ``data`` in one PUT (no spool), retried and size-checked like :meth:`put_file`."""
        data = bytes(data) if not isinstance(data, bytes) else data
        rpath = self._path(path)

        def attempt() -> None:
            # One PUT of the whole content: the old object stays until it succeeds.
            self.fs.pipe_file(rpath, data)
            self._check_size(path, rpath, len(data))

        self._upload(path, rpath, attempt)

    @contextmanager
    def open_read(self, path: str) -> Iterator[_RemoteReadHandle]:
        """A handle that reads through ranged GETs of at most 64 MiB each (retried).

        Raises:
            FileNotFoundError: no object at ``path``.
            IsADirectoryError: ``path`` is a prefix, not an object.
        """
        rpath = self._path(path)
        info = self._stat(path, rpath)
        if info.get("type") == "directory":
            raise IsADirectoryError(
                errno.EISDIR, "is a prefix (directory), not an object", self._object_url(path)
            )
        yield _RemoteReadHandle(self, path, rpath, int(info["size"]))

    def read_bytes(self, path: str) -> bytes:
        """The whole object in one GET (retried); FileNotFoundError naming its URL when missing."""
        # One GET: a consistent snapshot even if the object is being replaced.
        rpath = self._path(path)
        try:
            return self._retry("read", path, lambda: self.fs.cat_file(rpath))
        except FileNotFoundError:
            raise self._not_found(path) from None

    def exists(self, path: str) -> bool:
        """Whether an object or prefix is at ``path``; RemoteStoreError when that stays unknown."""
        # Not fs.exists(): fsspec's default swallows every error and answers
        # False, which would let an outage look like "no manifest here".
        try:
            self._stat(path, self._path(path))
        except FileNotFoundError:
            return False
        return True

    def existing(self, paths: Iterable[str]) -> set[str]:
        """Those of ``paths`` that are objects or prefixes: one lookup each (a HEAD on S3),
        :data:`_LOOKUPS_IN_FLIGHT` at a time on an async backend (s3fs, gcsfs, adlfs).

        A lookup that fails for another reason than "not found" is asked again
        through :meth:`exists`, which retries it and raises what persists.
        """
        paths = list(paths)
        if not self.fs.async_impl or len(paths) < 2:
            return super().existing(paths)
        rpaths = [self._path(p) for p in paths]
        for rpath in rpaths:
            # As in _stat: a cached listing may predate another writer's upload.
            self.fs.invalidate_cache(rpath)
        results = sync(self.fs.loop, _info_each, self.fs, rpaths, _LOOKUPS_IN_FLIGHT)
        found = set()
        for path, result in zip(paths, results, strict=True):
            if isinstance(result, FileNotFoundError):
                continue
            if isinstance(result, Exception):
                if self.exists(path):  # retried one at a time; raises when it keeps failing
                    found.add(path)
                continue
            if isinstance(result, BaseException):
                raise result  # cancelled or interrupted: not an answer about the path
            found.add(path)
        return found

    def listdir(self, path: str) -> list[str]:
        """Sorted names of the objects and prefixes directly below ``path`` (a fresh listing)."""
        rpath = self._path(path)

        def ls() -> list[dict[str, Any]]:
            self.fs.invalidate_cache(rpath)
            return self.fs.ls(rpath, detail=True)

        try:
            entries = self._retry("list", path, ls)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = set()
        for entry in entries:
            name = entry["name"].rstrip("/")
            # Listing an object (not a prefix) returns the object itself; some
            # backends add a leading "/" (memory), so compare without them.
            if name.strip("/") == rpath.strip("/"):
                continue
            names.add(posixpath.basename(name))
        return sorted(names)

    def remove_tree(self, path: str) -> None:
        """Delete the object or every object below prefix ``path`` (retried; missing is fine)."""
        rpath = self._path(path)

        def rm() -> None:
            try:
                self.fs.rm(rpath, recursive=True)
            except FileNotFoundError:
                pass  # missing is fine, and a retry after a partial delete finds less
            finally:
                self.fs.invalidate_cache(rpath)

        self._retry("remove", path, rm)

    def sweep(self, older_than_s: float, *, dry_run: bool = False) -> list[str]:
        """Remove spool files abandoned by dead processes from the spool directory
        (with ``dry_run``: only list them).

        A spool file (``dcp-ml-spool-<pid>-*``) goes when it is older than
        ``older_than_s`` and the process that made it is not running here. The
        age rule also covers names without a pid and spool directories shared
        by containers with their own pid namespaces. Objects on the remote
        itself are not touched here: data of uncommitted checkpoints is removed
        by the manager's retention, and S3 multipart uploads a crashed process
        left incomplete need the bucket's ``AbortIncompleteMultipartUpload``
        lifecycle rule (see docs/levels.md).
        """
        directory = self.spool_dir or tempfile.gettempdir()
        removed = sweep_spools(directory, older_than_s, dry_run=dry_run)
        if removed and not dry_run:
            logger.info("swept %d abandoned spool file(s) from %s", len(removed), directory)
        return removed

    # ------------------------------------------------------------------ internals

    def _path(self, path: str) -> str:
        """The backend path of ``path`` below the root."""
        if not path:
            return self._root or "/"
        return f"{self._root}/{path}"

    def _object_url(self, path: str) -> str:
        return f"{self._url}/{path}" if path else self._url

    def _not_found(self, path: str) -> FileNotFoundError:
        return FileNotFoundError(errno.ENOENT, "no such object", self._object_url(path))

    def _stat(self, path: str, rpath: str) -> dict[str, Any]:
        def info() -> dict[str, Any]:
            # A listing cached by an earlier call may predate another writer's upload.
            self.fs.invalidate_cache(rpath)
            return self.fs.info(rpath)

        try:
            return self._retry("stat", path, info)
        except FileNotFoundError:
            raise self._not_found(path) from None

    def _check_size(self, path: str, rpath: str, expected: int) -> None:
        self.fs.invalidate_cache(rpath)
        try:
            stored = self.fs.info(rpath).get("size")
        except FileNotFoundError:
            # Eventually consistent stores may not list a fresh object yet.
            stored = None
        if stored != expected:
            what = "is missing" if stored is None else f"holds {stored} bytes"
            raise UploadSizeMismatch(
                f"{self._object_url(path)} {what} after its upload, but {expected} bytes "
                "were written"
            )

    def _upload(self, path: str, rpath: str, attempt: Callable[[], None]) -> None:
        try:
            self._retry("upload", path, attempt)
        except RemoteStoreError as e:
            if isinstance(e.__cause__, UploadSizeMismatch):
                # The object there is ours and wrong: a failed upload leaves nothing.
                try:
                    self.fs.rm_file(rpath)
                except FileNotFoundError:
                    pass
                except OSError as rm_error:
                    logger.warning(
                        "could not remove wrongly sized %s: %s", self._object_url(path), rm_error
                    )
            raise

    def _retry_delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        return backoff_delay(attempt, self.backoff, self.backoff_max)

    def _retry(self, operation: str, path: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried on transient errors; RemoteStoreError when they persist."""
        return retry(
            fn,
            operation=operation,
            url=self._object_url(path),
            attempts=self.retries + 1,
            delay=self._retry_delay,
            logger=logger,
        )


def _without_upload_checksums(options: dict[str, Any]) -> dict[str, Any]:
    """S3 ``options`` with botocore computing a checksum of each uploaded part only
    where S3 requires one (``request_checksum_calculation="when_required"``, botocore's
    behavior before 1.36), unless ``config_kwargs`` says otherwise. The store checks
    every upload's size, and every item carries its own checksum that a load verifies;
    a CRC32 of every part besides costs the uploading rank's CPU."""
    config = importlib.import_module("botocore.config").Config
    if "request_checksum_calculation" not in getattr(config, "OPTION_DEFAULTS", {}):
        return options  # an older botocore: it computes none
    kwargs = dict(options.get("config_kwargs") or {})
    kwargs.setdefault("request_checksum_calculation", "when_required")
    return {**options, "config_kwargs": kwargs}


async def _info_each(fs: AsyncFileSystem, rpaths: list[str], limit: int) -> list[Any]:
    """``fs._info`` of every path, ``limit`` at a time; each result or its exception."""
    slots = asyncio.Semaphore(limit)

    async def one(rpath: str) -> Any:
        async with slots:
            return await fs._info(rpath)

    return await asyncio.gather(*(one(r) for r in rpaths), return_exceptions=True)


#: Prefix of spool files (in ``spool_dir``); any left after a crash are garbage.
SPOOL_PREFIX = "dcp-ml-spool-"


@contextmanager
def spool_file(spool_dir: str | None) -> Iterator[tuple[int, str]]:
    """A new, empty spool file in ``spool_dir``, as ``(fd, path)``; removed on exit.

    ``spool_dir`` None means the system temporary directory; a given one is
    created when missing. The caller closes ``fd``.
    """
    if spool_dir is not None:
        os.makedirs(spool_dir, exist_ok=True)
    # The pid in the name lets sweep_spools() tell a live writer's spool from garbage.
    fd, spool = tempfile.mkstemp(prefix=f"{SPOOL_PREFIX}{os.getpid()}-", dir=spool_dir)
    try:
        yield fd, spool
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spool)


def sweep_spools(directory: str, older_than_s: float, *, dry_run: bool = False) -> list[str]:
    """Remove the spool files in ``directory`` abandoned by dead processes; their paths
    (with ``dry_run``: the paths only, nothing removed).

    A spool file goes when it is older than ``older_than_s`` seconds (by
    mtime) and the process named in it is not running here. A missing
    ``directory`` holds nothing to remove.
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    cutoff = time.time() - older_than_s
    removed = []
    for name in names:
        if not name.startswith(SPOOL_PREFIX):
            continue
        pid_text = name[len(SPOOL_PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and _process_alive(int(pid_text)):
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_mtime < cutoff:
                if not dry_run:
                    os.unlink(path)
                removed.append(path)
        except FileNotFoundError:
            continue  # another process swept it first
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
