"""Shared helpers for the benchmarks.

Model-shaped state dicts built from config numbers (no downloads), timing,
page-cache control (fsync, eviction, residency check), raw disk bandwidth and
markdown output. Linux only where the page cache is involved.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

__all__ = [
    "GB",
    "MIB",
    "BertConfig",
    "assert_state_equal",
    "bert_pretraining_shapes",
    "build_state_dict",
    "cpu_snapshot",
    "evict_tree",
    "gbps",
    "machine_info",
    "markdown_table",
    "median",
    "other_cpu_fraction",
    "random_bytes",
    "raw_read_seconds",
    "raw_write_seconds",
    "remove_tree",
    "resident_fraction",
    "state_bytes",
    "state_nbytes",
    "timed",
    "tree_files",
    "tree_nbytes",
    "wait_for_idle",
    "zeros_like_state",
]

GB = 1e9  # decimal, as disks and bandwidth figures are quoted
MIB = 1 << 20

T = TypeVar("T")


# --------------------------------------------------------------------------- state dicts


@dataclass(frozen=True)
class BertConfig:
    """The numbers of a BERT config; the defaults are BERT-large."""

    vocab_size: int = 30522
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    max_position_embeddings: int = 512
    type_vocab_size: int = 2


def bert_pretraining_shapes(cfg: BertConfig) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of ``BertForPreTraining.state_dict()`` for ``cfg``.

    Written out by hand from the Hugging Face module structure. The tied MLM
    decoder weight (``cls.predictions.decoder.weight``, shared with the word
    embeddings in a real model) is listed as its own tensor, as it is a separate
    key of the state dict; the non-persistent ``position_ids`` buffer is not.
    """
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "bert.embeddings.word_embeddings.weight": (cfg.vocab_size, h),
        "bert.embeddings.position_embeddings.weight": (cfg.max_position_embeddings, h),
        "bert.embeddings.token_type_embeddings.weight": (cfg.type_vocab_size, h),
        "bert.embeddings.LayerNorm.weight": (h,),
        "bert.embeddings.LayerNorm.bias": (h,),
    }
    for n in range(cfg.num_hidden_layers):
        p = f"bert.encoder.layer.{n}"
        for proj in ("query", "key", "value"):
            shapes[f"{p}.attention.self.{proj}.weight"] = (h, h)
            shapes[f"{p}.attention.self.{proj}.bias"] = (h,)
        shapes[f"{p}.attention.output.dense.weight"] = (h, h)
        shapes[f"{p}.attention.output.dense.bias"] = (h,)
        shapes[f"{p}.attention.output.LayerNorm.weight"] = (h,)
        shapes[f"{p}.attention.output.LayerNorm.bias"] = (h,)
        shapes[f"{p}.intermediate.dense.weight"] = (i, h)
        shapes[f"{p}.intermediate.dense.bias"] = (i,)
        shapes[f"{p}.output.dense.weight"] = (h, i)
        shapes[f"{p}.output.dense.bias"] = (h,)
        shapes[f"{p}.output.LayerNorm.weight"] = (h,)
        shapes[f"{p}.output.LayerNorm.bias"] = (h,)
    shapes.update(
        {
            "bert.pooler.dense.weight": (h, h),
            "bert.pooler.dense.bias": (h,),
            "cls.predictions.bias": (cfg.vocab_size,),
            "cls.predictions.transform.dense.weight": (h, h),
            "cls.predictions.transform.dense.bias": (h,),
            "cls.predictions.transform.LayerNorm.weight": (h,),
            "cls.predictions.transform.LayerNorm.bias": (h,),
            "cls.predictions.decoder.weight": (cfg.vocab_size, h),
            "cls.seq_relationship.weight": (2, h),
            "cls.seq_relationship.bias": (2,),
        }
    )
    return shapes


def build_state_dict(
    shapes: dict[str, tuple[int, ...]], *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Random normal tensors of the given shapes, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen, dtype=dtype) for name, shape in shapes.items()}


