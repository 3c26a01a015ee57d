"""``dcp-multilevel gc ROOT --keep N``: retention and debris sweep for one root (level).

The rules are the runtime's (``levels/retention.py``: the same
:class:`RetentionRules` object), applied to what is in ROOT:

- **expired**: committed checkpoints past the newest ``--keep``; the newest
  committed one is never deleted, nor a checkpoint a kept delta checkpoint
  needs (its reference, and that one's: ``--keep`` counts restorable
  checkpoints). Quarantined checkpoints (their save's health checks found
  something: ``format/health.py``) do not count toward ``--keep``: they take
  the places clean ones leave free and go first, but the newest one stays
  while no clean checkpoint is newer;
- **abandoned**: ``step-<N>`` directories without a manifest that are older
  (by step) than the newest committed checkpoint, or whose files were all
  last modified more than ``--older-than`` seconds ago (age is known only on
  local directories); never one node's part of a node-local step (its ranks'
  data files, none of rank 0's: the manifest is on rank 0's node), which is
  kept and listed under ``parts``;
- **temporaries**: what the store's own sweep removes, older than
  ``--older-than`` seconds (``CheckpointRoot.sweep``, listed with
  ``dry_run=True`` for the plan): ``*.tmp-*`` files of crashed writers in a
  local directory; for an object store (which publishes objects only whole),
  this machine's spool files left by dead processes.

Finding what to delete costs per step, never per file: one listing of ROOT
and one lookup per step for its manifest (nothing inside a step:
``CheckpointRoot.scan``), the manifests only of the kept steps, of what
they need and of the quarantined steps newer than the kept clean ones, and,
for the sweep of a local directory, a listing of each step directory but
none of the settled directories of committed checkpoints
(``LocalStore.sweep``). Deleting a step is one recursive removal (on S3: a
listing of its prefix, then up to 1,000 objects per delete request).

Checkpoints are deleted newest first (a delta before its reference) and
manifest first, so a half-deleted one does not exist and an interrupted gc
leaves no delta without its reference. Nothing here knows what a running
job is doing: do not run ``gc`` on a level a ``CheckpointManager`` is
writing to with a short ``--older-than``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import click

from ..checkpoint import CheckpointRoot
from ..errors import ConfigError, DcpMultilevelError
from ..format import step_dir
from ..levels.retention import RetentionRules, deletion_order
from ._common import emit_json, json_option, resolve, stdout_console, storage_options_option
from ._parts import part_ranks

__all__ = ["gc", "plan_gc"]

#: The manager's default age for sweeping temporaries (``sweep_older_than_s``).
DEFAULT_OLDER_THAN_S = 3600.0


def _age(root: CheckpointRoot, name: str, now: float) -> float | None:
    """Seconds since anything below ``name`` last changed; None where the store cannot tell."""
    top = root.store.local_path(name)
    if top is None:
        return None
    newest = os.lstat(top).st_mtime
    for directory, dirs, files in os.walk(top):
        for entry in dirs + files:
            try:
                newest = max(newest, os.lstat(os.path.join(directory, entry)).st_mtime)
            except FileNotFoundError:
                continue  # removed while we looked
    return now - newest


class _Facts:
    """What the rules need of each committed step in ``root``: its reference step (None:
    stored whole) and whether it is quarantined, read from its manifest once, and
    only when asked.

    The rules ask only for the kept steps, what those need (``keyframes.needed``)
    and the quarantined steps newer than the kept clean ones (:func:`_quarantined`):
    ``--keep 3`` on a root of 10,000 steps reads a few manifests, not 10,000. A
    manifest that cannot be read counts as whole and clean: that checkpoint cannot
    be loaded anyway.
    """

    def __init__(self, root: CheckpointRoot) -> None:
        self._root = root
        self._read: dict[int, tuple[int | None, bool]] = {}

    def __call__(self, step: int) -> tuple[int | None, bool]:
        """``(reference step, quarantined)`` of the committed step ``step``."""
        if step not in self._read:
            try:
                manifest = self._root.checkpoint(step).manifest()
                self._read[step] = (manifest.reference_step, manifest.quarantined)
            except (DcpMultilevelError, OSError):
                self._read[step] = (None, False)
        return self._read[step]


class _References(Mapping[int, int | None]):
    """Each committed step's reference step, from its manifest when asked (:class:`_Facts`)."""

    def __init__(self, facts: _Facts, steps: Iterable[int]) -> None:
        self._facts = facts
        self._steps = frozenset(steps)

    def __getitem__(self, step: int) -> int | None:
        if step not in self._steps:
            raise KeyError(step)
        return self._facts(step)[0]

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._steps))

    def __len__(self) -> int:
        return len(self._steps)


def _quarantined(facts: _Facts, complete: list[int], keep: int) -> set[int]:
    """The quarantined steps from the newest down to the ``keep``-th newest clean one.

    Only their health changes what the rules keep: ``keep`` clean steps fill every
    place, so a step older than them goes whatever its health (unless a kept delta
    needs it), and its manifest is not read.
    """
    found: set[int] = set()
    clean = 0
    for step in reversed(complete):
        if clean == keep:
            break
        if facts(step)[1]:
            found.add(step)
        else:
            clean += 1
    return found


