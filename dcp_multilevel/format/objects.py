"""Non-tensor values: stored as DCP gives them (``torch.save`` bytes), loaded
only with ``torch.load(weights_only=True)``; ``io.BytesIO`` values stored as
their bytes (:func:`bytesio_record`), never unpickled.

The writer checks every value at save time so that a checkpoint never holds a
value it cannot load back; the reader checks again, because the file is
untrusted.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch

__all__ = [
    "BYTESIO_PREFIX",
    "bytesio_for_planner",
    "bytesio_payload",
    "bytesio_record",
    "load_object",
]

# Exceptions torch.load raises for refused or malformed pickles.
_LOAD_ERRORS = (
    pickle.UnpicklingError,
    RuntimeError,
    ValueError,
    TypeError,
    EOFError,
    AttributeError,
    ImportError,
    KeyError,
    IndexError,
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def load_object(raw: bytes | memoryview) -> tuple[Any, str | None]:
    """``(value, None)``, or ``(None, reason)`` when ``weights_only=True`` refuses it."""
    try:
        return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu"), None
    except _LOAD_ERRORS as e:
        return None, _reason(e)


def _reason(e: BaseException) -> str:
    """The line of torch's message that names the culprit, without its advice or colours."""
    text = _ANSI.sub("", str(e))
    for raw_line in text.splitlines():
        line = raw_line.strip()
        if line.startswith("WeightsUnpickler error:"):
            return line.removeprefix("WeightsUnpickler error:").strip()
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


#: How an ``io.BytesIO`` value is stored: this prefix, then the value's bytes as
#: they are. Stock DCP stores ``torch.save(value)`` and hands back a BytesIO of
#: the same bytes; ours hands back the same without unpickling anything stored.
#: A ``torch.save`` record starts with a zip (``PK``) or pickle (``0x80``)
#: header, never with this prefix.
BYTESIO_PREFIX = b"\x00dcp_multilevel:io.BytesIO\x00"


def bytesio_record(value: io.BytesIO) -> bytes:
    """The stored form of an ``io.BytesIO`` value (its whole buffer, any position)."""
    return BYTESIO_PREFIX + value.getvalue()


def bytesio_payload(raw: bytes | bytearray | memoryview) -> bytes | None:
    """The value's bytes when ``raw`` is a :func:`bytesio_record`, else None."""
    head = bytes(raw[: len(BYTESIO_PREFIX)])
    return bytes(raw[len(BYTESIO_PREFIX) :]) if head == BYTESIO_PREFIX else None


def bytesio_for_planner(payload: bytes) -> io.BytesIO:
    """What DCP's load planner expects for a BytesIO value: ``torch.save`` of it.

    ``DefaultLoadPlanner.load_bytes`` calls ``torch.load`` on what a reader
    hands it; this is our own record of a fresh BytesIO, never stored bytes.
    """
    out = io.BytesIO()
    torch.save(io.BytesIO(payload), out)
    out.seek(0)
    return out