def zeros_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A destination state dict of the same names, shapes and dtypes, filled with zeros."""
    return {name: torch.zeros_like(t) for name, t in state.items()}


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    """Logical bytes of all tensors in ``state``."""
    return sum(t.numel() * t.element_size() for t in state.values())


def assert_state_equal(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    """Raise AssertionError naming the first missing or differing tensor."""
    missing = expected.keys() - actual.keys()
    if missing:
        raise AssertionError(f"loaded state lacks {len(missing)} keys, e.g. {min(missing)!r}")
    for name, want in expected.items():
        if not torch.equal(want, actual[name]):
            raise AssertionError(f"loaded tensor {name!r} differs from the saved one")


# --------------------------------------------------------------------------- timing


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Run ``fn`` once; return (wall seconds by ``time.perf_counter``, its result)."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def gbps(nbytes: int, seconds: float) -> float:
    """Bandwidth in GB/s (decimal)."""
    return nbytes / GB / seconds if seconds > 0 else float("inf")


# --------------------------------------------------------------------------- CPU contention


@dataclass(frozen=True)
class CpuSnapshot:
    wall: float  # perf_counter seconds
    user: float  # user-mode CPU seconds of all processes (from /proc/stat), NaN if unknown
    ours: float  # user-mode CPU seconds of this process (all threads)


def cpu_snapshot() -> CpuSnapshot:
    """Machine-wide and own user CPU time now, to tell how much other processes ran.

    User time only: the kernel's writeback and I/O work done for *our* saves and
    loads runs in kernel threads and would otherwise count as someone else's.
    """
    user = float("nan")
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        user = (fields[0] + fields[1]) / os.sysconf("SC_CLK_TCK")  # user + nice
    except (OSError, ValueError, IndexError):
        pass
    return CpuSnapshot(time.perf_counter(), user, os.times().user)


def other_cpu_fraction(before: CpuSnapshot, after: CpuSnapshot) -> float:
    """Share of the machine's CPU capacity other processes used (in user mode) in between.

    0.0 on an otherwise idle machine; 0.5 means one of two cores was busy elsewhere.
    """
    capacity = (os.cpu_count() or 1) * (after.wall - before.wall)
    if capacity <= 0:
        return float("nan")
    others = (after.user - before.user) - (after.ours - before.ours)
    return max(0.0, others / capacity)


def wait_for_idle(
    *, threshold: float = 0.1, window: float = 0.5, timeout: float = 60.0
) -> float | None:
    """Block until other processes use less than ``threshold`` of the CPU over ``window``.

    Returns the seconds waited, or None if the machine stayed busy for ``timeout``.
    """
    start = time.perf_counter()
    while True:
        before = cpu_snapshot()
        time.sleep(window)
        if other_cpu_fraction(before, cpu_snapshot()) < threshold:
            return time.perf_counter() - start
        if time.perf_counter() - start >= timeout:
            return None


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


# --------------------------------------------------------------------------- reporting


def _run(cmd: Sequence[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def machine_info(root: str | os.PathLike[str]) -> dict[str, str]:
    """What the numbers were measured on: code version, CPU, memory, the disk under
    ``root``, software versions."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "unknown"
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kib / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    df = _run(["df", "-hT", os.fspath(root)]).splitlines()
    disk = " ".join(df[-1].split()) if df else "unknown"
    dev = df[-1].split()[0] if df else ""
    rota = ""
    name = Path(dev).name
    rota_file = Path(f"/sys/block/{name}/queue/rotational")
    if rota_file.exists():
        rota = " rotational" if rota_file.read_text().strip() == "1" else " non-rotational"
    repo = Path(__file__).resolve().parents[1]
    commit = _run(["git", "-C", os.fspath(repo), "rev-parse", "--short", "HEAD"]) or "unknown"
    if _run(["git", "-C", os.fspath(repo), "status", "--porcelain", "--", "dcp_multilevel"]):
        commit += " + uncommitted changes in dcp_multilevel/"
    return {
        "code": f"dcp_multilevel at git {commit}",
        "cpu": f"{cpu}, os.cpu_count()={os.cpu_count()}, nproc={_run(['nproc']) or '?'}",
        "memory": mem,
        "disk": f"{disk} ({dev}{rota} as reported by the kernel)",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": f"{torch.__version__}, torch.get_num_threads()={torch.get_num_threads()}",
    }


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub markdown table; numbers right-aligned."""
    rows = [[str(c) for c in r] for r in rows]
    # max() of a list: a table with no rows (e.g. `--codecs ''`) is just its header.
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    align = ["---:" if i else ":---" for i in range(len(headers))]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "| "
        + " | ".join(
            a.rjust(w, "-") if i else a.ljust(w, "-")
            for i, (a, w) in enumerate(zip(align, widths, strict=True))
        )
        + " |",
    ]
    for r in rows:
        cells = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
