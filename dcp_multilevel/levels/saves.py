"""What a :class:`~dcp_multilevel.MultiLevelWriter` given ``levels`` does around DCP's calls.

The writer writes the first level itself (``<first level>/step-<N>``, the
commit in ``finish``); :class:`LevelSaves` ties each save to the process's
runtime for the levels (``runtime/``), which sends it on to the higher levels
in the background once it committed::

    all ranks     MultiLevelWriter(path, levels=...)  runtime_for (collective); the step
                                   the path names; the first level's delta reference
                                   (policy "wait": the saves before followed up first)
    all ranks     reset(checkpoint_id)     the step it names
    all ranks     storage_meta             saves.begin(): the save's ticket (``every``
                                           counts it); what the manifest records
    all ranks     prepare_local_plan       within reporting(saves, None): a failure is told
    coordinator   prepare_global_plan      within reporting(saves, None): e.g. a refusal
    all ranks     write_data               within reporting(saves, "written"): its outcome
    coordinator   finish                   within reporting(saves, "committed"): the commit's
                                           (or its failure's): every rank's follower takes
                                           it from there (``levels/follower.py``)
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

from ..checkpoint import StoredCheckpoint
from ..errors import ConfigError, DcpMultilevelError
from .config import Level, step_of
from .follower import SaveTicket
from .runtime import LEVELS_KEY, Runtime, runtime_for
from .topology import Topology

__all__ = ["LevelSaves"]

# The logger users configure, named as documented (the writer's).
logger = logging.getLogger("dcp_multilevel.writer")


class LevelSaves:
    """One writer's saves onto a runtime (see the module docstring).

    Args:
        runtime: the process's runtime for the writer's levels.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.step: int | None = None
        #: The first-level step this writer's saves code deltas against (None: whole).
        self.reference_step: int | None = None
        self.ticket: SaveTicket | None = None

    @classmethod
    def of(
        cls,
        levels: Sequence[Level],
        topology: Topology | None,
        due: Sequence[int] | None,
        **first_level: Any,
    ) -> LevelSaves:
        """A writer's ``levels``, checked against its other arguments (``first_level``:
        those the first level sets instead). Collective.

        Raises:
            ConfigError: what is wrong, and what to pass instead.
        """
        named = [k for k, v in first_level.items() if v is not None]
        if named:
            raise ConfigError(
                f"MultiLevelWriter(levels=...) takes {', '.join(named)} from the first level: "
                "set them on it (Level(..., codec=..., storage_options=...); deltas: "
                "keyframe_every)"
            )
        saves = cls(runtime_for(levels, topology=topology, who="MultiLevelWriter"))
        if due is not None:
            saves.runtime.check_due(due)
        return saves

    def staging(self, deltas: bool) -> None:
        """An async save begins staging (the training thread)."""
        if deltas:
            raise ConfigError(
                f"dcp.async_save with MultiLevelWriter(levels=...): the first level "
                f"{self.runtime.first.url} stores deltas, which async saves do not code; keep "
                "deltas on a higher level, or save with dcp.save"
            )

    def location(self, path: str | os.PathLike[str]) -> str:
        """Where the first level holds the step ``path`` names (ConfigError otherwise)."""
        self.step = step_of(path, self.runtime.first, self.runtime.given[0])
        return self.runtime.first.checkpoint_url(self.step)

    def reference(self) -> StoredCheckpoint | None:
        """The first level's delta reference for this writer's saves (collective).

        Under ``drain_policy="wait"`` the saves before are followed up first: their
        drains have started, so this save waits for a level still busy with one."""
        if self.runtime.policy == "wait":
            self.runtime.follow_up()
        if not self.runtime.first.deltas:
            return None
        found = self.runtime.first_reference()
        self.reference_step = None if found is None else found[0]
        return None if found is None else found[1]

    def begin(self, extra: dict[str, Any], due: Sequence[int] | None, overwrite: bool) -> None:
        """DCP starts a save (every rank): its ticket; ``extra`` gets the runtime's record.
        ``due``: the higher levels it goes to (None: their ``every``); ``overwrite``:
        it replaces the step on every level that holds it."""
        if self.step is None:
            raise ConfigError(
                "MultiLevelWriter(levels=...) was given no step: pass 'step-<N>' as its path "
                "or as dcp.save(..., checkpoint_id='step-<N>')"
            )
        if overwrite:
            self.runtime.supersede(self.step)
        self.ticket = self.runtime.begin(self.step, due, self.reference_step)
        extra[LEVELS_KEY] = self.runtime.record(self.ticket)

    def replacing(self, checkpoint: StoredCheckpoint, save_id: str) -> bool:
        """The coordinator, before a save of this writer's step over the committed
        ``checkpoint``: whether it replaces the copy of a timeline that the last load
        passed over (logged with both save ids; ``Runtime.superseded``)."""
        if self.step is None or not self.runtime.replaces(self.step):
            return False
        try:
            held = checkpoint.held_save_id()
        except (DcpMultilevelError, OSError):
            held = None
        logger.warning(
            "dcp_multilevel: replacing step %d on %s (save %s, passed over by the load of step "
            "%s) with save %s of the resumed run",
            self.step,
            self.runtime.first.url,
            held,
            self.runtime.resumed_from,
            save_id,
        )
        return True

    def refusal(self) -> str | None:
        """Why this writer's step must not be saved unasked, when a level held it as the
        run resumed from an older step chosen by its number (None: not so)."""
        resumed = None if self.step is None else self.runtime.newer_than_resumed(self.step)
        if resumed is None:
            return None
        return (
            f"This run resumed from step {resumed}, older than step {self.step}, which the "
            f"load did not pass over (the levels hold step {self.step}, and the run chose the "
            "older step by its number); saving it again replaces a good checkpoint."
        )

    def quarantined(self, reason: str) -> None:
        """The coordinator, before its commit is reported: the save's checks found
        ``reason``; the runtime keeps the step on the first level (``docs/health.md``)."""
        if self.ticket is not None:
            self.ticket.quarantine = reason

    @contextlib.contextmanager
    def reporting(self, outcome: str | None) -> Iterator[None]:
        """Around each of the writer's calls in a save (its plans, ``write_data``, the
        coordinator's ``finish``): tell the runtime it failed (before it raises), so
        every rank hears of it; else its ``outcome``: ``"written"``, ``"committed"``,
        or None (a plan: nothing to tell yet)."""
        ticket = self.ticket
        try:
            yield
        except BaseException as e:
            if ticket is not None and not ticket.done:
                self.runtime.follower.failed(ticket, e)
            raise
        if ticket is not None and outcome is not None:
            commits = self.runtime.follower
            (commits.written if outcome == "written" else commits.committed)(ticket)
