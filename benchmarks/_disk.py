"""Files and the page cache: tree sizes and removal, eviction and residency checks,
and the raw disk's bandwidth for one file. Linux only where the page cache is involved.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

MIB = 1 << 20


# --------------------------------------------------------------------------- files, page cache


def tree_files(root: str | os.PathLike[str]) -> Iterator[Path]:
    """Every regular file under ``root`` (or ``root`` itself if it is a file)."""
    root = Path(root)
    if root.is_file():
        yield root
        return
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            yield Path(dirpath) / f


def tree_nbytes(root: str | os.PathLike[str]) -> tuple[int, int]:
    """(apparent bytes, number of files) under ``root``."""
    sizes = [p.stat().st_size for p in tree_files(root)]
    return sum(sizes), len(sizes)


def remove_tree(root: str | os.PathLike[str]) -> None:
    """Delete ``root`` and sync, so the deletion (journal, discards) is not charged
    to whatever is timed next."""
    root = Path(root)
    if root.is_dir():
        shutil.rmtree(root)
    elif root.exists():
        root.unlink()
    else:
        return
    os.sync()


@contextmanager
def scratch_dir(path: Path | None, prefix: str, *, parent: Path | None = None) -> Iterator[Path]:
    """``path`` (created if missing, left in place afterwards), or else a new
    temporary directory ``prefix*`` under ``parent`` (default: the system's),
    removed afterwards."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _evict_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        # Dirty pages cannot be dropped: make them clean first, then drop them all.
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict_tree(root: str | os.PathLike[str]) -> None:
    """Drop every file under ``root`` from the page cache (needs no privileges).

    Only this guest's cache: on a VM the host may still cache the virtual disk.
    """
    os.sync()
    for p in tree_files(root):
        _evict_file(p)


def warm_tree(root: str | os.PathLike[str]) -> None:
    """Read every file under ``root`` once, so that it is in the page cache.

    Ours writes with ``O_DIRECT`` (past the cache) and stock through it: a
    "warm" load right after a save would otherwise compare the disk with the
    cache."""
    for p in tree_files(root):
        with open(p, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


_libc: ctypes.CDLL | None = None


def _get_libc() -> ctypes.CDLL:
    global _libc  # noqa: PLW0603 - loaded once, lazily
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc = lib
    return _libc


def resident_fraction(root: str | os.PathLike[str]) -> float:
    """Fraction of the pages of the files under ``root`` that are in the page cache.

    Uses mincore(2) on a read-only mapping (mapping does not fault pages in).
    Returns NaN where that is not available.
    """
    try:
        libc = _get_libc()
    except OSError:
        return float("nan")
    page = mmap.PAGESIZE
    resident = total = 0
    for p in tree_files(root):
        size = p.stat().st_size
        if size == 0:
            continue
        npages = (size + page - 1) // page
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return float("nan")
            try:
                vec = ctypes.create_string_buffer(npages)
                if libc.mincore(addr, size, vec) != 0:
                    return float("nan")
                resident += sum(b & 1 for b in vec.raw)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        total += npages
    return resident / total if total else 0.0


# --------------------------------------------------------------------------- raw disk


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def random_bytes(nbytes: int, *, seed: int = 0) -> memoryview:
    """``nbytes`` incompressible bytes, reproducible from ``seed``."""
    return memoryview(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


def state_bytes(state: dict[str, torch.Tensor]) -> memoryview:
    """All tensors of ``state`` concatenated as one flat byte buffer (a copy)."""
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in state.values()]
    return memoryview(torch.cat(flat).numpy())


def raw_write_seconds(
    path: str | os.PathLike[str], data: memoryview, *, block: int = 64 * MIB
) -> float:
    """Seconds to write preallocated ``data`` to a new file in ``block``-sized writes + fsync.

    Pass the bytes the compared writers store (see :func:`state_bytes`): some
    storage (e.g. a VM disk on a compressing host) is faster for compressible
    data, so random bytes understate what the disk does for float tensors.
    """
    data = data.cast("B")
    remove_tree(path)
    # Fault every page of the source in first (outside the timing): the compared
    # writers read tensors that are in use, and so hot.
    int(np.frombuffer(data, dtype=np.uint8)[:: mmap.PAGESIZE].sum())
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(data), block):
            _write_all(fd, data[off : off + block])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def raw_read_seconds(path: str | os.PathLike[str], *, block: int = 64 * MIB) -> float:
    """Seconds to read the whole file in ``block``-sized reads after evicting it from cache."""
    evict_tree(path)
    buf = bytearray(block)
    view = memoryview(buf)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return time.perf_counter() - start
