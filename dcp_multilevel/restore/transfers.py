"""Carrying out a restore: the files and items each node lacks, copied, linked or rebuilt.

:class:`Transfers` runs what ``plan.py`` planned (``execute.py`` moves the
bytes), in rounds that re-plan around damaged sources, sets aside damaged
first-level files, and keeps each node's first level readable afterwards
(the manifests a delta's references need beside them, and the step's own on
rank 0's node). Every method that says so is collective: every rank calls
it in the same order, on the main thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from .. import _dist
from .._phases import reached
from ..errors import CheckpointNotFoundError
from ..format import MANIFEST_NAME
from ..levels import Drainer, LevelDriver
from ..levels.topology import Topology
from .actions import CopyFault, Fault
from .agreement import Restore
from .execute import RestoreReport, execute
from .execute import set_aside_damaged as set_aside_files
from .inventory import gather_inventories, take_inventory
from .plan import PART_SHARE, RestorePlan, plan_restore, rebuilders

__all__ = ["Transfers"]

logger = logging.getLogger("dcp_multilevel.restore.loader")

#: How many times a restore re-plans around damaged sources before giving up.
_RESTORE_ROUNDS = 4


class Transfers:
    """A ladder's restores onto its nodes (see the module docstring).

    Args:
        drivers: the level drivers, first level first.
        names: the levels as the user wrote them (for messages and reports).
        topology: which node each rank is on (None: unknown; nothing is shared).
        restore_group: the gloo group restores move bytes over (None: no transfers).
        drainer: the ladder's drainer (a restore first lets running drains end).
        part_share: see ``plan_restore`` (0: whole files).
    """

    def __init__(
        self,
        drivers: Sequence[LevelDriver],
        names: Sequence[str],
        topology: Topology | None,
        restore_group: Any,
        drainer: Drainer,
        part_share: float = PART_SHARE,
    ) -> None:
        self.drivers = list(drivers)
        self.names = list(names)
        self.topology = topology
        self.group = restore_group
        self.part_share = part_share
        self._drainer = drainer

    def node(self) -> int:
        """This rank's node (its rank when the topology is unknown: nothing is shared)."""
        return self.topology.nodes[_dist.rank()] if self.topology is not None else _dist.rank()

    def node_ranks(self) -> list[int]:
        """The ranks of this rank's node (just this one when the topology is unknown)."""
        if self.topology is None:
            return [_dist.rank()]
        return list(self.topology.ranks_on(self.node()))

    def recommit_first_level(self, plan: Restore) -> None:
        """Write the step's manifest on rank 0's first level when a restore brought the
        files there but the manifest was lost with the node (a node-local first level
        keeps it on rank 0's node only): drains of the step read it there."""
        if _dist.rank() != 0 or plan.levels[0] != 0 or plan.manifest is None:
            return
        first = self.drivers[0].checkpoint(plan.step)
        if not first.is_committed():
            logger.info(
                "dcp_multilevel: step %d: its manifest was lost with rank 0's node; "
                "writing it again on %s",
                plan.step,
                first.url,
            )
            first.store.write_atomic(MANIFEST_NAME, plan.manifest)

    def keep_manifest(self, step: int, data: bytes) -> None:
        """Write first-level ``step``'s manifest (``data``, as rank 0 read it) on this
        node's part of the first level where it is missing: the node's lowest rank
        (every rank when the topology is unknown: each may have a disk of its own).

        A delta's reference is found beside it, on the reading rank's node; a
        node-local first level has the manifests on rank 0's node only.
        """
        rank = _dist.rank()
        if self.topology is not None and not self.topology.leads(rank):
            return
        ckpt = self.drivers[0].checkpoint(step)
        # A node that holds none of the step's files reads no delta against it.
        if not ckpt.is_committed() and ckpt.data_files():
            ckpt.store.write_atomic(MANIFEST_NAME, data)

    def set_aside_damaged(self, plan: Restore) -> set[Fault]:
        """Check this node's first-level files of the step (one rank per node) and
        rename the damaged ones aside; every node's findings, as bad sources. Collective."""
        assert plan.manifest is not None
        found: list[str] = []
        node = self.node()
        if self.topology is None or self.topology.leads(_dist.rank()):
            first = self.drivers[0].checkpoint(plan.step, manifest_bytes=plan.manifest)
            mine = [i for i in plan.inventories if i.node == node]
            if len(plan.inventories) < _dist.world_size():  # the fast path kept only ours
                mine = [dataclasses.replace(mine[0], needs=None)]  # check every file here
            found = set_aside_files(first, mine)
        everyone = _dist.all_gather_object((node, found))
        bad: set[Fault] = {CopyFault(n, f) for n, files in everyone for f in files}
        if bad:
            logger.warning(
                "dcp_multilevel: step %d: damaged first-level files set aside, "
                "fetching intact copies: %s",
                plan.step,
                sorted(bad),
            )
        return bad

    def bring_files(
        self,
        parts: Sequence[Restore],
        bad: Sequence[set[Fault]] | None = None,
        report: RestoreReport | None = None,
    ) -> RestoreReport:
        """Copy or rebuild onto each node the files each of ``parts`` lacks (steps: a
        delta's references, then the step; collective), in rounds: a source found
        damaged (``bad``, one set per part, and what each round finds) is left out
        of that part's next plan. Within a round the parts' transfers run one after
        another with no wait in between: a rank goes on to the next step's as soon
        as its own part of the last one is done (every rank walks the same actions
        in the same order, so none waits on a transfer that never comes). Counts go
        on ``report`` (a new one, for the last part's step, by default)."""
        assert all(part.plan is not None and part.manifest is not None for part in parts)
        t0 = time.perf_counter()
        bads = [set(b) for b in bad] if bad is not None else [set() for _ in parts]
        parts = list(parts)  # each part's inventories are renewed by a re-plan
        steps: list[RestorePlan | None] = []
        for i, b in enumerate(bads):
            if b:
                parts[i] = self.replan(parts[i], b)
            steps.append(parts[i].plan)
        report = report if report is not None else RestoreReport(parts[-1].step)
        for _ in range(_RESTORE_ROUNDS):
            todo = [i for i, s in enumerate(steps) if s is not None and s.actions]
            if not todo:
                break
            for drain_driver in self.drivers:  # a running drain must not race the restore
                self._drainer.finish(drain_driver)
            found = [
                execute(
                    steps[i],
                    self.drivers,
                    parts[i].manifest,
                    self.group,  # type: ignore[arg-type]
                    parts[i].inventories,
                )
                for i in todo
            ]
            reached("restore", parts[-1].step)
            everyone = _dist.all_gather_object(found)
            for k, i in enumerate(todo):
                part, done = parts[i], steps[i]
                assert done is not None
                found_everywhere = {b for theirs in everyone for b in theirs[k]}
                report.add(done, self.names, part.inventories, self.node(), found_everywhere)
                steps[i] = None
                if found_everywhere:
                    bads[i] |= found_everywhere
                    damaged = sorted(map(repr, found_everywhere))
                    logger.warning(
                        "dcp_multilevel: damaged sources for step %d: %s; trying others",
                        part.step,
                        damaged,
                    )
                    parts[i] = self.replan(part, bads[i])
                    steps[i] = parts[i].plan
        report.seconds += time.perf_counter() - t0
        if report.received:
            logger.info(
                "dcp_multilevel: step %d restored onto this node: %s in %.2f s",
                report.step,
                report.received,
                report.seconds,
            )
        return report

    def replan(self, plan: Restore, bad: set[Fault]) -> Restore:
        """``plan`` planned again from fresh inventories, leaving ``bad`` out (collective)."""
        assert plan.manifest is not None
        manifest = self.drivers[0].checkpoint(plan.step, manifest_bytes=plan.manifest).manifest()
        mine = plan.mine or next(i for i in plan.inventories if i.rank == _dist.rank())
        inventory = take_inventory(
            plan.step, self.drivers, manifest, (mine.needs, mine.ranges), mine.node, mine.whole
        )
        everyone = gather_inventories(inventory, self.node_ranks(), self.group)
        kinds = rebuilders(self.drivers)
        steps = plan_restore(
            plan.step,
            manifest.files,
            everyone,
            self.names,
            bad,
            part_share=self.part_share,
            rebuilders=kinds,
        )
        if not steps.ok:
            raise CheckpointNotFoundError(
                f"step {plan.step} cannot be restored: " + "; ".join(steps.reasons),
                checkpoint=self.drivers[0].level.checkpoint_url(plan.step),
            )
        return dataclasses.replace(plan, plan=steps, inventories=tuple(everyone))
