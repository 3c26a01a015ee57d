"""The save flow: one checkpoint onto the first level, coded against the right reference.

:class:`FirstLevelSaves` writes each save to the first level with DCP and a
:class:`~dcp_multilevel.MultiLevelWriter`, choosing the step a delta
level codes it against (``chains.py``), and saves it whole when that
reference fails while the save reads it (every rank sees the same failure).

Call order (main thread, every rank, collective)::

    saves = FirstLevelSaves(level, driver, chains, planner, keep_manifest)
    writer = saves.save(state_dict, step, extra)   returns once the first level committed

With ``async_group`` (``CheckpointManager(async_save=True)``), instead::

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
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from .. import _dist
from ..checkpoint import StoredCheckpoint
from ..errors import BrokenChainError, ConfigError, CorruptCheckpointError, DcpMultilevelError
from ..levels import LevelDriver
from ..levels.options import Level
from ..plugin import MultiLevelWriter
from ..staging import StagingConfig
from .chains import DeltaChains
from .metrics import SaveMetrics

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
    """Saves onto the first level (see the module docstring).

    Args:
        level, driver: the first level and its driver.
        chains: the delta histories (which step the save is coded against).
        planner: the save planner, reused so that DCP's plan cache works.
        keep_manifest: ``keep_manifest(step, manifest_bytes)`` writes a reference's
            manifest on each node that lacks it (a node-local first level).
        async_save: saves go through :meth:`save_async`; makes the gloo group DCP's
            background thread saves over (collective; never the trainer's group,
            see ``_dist.py``), with ``timeout_s``.
        staging: the async writer's staging (buffer budget, pinning).

    Raises:
        ConfigError: ``async_save`` with a first level that stores deltas.
    """

    def __init__(
        self,
        level: Level,
        driver: LevelDriver,
        chains: DeltaChains,
        planner: SavePlanner,
        keep_manifest: Callable[[int, bytes], None],
        *,
        async_save: bool = False,
        staging: StagingConfig | None = None,
        timeout_s: float = 3600.0,
    ) -> None:
        if async_save and level.deltas:
            raise ConfigError(
                f"CheckpointManager(async_save=True): the first level {level.url} stores "
                "deltas, which async saves do not code; keep deltas on a higher level, or "
                "save synchronously"
            )
        self.level = level
        self.driver = driver
        self.chains = chains
        self.planner = planner
        self._keep_manifest = keep_manifest
        self._async_group = _dist.new_group(timeout_s) if async_save else None
        self._staging = staging
        self._async_writer: MultiLevelWriter | None = None
        #: The async save in flight (at most one), finished by :meth:`finish_async`.
        self.pending: PendingSave | None = None

    def save_async(
        self, state_dict: dict[str, Any], step: int, extra: dict[str, Any] | None, due: list[int]
    ) -> SaveMetrics:
        """Stage ``step`` and start writing it (``dcp.async_save``); its metrics so far
        (``blocked_seconds``: the staging). ``due``: the higher levels it is due on.
        The save before must be finished (:meth:`finish_async`)."""
        assert self.pending is None
        t0 = time.perf_counter()
        url = self.level.checkpoint_url(step)
        writer = self._async_writer
        if writer is None:
            writer = self._async_writer = MultiLevelWriter(
                url, codec=self.level.codec, storage_options=self.level.storage_options,
                staging=self._staging, overwrite=self.level.overwrite,
            )  # fmt: skip
        writer.extra = dict(extra or {})  # the save before has committed: not read any more
        future = dcp.async_save(
            state_dict, storage_writer=writer, checkpoint_id=url, planner=self.planner,
            process_group=self._async_group,
        )  # fmt: skip
        fence = None
        if isinstance(future, AsyncSaveResponse):  # overlap: the copies run behind a fence
            fence, future = future.staging_completion, future.upload_completion
        metrics = SaveMetrics(step, self.level.url, 0, time.perf_counter() - t0)
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
        self.chains.stored(0, p.step, None)  # a whole checkpoint
        return p

    def close(self) -> None:
        """Free the async writer's idle staging buffers."""
        if self._async_writer is not None:
            self._async_writer.close()

    def save(
        self, state_dict: dict[str, Any], step: int, extra: dict[str, Any] | None
    ) -> MultiLevelWriter:
        """Save ``step`` (``extra`` in its manifest); the writer says what it wrote."""
        ref = self.chains.reference(0)
        reference = self._reference(ref)
        if reference is None:
            ref = None
        writer = self._write(state_dict, step, reference, extra)
        if writer is None:  # the reference failed while the save read it: save whole
            ref = None
            writer = self._write(state_dict, step, None, extra)
        self.chains.stored(0, step, ref)
        return writer

    def _write(
        self,
        state_dict: dict[str, Any],
        step: int,
        reference: StoredCheckpoint | None,
        extra: dict[str, Any] | None,
    ) -> MultiLevelWriter | None:
        """``dcp.save`` onto the first level; None when it failed because of its
        reference (every rank sees the same failure)."""
        writer = MultiLevelWriter(
            self.level.checkpoint_url(step), codec=self.level.codec,
            storage_options=self.level.storage_options, reference=reference, extra=extra,
            overwrite=self.level.overwrite,
        )  # fmt: skip
        try:
            dcp.save(state_dict, storage_writer=writer, planner=self.planner)
        except CheckpointException as e:
            why = None if reference is None else _reference_failed(e)
            if why is None:
                raise
            logger.warning(
                "dcp_multilevel: step %d could not be coded against %s (%s); saving it whole",
                step, reference.url, why,  # type: ignore[union-attr]
            )  # fmt: skip
            return None
        return writer

    def _reference(self, step: int | None) -> StoredCheckpoint | None:
        """The first level's checkpoint of ``step`` as a reference every rank can use.

        Only rank 0's node may hold its manifest (a node-local first level):
        rank 0 sends it. None on every rank when rank 0 cannot read it.
        """
        if step is None:
            return None
        ckpt = self.driver.checkpoint(step)
        if _dist.world_size() == 1:
            return ckpt

        def read() -> bytes | None:
            try:
                return ckpt.manifest_bytes()
            except (DcpMultilevelError, OSError) as e:
                logger.warning("dcp_multilevel: no delta against step %d: %s", step, e)
                return None

        data = _dist.rank0_decides(read)
        if data is None:
            return None
        # The delta's ranks find its reference's manifest beside it later (drains,
        # loads), on their own node: a node-local first level has it on rank 0's
        # node only, so each node's lowest rank keeps a copy before any delta
        # against it exists there.
        self._keep_manifest(step, data)
        return self.driver.checkpoint(step, manifest_bytes=data)


def _reference_failed(e: CheckpointException) -> str | None:
    """The first rank's reference failure in a failed save (BrokenChainError or the
    commit's check), or None when the save failed for another reason."""
    for failure in e.failures.values():
        err = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(err, (BrokenChainError, CorruptCheckpointError)):
            return str(err)
    return None
