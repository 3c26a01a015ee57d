"""The contenders of ``bench_codecs.py``: codecs (stock ZStandard, ZipNN, ours) and savers.

A :class:`Codec` builds an (encode, decode) pair per thread count; a
:class:`Saver` is a ``dcp.save`` writer, its planner and its reader.
``bench_codecs.py`` times them side by side. Stock DCP runs in its best
configuration for the job: its ZStandard streams spread over as many threads as
ours get (as ``FileSystemWriter(thread_count=N)`` spreads files), and its saves
with ``thread_count=2`` and ``DefaultSavePlanner(enable_plan_caching=True)``.
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from _data import tensor_bytes

Encode = Callable[[torch.Tensor], bytes]
Decode = Callable[[bytes, torch.Tensor], torch.Tensor]

#: Thread counts every codec is measured with (unless it says otherwise).
THREADS = (1, 2)


# --------------------------------------------------------------------------- codecs


@dataclass(frozen=True)
class Codec:
    name: str
    note: str
    # Builds (encode, decode) for a thread count.
    make: Callable[[int], tuple[Encode, Decode]]
    threads: tuple[int, ...] = THREADS
    copy_input: bool = False  # the encoder overwrites its input: hand it a copy
    # One stream per call and no threads of its own: with N threads, the tensors are
    # spread over N threads (as DCP's writer threads spread its files).
    spread: bool = False


class _KeepOpen(io.BytesIO):
    """A BytesIO whose close() keeps the buffer, like DCP's NoCloseWriter."""

    def close(self) -> None:
        pass


def _stock_codec() -> Codec:
    from torch.distributed.checkpoint._extension import ZStandard

    def make(_threads: int) -> tuple[Encode, Decode]:
        ext = ZStandard()

        def encode(t: torch.Tensor) -> bytes:
            out = _KeepOpen()
            w = ext.transform_to(out)
            w.write(tensor_bytes(t))
            w.close()  # ends the frame, as DCP's _write_item does
            return out.getvalue()

        def decode(blob: bytes, like: torch.Tensor) -> torch.Tensor:
            out = torch.empty(like.numel() * like.element_size(), dtype=torch.uint8)
            view = memoryview(out.numpy())
            r = ext.transform_from(io.BytesIO(blob))
            got = 0
            while got < len(view):
                n = r.readinto(view[got:])
                if not n:
                    raise ValueError(f"stock ZStandard stream ended after {got} of {len(view)} B")
                got += n
            return out.view(like.dtype).view(like.shape)

        return encode, decode

    return Codec(
        "stock-zstd",
        "torch.distributed.checkpoint._extension.ZStandard, one stream per tensor at the "
        "zstandard default level (3); with N threads the tensors are spread over N threads, "
        "as FileSystemWriter(thread_count=N) spreads its files",
        make,
        spread=True,
    )


def _zipnn_codec() -> Codec:
    from zipnn import ZipNN

    def make(threads: int) -> tuple[Encode, Decode]:
        z = ZipNN(input_format="torch", threads=threads)

        def decode(blob: bytes, like: torch.Tensor) -> torch.Tensor:
            return z.decompress(blob)

        return z.compress, decode

    return Codec(
        "zipnn",
        "ZipNN(input_format='torch', threads=N), library defaults otherwise; it overwrites "
        "its input, so it compresses copies made before the clock starts",
        make,
        copy_input=True,
    )


def _compression(codec: str, threads: int, args: argparse.Namespace) -> object:
    from dcp_multilevel.codecs import Compression

    kwargs: dict[str, object] = {"codec": codec, "threads": threads}
    if args.level is not None:
        kwargs["level"] = args.level
    if args.chunk_mib is not None:
        kwargs["chunk_size"] = int(args.chunk_mib * (1 << 20))
    return Compression(**kwargs)


def _our_codec(codec: str, args: argparse.Namespace) -> Codec:
    from dcp_multilevel.codecs import compress_tensor, decompress_tensor

    def make(threads: int) -> tuple[Encode, Decode]:
        comp = _compression(codec, threads, args)

        def encode(t: torch.Tensor) -> bytes:
            return compress_tensor(t, comp)

        def decode(blob: bytes, like: torch.Tensor) -> torch.Tensor:
            return decompress_tensor(blob, like=like, threads=threads, codec=codec)

        return encode, decode

    return Codec(
        f"ours-{codec}",
        f"dcp_multilevel.codecs {_compression(codec, 1, args)!r} with threads=N",
        make,
    )


CODECS: dict[str, Callable[[argparse.Namespace], Codec]] = {
    "stock-zstd": lambda _a: _stock_codec(),
    "zipnn": lambda _a: _zipnn_codec(),
    "ours-bytegroup": lambda a: _our_codec("bytegroup", a),
    "ours-zstd": lambda a: _our_codec("zstd", a),
}


# --------------------------------------------------------------------------- dcp.save writers


@dataclass(frozen=True)
class Saver:
    name: str
    note: str
    writer: Callable[[Path], object]
    reader: Callable[[Path], object]
    planner: Callable[[], object] | None = None  # None: DCP's default


#: Stock's writer threads in dcp.save (its best on this 2-core machine).
STOCK_SAVE_THREADS = 2
SAVERS = ("stock", "stock+ZStandard", "ours codec=None", "ours codec=bytegroup", "ours codec=zstd")


def make_saver(name: str, args: argparse.Namespace) -> Saver:
    """The writer ``name`` of :data:`SAVERS` (every one fsyncs). Stock: its writer
    threads and plan caching; ours: one writer thread, the codec's own threads."""
    from torch.distributed.checkpoint import (
        DefaultSavePlanner,
        FileSystemReader,
        FileSystemWriter,
    )
    from torch.distributed.checkpoint._extension import ZStandard

    from dcp_multilevel import MultiLevelReader, MultiLevelWriter

    t = STOCK_SAVE_THREADS
    caching = f"DefaultSavePlanner(enable_plan_caching=True), thread_count={t}, fsync"

    def stock(note: str, writer: Callable[[Path], object]) -> Saver:
        planner = lambda: DefaultSavePlanner(enable_plan_caching=True)  # noqa: E731
        return Saver(name, f"{note} ({caching})", writer, FileSystemReader, planner)

    if name == "stock":
        return stock("FileSystemWriter(path)", lambda p: FileSystemWriter(p, thread_count=t))
    if name == "stock+ZStandard":
        return stock(
            "FileSystemWriter(path, _extensions=[ZStandard()])",
            lambda p: FileSystemWriter(p, thread_count=t, _extensions=[ZStandard()]),
        )
    codec = name.removeprefix("ours codec=")
    comp = None if codec == "None" else _compression(codec, args.save_threads, args)
    note = f"MultiLevelWriter(path, codec={comp!r}) (thread_count=1, fsync)"
    return Saver(name, note, lambda p: MultiLevelWriter(p, codec=comp), MultiLevelReader)
