"""DCP's log of a failed metadata read, kept to one line for our reader.

``dcp.load`` (torch's ``state_dict_loader.py``) catches whatever
``StorageReader.read_metadata`` raises, logs "Global metadata is not found.
Falling back to rank local metadata." with the whole traceback (a warning on
that module's logger, the root logger in torch 2.13), and then raises a
``CheckpointException`` that carries the error's message. For
:class:`~dcp_multilevel.MultiLevelReader` the fallback does not exist (its
``read_metadata`` takes no ``rank``) and the traceback repeats what the
exception says. Its ``read_metadata`` is therefore wrapped in
:func:`one_line_in_dcp_log`: when it raises, :class:`FailedMetadataLine` is put
on that logger (once), and turns a record whose exception came out of the
wrapper into one line naming the error. Every other record passes unchanged,
other readers' failures included.
"""

from __future__ import annotations

import functools
import logging
import threading
import traceback
from collections.abc import Callable
from types import CodeType
from typing import Any, TypeVar

from torch.distributed.checkpoint import state_dict_loader

__all__ = ["FailedMetadataLine", "one_line_in_dcp_log"]

T = TypeVar("T")


class FailedMetadataLine(logging.Filter):
    """Turns a record about an exception raised through ``code`` into one line.

    Args:
        code: the code object whose frame marks the exceptions to shorten (the
            wrapper of :func:`one_line_in_dcp_log`).
    """

    def __init__(self, code: CodeType) -> None:
        super().__init__()
        self.code = code

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or not any(
            frame.f_code is self.code for frame, _ in traceback.walk_tb(exc.__traceback__)
        ):
            return True
        text = str(exc)
        # The first line: with fallbacks the message goes on listing every copy tried.
        record.msg = "dcp.load could not read the checkpoint's metadata: %s: %s"
        record.args = (type(exc).__name__, text.splitlines()[0] if text else "")
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        return True


_lock = threading.Lock()  # two readers failing at once put one filter on the logger


def one_line_in_dcp_log(read_metadata: Callable[[Any], T]) -> Callable[[Any], T]:
    """``read_metadata``, whose failures ``dcp.load`` logs in one line (module docstring)."""

    # Only ``self``: DCP passes ``rank=`` to a read_metadata that takes keywords.
    @functools.wraps(read_metadata)
    def wrapper(self: Any) -> T:
        try:
            return read_metadata(self)
        except Exception:
            _install(wrapper.__code__)
            raise

    return wrapper


def _install(code: CodeType) -> None:
    """Put a :class:`FailedMetadataLine` for ``code`` on the logger ``dcp.load`` logs a
    failed metadata read on, unless one is there (nothing if torch has no such logger)."""
    target = getattr(state_dict_loader, "logger", None)
    if not isinstance(target, logging.Logger):
        return
    with _lock:
        if not any(isinstance(f, FailedMetadataLine) and f.code is code for f in target.filters):
            target.addFilter(FailedMetadataLine(code))
