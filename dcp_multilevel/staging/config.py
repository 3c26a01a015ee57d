"""StagingConfig: how MultiLevelWriter stages async saves (see ``docs/async.md``).

Read by the training thread (budget, in-flight policy, copy threads) and by
the background thread of an async save (``background_nice``); frozen, so both
may hold it without a lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError

__all__ = ["StagingConfig"]


@dataclass(frozen=True)
class StagingConfig:
    """How :class:`~dcp_multilevel.MultiLevelWriter` stages async saves.

    Args:
        budget_bytes: most host memory the buffer pool may hold (both sets
            together); ``None``: no limit (two sets of the state's size). A state
            larger than this is saved in two waves (see ``docs/async.md``); with
            ``overlap``, ``0`` copies nothing: the tensors are written from the
            live state behind the fence.
        in_flight: what a save does when both buffer sets are taken by earlier
            saves: ``"wait"`` until one is free, or ``"raise"``
            :class:`~dcp_multilevel.errors.SaveInFlightError`.
        wait_timeout_s: longest wait under ``"wait"`` before raising
            :class:`~dcp_multilevel.errors.SaveInFlightError`.
        pin_memory: page-lock the buffers (faster device-to-host copies);
            ``None``: when CUDA is available.
        shared_memory: allocate the buffers in shared memory up front, so that
            ``AsyncCheckpointerType.PROCESS`` never moves them on first use.
        copy_threads: threads copying into the buffers while ``async_save``
            blocks (``copy_`` releases the GIL); 1: the calling thread only.
        background_nice: nice value (Linux) of the thread writing an async
            save, and of the threads it starts, so that on busy cores the
            training loop runs first; 0: leave priorities alone.
        overlap: copy into the buffers on a background thread: ``async_save``
            returns before the copies are done, with DCP's ``AsyncSaveResponse``;
            the state may change only once its ``staging_completion`` is done
            (the fence: wait for it before the next optimizer step; over the
            budget it also waits until the tensors left live are written).
            ``torch.optim`` optimizer steps wait for the last save's fence by
            themselves (a global step pre-hook, until the next save or
            ``close()``); other in-place changes must wait for it. Off: the
            copies are done when ``async_save`` returns.
        check_fence: with ``overlap``, hash every tensor when ``async_save`` is
            called and its copy once made; a difference (the state changed before
            the fence) fails the save with ``StagingFenceError``. For debugging:
            it reads the state twice more.
        device_snapshot_bytes: with ``overlap``, GPU memory (per device) for a
            copy of the CUDA tensors on their own device: the fence then waits
            for that copy (milliseconds) instead of the copy over the bus, which
            runs after it while training goes on. Tensors go there while they
            fit; the rest reach the host before the fence. 0: none. Held until
            ``close()`` (see ``staging/device.py``).
    """

    budget_bytes: int | None = None
    in_flight: Literal["wait", "raise"] = "wait"
    wait_timeout_s: float = 3600.0
    pin_memory: bool | None = None
    shared_memory: bool = False
    copy_threads: int = 2
    background_nice: int = 10
    overlap: bool = False
    check_fence: bool = False
    device_snapshot_bytes: int = 0

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and (
            not isinstance(self.budget_bytes, int) or self.budget_bytes < 0
        ):
            raise ConfigError(
                f"budget_bytes must be None or an int >= 0, got {self.budget_bytes!r}"
            )
        if self.in_flight not in ("wait", "raise"):
            raise ConfigError(f'in_flight must be "wait" or "raise", got {self.in_flight!r}')
        if not isinstance(self.copy_threads, int) or self.copy_threads < 1:
            raise ConfigError(f"copy_threads must be an int >= 1, got {self.copy_threads!r}")
        if not isinstance(self.background_nice, int) or not 0 <= self.background_nice <= 19:
            raise ConfigError(
                f"background_nice must be an int from 0 to 19, got {self.background_nice!r}"
            )
        if not isinstance(self.device_snapshot_bytes, int) or self.device_snapshot_bytes < 0:
            raise ConfigError(
                f"device_snapshot_bytes must be an int >= 0, got {self.device_snapshot_bytes!r}"
            )
        if self.device_snapshot_bytes and not self.overlap:
            raise ConfigError(
                "device_snapshot_bytes needs overlap=True: without it async_save returns "
                "only once the state is in host memory, so a copy on the device saves nothing"
            )
        if not self.wait_timeout_s > 0:
            raise ConfigError(f"wait_timeout_s must be > 0, got {self.wait_timeout_s!r}")
