"""``dcp-multilevel ls ROOT...``: the checkpoints below one or more roots (levels).

Reads manifests only, never data, and lists nothing inside a step (see
``CheckpointRoot.scan``): its cost is one lookup and one manifest read per
step, whatever the number of files, for the newest :data:`NEWEST` steps (and a
count of the older ones; ``--all`` reads every one). A ``step-<N>`` directory without a
committed manifest is listed as incomplete; a manifest that does not decode
is listed with its error (the listing goes on). A ROOT that is itself one
checkpoint is listed as that checkpoint. A quarantined step (its save's health
checks found something: ``format/health.py``) says so, and why.
"""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from ..checkpoint import StoredCheckpoint
from ..errors import DcpMultilevelError
from ._common import (
    Target,
    emit_json,
    format_bytes,
    format_codecs,
    format_health,
    format_time,
    json_option,
    one_line,
    resolve,
    stdout_console,
    storage_options_option,
)
from ._summary import summary

__all__ = ["NEWEST", "list_root", "ls"]

#: Steps ``ls`` describes by default, newest first; the older ones are counted. A
#: manifest naming 1,000 files takes some 20 ms to decode: 10,000 of them, minutes.
NEWEST = 50

#: Characters of a quarantined step's reason ``ls`` shows (``inspect`` shows all of it).
REASON_WIDTH = 60


def _entry(step: int | None, ckpt: StoredCheckpoint, committed: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"step": step, "url": ckpt.url, "complete": committed, "error": None}
    if not committed:
        return entry
    try:
        entry.update(summary(ckpt.manifest()))
    except (DcpMultilevelError, OSError) as e:
        # One unreadable manifest must not hide the other checkpoints.
        entry["complete"] = False
        entry["error"] = one_line(e)
    return entry


def list_root(target: Target, newest: int | None = None) -> dict[str, Any]:
    """What ``ls`` reports for one location (the JSON shape of one ``roots`` entry):
    every step, or with ``newest`` the newest ``newest`` and how many older ones there
    are (``older``: complete and incomplete), whose manifests are not read."""
    if target.is_checkpoint:
        checkpoints = [_entry(None, target.checkpoint(), True)]
        return {"url": target.root.store.url, "kind": "checkpoint", "checkpoints": checkpoints}
    root = target.root
    found = root.scan()  # one listing of the root; nothing inside a step is listed
    committed = set(found.committed)
    steps = sorted(committed | set(found.uncommitted))
    shown = steps if newest is None else steps[max(0, len(steps) - newest) :]
    older = steps[: len(steps) - len(shown)]
    checkpoints = [_entry(s, root.checkpoint(s), s in committed) for s in shown]
    listing = {"url": root.store.url, "kind": "root", "checkpoints": checkpoints}
    if older:
        done = sum(1 for s in older if s in committed)
        listing["older"] = {"complete": done, "incomplete": len(older) - done}
    return listing


def _heading(listing: dict[str, Any], label: str) -> str:
    if listing["kind"] == "checkpoint":
        return f"{label}{listing['url']} (one checkpoint, not a root of step-<N> checkpoints)"
    return f"{label}{listing['url']}"


def _table(listing: dict[str, Any]) -> Table:
    table = Table()
    for name, justify in [
        ("step", "right"), ("saved (UTC)", "left"), ("on disk", "right"),
        ("raw", "right"), ("codec", "left"), ("world", "right"), ("state", "left"),
        ("health", "left"),
    ]:  # fmt: skip
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for c in listing["checkpoints"]:
        if c["error"] is not None:
            state = f"unreadable: {c['error']}"
        else:
            state = "complete" if c["complete"] else "incomplete"
            if c.get("delta_of"):
                state += f", delta of {c['delta_of']}"
        table.add_row(
            "-" if c["step"] is None else str(c["step"]),
            format_time(c.get("created_unix")),
            format_bytes(c.get("stored_bytes")),
            format_bytes(c.get("raw_bytes")),
            format_codecs(c.get("codecs")),
            str(c.get("world_size", "-")),
            state,
            format_health(c, REASON_WIDTH),
        )
    return table


@click.command("ls")
@click.argument("roots", nargs=-1, required=True, metavar="ROOT...")
@storage_options_option()
@click.option(
    "--all",
    "every",
    is_flag=True,
    help=f"describe every step (default: the newest {NEWEST}, and a count of the others)",
)
@json_option
def ls(roots: tuple[str, ...], storage_options: dict, every: bool, as_json: bool) -> None:
    """List the checkpoints below ROOT (several ROOTs: one per level, labelled L1, L2, ...).

    For each step: save time, size on disk (stored bytes), raw size, codecs,
    world size, whether it is complete (committed), and its health (clean, or
    QUARANTINED and why: its save's checks found something); the newest 50 steps,
    and how many older ones there are (``--all``: every one; each costs a
    manifest read). Exit status 1 when a ROOT holds no checkpoint at all.
    """
    newest = None if every else NEWEST
    listings = [list_root(resolve(url, storage_options), newest) for url in roots]
    if len(roots) > 1:
        for i, listing in enumerate(listings, 1):
            listing["level"] = f"L{i}"
    if as_json:
        emit_json({"roots": listings})
        return
    console = stdout_console()
    for listing in listings:
        label = f"{listing['level']}: " if "level" in listing else ""
        # A heading line, not a table title: a title would wrap at the table's width.
        console.print(_heading(listing, label), highlight=False, soft_wrap=True)
        console.print(_table(listing))
        if "older" in listing:
            o = listing["older"]
            console.print(f"... and {o['complete'] + o['incomplete']} older step(s) "
                          f"({o['incomplete']} incomplete): --all describes them",
                          highlight=False)  # fmt: skip
