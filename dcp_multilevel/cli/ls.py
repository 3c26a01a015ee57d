"""``dcp-multilevel ls ROOT...``: the checkpoints below one or more roots (levels).

Reads manifests only, never data, and lists nothing inside a step (see
``CheckpointRoot.scan``): its cost is one lookup and one manifest read per
step, whatever the number of files, for the newest :data:`NEWEST` steps (and a
count of the older ones; ``--all`` reads every one). A ``step-<N>`` directory without a
committed manifest is listed as incomplete; a manifest that does not decode
is listed with its error (the listing goes on). A ROOT that is itself one
checkpoint is listed as that checkpoint. A quarantined step (its save's health
checks found something: ``format/health.py``) says so, and why.

On a level whose path has ``{node}`` in it each node's disk holds a part of
each step (``_parts.py``). A ROOT with ``{node}`` in it lists every node's
parts as one level: a step is complete when some node holds its manifest, and
its row says which nodes hold the manifest and which hold a part. A ROOT that
is one node's directory is listed as it is; a step directory there without a
manifest whose data files are all other ranks' than rank 0 (the coordinator,
which commits on its own node) is named as that node's part, not incomplete:
that costs one listing of its data directory, made on a local disk only (a
node's part is on its own disk; in a bucket a listing is a request, and none
is made inside a step).
"""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from ..checkpoint import StoredCheckpoint
from ..errors import CheckpointNotFoundError, DcpMultilevelError
from ..format import MANIFEST_NAME, checkpoint_url
from ..stores import parse_location
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
from ._parts import counted, has_node_field, node_roots, part_ranks, template_url
from ._summary import summary

__all__ = ["NEWEST", "list_nodes", "list_root", "ls"]

#: Steps ``ls`` describes by default, newest first; the older ones are counted. A
#: manifest's decoding grows with the files it names: a root of thousands of steps
#: of many files each would take far longer to describe than to count
#: (``benchmarks/bench_many_files.py`` times ``ls``).
NEWEST = 50

#: Characters of a quarantined step's reason ``ls`` shows (``inspect`` shows all of it).
REASON_WIDTH = 60


def _entry(
    step: int | None, ckpt: StoredCheckpoint, committed: bool, url: str | None = None
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "step": step,
        "url": url or ckpt.url,
        "complete": committed,
        "error": None,
    }
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
    # A node's part is on the node's own disk: a local directory (see the module docstring).
    if parse_location(root.url).scheme == "file":
        for c in checkpoints:
            if not c["complete"]:
                ranks = part_ranks(root.checkpoint(c["step"]))
                if ranks is not None:
                    c["part_ranks"] = list(ranks)
    listing = {"url": root.store.url, "kind": "root", "checkpoints": checkpoints}
    if older:
        done = sum(1 for s in older if s in committed)
        listing["older"] = {"complete": done, "incomplete": len(older) - done}
    return listing


def list_nodes(url: str, storage_options: dict, newest: int | None = None) -> dict[str, Any]:
    """What ``ls`` reports for a location with ``{node}`` in it: every node's parts as one
    root (or one checkpoint), each step with the nodes that hold its manifest
    (``manifest_nodes``) and a part (``part_nodes``); shaped as :func:`list_root`'s,
    with ``nodes``: each node's location.

    Raises:
        CheckpointNotFoundError: no node's directory matches, or none holds a step.
    """
    roots = node_roots(url, storage_options)
    nodes = {str(n): r.store.url for n, r in roots.items()}
    listing: dict[str, Any] = {"url": template_url(url), "kind": "root", "nodes": nodes}
    held = [n for n, r in roots.items() if r.store.exists(MANIFEST_NAME)]
    if held:
        entry = _entry(None, StoredCheckpoint(roots[held[0]].store), True, template_url(url))
        entry.update(
            manifest_nodes=held, part_nodes=[n for n, r in roots.items() if r.store.listdir("")]
        )
        return {**listing, "kind": "checkpoint", "checkpoints": [entry]}
    scans = {n: r.scan() for n, r in roots.items()}
    steps = sorted({s for found in scans.values() for s in found.committed + found.uncommitted})
    if not steps:
        raise CheckpointNotFoundError(
            f"no checkpoint at {template_url(url)}: no node's directory holds a "
            f"{MANIFEST_NAME} or step-<N> directories ({counted('node', roots)} looked at)",
            checkpoint=template_url(url),
        )
    shown = steps if newest is None else steps[max(0, len(steps) - newest) :]
    older = steps[: len(steps) - len(shown)]
    committed = {s for found in scans.values() for s in found.committed}
    checkpoints = []
    for s in shown:
        manifests = [n for n, found in scans.items() if s in found.committed]
        parts = [n for n, found in scans.items() if s in found.committed + found.uncommitted]
        where = roots[manifests[0] if manifests else parts[0]]
        entry = _entry(s, where.checkpoint(s), bool(manifests), checkpoint_url(listing["url"], s))
        entry.update(manifest_nodes=manifests, part_nodes=parts)
        checkpoints.append(entry)
    listing["checkpoints"] = checkpoints
    if older:
        done = sum(1 for s in older if s in committed)
        listing["older"] = {"complete": done, "incomplete": len(older) - done}
    return listing


def _nodes_state(c: dict[str, Any], listing: dict[str, Any]) -> str:
    """Where a step's manifest and parts are (a ROOT with ``{node}``)."""
    lacking = [int(n) for n in listing["nodes"] if int(n) not in c["part_nodes"]]
    said = f": manifest on {counted('node', c['manifest_nodes'])}," if c["manifest_nodes"] else ":"
    said += f" part{'s' if len(c['part_nodes']) != 1 else ''} on {counted('node', c['part_nodes'])}"
    if lacking:
        said += f", none on {counted('node', lacking)}"
    return said


def _heading(listing: dict[str, Any], label: str) -> str:
    if listing["kind"] == "checkpoint":
        return f"{label}{listing['url']} (one checkpoint, not a root of step-<N> checkpoints)"
    return f"{label}{listing['url']}"


def _table(listing: dict[str, Any]) -> Table:
    table = Table()
    for name, justify in [
        ("step", "right"),
        ("saved (UTC)", "left"),
        ("on disk", "right"),
        ("raw", "right"),
        ("codec", "left"),
        ("world", "right"),
        ("state", "left"),
        ("health", "left"),
    ]:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for c in listing["checkpoints"]:
        if c["error"] is not None:
            state = f"unreadable: {c['error']}"
        elif "part_ranks" in c:
            state = f"part of {counted('rank', c['part_ranks'])}, manifest on rank 0's node"
        else:
            state = "complete" if c["complete"] else "incomplete"
            if c.get("delta_of"):
                state += f", delta of {c['delta_of']}"
            if "part_nodes" in c:
                state += _nodes_state(c, listing)
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
    manifest read). A ROOT with {node} in it (/nvme/{node}/ckpt) lists every
    node's parts as one level, with the nodes that hold each step's manifest and
    parts. Exit status 1 when a ROOT holds no checkpoint at all.
    """
    newest = None if every else NEWEST
    listings = [
        list_nodes(url, storage_options, newest)
        if has_node_field(url)
        else list_root(resolve(url, storage_options), newest)
        for url in roots
    ]
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
            console.print(
                f"... and {o['complete'] + o['incomplete']} older step(s) "
                f"({o['incomplete']} incomplete): --all describes them",
                highlight=False,
            )
