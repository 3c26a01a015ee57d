"""Compression codecs: chunked, multi-threaded zstd and float-aware byte grouping.

Codecs are found by registry name (``dcp_multilevel.zstd``,
``dcp_multilevel.bytegroup``, ...) through the ``dcp_multilevel.codecs``
entry-point group; the built-ins register the same way as third-party codecs.
The manifest records ``<name>/<version>`` per item, so a reader rebuilds the
codec from the checkpoint alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .._registry import Registry
from ..errors import RegistryError
from ..format import frames
from ..format.tensor_bytes import byte_view, pieces
from ._scratch import scratch
from .base import MIN_CODED_BYTES, Codec, element_layout
from .options import Compression
from .pipeline import (
    BufferPool,
    EncodeJob,
    ReferenceSource,
    decode_frames,
    encode_chunk,
    encode_frames,
    encode_items,
)

__all__ = [
    "CODECS",
    "MIN_CODED_BYTES",
    "MIN_SPLIT_CHUNK",
    "BufferPool",
    "Codec",
    "Compression",
    "EncodeJob",
    "ReferenceSource",
    "balanced_chunk_size",
    "codec_for",
    "codec_from_descriptor",
    "compress_tensor",
    "decode_buffer",
    "decode_frames",
    "decompress_tensor",
    "element_layout",
    "encode_frames",
    "encode_item",
    "encode_items",
    "item_layout",
    "scratch",
    "shared_pool",
]

#: registry name -> Codec subclass.
CODECS: Registry[type[Codec]] = Registry("dcp_multilevel.codecs", "codec")


def codec_for(compression: Compression) -> Codec:
    """The codec instance a writer uses for ``compression``."""
    return CODECS.get(compression.registry_name)(compression.level)


def codec_from_descriptor(descriptor: str) -> Codec:
    """Rebuild a codec from a manifest descriptor like ``dcp_multilevel.zstd/1``."""
    name, _, version = descriptor.partition("/")
    cls = CODECS.get(name)
    if not cls.reads(version):
        raise RegistryError(
            f"codec {name!r} version {version!r} is not readable by the installed codec "
            f"(version {cls.version}); {cls.remedy(version)}"
        )
    return cls()


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def shared_pool(workers: int) -> ThreadPoolExecutor | None:
    """A process-wide coding pool of ``workers`` threads (None for 0: code inline).

    Reused by every call, so tools that code one tensor per call do not start
    threads per call; its threads exit with the interpreter. Encoding with
    ``threads`` asks for ``threads - 1`` workers (the caller codes too, see
    ``encode_items``); decoding, for ``threads`` (or none for 1).
    """
    if workers < 1:
        return None
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="dcp-ml-codec")
        return pool


#: Payload buffers reused by every :func:`compress_tensor` call.
_TOOL_BUFFERS = BufferPool()
#: :func:`compress_tensor` splits a tensor into chunks no smaller than this to
#: give every thread work.
MIN_SPLIT_CHUNK = 512 << 10


def balanced_chunk_size(nbytes: int, compression: Compression) -> int:
    """The chunk size that splits ``nbytes`` into a multiple of ``threads`` chunks.

    Chunks are at most ``compression.chunk_size`` and at least
    :data:`MIN_SPLIT_CHUNK` (bytes; multiples of 4 KiB), so that one tensor
    coded on its own keeps every thread busy: 2.4 MB in chunks of 1, 1 and
    0.4 MB leaves a second thread idle half the time. Smaller chunks scaled
    worse with 2 threads (per-chunk Python work holds the GIL).
    """
    size, threads = compression.chunk_size, compression.threads
    if threads <= 1 or nbytes <= MIN_SPLIT_CHUNK:
        return size
    count = -(-nbytes // size)
    # No more chunks than keep each at MIN_SPLIT_CHUNK: 0.6 MB as 512 + 88 KiB
    # keeps one thread busy anyway, and pays a pool hand-off for the small one.
    count = min(-(-count // threads) * threads, max(1, nbytes // MIN_SPLIT_CHUNK))
    even = -(-nbytes // count)
    even = -(-even // 4096) * 4096
    return min(size, even)


def compress_tensor(t: torch.Tensor, compression: Compression) -> memoryview:
    """Frame-encode a contiguous CPU tensor (for benchmarks and tools); a bytes-like view.

    Chunks are sized by :func:`balanced_chunk_size`. Coded inline (one chunk,
    or one thread), each chunk is coded straight into the result; from the
    pool, into reused payload buffers that are then copied into it.
    """
    codec = codec_for(compression)
    width, rotate = codec.layout(t.dtype)
    view = byte_view(t)
    chunk_size = balanced_chunk_size(len(view), compression)
    count = -(-len(view) // chunk_size)
    # Frames never exceed the raw bytes plus their records, but a chunk is
    # coded into room of its payload bound: the last one may reach past the
    # raw size by that slack. Pages never written are never touched.
    largest = min(chunk_size, len(view))
    slack = codec.payload_bound(largest, width) - largest
    size = frames.HEADER.size + (count + 1) * frames.CHUNK.size + len(view) + max(0, slack)
    out = np.empty(size, np.uint8)
    header = frames.pack_header(width, rotate, chunk_size, len(view))
    # One chunk: code it here; handing it to a pool thread only adds a wake-up.
    pool = shared_pool(compression.threads - 1) if count > 1 else None
    if pool is None:
        return _code_in_place(out, header, view, codec, width, rotate, chunk_size)
    parts = encode_frames(
        view,
        codec,
        width=width,
        rotate=rotate,
        chunk_size=chunk_size,
        pool=pool,
        window=2 * compression.threads,
        buffers=_TOOL_BUFFERS,
    )
    pos = 0
    for part in parts:  # each payload buffer is reused once the next part is pulled
        # numpy copies with the GIL released (a memoryview slice copy holds it,
        # and stalls the coding threads for the whole copy).
        out[pos : pos + len(part)] = np.frombuffer(part, np.uint8)
        pos += len(part)
    return memoryview(out)[:pos]  # keeps ``out`` alive


def _code_in_place(
    out: np.ndarray,
    header: bytes,
    view: memoryview,
    codec: Codec,
    width: int,
    rotate: int,
    chunk_size: int,
) -> memoryview:
    """The frames of ``view`` coded chunk by chunk straight into ``out`` (no payload copy)."""
    dest = memoryview(out)
    dest[: len(header)] = header
    pos = len(header)
    for start in range(0, len(view), chunk_size):
        chunk = view[start : start + chunk_size]
        at = pos + frames.CHUNK.size
        record, payload, _ = encode_chunk(codec, chunk, width, rotate, into=dest[at:])
        dest[pos:at] = record
        if payload.obj is not out:  # stored raw: the bytes are still in the tensor
            out[at : at + len(payload)] = np.frombuffer(payload, np.uint8)
        pos = at + len(payload)
    end = frames.pack_chunk(frames.METHOD_RAW, 0, 0, 0)
    dest[pos : pos + len(end)] = end
    return dest[: pos + len(end)]


def item_layout(
    view: memoryview,
    dtype: torch.dtype | None,
    codec: Codec | None,
    compression: Compression | None,
) -> tuple[int, int] | None:
    """``(width, rotate)`` to frame an item with, or None to store it uncoded.

    Uncoded without a codec, for non-tensor values (``dtype`` None) and under
    :data:`MIN_CODED_BYTES`.
    """
    if codec is None or compression is None or dtype is None or len(view) < MIN_CODED_BYTES:
        return None
    return codec.layout(dtype)


def encode_item(
    view: memoryview,
    dtype: torch.dtype | None,
    codec: Codec | None,
    compression: Compression | None,
    *,
    pool=None,
    window: int = 1,
    reference: ReferenceSource | None = None,
) -> tuple[tuple[str, ...], Iterable[bytes | memoryview]]:
    """``(transforms, parts to store)`` for one item's raw bytes.

    Stored uncoded (no transforms) as :func:`item_layout` says; otherwise framed,
    lazily: parts are produced as the caller consumes them (bounded by ``window``).
    ``reference``: the same item's bytes in a reference checkpoint: chunks may
    be stored as deltas against them (``reference.used`` says, once consumed).
    """
    layout = item_layout(view, dtype, codec, compression)
    if layout is None:
        return (), pieces(view)
    assert codec is not None and compression is not None  # item_layout checked
    width, rotate = layout
    frames = encode_frames(
        view,
        codec,
        width=width,
        rotate=rotate,
        chunk_size=compression.chunk_size,
        pool=pool,
        window=window,
        reference=reference,
    )
    return (codec.descriptor,), frames


def decode_buffer(
    data: memoryview, out: memoryview, codec: Codec, on_chunk_error, pool=None, window: int = 4
) -> None:
    """Decode one framed item held in memory into ``out`` (exactly ``len(data)`` consumed)."""
    pos = 0

    def read(n: int) -> memoryview:
        nonlocal pos
        pos += n
        return data[pos - n : pos]

    decode_frames(
        read,
        out,
        codec,
        stored_length=len(data),
        pool=pool,
        window=window,
        on_chunk_error=on_chunk_error,
    )


def decompress_tensor(
    data: bytes | bytearray | memoryview,
    like: torch.Tensor,
    *,
    codec: str = "bytegroup",
    threads: int = 2,
) -> torch.Tensor:
    """Decode :func:`compress_tensor` output into a new tensor shaped like ``like``."""
    out = torch.empty_like(like, memory_format=torch.contiguous_format)

    def error(index: int, why: str) -> Exception:
        return ValueError(f"chunk {index}: {why}")

    inst = codec_for(Compression(codec=codec))
    pool = shared_pool(threads) if threads > 1 else None
    decode_buffer(memoryview(data), byte_view(out), inst, error, pool, 2 * threads)
    return out
