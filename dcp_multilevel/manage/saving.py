"""The save flow: one checkpoint onto the first level, coded against the right reference.

:class:`FirstLevelSaves` writes each save to the first level with DCP and a
:class:`~dcp_multilevel.writer.MultiLevelWriter`, choosing the step a delta
level codes it against (``chains.py``), and saves it whole when that
reference fails while the save reads it (every rank sees the same failure).

Call order (main thread, every rank, collective)::

    saves = FirstLevelSaves(level, driver, chains, planner, keep_manifest)
    writer = saves.save(state_dict, step, extra)   returns once the first level committed

With ``async_group`` (``CheckpointManager(async_save=True)``), instead::

    writer, future = saves.save_async(state_dict, step, extra)   returns once staged
    ... training goes on; DCP writes and commits in its background thread ...
    future.result(); saves.committed(step)         before the next save (main thread)

One writer serves every async save, so its staging buffers are reused; at
most one async save is in flight (the manager finishes one before the next).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner

from .. import _dist
from ..checkpoint import StoredCheckpoint
from ..config import Level
from ..errors import BrokenChainError, ConfigError, CorruptCheckpointError, DcpMultilevelError
from ..levels import LevelDriver
from ..staging import StagingConfig
from ..writer import MultiLevelWriter
from .chains import DeltaChains

__all__ = ["FirstLevelSaves"]

logger = logging.getLogger(__name__)


class FirstLevelSaves:
    """Saves onto the first level (see the module docstring).

    Args:
        level, driver: the first level and its driver.
        chains: the delta histories (which step the save is coded against).
        planner: the save planner, reused so that DCP's plan cache works.
        keep_manifest: ``keep_manifest(step, manifest_bytes)`` writes a reference's
            manifest on each node that lacks it (a node-local first level).
        async_group: for :meth:`save_async`: the gloo group DCP's background
            thread saves over (never the trainer's, see ``_dist.py``).
        staging: the async writer's staging (buffer budget, pinning).
    """

    def __init__(
        self,
        level: Level,
        driver: LevelDriver,
        chains: DeltaChains,
        planner: SavePlanner,
        keep_manifest: Callable[[int, bytes], None],
        *,
        async_group: Any = None,
        staging: StagingConfig | None = None,
    ) -> None:
        self.level = level
        self.driver = driver
        self.chains = chains
        self.planner = planner
        self._keep_manifest = keep_manifest
        self._async_group = async_group
        self._staging = staging
        self._async_writer: MultiLevelWriter | None = None

    def save_async(
        self, state_dict: dict[str, Any], step: int, extra: dict[str, Any] | None
    ) -> tuple[MultiLevelWriter, Future]:
        """Stage ``step`` and start writing it (``dcp.async_save``); the future
        completes once the first level committed it. Call :meth:`committed` then.

        Raises:
            ConfigError: the first level stores deltas (async saves store whole).
        """
        if self.level.deltas:
            raise ConfigError(
                f"level {self.level.url} stores deltas; async saves store whole checkpoints: "
                "use CheckpointManager(async_save=False), or deltas on a higher level"
            )
        url = self.level.checkpoint_url(step)
        writer = self._async_writer
        if writer is None:
            writer = self._async_writer = MultiLevelWriter(
                url, codec=self.level.codec, storage_options=self.level.storage_options,
                staging=self._staging,
            )  # fmt: skip
        writer.extra = dict(extra or {})  # the save before has committed: not read any more
        future = dcp.async_save(
            state_dict, storage_writer=writer, checkpoint_id=url, planner=self.planner,
            process_group=self._async_group,
        )  # fmt: skip
        return writer, future

    def committed(self, step: int) -> None:
        """An async save of ``step`` committed (a whole checkpoint)."""
        self.chains.stored(0, step, None)

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
