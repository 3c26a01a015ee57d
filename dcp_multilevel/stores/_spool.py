"""Spool files: the local copies of files being written to a remote store.

An object store cannot take a file piece by piece and have it appear whole,
and an upload that fails must be sent again from the start; the caller hands
its bytes over once. So the remote store spools each file to local disk
(:func:`spool_file`) and uploads the spool as a whole. A process that dies
mid-write leaves its spool behind: :func:`sweep_spools` removes those.

A spool file is named ``dcp-ml-spool-<pid>-<random>``: the pid tells a live
writer's spool from garbage.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["SPOOL_PREFIX", "spool_file", "sweep_spools"]

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
