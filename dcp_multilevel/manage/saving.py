"""The manager's saves: plain ``dcp.save`` / ``dcp.async_save`` through the plugin.

Each save is ``dcp.save(state, storage_writer=MultiLevelWriter("step-<N>",
levels=...))``, the manager's levels and the schedule's decision of where
the step goes (``due``): the writer commits it on the first level, and the
process's runtime for the levels (``runtime/``) sends it on in the background.
A first-level delta whose reference fails while the save reads it is saved
again whole (every rank sees the same failure; the runtime then drops that
reference).

Call order (main thread, every rank, collective)::

    saves = FirstLevelSaves(runtime, levels, topology, planner)
    writer = saves.save(state_dict, step, extra, due)   returns once the first level committed

With ``async_save=True`` (``CheckpointManager(async_save=True)``), instead::

    metrics = saves.save_async(state_dict, step, extra, due)   returns once staged
                                       (with StagingConfig(overlap=True): at once)
    ... training goes on; DCP writes and commits in its background thread ...
    saves.wait_for_staging()           overlap: before the state changes
    pending = saves.finish_async()     before the next save (main thread): committed

One writer serves every async save, so its staging buffers are reused; at
most one async save is in flight (the manager finishes one before the next).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from .. import _dist
from ..errors import BrokenChainError, ConfigError, CorruptCheckpointError
from ..format import step_dir
from ..health import Checks
from ..levels.config import Level
from ..plugin import MultiLevelWriter
from ..staging import StagingConfig
from .metrics import SaveMetrics

if TYPE_CHECKING:
    from ..levels.runtime import Runtime
    from ..levels.topology import Topology

__all__ = ["FirstLevelSaves", "PendingSave"]

logger = logging.getLogger(__name__)


@dataclass
class PendingSave:
    """An async save staged and being written (``FirstLevelSaves.finish_async``)."""

    step: int
    due: list[int]  # the higher levels it is due on
    future: Future
    writer: MultiLevelWriter
    metrics: SaveMetrics
    from_step: bool = False  # made by the manager's step() (its schedule follows it)
    #: With ``StagingConfig(overlap=True)``: done once the save no longer reads the state.
    fence: Future | None = None


class FirstLevelSaves:
    """The manager's saves (see the module docstring).

    Args:
        runtime: the manager's runtime (``runtime_for(levels)``).
        levels, topology: as the manager was given them (its writers get the same).
        planner: the save planner, reused so that DCP's plan cache works.
        async_save: saves go through :meth:`save_async`; makes the gloo group DCP's
            background thread saves over (collective; never the trainer's group,
            see ``_dist.py``), with ``timeout_s``.
        staging: the async writer's staging (buffer budget, pinning).

    Raises:
        ConfigError: ``async_save`` with a first level that stores deltas.
    """

    def __init__(
        self,
        runtime: Runtime,
        levels: Sequence[Level],
        topology: Topology | None,
        planner: SavePlanner,
        *,
        async_save: bool = False,
        staging: StagingConfig | None = None,
        timeout_s: float = 3600.0,
    ) -> None:
        if async_save and runtime.first.deltas:
            raise ConfigError(
                f"CheckpointManager(async_save=True): the first level {runtime.first.url} stores "
                "deltas, which async saves do not code; keep deltas on a higher level, or "
                "save synchronously"
            )
        self.runtime = runtime
        self.levels = list(levels)
        self.topology = topology
        self.planner = planner
        self._async_group = _dist.new_group(timeout_s) if async_save else None
        self._staging = staging
        self._async_writer: MultiLevelWriter | None = None
        #: The health checks each save runs (the manager's), and the next save's loss.
        self.checks: Checks | None = None
        self.loss: float | None = None
        #: The async save in flight (at most one), finished by :meth:`finish_async`.
        self.pending: PendingSave | None = None

    def _writer(self, step: int, due: Sequence[int], **options: Any) -> MultiLevelWriter:
        """A writer of ``step`` onto the levels (collective)."""
        return MultiLevelWriter(
            step_dir(step),
            levels=self.levels,
            topology=self.topology,
            due=due,
            checks=self.checks,
            loss=self.loss,
            **options,
        )

    def save_async(
        self, state_dict: dict[str, Any], step: int, extra: dict[str, Any] | None, due: list[int]
    ) -> SaveMetrics:
        """Stage ``step`` and start writing it (``dcp.async_save``); its metrics so far
        (``blocked_seconds``: the staging). ``due``: the higher levels it is due on.
        The save before must be finished (:meth:`finish_async`)."""
        assert self.pending is None
        t0 = time.perf_counter()
        writer = self._async_writer
        if writer is None:
            writer = self._async_writer = self._writer(step, due, staging=self._staging)
        writer.due = list(due)  # the save before has committed: not read any more
        writer.loss = self.loss
        writer.extra = dict(extra or {})
        future = dcp.async_save(
            state_dict,
            storage_writer=writer,
            checkpoint_id=step_dir(step),
            planner=self.planner,
            process_group=self._async_group,
        )
        fence = None
        if isinstance(future, AsyncSaveResponse):  # overlap: the copies run behind a fence
            fence, future = future.staging_completion, future.upload_completion
        metrics = SaveMetrics(step, self.runtime.first.url, 0, time.perf_counter() - t0)
        pool = writer.staging_pool
        if pool is not None:
            metrics.staging_bytes, metrics.staging_peak_bytes = pool.held_bytes, pool.peak_bytes
        self.pending = PendingSave(step, due, future, writer, metrics, fence=fence)
        return metrics

    def wait_for_staging(self) -> None:
        """Wait until the async save in flight no longer reads the state (the fence of
        ``StagingConfig(overlap=True)``); at once without one. Raises its error."""
        p = self.pending
        if p is not None and p.fence is not None:
            p.fence.result()

    def finish_async(self) -> PendingSave | None:
        """Wait for the async save in flight to commit; it, or None when none was.

        Its metrics then have the bytes written and, as ``waited_seconds``, the
        time this waited for the write. Raises the save's error (it is dropped).
        """
        p, self.pending = self.pending, None
        if p is None:
            return None
        t0 = time.perf_counter()
        p.future.result()
        p.metrics.waited_seconds = time.perf_counter() - t0  # training waited for the write
        p.metrics.bytes_written = p.writer.bytes_written
        return p

    def close(self) -> None:
        """Free the async writer's idle staging buffers."""
        if self._async_writer is not None:
            self._async_writer.close()

    def save(
        self, state_dict: dict[str, Any], step: int, extra: dict[str, Any] | None, due: list[int]
    ) -> MultiLevelWriter:
        """Save ``step`` (``extra`` in its manifest); the writer says what it wrote."""
        writer = self._write(state_dict, step, extra, due)
        if writer is None:  # the reference failed while the save read it: save whole
            writer = self._write(state_dict, step, extra, due)
            assert writer is not None  # a whole save has no reference to fail
        return writer

    def _write(
        self, state_dict: dict[str, Any], step: int, extra: dict[str, Any] | None, due: list[int]
    ) -> MultiLevelWriter | None:
        """``dcp.save`` onto the levels; None when it failed because of its first-level
        reference (every rank sees the same failure)."""
        writer = self._writer(step, due, extra=extra)
        try:
            dcp.save(state_dict, storage_writer=writer, planner=self.planner)
        except CheckpointException as e:
            why = None if writer.reference is None else _reference_failed(e)
            if why is None:
                raise
            logger.warning(
                "dcp_multilevel: step %d could not be coded against %s (%s); saving it whole",
                step,
                writer.reference.url,
                why,  # type: ignore[union-attr]
            )
            return None
        return writer


def _reference_failed(e: CheckpointException) -> str | None:
    """The first rank's reference failure in a failed save (BrokenChainError or the
    commit's check), or None when the save failed for another reason."""
    for failure in e.failures.values():
        err = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(err, (BrokenChainError, CorruptCheckpointError)):
            return str(err)
    return None
