"""The fence kept for the optimizer: with overlap, ``optimizer.step()`` waits for it.

A save with ``StagingConfig(overlap=True)`` copies the state after
``async_save`` returned; the state may change only once its fence
(``staging_completion``) is done. Callers are told to wait for it before the
next optimizer step; one who forgets would store a state mixed from two
steps (pytorch/pytorch#144657), silently. So until the next save or
``close()``, a global optimizer step pre-hook of torch
(``register_optimizer_step_pre_hook``: every ``torch.optim`` optimizer runs
it first) waits for the last save's fence. Where the caller waited already it
returns at once.

Call order, on the training thread only (torch iterates the hooks on the
thread stepping the optimizer, so they must not change under it):
:meth:`StepFence.guard` per overlapped save, replacing the last hook;
:meth:`StepFence.release` from ``close()``.
"""

from __future__ import annotations

import threading
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["StepFence"]


class StepFence:
    """At most one optimizer step pre-hook, waiting for the last overlapped save's fence."""

    def __init__(self) -> None:
        self._handle: RemovableHandle | None = None

    def guard(self, completed: threading.Event) -> None:
        """Until the next ``guard`` or :meth:`release`, every optimizer step first
        waits for the fence's ``completed`` event (failed or not, the state may
        change then). The stager completes every fence, within ``wait_timeout_s``
        where a save cannot go on."""

        def wait(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            completed.wait()

        self.release()
        self._handle = register_optimizer_step_pre_hook(wait)

    def release(self) -> None:
        """Remove the hook (optimizer steps no longer wait)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
