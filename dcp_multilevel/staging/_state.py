"""A stager's state in the training process: its buffers, tickets and threads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from ._tickets import Ticket
from .buffers import HostBufferPool
from .config import StagingConfig
from .device import DeviceSnapshot

__all__ = ["StagingState"]


class StagingState:
    """A stager's state in the training process, made by its first ``stage``."""

    def __init__(self, config: StagingConfig) -> None:
        pin = config.pin_memory if config.pin_memory is not None else torch.cuda.is_available()
        self.pool = HostBufferPool(config.budget_bytes, pin=pin, shared=config.shared_memory)
        # Guards tickets and the pool (stage and close, on the training thread,
        # against claim, on background threads).
        self.lock = threading.Lock()
        self.tickets: list[Ticket] = []
        self.seq = 0
        # copy_ releases the GIL: while the training thread waits for staging anyway,
        # more cores copy (threads exit with the process).
        self.copier = (
            ThreadPoolExecutor(config.copy_threads, thread_name_prefix="dcp-ml-stage")
            if config.copy_threads > 1
            else None
        )
        # overlap: one thread runs each save's copies, in order, behind its fence.
        self.overlapper = (
            ThreadPoolExecutor(1, thread_name_prefix="dcp-ml-overlap") if config.overlap else None
        )
        # GPU memory for the state's copy on its device (guarded by ``lock`` for close).
        self.device = (
            DeviceSnapshot(config.device_snapshot_bytes) if config.device_snapshot_bytes else None
        )
