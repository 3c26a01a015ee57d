"""The codec interface: how one chunk of raw bytes is coded and decoded.

Call order: the writer asks ``layout(dtype)`` once per item, then its threads
call ``payload_bound`` and ``encode_into`` (which defaults to ``encode``) once
per chunk, in any order; the reader's threads call ``decode`` once per coded
chunk. A codec keeps no state between calls
(per-thread zstd contexts live in ``zstd.py``), so one instance serves every
thread.

A chunk is described by ``width`` (bytes per value plane: the element size,
or the component size of complex numbers) and ``rotate`` (bits each value is
rotated left before it is split into planes: for floats, so that the bits that
barely vary share a plane). Both are recorded in the frame header
(``format/frames.py``), so decoding needs nothing but the bytes.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import ClassVar

import torch

from ._scratch import scratch
from .delta import xor_into

__all__ = ["MIN_CODED_BYTES", "Codec", "element_layout"]

#: Items and chunks smaller than this are stored uncoded: framing (60 bytes) and
#: a codec call cost more than compressing a few biases (or an item's short
#: last chunk) can save.
MIN_CODED_BYTES = 4096

#: Below this saving a coded chunk is stored raw: decoding it would cost time for
#: (almost) nothing. 1/64 = 1.6 %.
MIN_SAVING = 1 / 64


class Codec(abc.ABC):
    """Codes chunks. Subclasses set ``name`` (the registry name) and ``version``.

    ``version`` is what a writer records; ``read_versions`` (default: just
    ``version``) are the recorded versions this class decodes, so a codec that
    changes its coding keeps reading what its earlier versions wrote.
    """

    name: ClassVar[str]
    version: ClassVar[int] = 1
    read_versions: ClassVar[frozenset[int] | None] = None

    def __init__(self, level: int = 1) -> None:
        self.level = level

    @property
    def descriptor(self) -> str:
        """What the manifest records, e.g. ``dcp_multilevel.bytegroup/4``."""
        return f"{self.name}/{self.version}"

    @classmethod
    def remedy(cls, version: str) -> str:
        """What to do with a chunk recorded as ``<name>/<version>`` that this class does
        not read: an older version is no longer read, a newer one needs an upgrade."""
        if version.isdigit() and int(version) < cls.version:
            return (
                "an older version that this release no longer reads: load it with the "
                "release that wrote it and save it again"
            )
        return "install a dcp_multilevel release that reads it"

    @classmethod
    def reads(cls, version: str) -> bool:
        """Whether a chunk recorded as ``<name>/<version>`` is decodable by this class."""
        readable = cls.read_versions or frozenset({cls.version})
        return version.isdigit() and int(version) in readable

    def layout(self, dtype: torch.dtype) -> tuple[int, int]:
        """``(width, rotate)`` for values of ``dtype`` (see the module docstring)."""
        return element_layout(dtype)

    @abc.abstractmethod
    def encode(self, chunk: memoryview, width: int, rotate: int) -> bytes | None:
        """The coded payload of ``chunk``, or ``None`` when coding does not pay."""

    def payload_bound(self, raw_len: int, width: int) -> int:
        """Bytes of buffer :meth:`encode_into` needs for a chunk of ``raw_len`` bytes."""
        return raw_len + (raw_len >> 8) + 1024

    def encode_into(
        self, chunk: memoryview, width: int, rotate: int, out: memoryview
    ) -> int | None:
        """Code ``chunk`` into ``out`` (at least :meth:`payload_bound` bytes).

        Returns the payload's length, or ``None`` when coding does not pay. The
        pipeline calls this, with buffers it reuses across chunks; the default
        copies what :meth:`encode` returns (override it to code in place).
        """
        coded = self.encode(chunk, width, rotate)
        if coded is None or len(coded) > len(out):
            return None
        out[: len(coded)] = coded
        return len(coded)

    @abc.abstractmethod
    def decode(self, payload: memoryview, out: memoryview, width: int, rotate: int) -> None:
        """Decode ``payload`` into exactly ``len(out)`` bytes; ValueError if it cannot."""

    def decode_xor(
        self,
        payload: memoryview,
        out: memoryview,
        width: int,
        rotate: int,
        ready: Callable[[], object] | None = None,
    ) -> None:
        """XOR the decoding of ``payload`` into ``out`` (a delta chunk decoded onto the
        reference's bytes that ``out`` holds, ``delta.py``); ValueError as :meth:`decode`.

        ``ready``, when given, is called once before ``out`` is first touched
        and returns when ``out`` holds those bytes (another thread may still be
        writing them until then), so the two decodings overlap. The default
        decodes into a per-thread buffer, then XORs; a codec that can fold the
        XOR into its last pass overrides it.
        """
        values = memoryview(scratch("decode_xor", len(out)))
        self.decode(payload, values, width, rotate)
        if ready is not None:
            ready()
        xor_into(out, values, out)


def element_layout(dtype: torch.dtype) -> tuple[int, int]:
    """The default ``(width, rotate)``: floats rotated by one bit.

    One bit moves the sign below the mantissa, so the top plane of fp32/bf16/
    fp64 holds (the top of) the exponent.
    """
    if dtype.is_complex:
        return dtype.itemsize // 2, 1
    if dtype.is_floating_point and dtype.itemsize > 1:
        return dtype.itemsize, 1
    return dtype.itemsize, 0
