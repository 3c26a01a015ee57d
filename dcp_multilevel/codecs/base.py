"""The codec interface: how one chunk of raw bytes is coded and decoded.

Call order: the writer's threads call ``encode`` once per chunk, in any
order; the reader's threads call ``decode`` once per coded chunk. A codec keeps
no state between calls (per-thread zstd contexts live in ``_zstd.py``), so one
instance serves every thread.

A chunk is described by ``width`` (bytes per value plane: the element size,
or the component size of complex numbers) and ``rotate`` (floating point:
rotate each value left by one bit so the whole exponent lands in the top
byte and the sign joins the mantissa). Both are recorded in the frame header
(``format/frames.py``), so decoding needs nothing but the bytes.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

__all__ = ["Codec", "element_layout"]

#: Below this saving a coded chunk is stored raw: decoding it would cost time for
#: (almost) nothing. 1/64 = 1.6 %.
MIN_SAVING = 1 / 64


class Codec(abc.ABC):
    """Codes chunks. Subclasses set ``name`` (the registry name) and ``version``."""

    name: ClassVar[str]
    version: ClassVar[int] = 1

    def __init__(self, level: int = 1) -> None:
        self.level = level

    @property
    def descriptor(self) -> str:
        """What the manifest records, e.g. ``dcp_multilevel.bytegroup/1``."""
        return f"{self.name}/{self.version}"

    @abc.abstractmethod
    def encode(self, chunk: memoryview, width: int, rotate: bool) -> bytes | None:
        """The coded payload of ``chunk``, or ``None`` when coding does not pay."""

    @abc.abstractmethod
    def decode(self, payload: memoryview, out: memoryview, width: int, rotate: bool) -> None:
        """Decode ``payload`` into exactly ``len(out)`` bytes; ValueError if it cannot."""


def element_layout(dtype: torch.dtype) -> tuple[int, bool]:
    """``(width, rotate)`` for values of ``dtype``."""
    if dtype.is_complex:
        return dtype.itemsize // 2, True
    if dtype.is_floating_point and dtype.itemsize > 1:
        return dtype.itemsize, True
    return dtype.itemsize, False
