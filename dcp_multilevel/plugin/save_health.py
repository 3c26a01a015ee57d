"""A :class:`~dcp_multilevel.MultiLevelWriter` save's health: each rank's report, and
the record the coordinator commits (``health/``, ``format/health.py``).

DCP gathers every rank's write results to the coordinator's ``finish``; each
rank's :class:`~dcp_multilevel.health.RankReport` travels with them as one more
result, under a name no item has, and the coordinator takes the reports out
before it commits::

    every rank    write_data -> results + [rank_report(...)]
    coordinator   finish     -> take_reports(results) -> Health in the manifest
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from ..checkpoint import StoredCheckpoint
from ..errors import DcpMultilevelError
from ..health import REPORT_FQN, Checks, Health, RankReport, Tally

__all__ = ["rank_report", "replaces_quarantined", "take_reports"]

# The logger users configure, named as documented (the writer's).
logger = logging.getLogger("dcp_multilevel.writer")


def rank_report(
    checks: Checks,
    rank: int,
    coordinator: bool,
    planner: SavePlanner,
    loss: float | None,
    tally: Tally | None,
) -> WriteResult:
    """This rank's health report, as a write result (see the module docstring).

    The custom checks see the planner's state: the state as staged, whose bytes
    were written. The coordinator adds what its planner's replica check found.
    """
    state = getattr(planner, "state_dict", None) or {}
    report = checks.report(rank, state, loss, tally or Tally())
    if coordinator and getattr(planner, "verify_replicas", False):
        found = tuple(getattr(planner, "health_findings", ()) or ())
        report = RankReport(rank, (*report.checked, "replicas"), (*report.findings, *found))
    return WriteResult(index=MetadataIndex(REPORT_FQN), size_in_bytes=0, storage_data=report)


def take_reports(results: Sequence[Sequence[WriteResult]]) -> tuple[list[Any], Health | None]:
    """Every rank's write results without the reports, and the health record they
    make (None when no rank sent one: another writer's results)."""
    items, reports = [], []
    for rank_results in results:
        for wr in rank_results:
            if isinstance(wr.storage_data, RankReport):
                reports.append(wr.storage_data)
            else:
                items.append(wr)
    if not reports:
        return items, None
    checked = [c for r in reports for c in r.checked]
    return items, Health.merged(checked, [f for r in reports for f in r.findings])


def replaces_quarantined(checkpoint: StoredCheckpoint) -> bool:
    """Whether the committed ``checkpoint`` a save is about to replace is quarantined:
    a run resumed from an older, clean step saves its steps again over the poisoned
    ones (logged; the manifest swap keeps the old one loadable until the new one
    commits). False when it is clean, or its manifest cannot be read."""
    try:
        manifest = checkpoint.manifest()
    except (DcpMultilevelError, OSError):
        return False
    if manifest.quarantined:
        logger.warning(
            "dcp_multilevel: replacing %s, quarantined (%s)",
            checkpoint.url,
            manifest.health.reason(),
        )  # type: ignore[union-attr]
    return manifest.quarantined
