"""A torchtitan checkpointer whose checkpoints are dcp_multilevel checkpoints on several levels.

torchtitan (0.3.0) saves with ``dcp.save(state, checkpoint_id=folder/step-N)``
and has no ``storage_writer`` option; its plugin point is the checkpointer
class the job config names. One config change selects this one::

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

The subclass keeps torchtitan's ``save()``: torchtitan decides when to save
(``interval``, ``enable_first_step_checkpoint``, ``load_only``, the last
step), which states, the async waits (``maybe_wait_for_saving`` before a save,
``maybe_wait_for_staging`` before the optimizer step) and the HF export. Only
``dcp_save``, through which that ``save()`` makes every save, changes: it
writes ``folder/step-N`` as step N of the levels, with plain ``dcp.save`` /
``dcp.async_save`` and a :class:`~dcp_multilevel.MultiLevelWriter` given them:

- the save returns once the first level committed the step (async: once
  staged); the process's runtime for the levels sends it on in the background
  and applies each level's ``keep`` as each save commits. ``keep_latest_k``
  is the ``keep`` of every level that sets none (0: all); torchtitan's own
  purge is off (its ``keep_latest_k`` attribute is 0);
- the higher levels a step goes to are ``schedule.due(...)`` (default
  :class:`~dcp_multilevel.schedule.FixedInterval`: a level's ``every`` counts steps, as
  ``interval`` does); the last full step (``last_save_model_only=False``) and
  the seed (step 0) go to every level;
- a model-only last step (torchtitan's default) is an export, not a step to
  resume from: ``export_folder/step-N``, a checkpoint of ours, or HF
  safetensors (``last_save_in_hf``) written by torchtitan's own ``dcp_save``;
- ``async_mode="async"``: ``dcp.async_save`` over torchtitan's gloo group with
  one writer reused for every save (its staging buffers too);
  ``"async_with_pinned_mem"`` also overlaps the copies with the next forward
  and backward (``StagingConfig(overlap=True)``): that writer is torchtitan's
  ``stager``, and ``maybe_wait_for_staging`` waits for the fence DCP returns.
  No daemon process (torchtitan's own uses DCP's PROCESS executor).

``load()`` is collective: every rank lists what each level holds, so a node
that lost its disk still takes part. When a rank sees a step, ``load(-1)``
reads ``MultiLevelReader("latest", levels=...)`` (``"step-0"``, model only,
when the seed is the newest): the ranks agree on the newest step every rank
can read, passing over quarantined steps (``docs/health.md``), a lost node's
files come back from the partner or erasure level, and each item is read from
the fastest level holding it; ``load(N)`` reads ``"step-N"`` (a quarantined
one with a warning). When no level holds it, torchtitan's own ``load`` runs
(``initial_load_path``: ours through :meth:`~MultiLevelCheckpointManager.dcp_load`,
stock DCP or HF; a stock ``folder/step-N``; or a fresh start). ``close()``
waits for the async save in flight and every due drain (``dcp_multilevel.wait()``).

Not kept: a schedule deciding at every training step (``Schedule.auto``)
needs ``dcp_multilevel.CheckpointManager.step()``; here torchtitan decides
when, so ``schedule`` must decide from the step alone (``FixedInterval``).

Tested with ``torchtitan==0.3.0`` on torch 2.13 CPU
(``tests/stacks/test_integration_torchtitan.py``: its checkpointer, optimizers, lr
schedulers and dataloader driven as ``Trainer.train`` drives them, 2 gloo
ranks). Its ``Trainer`` does not run on a CPU-only torch:
``torchtitan/tools/utils.py:55`` sets ``device_type =
_get_available_device_type() or "cuda"``, and ``Trainer.__init__``
(``torchtitan/trainer.py:301``) calls ``torch.cuda.set_device``:
``AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'``; no
option selects the CPU. With the device patched, ``DeviceMemoryMonitor``
(``components/metrics.py:42``) needs ``get_device_name``; past it no Llama 3
attention trains on CPU: ``flex`` raises ``NotImplementedError: FlexAttention
does not support backward on CPU`` (``torch/nn/attention/flex_attention.py:2082``),
``varlen`` calls ``aten::_flash_attention_forward`` (no CPU kernel), and
``sdpa`` is refused (``models/common/config_utils.py:98``).

Private torchtitan names used: one, ``CheckpointManager._states_to_load``,
torchtitan's choice of the states to load (model only for step 0 and initial
loads, ``exclude_from_loading``), so that our loads restore what its own
would. Conventions relied on: ``save()`` makes every save through
``dcp_save(state, folder/step-N, async_mode)``, builds a ``DefaultStager``
only while ``stager`` is None, and keeps the async futures in
``save_future`` / ``staging_future``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.utils import GarbageCollection

from ..convert import detect_source
from ..errors import CheckpointNotFoundError, ConfigError, ConvertError
from ..format.layout import parse_step_dir, step_dir
from ..levels import Level
from ..levels.config import LATEST
from ..levels.restore_execute import RestoreReport
from ..levels.runtime import Runtime, runtime_for, wait
from ..plugin import BalancedSavePlanner, MultiLevelReader, MultiLevelWriter
from ..schedule import FixedInterval, SavePolicy
from ..staging import StagingConfig

__all__ = ["MultiLevelCheckpointManager"]

logger = logging.getLogger(__name__)

#: What ``Config.planner`` may say.
PLANNERS = ("balanced", "default")


class MultiLevelCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager``, saving and loading through dcp_multilevel levels.

    Built by torchtitan from :class:`Config` (``config.checkpoint.build(...)``,
    on every rank: construction is collective), with the same arguments as its
    base class. Every option of torchtitan's ``CheckpointManager.Config`` keeps
    its meaning (see the module docstring for how each maps onto levels).

    Attributes:
        levels: the levels, ``keep_latest_k`` and ``codec`` filled in.
        runtime: the process's runtime for them (shared with any writer or reader
            given the same levels).
        schedule: which higher levels each step goes to.
        export_folder: where a model-only last step goes.
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
        """Which higher levels take each step (a deterministic
        ``dcp_multilevel.schedule.SavePolicy``); None: ``FixedInterval()``, each level's
        ``every`` in steps. The last full step and the seed go to every level."""

        drain_policy: Literal["latest", "skip", "wait"] = "latest"
        """What a save due on a level still draining an earlier one does there
        (``"latest"``: waits in the level's one slot, replaced by a newer step;
        ``"skip"``: not sent there; ``"wait"``: the save waits for the level)."""

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
            if self.schedule is not None and not (
                isinstance(self.schedule, SavePolicy) and self.schedule.deterministic
            ):
                raise ConfigError(
                    f"checkpoint.schedule={self.schedule!r}: torchtitan decides when to save "
                    "(interval), so the schedule only says which levels take each step and must "
                    "decide from the step alone (FixedInterval(), or a SavePolicy with "
                    "deterministic=True and due()); a schedule that decides at every training "
                    "step (Schedule.auto) needs dcp_multilevel.CheckpointManager.step()"
                )
            if not self.export_folder.strip():
                raise ConfigError("checkpoint.export_folder cannot be empty")

    def __init__(self, config: Config, *, base_folder: str = "", **components: Any) -> None:
        # The levels apply the retention (keep_latest_k becomes their keep): the base
        # class is built with keep_latest_k=0, so its purge thread never starts and
        # its save() purges nothing.
        super().__init__(
            dataclasses.replace(config, keep_latest_k=0), base_folder=base_folder, **components
        )
        self._open = False
        if not self.enable:
            return
        self.export_folder = filesystem.join(base_folder, config.export_folder)
        self.levels = _levels(config, self.folder)
        self.schedule = config.schedule or FixedInterval()
        self.planner = (
            BalancedSavePlanner() if config.planner == "balanced" else DefaultSavePlanner()
        )
        # Collective (every rank, as torchtitan builds its checkpointer): the runtime is
        # made here, with the drain policy, which writers cannot pass.
        self.runtime: Runtime = runtime_for(
            self.levels, who="MultiLevelCheckpointManager", drain_policy=config.drain_policy
        )
        #: One writer for every async save: its staging buffers are reused.
        self._async_writer: MultiLevelWriter | None = None
        if self.async_mode != AsyncMode.DISABLED:
            self._async_writer = self._async_saves()
        #: Set by save() around torchtitan's own: dcp_save tells the last step by it.
        self._saving_last = False
        self._open = True

    # ------------------------------------------------------------------ save

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        """torchtitan's ``save``: it decides whether and what to save; the save itself
        is :meth:`dcp_save`. True when a checkpoint was saved (or staged)."""
        self._saving_last = last_step
        try:
            return super().save(curr_step, last_step)
        finally:
            self._saving_last = False

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future | AsyncSaveResponse | None:
        """Save ``state_dict`` as torchtitan asks: ``folder/step-N`` is step N of the levels.

        A model-only last step goes to ``export_folder/step-N``; a location that is
        not ``folder/step-N`` is torchtitan's own ``dcp_save``. Returns what
        torchtitan's returns: None (saved), DCP's future (``async``) or its
        ``AsyncSaveResponse`` (``async_with_pinned_mem``).
        """
        step = self._step_of(checkpoint_id)
        if step is None:
            return super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        if self._saving_last and step > 0 and self.last_save_model_only:
            self._export(state_dict, step, to_hf)
        elif async_mode == AsyncMode.DISABLED:
            writer = MultiLevelWriter(step_dir(step), levels=self.levels, due=self._due(step))
            dcp.save(state_dict, storage_writer=writer, planner=self.planner)
            logger.info("dcp_multilevel: step %d committed on %s", step, self.levels[0].url)
        else:
            return self._save_async(state_dict, step, async_mode)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return None

    def _async_saves(self) -> MultiLevelWriter:
        """The writer of every async save (collective). In ``async_with_pinned_mem`` it
        is also torchtitan's ``stager``: torchtitan then builds no ``DefaultStager``
        (whose non-blocking copies need an accelerator) and closes ours."""
        if self.runtime.first.deltas:
            raise ConfigError(
                f"checkpoint.async_mode={self.async_mode.value!r}: the first level "
                f"{self.runtime.first.url} stores deltas, which async saves do not code; keep "
                "deltas on a higher level, or set async_mode='disabled'"
            )
        overlap = self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
        staging = StagingConfig(overlap=True) if overlap else None
        writer = MultiLevelWriter(levels=self.levels, staging=staging)
        if overlap:
            self.stager = writer
        return writer

    def _save_async(
        self, state_dict: dict[str, Any], step: int, async_mode: AsyncMode
    ) -> Future | AsyncSaveResponse:
        """``dcp.async_save`` of ``step`` with the reused writer; torchtitan waited for
        the save before (``maybe_wait_for_saving``), so at most one is in flight."""
        writer = self._async_writer
        if writer is None or async_mode != self.async_mode:
            raise ConfigError(
                f"dcp_save(async_mode={async_mode.value!r}) on a checkpointer configured "
                f"with async_mode={self.async_mode.value!r}"
            )
        writer.due = self._due(step)  # the save before has committed: not read any more
        return dcp.async_save(
            state_dict,
            storage_writer=writer,
            checkpoint_id=step_dir(step),
            planner=self.planner,
            process_group=self.pg,
        )

    def _step_of(self, checkpoint_id: str) -> int | None:
        """The step ``checkpoint_id`` names when it is ``folder/step-N`` (None otherwise)."""
        step = parse_step_dir(os.path.basename(os.fspath(checkpoint_id).rstrip("/")))
        if step is None or checkpoint_id != filesystem.join(self.folder, step_dir(step)):
            return None
        return step

    def _due(self, step: int) -> list[int]:
        """The higher levels ``step`` goes to: every one for the last full step and the
        seed (a save torchtitan makes as its last step), else the schedule's."""
        higher = range(1, len(self.levels))
        if self._saving_last:
            return list(higher)
        return [i for i in higher if self.schedule.due(i, self.levels[i], step)]

    def _export(self, state_dict: dict[str, Any], step: int, to_hf: bool) -> None:
        """A model-only last step: HF safetensors or one checkpoint of ours, outside the levels."""
        path = filesystem.join(self.export_folder, step_dir(step))
        if to_hf:
            # torchtitan's own path: its state dict adapter and HuggingFaceStorageWriter.
            super().dcp_save(
                state_dict, checkpoint_id=path, async_mode=AsyncMode.DISABLED, to_hf=True
            )
        else:
            writer = MultiLevelWriter(path, overwrite=True, codec=self.levels[0].codec)
            dcp.save(state_dict, storage_writer=writer)
        logger.info("dcp_multilevel: model-only step %d exported to %s", step, path)

    # ------------------------------------------------------------------ load

    @torch.no_grad()
    def load(self, step: int = -1, *, allow_quarantined: bool = False) -> bool:
        """Load ``step`` (-1: the newest clean step every rank can read, quarantined ones
        passed over unless ``allow_quarantined``: ``docs/health.md``) from the levels;
        when no level holds it, torchtitan's own ``load`` (initial load, fresh start).
        Collective.

        Returns:
            Whether a checkpoint was loaded (False: a fresh start).

        Raises:
            CheckpointNotFoundError: steps exist but none every rank can read, or
                every one is quarantined.
        """
        if not self.enable:
            return False
        held = self._held_steps()
        if (step == -1 and not held) or (step != -1 and step not in held):
            return super().load(step)
        if step == -1 and max(held) == 0:  # only the seed: torchtitan loads its model alone
            step = 0
        states = self._states_to_load(model_only=step == 0)
        reader = MultiLevelReader(
            LATEST if step == -1 else step_dir(step),
            levels=self.levels,
            allow_quarantined=allow_quarantined,
        )
        try:
            dcp.load(states, storage_reader=reader)
        except CheckpointException as e:  # the ranks could not agree on the step, or bring it
            if reader.loads is not None and reader.loads.failure is not None:
                raise reader.loads.failure from e
            raise
        # The model's tensors are flattened into ``states`` and were loaded in place;
        # torchtitan's ModelWrapper then loads them into the modules (as its dcp_load does).
        self.states[MODEL].load_state_dict(states)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        assert reader.loads is not None and reader.loads.restore is not None
        logger.info("dcp_multilevel: loaded step %d", reader.loads.restore.step)
        return True

    def _held_steps(self) -> set[int]:
        """Every step some rank lists on some level. Collective.

        A node that lost its disk lists nothing; the others' listings still show
        that checkpoints exist, and the reader brings that node's files back.
        """
        mine = sorted({s for i in range(len(self.levels)) for s in self.steps(i)})
        if not (dist.is_available() and dist.is_initialized()):
            return set(mine)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {s for steps in everyone for s in steps}

    def steps(self, level_index: int) -> list[int]:
        """Steps committed on level ``level_index`` as this rank sees it, ascending."""
        return self.runtime.drivers[level_index].steps()

    @property
    def last_restore(self) -> RestoreReport | None:
        """The last load's restore: files brought onto this rank's node, by source."""
        return self.runtime.restorer.last_restore

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """torchtitan's ``dcp_load`` (its initial load), reading a checkpoint of ours
        with our reader; a stock DCP folder or HF safetensors goes to torchtitan's own."""
        if not _is_ours(checkpoint_id):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        if from_hf:
            # A checkpoint of ours holding HF names (e.g. an HF model converted to ours).
            if self.sd_adapter is None:
                raise ConfigError(f"loading {checkpoint_id} with from_hf needs an sd_adapter")
            hf_state_dict = self.sd_adapter.to_hf(state_dict)
            dcp.load(hf_state_dict, storage_reader=MultiLevelReader(checkpoint_id))
            self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf_state_dict))
            return
        dcp.load(state_dict, storage_reader=MultiLevelReader(checkpoint_id))
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wait for the async save in flight and every due drain (raising their
        errors), then torchtitan's own close. Collective, like the drains."""
        try:
            if getattr(self, "_open", False):
                self._open = False  # torchtitan's __del__ calls close() again
                self.maybe_wait_for_saving()
                wait()
        finally:
            writer = getattr(self, "_async_writer", None)
            if writer is not None and writer is not getattr(self, "stager", None):
                writer.close()  # its idle staging buffers (torchtitan closes its stager)
            super().close()


def _levels(config: MultiLevelCheckpointManager.Config, folder: str) -> list[Level]:
    """The configured levels (default: one at ``folder``), each with ``keep_latest_k``
    where it sets no ``keep``, the first with ``codec`` where it sets none."""
    keep = config.keep_latest_k or None
    levels = list(config.levels) or [Level(folder)]
    levels = [
        lvl if lvl.keep is not None else dataclasses.replace(lvl, keep=keep) for lvl in levels
    ]
    if config.codec is not None and levels[0].codec is None:
        levels[0] = dataclasses.replace(levels[0], codec=config.codec)
    return levels


def _is_ours(path: str) -> bool:
    """True when ``path`` holds a dcp_multilevel checkpoint (its manifest)."""
    if not filesystem.is_remote(path) and not os.path.isdir(path):
        return False
    try:
        return detect_source(path) == "ours"
    except (CheckpointNotFoundError, ConvertError):  # nothing there, or not ours
        return False
