"""The failure record: a background failure, reported once to the training thread.

Call order: a background step of an async save fails -> ``note`` (on DCP's
background thread, or in DCP's daemon process on its unpickled copy); the
next ``Stager.stage`` on the training thread -> ``take``, which returns it
once.

The record is a fixed-size tensor in shared memory, so the copy that DCP's
PROCESS mode pickles to its daemon process writes where the training process
reads (torch shares a tensor's storage when it is pickled to a child).
Layout: byte 0 set when a failure is recorded, bytes 4-8 the text's length
(int32), then the UTF-8 text, cut at :data:`RECORD_BYTES`.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["RECORD_BYTES", "FailureRecord"]

#: Bytes of the shared record (the text is cut to fit).
RECORD_BYTES = 4096
_HEADER = 8


class FailureRecord:
    """The last background failure of a stager's async saves (see module docs)."""

    def __init__(self) -> None:
        self._shared = torch.zeros(RECORD_BYTES, dtype=torch.uint8).share_memory_()
        # Serializes note/take in this process; a daemon copy writes while no
        # other save of this writer runs (saves run one at a time).
        self._lock = threading.Lock()

    def note(self, text: str) -> None:
        """Record ``text`` (replacing any earlier failure not taken yet)."""
        raw = text.encode("utf-8", "replace")[: RECORD_BYTES - _HEADER]
        with self._lock:
            if raw:
                body = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                self._shared[_HEADER : _HEADER + len(raw)] = body
            self._shared[4:8] = torch.tensor([len(raw)], dtype=torch.int32).view(torch.uint8)
            self._shared[0] = 1  # last: a reader sees the flag after the text

    def take(self) -> str | None:
        """The recorded failure, once; None if none was recorded since the last take."""
        with self._lock:
            if not self._shared[0].item():
                return None
            n = int(self._shared[4:8].view(torch.int32).item())
            text = bytes(self._shared[_HEADER : _HEADER + n].tolist()).decode("utf-8", "replace")
            self._shared[0] = 0
        return text

    def __getstate__(self) -> dict[str, torch.Tensor]:
        return {"shared": self._shared}

    def __setstate__(self, state: dict[str, torch.Tensor]) -> None:
        self._shared = state["shared"]
        self._lock = threading.Lock()
