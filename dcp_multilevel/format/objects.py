"""Non-tensor values: stored as DCP gives them (``torch.save`` bytes), loaded
only with ``torch.load(weights_only=True)``.

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

__all__ = ["load_object"]

# Exceptions torch.load raises for refused or malformed pickles.
_LOAD_ERRORS = (pickle.UnpicklingError, RuntimeError, ValueError, TypeError, EOFError,
                AttributeError, ImportError, KeyError, IndexError)  # fmt: skip
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
