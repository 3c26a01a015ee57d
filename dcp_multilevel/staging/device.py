"""A copy of the state on its own GPU, for the fence to wait on instead of the bus.

With ``StagingConfig(overlap=True)`` the fence (``staging_completion``) waits
until every tensor of the state has been read. Read over the bus into host
memory, a few GB take long enough to race the next forward and backward;
copied within the device, whose memory is many times faster than the bus,
they are read far sooner. With
``StagingConfig(device_snapshot_bytes=N)`` the CUDA tensors are first copied
into a buffer of at most N bytes on their own device, the fence completes
once those copies (and the others) are done, and the copies from that buffer
to the host run after it, while training goes on. Tensors go there in the
order they are laid out while they fit; the rest is copied to the host
before the fence, as without it.

Call order, on the thread laying out one save at a time (the overlap
thread): :meth:`DeviceSnapshot.reserve` with the state's tensors ->
:meth:`DeviceSnapshot.take` per CUDA tensor as its copy is issued
(``copies.DeviceCopies``) -> that save's copies done -> the next save's
``reserve``. :meth:`DeviceSnapshot.close` (under the stager's lock) frees
the buffers; the copies still queued hold the places they use.

The buffers are allocated on the staging side stream (:func:`side_stream`),
the only stream that uses them: memory the training freed with kernels
still queued on its own stream is never handed to them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from .buffers import KeptViews, _aligned, pool_source, staged_nbytes

__all__ = ["DeviceSnapshot", "side_stream"]

log = logging.getLogger(__name__)

#: One side stream per CUDA device for the staging copies (made on first use).
_SIDE_STREAMS: dict[torch.device, Any] = {}


def side_stream(device: torch.device) -> Any:
    """The stream a device's staging copies run on (one per device, kept)."""
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return side


class DeviceSnapshot:
    """One flat buffer per CUDA device, of at most ``budget_bytes``, reused save after save.

    Args:
        budget_bytes: most GPU memory each device gives the snapshot.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.buffers: dict[torch.device, torch.Tensor] = {}
        self._used: dict[torch.device, int] = {}
        # The places the last save took, reused by the next one of the same state
        # (making each is three torch calls, and each costs training a GIL hand-off).
        self._places = KeptViews()
        self._refused: set[torch.device] = set()  # out of memory once: not asked again

    @property
    def held_bytes(self) -> int:
        """GPU bytes held, all devices together."""
        return sum(b.numel() for b in self.buffers.values())

    def reserve(self, tensors: Iterable[torch.Tensor]) -> None:
        """Start a save: a buffer on each device holding some of ``tensors``, of
        their bytes or the budget, whichever is less (kept if big enough)."""
        self._places.begin()
        on_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            src = pool_source(t)
            if src is not None and src.is_cuda:
                on_device.setdefault(src.device, []).append(src)
        for device, group in on_device.items():
            nbytes = min(staged_nbytes(group), self.budget_bytes)
            held = self.buffers.get(device)
            if device in self._refused or (held is not None and held.numel() >= nbytes):
                continue
            self.buffers.pop(device, None)  # freed first: at most the budget at once
            self._places.discard(lambda key, device=device: key[0] == device)
            try:
                with torch.cuda.stream(side_stream(device)):
                    self.buffers[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            except torch.cuda.OutOfMemoryError:
                self._refused.add(device)
                log.warning(
                    "dcp_multilevel: no device snapshot on %s: %d bytes of GPU memory "
                    "(StagingConfig.device_snapshot_bytes) could not be allocated; its "
                    "tensors are copied to host memory before the fence instead",
                    device,
                    nbytes,
                )
        self._used = dict.fromkeys(self.buffers, 0)

    def take(self, src: torch.Tensor) -> torch.Tensor | None:
        """A place for ``src`` (a CUDA tensor) in its device's buffer, shaped as it is
        and contiguous; None once the buffer is full (or there is none)."""
        device = src.device
        buf, used = self.buffers.get(device), self._used.get(device)
        if buf is None or used is None:  # none, or closed meanwhile
            return None
        start = _aligned(used)
        end = start + src.nbytes
        if end > buf.numel():
            return None
        self._used[device] = end
        return self._places.get(
            (device, start, src.dtype, src.shape),
            lambda: buf[start:end].view(src.dtype).view(src.shape),
        )

    def close(self) -> None:
        """Free the buffers (a new ``reserve`` allocates again)."""
        self.buffers.clear()
        self._used.clear()
        self._places.clear()
