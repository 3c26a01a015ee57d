"""Writing a converted state to one file: ``torch.save`` or safetensors.

Both are written under a temporary name next to ``dst`` and renamed when
complete, so ``dst`` is either the whole result or absent. Neither writer
copies the tensors: ``torch.save`` writes each storage from its memory, and
``safetensors.torch.save_file`` (0.8) hands the Rust serializer each tensor's
data pointer; with file-backed tensors their pages are read from the page
cache (see ``docs/interop.md`` for the measurement). Progress is the size of
the file being written, polled (neither library has a per-tensor hook).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch

from ..errors import ConvertError
from .progress import Progress

__all__ = ["safetensors_problems", "write_safetensors", "write_torch_save"]

#: How often the size of the file being written is reported.
_POLL_S = 0.2

_INSTALL_HINT = "install it with: pip install 'dcp_multilevel[convert]' (or safetensors>=0.8)"


def write_torch_save(state: dict[str, Any], dst: str, progress: Progress, start: int) -> None:
    """``torch.save(state, dst)``, atomically; progress from ``start`` by bytes written."""
    with _atomic(dst, progress, start) as tmp:
        torch.save(state, tmp)


def write_safetensors(
    tensors: dict[str, torch.Tensor], dst: str, progress: Progress, start: int
) -> None:
    """``safetensors.torch.save_file(tensors, dst)``, atomically.

    ``tensors`` must have passed :func:`safetensors_problems`.
    """
    save_file = _safetensors().save_file
    with _atomic(dst, progress, start) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})


def safetensors_problems(
    entries: Mapping[str, torch.dtype | None],
) -> tuple[list[str], list[str]]:
    """``(non-tensor keys, "key (dtype)" of tensors whose dtype safetensors lacks)``.

    ``entries``: every value by flattened key, its dtype or None for a non-tensor.
    """
    others = [k for k, dtype in entries.items() if dtype is None]
    bad = [
        f"{k} ({str(dtype).removeprefix('torch.')})"
        for k, dtype in entries.items()
        if dtype is not None and not _safetensors_has(dtype)
    ]
    return others, bad


def _safetensors() -> Any:
    try:
        # Lazy: safetensors is an optional dependency (the ``convert`` extra),
        # needed only for this target.
        import safetensors.torch  # noqa: PLC0415
    except ImportError:
        raise ConvertError(
            f"converting to safetensors needs the safetensors package; {_INSTALL_HINT}",
            path="safetensors",
        ) from None
    return safetensors.torch


@cache
def _safetensors_has(dtype: torch.dtype) -> bool:
    """Whether the installed safetensors stores ``dtype`` (asked, not from a table:
    its dtype list grows across releases)."""
    try:
        _safetensors().save({"probe": torch.empty(0, dtype=dtype)})
    except (ValueError, TypeError, KeyError):
        return False
    return True


@contextmanager
def _atomic(dst: str, progress: Progress, start: int) -> Iterator[str]:
    """A temporary path next to ``dst``, renamed to ``dst`` on success, removed on failure."""
    tmp = f"{dst}.tmp-{uuid.uuid4().hex[:12]}"
    stop = threading.Event()
    poller = threading.Thread(
        target=_poll_size, args=(tmp, stop, lambda n: progress.reach(start + n)), daemon=True
    )
    poller.start()
    try:
        yield tmp
        os.replace(tmp, dst)
    finally:
        stop.set()
        poller.join()
        if os.path.exists(tmp):
            os.unlink(tmp)


def _poll_size(path: str, stop: threading.Event, report: Callable[[int], None]) -> None:
    while not stop.wait(_POLL_S):
        try:
            report(os.path.getsize(path))
        except OSError:  # not created yet, or already renamed
            continue
