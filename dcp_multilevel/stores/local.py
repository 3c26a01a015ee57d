"""Node-local (or any POSIX) directory store: the usual first level.

Files are written to a temporary name in the same directory, fsynced, renamed
into place, and the directory is fsynced, so after a crash a file is either
complete under its final name or not there (temporaries are swept later).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import ConfigError
from ..format.layout import MANIFEST_NAME, TMP_MARKER
from . import _direct
from ._direct import DirectWriteHandle
from .base import FdWriteHandle, Store, WriteHandle

__all__ = ["LocalStore"]

logger = logging.getLogger(__name__)


class _LocalReadHandle:
    __slots__ = ("_fd", "size")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.size = os.fstat(fd).st_size

    def read_into(self, offset: int, out: memoryview) -> int:
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        done = 0
        while done < len(out):
            n = os.preadv(self._fd, [out[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done


class LocalStore(Store):
    """A store in a local directory (``/path`` or ``file:///path``).

    Args:
        root: the directory (created on first write).
        sync: fsync files and directories before publishing them. Turn off only
            for scratch data (e.g. tests on tmpfs): without it a power loss can
            leave a published file empty.
        direct_io: write whole blocks with ``O_DIRECT``, past the page cache,
            where the file system takes it (see ``_direct.py``: a fraction of
            the CPU an ordinary write takes, which matters while training runs
            beside an async save). Off by default (False or None): a checkpoint
            is read back soon after it is written (a restart on the same node,
            the drains to the higher levels), and through the page cache those
            reads cost no disk (``docs/benchmarks.md``).
    """

    supports_atomic_rename = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        sync: bool = True,
        direct_io: bool | None = None,
        **options: object,
    ):
        if options:
            raise ConfigError(
                f"options {sorted(options)} do not apply to the local directory store at "
                f"{os.fspath(root)!r} (storage options are for remote URLs such as s3://)"
            )
        root = os.fspath(root)
        if root.startswith("file://"):
            root = root[len("file://") :]
        self.root = Path(root)
        self.sync = sync
        if direct_io is not None and not isinstance(direct_io, bool):
            raise ConfigError(
                f"direct_io for the local store at {root!r} must be True, False or None, "
                f"got {direct_io!r}"
            )
        self.direct_io = bool(direct_io) and _direct.available()

    @property
    def url(self) -> str:
        """``file://`` and the root's absolute path."""
        return f"file://{self.root.absolute()}"

    def _abs(self, path: str) -> Path:
        return self.root / path if path else self.root

    @contextmanager
    def open_write(self, path: str) -> Iterator[WriteHandle]:
        """Write a temporary file beside ``path``, then rename it into place (atomic).

        With ``sync``, the file is fsynced before the rename and its directory
        after it; on error the temporary file is removed and nothing appears.
        """
        final = self._abs(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f"{final.name}{TMP_MARKER}{uuid.uuid4().hex[:12]}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        direct: DirectWriteHandle | None = None
        try:
            dfd = _direct.open_direct(tmp) if self.direct_io else None
            if dfd is not None:
                direct = DirectWriteHandle(fd, dfd)
                yield direct
                direct.finish()
            else:
                # Early writeback only where the file is fsynced at the end.
                yield FdWriteHandle(fd, early_writeback=self.sync)
            if self.sync:
                os.fsync(fd)
        except BaseException:
            if direct is not None:
                direct.close()
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        if direct is not None:
            direct.close()
        os.close(fd)
        os.replace(tmp, final)
        if self.sync:
            self._fsync_dir(final.parent)

    @contextmanager
    def open_read(self, path: str) -> Iterator[_LocalReadHandle]:
        """Open ``path`` for positioned reads (``preadv``); FileNotFoundError when missing."""
        fd = os.open(self._abs(path), os.O_RDONLY | os.O_CLOEXEC)
        try:
            yield _LocalReadHandle(fd)
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists: a file there is committed, as files appear only by rename."""
        return self._abs(path).exists()

    def existing(self, paths: Iterable[str]) -> set[str]:
        """Those of ``paths`` that exist: one ``stat`` each (on strings: a ``Path`` per
        lookup costs as much as the lookup, and discovery makes one per step)."""
        root = os.fspath(self.root)
        return {p for p in paths if os.path.exists(os.path.join(root, p))}

    def local_path(self, path: str) -> str:
        """The file's path on this machine's file system (always known here)."""
        return str(self._abs(path))

    def sweep(self, older_than_s: float, *, dry_run: bool = False) -> list[str]:
        """Remove temporary files (``*.tmp-*``) left by crashed writers below the root
        (with ``dry_run``: only list them).

        A live writer's temporary file is recent (its modification time moves
        with every write), so only files older than ``older_than_s`` go. The
        settled directories of committed checkpoints are not walked (see
        :func:`_temporaries`): a root of 10,000 checkpoints of 1,000 files each
        is swept by listing each checkpoint's own directory, not 10 million names.
        """
        removed: list[str] = []
        cutoff = time.time() - older_than_s
        for path in _temporaries(str(self.root)):
            try:
                if os.lstat(path).st_mtime < cutoff:
                    if not dry_run:
                        os.unlink(path)
                    removed.append(os.path.relpath(path, self.root))
            except FileNotFoundError:
                continue  # another rank swept it first
        if removed and not dry_run:
            logger.info("swept %d abandoned temporary file(s) below %s", len(removed), self.url)
        return removed

    def listdir(self, path: str) -> list[str]:
        """Sorted names below directory ``path``; empty when it is missing or not a directory."""
        try:
            return sorted(os.listdir(self._abs(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove_tree(self, path: str) -> None:
        """Remove ``path`` (a symlink itself, not its target); with ``sync``, fsync its parent."""
        target = self._abs(path)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, onerror=_gone_is_fine)
        else:
            target.unlink(missing_ok=True)
        if self.sync and target.parent.exists():
            self._fsync_dir(target.parent)

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _temporaries(top: str) -> Iterator[str]:
    """Paths of the temporary files (``*.tmp-*``) below ``top``, except in settled
    directories of committed checkpoints.

    A directory holding a manifest is a committed checkpoint, and its commit
    removed its temporaries (``StoredCheckpoint.sweep`` runs right after the
    manifest is written). A subdirectory of it (``data/``) whose modification
    time is older than the manifest's has had no entry created, renamed or
    removed since then (each of those moves it), so it holds no temporary
    file and is not listed. One written to after the commit (a save of the
    same step again that crashed) is newer and walked as before; so is one
    whose time equals the manifest's (a coarse clock cannot tell the order).
    What this misses: temporaries left when a writer crashed between a
    manifest and its sweep; they go when retention removes the checkpoint.

    Like ``os.walk``: directories that cannot be listed are passed over, and
    links to directories are not followed.
    """
    stack = [top]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                entries = list(it)
        except OSError:
            continue  # removed while we looked, or not readable: os.walk's default
        committed_ns = _manifest_mtime_ns(entries)
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if not is_dir:
                if TMP_MARKER in entry.name:
                    yield entry.path
            elif not entry.is_symlink() and not _settled(entry, committed_ns):
                stack.append(entry.path)


def _manifest_mtime_ns(entries: list[os.DirEntry[str]]) -> int | None:
    """The modification time of the manifest among ``entries``; None: there is none."""
    for entry in entries:
        if entry.name == MANIFEST_NAME:
            try:
                return entry.stat(follow_symlinks=False).st_mtime_ns
            except OSError:
                return None  # removed while we looked: not a committed checkpoint now
    return None


def _settled(entry: os.DirEntry[str], committed_ns: int | None) -> bool:
    """Whether the directory ``entry`` of a committed checkpoint (its manifest written at
    ``committed_ns``) is unchanged since the commit (see :func:`_temporaries`)."""
    if committed_ns is None:
        return False
    try:
        return entry.stat(follow_symlinks=False).st_mtime_ns < committed_ns
    except OSError:
        return True  # removed while we looked: nothing to sweep there


def _gone_is_fine(function: object, path: str, exc_info: tuple) -> None:
    """rmtree's error handler: what another process removed first is removed."""
    if not issubclass(exc_info[0], FileNotFoundError):
        raise exc_info[1]
