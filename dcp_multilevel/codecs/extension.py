"""Our codecs as DCP ``StreamTransformExtension``s.

DCP records ``get_descriptor()`` per item and rebuilds extensions from it,
so stock ``FileSystemWriter(_extensions=[ByteGroupExtension()])`` and
``FileSystemReader(_extension_registry=...)`` can use our codecs too. A stream
carries no dtype, so this path codes bytes with width 1 (plain zstd framing);
``MultiLevelWriter`` uses the faster, dtype-aware path in ``pipeline.py`` and
records the same descriptors.
"""

from __future__ import annotations

import io
from typing import IO, ClassVar

import xxhash
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

from ..format import frames
from .base import Codec
from .bytegroup import ByteGroupCodec
from .zstd import ZstdCodec

__all__ = ["ByteGroupExtension", "CodecExtension", "ZstdExtension", "extension_registry"]

_STREAM_CHUNK = 4 << 20


class CodecExtension(StreamTransformExtension):
    """Adapter from a :class:`Codec` to DCP's stream-transform protocol."""

    codec_cls: ClassVar[type[Codec]]

    def __init__(self, level: int = 1) -> None:
        super().__init__()
        self.codec = self.codec_cls(level)

    @classmethod
    def registry_name(cls) -> str:  # type: ignore[override]
        """The codec's registry name, which DCP records as the descriptor's name."""
        return cls.codec_cls.name

    @classmethod
    def from_descriptor(cls, version: str) -> CodecExtension:  # type: ignore[override]
        """The extension for a recorded ``version``; ValueError when the codec cannot read it."""
        if not cls.codec_cls.reads(version):
            raise ValueError(
                f"{cls.codec_cls.name} version {version!r} is not supported by this "
                f"dcp_multilevel (it reads version {cls.codec_cls.version}); "
                + cls.codec_cls.remedy(version)
            )
        return cls()

    def get_descriptor(self) -> str:
        """``<name>/<version>``, the same descriptor ``MultiLevelWriter`` records."""
        return self.codec.descriptor

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        """A writable stream that frames what is written into ``output`` (4 MiB chunks, width 1)."""
        return _FrameWriter(output, self.codec)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        """A readable stream of the raw bytes framed in ``input``, each chunk checksum-checked."""
        return io.BufferedReader(_FrameReader(input, self.codec))  # type: ignore[return-value]


class ZstdExtension(CodecExtension):
    """:class:`ZstdCodec` as a DCP stream extension."""

    codec_cls = ZstdCodec


class ByteGroupExtension(CodecExtension):
    """:class:`ByteGroupCodec` as a DCP stream extension (width 1: byte planes need a dtype)."""

    codec_cls = ByteGroupCodec


def extension_registry() -> ExtensionRegistry:
    """A DCP ExtensionRegistry that knows our codecs (for stock FileSystemReader)."""
    registry = ExtensionRegistry()
    for cls in (ZstdExtension, ByteGroupExtension):
        registry.register(cls)
    return registry


class _FrameWriter(io.RawIOBase):
    def __init__(self, output: IO[bytes], codec: Codec) -> None:
        self._out = output
        self._codec = codec
        self._buf = bytearray()
        self._started = False

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        if not self._started:
            self._out.write(frames.pack_header(1, 0, _STREAM_CHUNK, frames.UNKNOWN_TOTAL))
            self._started = True
        self._buf += memoryview(b).cast("B")
        while len(self._buf) >= _STREAM_CHUNK:
            self._emit(memoryview(self._buf)[:_STREAM_CHUNK])
            del self._buf[:_STREAM_CHUNK]
        return len(memoryview(b).cast("B"))

    def _emit(self, chunk: memoryview) -> None:
        coded = self._codec.encode(chunk, 1, False)
        method, payload = (
            (frames.METHOD_RAW, chunk) if coded is None else (frames.METHOD_CODED, coded)
        )
        self._out.write(
            frames.pack_chunk(method, len(chunk), len(payload), xxhash.xxh3_64_intdigest(payload))
        )
        self._out.write(payload)

    def close(self) -> None:
        if not self.closed:
            if not self._started:
                self.write(b"")
            if self._buf:
                self._emit(memoryview(self._buf))
                self._buf.clear()
            self._out.write(frames.pack_chunk(frames.METHOD_RAW, 0, 0, 0))
            self._out.flush()
        super().close()


class _FrameReader(io.RawIOBase):
    def __init__(self, input: IO[bytes], codec: Codec) -> None:
        self._in = input
        self._codec = codec
        self._header: frames.FrameHeader | None = None
        self._pending = memoryview(b"")
        self._done = False
        self._index = 0

    def readable(self) -> bool:
        return True

    def _exact(self, n: int) -> bytes:
        data = self._in.read(n)
        if data is None or len(data) != n:
            raise ValueError(f"compressed stream ends early (chunk {self._index})")
        return data

    def _next_chunk(self) -> None:
        if self._header is None:
            self._header = frames.unpack_header(self._exact(frames.HEADER.size))
        rec = frames.unpack_chunk(self._exact(frames.CHUNK.size))
        if rec.is_terminator:
            self._done = True
            return
        if rec.method == frames.METHOD_DELTA:  # only items with a reference hold them
            raise ValueError(f"chunk {self._index}: a delta chunk in a stream")
        if not 0 < rec.raw_len <= self._header.chunk_size:
            raise ValueError(f"chunk {self._index}: bad raw length {rec.raw_len}")
        payload = memoryview(self._exact(rec.stored_len))
        if xxhash.xxh3_64_intdigest(payload) != rec.checksum:
            raise ValueError(f"chunk {self._index}: checksum mismatch")
        out = bytearray(rec.raw_len)
        if rec.method == frames.METHOD_RAW:
            out[:] = payload
        else:
            self._codec.decode(payload, memoryview(out), self._header.width, self._header.rotate)
        self._pending = memoryview(out)
        self._index += 1

    def readinto(self, b) -> int:  # type: ignore[override]
        while not self._pending and not self._done:
            self._next_chunk()
        n = min(len(b), len(self._pending))
        memoryview(b).cast("B")[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n