def plan_gc(
    root: CheckpointRoot, keep: int, older_than_s: float, *, temporaries: bool = True
) -> dict[str, Any]:
    """What ``gc`` deletes in ``root`` (the JSON shape of ``gc --dry-run --json``).

    ``temporaries=False``: leave them out (an empty list) when the sweep itself
    follows and reports them: listing them first would walk the root twice.
    """
    now = time.time()
    found = root.scan()  # one listing of the root; nothing inside a step is listed
    complete, uncommitted = list(found.committed), list(found.uncommitted)
    facts = _Facts(root)
    quarantined = _quarantined(facts, complete, keep)
    rules = RetentionRules(keep)
    gone = rules.expired(complete, refs=_References(facts, complete), quarantined=quarantined)
    # What --keep alone keeps: the rest of the kept steps are references of kept deltas.
    by_keep = set(complete) - set(rules.expired(complete, quarantined=quarantined))
    by_step = set(rules.abandoned(uncommitted, complete))
    for step in uncommitted:
        age = _age(root, step_dir(step), now)
        if age is not None and age > older_than_s:
            by_step.add(step)
    # One node's part of a node-local step (its ranks' files, the manifest on rank 0's
    # node) is no debris: deleting it would lose that node's share of a good step.
    parts = sorted(s for s in by_step if part_ranks(root.checkpoint(s)) is not None)
    debris = sorted(by_step - set(parts))
    skip = {step_dir(s) for s in gone + debris}
    expired = set(gone)  # not the list: 10,000 steps would make these loops quadratic
    # The store's own sweep rule, listing only; not inside steps deleted anyway.
    listed = root.sweep(older_than_s, dry_run=True) if temporaries else []
    return {
        "root": root.store.url,
        "keep": keep,
        "older_than_s": older_than_s,
        "kept": [s for s in complete if s not in expired],
        # Kept beyond --keep: a kept delta checkpoint needs them.
        "kept_as_reference": [s for s in complete if s not in expired and s not in by_keep],
        "expired": gone,
        # Kept or expired; not counted toward --keep (see _quarantined for which are read).
        "quarantined": sorted(quarantined),
        "abandoned": debris,
        # Kept: another node's ranks' files of a step whose manifest is on rank 0's node.
        "parts": parts,
        "temporaries": sorted(p for p in listed if p.split("/", 1)[0] not in skip),
    }


@click.command("gc")
@click.argument("root", metavar="ROOT")
@click.option(
    "--keep",
    type=click.IntRange(min=1),
    required=True,
    help="Committed checkpoints to keep (the newest N; the newest is always kept).",
)
@click.option(
    "--older-than",
    "older_than_s",
    type=click.FloatRange(min=0),
    default=DEFAULT_OLDER_THAN_S,
    show_default=True,
    metavar="SECONDS",
    help="Age after which temporaries and incomplete step directories count as debris.",
)
@click.option("--dry-run", is_flag=True, help="Print what would be deleted; delete nothing.")
@storage_options_option()
@json_option
def gc(
    root: str, keep: int, older_than_s: float, dry_run: bool, storage_options: dict, as_json: bool
) -> None:
    """Delete old checkpoints and crash debris below the root ROOT.

    Keeps the newest --keep committed checkpoints and what delta checkpoints
    among them are coded against; quarantined checkpoints do not count toward
    --keep and go first (the newest stays while no clean one is newer).
    Removes step-<N> directories without a manifest that are older than the
    newest committed checkpoint (or untouched for --older-than seconds), and
    temporary files older than that.
    """
    target = resolve(root, storage_options)
    if target.is_checkpoint:
        raise ConfigError(
            f"{target.root.store.url} is one checkpoint, not a root of step-<N> checkpoints; "
            "gc works on a level's root (its parent directory)"
        )
    plan = plan_gc(target.root, keep, older_than_s, temporaries=dry_run)
    plan["dry_run"] = dry_run
    if not dry_run:
        # Newest first (a delta before its reference), each manifest first
        # (StoredCheckpoint.delete): an interrupted gc leaves every kept step whole.
        for step in deletion_order(plan["expired"]) + plan["abandoned"]:
            target.root.delete(step)
        plan["temporaries"] = sorted(target.root.sweep(older_than_s))
    if as_json:
        emit_json(plan)
        return
    console = stdout_console()
    verb = "would delete" if dry_run else "deleted"
    quarantined = set(plan["quarantined"])
    lines = [f"{plan['root']}: keeping steps {_steps(plan['kept'])}"]
    if plan["kept_as_reference"]:
        lines[0] += f" ({_steps(plan['kept_as_reference'])}: references of kept deltas)"
    if kept_quarantined := [s for s in plan["kept"] if s in quarantined]:
        lines[0] += f" ({_steps(kept_quarantined)}: quarantined)"
    lines += [
        f"{verb} step {s} (expired{', quarantined' if s in quarantined else ''})"
        for s in plan["expired"]
    ]
    lines += [f"{verb} step {s} (incomplete, abandoned)" for s in plan["abandoned"]]
    lines += [
        f"kept step {s} (part of a node-local step, manifest on rank 0's node)"
        for s in plan.get("parts", [])
    ]
    lines += [f"{verb} {p} (temporary)" for p in plan["temporaries"]]
    if not (plan["expired"] or plan["abandoned"] or plan["temporaries"]):
        lines.append("nothing to delete")
    # One print: rich has a fixed cost per call, and a gc of 10,000 steps prints a
    # line for each.
    console.print("\n".join(lines), highlight=False)


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) or "(none)"
