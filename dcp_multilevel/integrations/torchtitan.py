"""A torchtitan checkpointer whose checkpoints are dcp_multilevel checkpoints on several levels.

torchtitan (0.3.0) saves with ``dcp.save(state, checkpoint_id=folder/step-N)``
and finds a checkpoint to resume from by looking for ``.metadata`` in
``folder/step-N``; it has no ``storage_writer`` option. Its plugin point is the
checkpointer class the job config names. One config change selects this one::

    from dcp_multilevel import Level
    from dcp_multilevel.integrations.torchtitan import MultiLevelCheckpointManager

    config.checkpoint = MultiLevelCheckpointManager.Config(
        enable=True,
        interval=100,
        keep_latest_k=3,
        levels=[
            Level("/local_nvme/run1/{node}/ckpt"),                  # every save
            Level("partner:/local_nvme/run1/{node}/partner", replicas=2),
            Level("s3://bucket/run1", every=1000, codec="bytegroup"),
        ],
        codec="bytegroup",  # the first level's codec (partner copies carry its bytes)
    )

:class:`MultiLevelCheckpointManager` is a subclass of torchtitan's
``CheckpointManager``: torchtitan's own code decides when to save (``interval``,
``enable_first_step_checkpoint``, ``load_only``, the last step), which states
(model, optimizer, lr scheduler, dataloader, train state), what to load
(``load_step``, ``exclude_from_loading``, model-only step 0) and the HF
safetensors export; the saves and loads themselves go through one
:class:`dcp_multilevel.CheckpointManager`:

- a save is ``CheckpointManager.save(state, step)``: it returns once the first
  level committed; the levels above drain in the background (their ``every``
  counts steps, as ``interval`` does); the last step of a run (a full save,
  ``last_save_model_only=False``) is due on every level;
- ``keep_latest_k`` is the ``keep`` of every level that sets none (0: keep all);
  torchtitan's own purge thread is not started;
- resuming (``load_step=-1``) is ``CheckpointManager.load_latest``: the newest
  step every rank can read on any level, after bringing back what a lost node
  held from the partner or erasure level (or reading it from a store level);
  ``load_step=N`` is ``CheckpointManager.load(state, N)``;
- a model-only last step (``last_save_model_only=True``, torchtitan's default)
  is an export, not a step to resume from: it goes to ``export_folder/step-N``
  (a checkpoint of ours, or HF safetensors with ``last_save_in_hf`` through
  torchtitan's own ``HuggingFaceStorageWriter`` and state dict adapter);
- ``initial_load_path`` may be one of our checkpoints (read with
  :class:`~dcp_multilevel.MultiLevelReader`), a stock DCP folder or, with
  ``initial_load_in_hf``, HF safetensors (torchtitan's own reader).

``async_mode``: ``"disabled"`` saves the first level before ``save`` returns;
``"async"`` and ``"async_with_pinned_mem"`` are
``CheckpointManager(async_save=True)``: ``save`` returns once the state is
staged into reused host buffers (page-locked whenever CUDA is there), DCP's
background thread writes the first level, and the next save (or the close)
finishes it and starts the drains. With ``"async_with_pinned_mem"``, as with
torchtitan's own, the copies overlap the next forward and backward
(``StagingConfig(overlap=True)``): ``save`` returns before they are made, and
``maybe_wait_for_staging``, which torchtitan's trainer calls before the
optimizer step, waits for them (``CheckpointManager.wait_for_staging``). There
is no daemon process (torchtitan's pinned mode uses DCP's PROCESS executor;
ours stays in a thread of the trainer). See ``docs/integrations.md``.

Tested with ``torchtitan==0.3.0`` on torch 2.13 CPU
(``tests/test_integration_torchtitan.py``). Besides its public classes this
module relies on these torchtitan methods, pinned by that version:
``CheckpointManager._should_save``, ``_states_to_load``,
``_flattened_model_states_sd``, ``dcp_save`` (the HF export) and ``dcp_load``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools import filesystem

from ..convert import detect_source
from ..errors import CheckpointNotFoundError, ConfigError, ConvertError
from ..levels import Level
from ..manage.manager import CheckpointManager as LevelsManager
from ..plugin import BalancedSavePlanner, MultiLevelReader, MultiLevelWriter
from ..schedule import FixedInterval, SavePolicy
from ..staging import StagingConfig

__all__ = ["MultiLevelCheckpointManager"]

logger = logging.getLogger(__name__)

#: What ``Config.planner`` may say.
PLANNERS = ("balanced", "default")


class _LastStepDue(FixedInterval):
    """Each level's ``every``, and the run's last step on every level: a run's final
    full checkpoint reaches the remote level even when ``every`` does not divide it."""

    def __init__(self) -> None:
        self.last_step: int | None = None

    def due(self, index: int, level: Level, step: int) -> bool:
        return step == self.last_step or super().due(index, level, step)

    def __repr__(self) -> str:
        return f"FixedInterval(last_step={self.last_step})"


class MultiLevelCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager``, saving and loading through dcp_multilevel levels.

    Built by torchtitan from :class:`Config` (``config.checkpoint.build(...)``),
    with the same arguments as its base class. Every option of torchtitan's
    ``CheckpointManager.Config`` keeps its meaning (see the module docstring
    for how each maps onto levels).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's checkpoint options, plus where and how our levels store them."""

        levels: list[Level] = field(default_factory=list)
        """The levels, fastest first (``dcp_multilevel.Level``); empty: one level
        at ``folder`` (torchtitan's layout, ``folder/step-N``). A level without
        ``keep`` keeps ``keep_latest_k`` checkpoints (0: all)."""

        codec: str | None = None
        """The first level's codec when it sets none (``"bytegroup"``, ``"zstd"``);
        partner and erasure levels copy the first level's bytes as they are."""

        planner: Literal["balanced", "default"] = "balanced"
        """``"balanced"``: ``BalancedSavePlanner`` (replicated state written once,
        spread over ranks); ``"default"``: DCP's ``DefaultSavePlanner``."""

        schedule: SavePolicy | None = None
        """Which levels take each save (``dcp_multilevel.Schedule``); None: each
        level's ``every`` in steps, and the last step on every level. A policy
        that is not deterministic (``Schedule.auto``) decides every step itself,
        in place of ``interval``."""

        drain_policy: Literal["latest", "skip", "wait"] = "latest"
        """What a save due on a level still draining an earlier one does there
        (``dcp_multilevel.CheckpointManager``)."""

        export_folder: str = "export"
        """Where a model-only last step goes (``export_folder/step-N``), relative to
        the trainer's dump folder like ``folder``."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if not all(isinstance(level, Level) for level in self.levels):
                raise ConfigError(
                    f"checkpoint.levels must be a list of dcp_multilevel.Level, got {self.levels!r}"
                )
            if self.planner not in PLANNERS:
                raise ConfigError(
                    f"checkpoint.planner must be one of {PLANNERS}, got {self.planner!r}"
                )
            if self.schedule is not None and not isinstance(self.schedule, SavePolicy):
                raise ConfigError(
                    "checkpoint.schedule must be None or a dcp_multilevel SavePolicy "
                    f"(Schedule.auto(...), FixedInterval()), got {self.schedule!r}"
                )
            if not self.export_folder.strip():
                raise ConfigError("checkpoint.export_folder cannot be empty")

    def __init__(self, config: Config, *, base_folder: str = "", **components: Any) -> None:
        # torchtitan's purge thread deletes folder/step-N directories itself: our
        # levels apply the retention (keep_latest_k becomes their keep), so the base
        # class is built without one.
        super().__init__(
            dataclasses.replace(config, keep_latest_k=0), base_folder=base_folder, **components
        )
        if not self.enable:
            return
        self.keep_latest_k = config.keep_latest_k
        self.export_folder = filesystem.join(base_folder, config.export_folder)
        self.levels = self._levels(config)
        self._last_step_due = _LastStepDue() if config.schedule is None else None
        self.schedule = config.schedule or self._last_step_due
        self._adaptive = not self.schedule.deterministic
        planner = BalancedSavePlanner() if config.planner == "balanced" else DefaultSavePlanner()
        # async / async_with_pinned_mem: our staging (reused buffers, page-locked
        # where CUDA is), then DCP's background thread writes the first level. The
        # pinned mode's copies overlap training until maybe_wait_for_staging.
        overlap = self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
        # Collective (every rank, as torchtitan builds its checkpointer).
        self.multilevel = LevelsManager(
            self.levels, schedule=self.schedule, planner=planner,
            drain_policy=config.drain_policy,
            async_save=self.async_mode != AsyncMode.DISABLED,
            staging=StagingConfig(overlap=True) if overlap else None,
        )  # fmt: skip

    def _levels(self, config: Config) -> list[Level]:
        """The configured levels, each with ``keep_latest_k`` where it sets no ``keep``,
        the first with ``codec`` where it sets none."""
        keep = config.keep_latest_k or None
        levels = list(config.levels) or [Level(self.folder)]
        levels = [lvl if lvl.keep is not None else dataclasses.replace(lvl, keep=keep)
                  for lvl in levels]  # fmt: skip
        if config.codec is not None and levels[0].codec is None:
            levels[0] = dataclasses.replace(levels[0], codec=config.codec)
        return levels

    # ------------------------------------------------------------------ save

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save ``curr_step`` when torchtitan's policy (or an adaptive schedule) says so."""
        if self.load_only:
            return False
        forced = last_step or (curr_step == 1 and self.enable_first_step_checkpoint)
        if self._adaptive and not forced:
            # The schedule decides every step (collective at its check steps).
            return self.multilevel.step(self._flattened_model_states_sd(), curr_step) is not None
        if not self._should_save(curr_step, last_step):
            return False
        if last_step and curr_step > 0 and self.last_save_model_only:
            self._export_model(curr_step)
            return True
        if last_step and curr_step == 0:  # the seed checkpoint (create_seed_checkpoint)
            states = self._model_states() if self.last_save_model_only else None
        else:
            states = None
        if last_step and self._last_step_due is not None:
            self._last_step_due.last_step = curr_step
        metrics = self.multilevel.save(
            states if states is not None else self._flattened_model_states_sd(), step=curr_step
        )
        logger.info(
            "dcp_multilevel: step %d saved to %s in %.2f s; draining to %s",
            curr_step, metrics.level, metrics.seconds, metrics.drains_started or "no level",
        )  # fmt: skip
        return True

    def _model_states(self) -> dict[str, Any]:
        """The model's state in ``export_dtype`` (torchtitan's model-only last step)."""
        dtype = self.export_dtype
        return {
            k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in self.states[MODEL].state_dict().items()
        }

    def _export_model(self, step: int) -> None:
        """A model-only last step: HF safetensors or one checkpoint of ours, outside the levels."""
        path = filesystem.join(self.export_folder, f"step-{step}")
        states = self._model_states()
        if self.last_save_in_hf:
            # torchtitan's own path: its state dict adapter and HuggingFaceStorageWriter.
            self.dcp_save(states, checkpoint_id=path, async_mode=AsyncMode.DISABLED, to_hf=True)
        else:
            writer = MultiLevelWriter(path, overwrite=True, codec=self.levels[0].codec)
            dcp.save(states, storage_writer=writer)
        logger.info("dcp_multilevel: model-only step %d exported to %s", step, path)

    # ------------------------------------------------------------------ load

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Load ``step`` (-1: the newest every rank can read), else torchtitan's
        initial load; False on a fresh start."""
        if step != -1:
            self._load_step(step)
            return True
        newest = self._newest_step()
        if newest == 0:  # only a seed checkpoint: torchtitan loads its model alone
            self._load_step(0)
            return True
        if newest > 0:
            states = self._states_to_load(model_only=False)
            loaded = self.multilevel.load_latest(states)
            if loaded is not None:
                self._model_loaded(states)
                logger.info("dcp_multilevel: resumed from step %d", loaded)
                return True
        return self._initial_load()

    def _load_step(self, step: int) -> None:
        states = self._states_to_load(model_only=step == 0)
        self.multilevel.load(states, step)
        self._model_loaded(states)
        logger.info("dcp_multilevel: loaded step %d", step)

    def _model_loaded(self, states: dict[str, Any]) -> None:
        # The model's tensors are flattened into ``states`` and were loaded in place;
        # torchtitan's ModelWrapper then loads them into the modules (as dcp_load does).
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(states)

    def _find_load_step(self, folder: str = "") -> int:
        """The newest step any level lists on this rank (-1: none); ``folder`` is ignored
        (our levels say where checkpoints are). Not collective: see :meth:`_newest_step`."""
        steps = [s for i in range(len(self.levels)) for s in self.multilevel.steps(i)]
        return max(steps, default=-1)

    def _newest_step(self) -> int:
        """The newest step listed on any level of any rank (-1: none). Collective.

        A node that lost its disk lists nothing; the others' listings still show
        that checkpoints exist, and ``load_latest`` restores that node's files.
        """
        mine = self._find_load_step()
        if not (dist.is_available() and dist.is_initialized()):
            return mine
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return max(everyone)

    def _initial_load(self) -> bool:
        """torchtitan's initial load (``initial_load_path`` / HF assets), or a fresh start."""
        from_hf = self.initial_load_in_hf
        if self.initial_load_path:
            path = self.initial_load_path
        elif from_hf:
            adapter = self.sd_adapter
            if adapter is None or not adapter.hf_assets_path:
                raise ValueError("from_hf=True requires sd_adapter and hf_assets_path.")
            path = adapter.hf_assets_path
        else:
            logger.info("No checkpoint was provided, this is a fresh start.")
            return False
        if not filesystem.is_remote(path) and not filesystem.isdir(path):
            raise ValueError(f"Checkpoint.initial_load_path is invalid: {path}")
        logger.info("Loading the initial checkpoint from %s.", path)
        self.dcp_load(
            self._states_to_load(self.initial_load_model_only),
            checkpoint_id=path,
            from_hf=from_hf,
            from_quantized=self.initial_load_in_hf_quantized,
        )
        return True

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """torchtitan's ``dcp_load``, reading a checkpoint of ours with our reader.

        A stock DCP folder or HF safetensors goes to torchtitan's own code.
        """
        if not _is_ours(checkpoint_id):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        if from_hf:
            # A checkpoint of ours holding HF names (e.g. an HF model converted to ours).
            assert self.sd_adapter is not None, "from_hf=True requires an sd_adapter"
            hf_state_dict = self.sd_adapter.to_hf(state_dict)
            dcp.load(hf_state_dict, storage_reader=MultiLevelReader(checkpoint_id))
            self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf_state_dict))
            return
        dcp.load(state_dict, storage_reader=MultiLevelReader(checkpoint_id))
        self._model_loaded(state_dict)

    # ------------------------------------------------------------------ lifecycle

    def _purge_stale_checkpoints(self) -> None:
        """Nothing: each level applies its own retention (``keep``)."""

    def _maybe_wait_for_staging(self) -> None:
        """The fence of ``async_with_pinned_mem``: the last save's copies are made.

        torchtitan's trainer calls it before the optimizer step.
        """
        super()._maybe_wait_for_staging()
        if self.multilevel is not None:
            self.multilevel.wait_for_staging()

    def _close(self) -> None:
        """Wait for the drains (raising their errors), then torchtitan's own close."""
        manager = getattr(self, "multilevel", None)
        try:
            if manager is not None:
                self.multilevel = None
                manager.close()
        finally:
            super()._close()


def _is_ours(path: str) -> bool:
    """True when ``path`` holds a dcp_multilevel checkpoint (its manifest)."""
    if not filesystem.is_remote(path) and not os.path.isdir(path):
        return False
    try:
        return detect_source(path) == "ours"
    except (CheckpointNotFoundError, ConvertError):  # nothing there, or not ours
        return False
