"""Loading a step through the levels: agree on it, bring each node what it lacks, read.

The manager's load path (``CheckpointManager.load_latest`` / ``load``) after it
listed every level: :meth:`Loader.plan` agrees collectively on how every rank
can load a step (``agreement.py``, ``inventory.py``, ``plan.py``);
:meth:`Loader.load` carries out the restore (copies, links, rebuilds over the
restore's gloo group, in rounds that leave damaged sources out), reads with a
``MultiLevelReader`` over the levels holding the step, and, when that read
fails on a first-level file damaged since the save (the step's or one of its
references'), sets those files aside, fetches intact copies and reads again.

Call order (every rank, main thread, the same steps)::

    restore = loader.load_newest(state_dict, views, planner)  collective: the newest step
    restore = loader.load_step(state_dict, step, views, planner)   or a given one
    # or, step by step:
    restore = loader.plan(step, views, state_dict, planner)   collective
    loader.load(state_dict, restore, planner)                 collective, when restore.ok
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner

from .. import _dist
from ..errors import CheckpointNotFoundError, DcpMultilevelError
from ..format import MANIFEST_NAME, Manifest
from ..levels import Drainer, LevelDriver
from ..levels.topology import Topology
from ..plugin import MultiLevelReader
from .actions import CopyFault, Fault
from .agreement import Restore, Views, restorable
from .execute import RestoreReport, execute, parts_copy, set_aside_damaged
from .inventory import gather_inventories, needed_ranges, take_inventory, whole_files_of
from .plan import PART_SHARE, RestorePlan, plan_restore, rebuilders

__all__ = ["Loader"]

logger = logging.getLogger(__name__)

#: How many times a restore re-plans around damaged sources before giving up.
_RESTORE_ROUNDS = 4


class Loader:
    """Plans and carries out loads for a manager (see the module docstring).

    Args:
        drivers: the manager's level drivers, first level first.
        names: the levels as the user wrote them (for messages and reports).
        topology: which node each rank is on (None: unknown; nothing is shared).
        restore_group: the gloo group restores move bytes over (None: no transfers).
        drainer: the manager's drainer (a restore first lets running drains end).
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
        self.part_share = part_share
        self._names = list(names)
        self.topology = topology
        self._restore_group = restore_group
        self._drainer = drainer
        #: After a load: how many items each copy served on this rank.
        self.last_load_sources: dict[str, int] = {}
        #: The last load's restore: files brought onto this rank's node, by source.
        self.last_restore: RestoreReport | None = None
        #: Seconds the last load spent in each phase on this rank: ``plan`` (agreeing
        #: on the step, inventories, the restore plan), ``bring`` (copies, links,
        #: rebuilds), ``read`` (``dcp.load`` through the levels).
        self.last_phases: dict[str, float] = {}

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.last_phases[name] = self.last_phases.get(name, 0.0) + time.perf_counter() - t0

    def load_newest(
        self, state_dict: dict[str, Any], views: Views, planner: LoadPlanner | None
    ) -> Restore | None:
        """Load the newest step every rank can restore; its restore, or None when no
        level holds a checkpoint. Collective.

        Raises:
            CheckpointNotFoundError: checkpoints exist, but none can be restored by
                every rank (never a silent fresh start).
        """
        self.last_phases = {}
        candidates = views.candidates()
        newest: Restore | None = None
        for step in reversed(candidates):
            plan = self.plan(step, views, state_dict, planner)
            newest = newest or plan
            if not plan.ok:
                continue
            try:
                self.load(state_dict, plan, planner)
            except CheckpointNotFoundError as e:
                # Damage found only while copying (every rank re-planned alike):
                # the next older step may still be whole.
                logger.warning("dcp_multilevel: %s; trying an older step", e)
                if newest is plan:
                    newest = dataclasses.replace(plan, reasons=(*plan.reasons, str(e)))
                continue
            return plan
        if candidates:
            first = self.drivers[0].level
            raise CheckpointNotFoundError(
                f"committed checkpoints exist (newest: step {candidates[-1]}), but for each of "
                f"them some rank cannot reach all of its data files on {first.url} (a "
                "node-local level on a lost or new node?) and no higher level holds it"
                + _why(newest)
                + ". Restore the nodes' disks, or start fresh deliberately "
                "with a new level location.",
                checkpoint=first.checkpoint_url(candidates[-1]),
            )
        return None

    def load_step(
        self, state_dict: dict[str, Any], step: int, views: Views, planner: LoadPlanner | None
    ) -> Restore:
        """Load ``step`` from the fastest level holding it; its restore. Collective.

        Raises:
            CheckpointNotFoundError: no level holds ``step``, or not every rank can
                restore it.
        """
        self.last_phases = {}
        first = self.drivers[0].level
        if not views.anywhere(step):
            raise CheckpointNotFoundError(
                f"step {step} has no complete checkpoint on any level ("
                + "; ".join(
                    f"{d.url}: {views.mine[i][-3:] or 'none'}" for i, d in enumerate(self.drivers)
                )
                + " are the newest there). Refusing to start fresh silently: pick an existing "
                "step or call load_latest().",
                checkpoint=first.checkpoint_url(step),
            )
        plan = self.plan(step, views, state_dict, planner)
        if not plan.ok:
            raise CheckpointNotFoundError(
                f"step {step} is committed on {first.url}, but not every rank can reach "
                "all of its data files there (a node-local level on a lost or new node?) and no "
                "higher level holds it" + _why(plan) + ". Load an earlier step that a higher "
                "level holds.",
                checkpoint=first.checkpoint_url(step),
            )
        self.load(state_dict, plan, planner)
        return plan

    def record(self, step: int) -> dict[str, Any]:
        """The last load's metrics record: where the time went, what came from where."""
        restore = self.last_restore
        return {
            "kind": "load", "rank": _dist.rank(), "step": step,
            **{f"{name}_seconds": seconds for name, seconds in self.last_phases.items()},
            "sources": dict(self.last_load_sources),
            "received": dict(restore.received) if restore is not None else {},
            "unix": time.time(),
        }  # fmt: skip

    def kept(self, plan: Restore, key: str) -> Any:
        """What the loaded step's manifest keeps under ``key`` in its ``extra`` (rank 0
        reads it from the first level that has it; every rank gets it). Collective."""

        def read() -> Any:
            for index in plan.levels:
                try:
                    known = plan.manifest if index == 0 else None
                    ckpt = self.drivers[index].checkpoint(plan.step, manifest_bytes=known)
                    return ckpt.manifest().extra.get(key)
                except (DcpMultilevelError, OSError):
                    continue  # the load read another copy: so does this
            return None

        return _dist.rank0_decides(read)

    def plan(self, step: int, views: Views, state_dict: dict[str, Any],
             planner: LoadPlanner | None) -> Restore:  # fmt: skip
        """How every rank can load ``step`` (``Restore.ok``), logged when it cannot. Collective.

        A first-level delta is read beside its references on the same level:
        each of them must be restorable too (``Restore.chain``, whole files:
        a reference is found in the step's directory, never in a parts copy).
        """
        with self._phase("plan"):
            return self._plan(step, views, state_dict, planner)

    def _plan(self, step: int, views: Views, state_dict: dict[str, Any],
              planner: LoadPlanner | None) -> Restore:  # fmt: skip

        def agree(at: int, whole_files: bool) -> Restore:
            def needs(manifest: Manifest) -> dict[str, list[list[int]]] | None:
                ranges = needed_ranges(state_dict, manifest, planner)
                return whole_files_of(ranges, manifest) if whole_files else ranges

            return restorable(
                at, self.drivers, views, node=self.node(), needs=needs,
                transfers=self._restore_group is not None, names=self._names,
                members=self._node_ranks(), group=self._restore_group,
                part_share=self.part_share,
            )  # fmt: skip

        plan = agree(step, whole_files=False)
        chain: list[Restore] = []  # the references, newest first while they are found
        why_not: list[str] = []
        link = plan.reference_step()
        while plan.ok and link is not None:
            if any(r.step == link for r in chain) or link >= step:
                why_not.append(f"step {step}: its reference chain loops at step {link}")
                break
            ref = agree(link, whole_files=True)
            if not ref.ok or ref.manifest is None:
                why = "; ".join(ref.reasons) or "only store levels hold it"
                if views.on_a_store(step, self.drivers):
                    # The reader falls back, item by item, to the store level.
                    logger.warning("dcp_multilevel: step %d is a delta against step %d, which "
                                   "cannot be restored onto the nodes (%s); reading it from a "
                                   "store level", step, link, why)  # fmt: skip
                    chain.clear()
                    break
                why_not.append(f"step {step} is a delta against step {link}, which cannot "
                               f"be restored: {why}")  # fmt: skip
                break
            chain.append(ref)
            link = ref.reference_step()
        plan = dataclasses.replace(plan, chain=tuple(reversed(chain)),
                                   reasons=(*plan.reasons, *why_not))  # fmt: skip
        if not plan.ok:
            logger.warning("dcp_multilevel: step %d cannot be restored: %s", step,
                           "; ".join(plan.reasons))  # fmt: skip
        return plan

    def node(self) -> int:
        """This rank's node (its rank when the topology is unknown: nothing is shared)."""
        return self.topology.nodes[_dist.rank()] if self.topology is not None else _dist.rank()

    def _node_ranks(self) -> list[int]:
        """The ranks of this rank's node (just this one when the topology is unknown)."""
        if self.topology is None:
            return [_dist.rank()]
        return list(self.topology.ranks_on(self.node()))

    def load(self, state_dict: dict[str, Any], plan: Restore, planner: LoadPlanner | None) -> None:
        """Bring each node what it lacks, then ``dcp.load`` through the levels. Collective."""
        # The references first (the step is read beside them), in one go with the step.
        parts = [ref for ref in plan.chain if ref.plan is not None and ref.plan.actions]
        if plan.plan is not None and plan.manifest is not None:
            parts.append(plan)
        if parts:
            with self._phase("bring"):
                self.last_restore = self._bring_files(parts, report=RestoreReport(plan.step))
        for ref in plan.chain:
            assert ref.manifest is not None  # plan() keeps only references with one
            self.keep_manifest(ref.step, ref.manifest)
        if plan.plan is not None and plan.manifest is not None and plan.plan.actions:
            self._recommit_first_level(plan)
        try:
            with self._phase("read"):
                self._read(state_dict, plan, planner)
        except CheckpointException:
            # Every rank sees DCP's failure. A first-level file damaged since the
            # save (the reader found no intact copy on this node, and no store
            # level holds the step) may still be intact on another node: set the
            # damaged ones aside, fetch them like lost ones, and read again. The
            # step's references too: a delta is decoded onto their bytes.
            if self._restore_group is None:
                raise
            damaged = []
            for part in [*plan.chain, plan]:  # the same list on every rank (agreed)
                if part.plan is not None and part.manifest is not None:
                    bad = self._set_aside_damaged(part)
                    if bad:
                        damaged.append((part, bad))
            if not damaged:
                raise
            with self._phase("bring"):
                self.last_restore = self._bring_files(
                    [part for part, _ in damaged], [bad for _, bad in damaged], self.last_restore
                )
            with self._phase("read"):
                self._read(state_dict, plan, planner)

    def _read(self, state_dict: dict[str, Any], plan: Restore, planner) -> None:
        # The first level serves what this rank sees there (with what the restore
        # brought); the rest comes, file by file, from the higher levels (the
        # reader's per-item fallback).
        copies = [self.drivers[i].checkpoint(plan.step) for i in plan.levels]
        options = [self.drivers[i].root.storage_options for i in plan.levels]
        if plan.levels[0] == 0 and plan.manifest is not None:
            # Items a restore brought without their whole file (execute.py's parts copy).
            first = self.drivers[0].checkpoint(plan.step, manifest_bytes=plan.manifest)
            parts = parts_copy(first, first.manifest())
            if parts is not None and parts.is_committed():
                copies.insert(1, parts)
                options.insert(1, None)
        reader = MultiLevelReader(
            copies[0].location,
            fallbacks=[c.location for c in copies[1:]],
            storage_options=options[0],
            fallback_storage_options=options[1:],
            primary_manifest=plan.manifest if plan.levels[0] == 0 else None,
        )
        dcp.load(state_dict, storage_reader=reader, planner=planner)
        self.last_load_sources = dict(reader.last_load_sources)

    def _recommit_first_level(self, plan: Restore) -> None:
        """Write the step's manifest on rank 0's first level when a restore brought the
        files there but the manifest was lost with the node (a node-local first level
        keeps it on rank 0's node only): drains of the step read it there."""
        if _dist.rank() != 0 or plan.levels[0] != 0 or plan.manifest is None:
            return
        first = self.drivers[0].checkpoint(plan.step)
        if not first.is_committed():
            logger.info("dcp_multilevel: step %d: its manifest was lost with rank 0's node; "
                        "writing it again on %s", plan.step, first.url)  # fmt: skip
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

    def _set_aside_damaged(self, plan: Restore) -> set[Fault]:
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
            found = set_aside_damaged(first, mine)
        everyone = _dist.all_gather_object((node, found))
        bad: set[Fault] = {CopyFault(n, f) for n, files in everyone for f in files}
        if bad:
            logger.warning("dcp_multilevel: step %d: damaged first-level files set aside, "
                           "fetching intact copies: %s", plan.step, sorted(bad))  # fmt: skip
        return bad

    def _bring_files(
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
                parts[i] = self._replan(parts[i], b)
            steps.append(parts[i].plan)
        report = report if report is not None else RestoreReport(parts[-1].step)
        for _ in range(_RESTORE_ROUNDS):
            todo = [i for i, s in enumerate(steps) if s is not None and s.actions]
            if not todo:
                break
            for drain_driver in self.drivers:  # a running drain must not race the restore
                self._drainer.finish(drain_driver)
            found = [
                execute(steps[i], self.drivers, parts[i].manifest, self._restore_group,  # type: ignore[arg-type]
                        parts[i].inventories)
                for i in todo
            ]  # fmt: skip
            everyone = _dist.all_gather_object(found)
            for k, i in enumerate(todo):
                part, done = parts[i], steps[i]
                assert done is not None
                found_everywhere = {b for theirs in everyone for b in theirs[k]}
                report.add(done, self._names, part.inventories, self.node(), found_everywhere)
                steps[i] = None
                if found_everywhere:
                    bads[i] |= found_everywhere
                    damaged = sorted(map(repr, found_everywhere))
                    logger.warning("dcp_multilevel: damaged sources for step %d: %s; trying "
                                   "others", part.step, damaged)  # fmt: skip
                    parts[i] = self._replan(part, bads[i])
                    steps[i] = parts[i].plan
        report.seconds += time.perf_counter() - t0
        if report.received:
            logger.info("dcp_multilevel: step %d restored onto this node: %s in %.2f s",
                        report.step, report.received, report.seconds)  # fmt: skip
        return report

    def _replan(self, plan: Restore, bad: set[Fault]) -> Restore:
        """``plan`` planned again from fresh inventories, leaving ``bad`` out (collective)."""
        assert plan.manifest is not None
        manifest = self.drivers[0].checkpoint(plan.step, manifest_bytes=plan.manifest).manifest()
        mine = plan.mine or next(i for i in plan.inventories if i.rank == _dist.rank())
        inventory = take_inventory(plan.step, self.drivers, manifest,
                                   (mine.needs, mine.ranges), mine.node, mine.whole)  # fmt: skip
        everyone = gather_inventories(inventory, self._node_ranks(), self._restore_group)
        kinds = rebuilders(self.drivers)
        steps = plan_restore(plan.step, manifest.files, everyone, self._names, bad,
                             part_share=self.part_share, rebuilders=kinds)  # fmt: skip
        if not steps.ok:
            raise CheckpointNotFoundError(
                f"step {plan.step} cannot be restored: " + "; ".join(steps.reasons),
                checkpoint=self.drivers[0].level.checkpoint_url(plan.step),
            )
        return dataclasses.replace(plan, plan=steps, inventories=tuple(everyone))


def _why(plan: Restore | None) -> str:
    return f" ({'; '.join(plan.reasons)})" if plan is not None and plan.reasons else ""
