"""``dcp-multilevel verify CKPT...``: read back every item, verified and decoded.

Each argument is a checkpoint, or a root of ``step-<N>`` checkpoints (a
level), which stands for every committed checkpoint below it (``--latest``:
its newest only). So "every level" is one call with each level's root as an
argument; there is no separate ``--all-levels`` flag. Every bad item is
reported, not only the first; the exit status is 0 only when all are good.

On a level whose path has ``{node}`` in it, each node's disk holds a part of
each step (``_parts.py``). An argument with ``{node}`` in it checks every
node's part against the one manifest; an argument naming one node's directory
checks what that node holds and names the files that are on other nodes
(``part``, not ``BAD``: their absence there is no damage, but they were not
checked, so the exit status is 1).

A quarantined checkpoint (its save's health checks found something:
``format/health.py``) is reported as such, with every finding, but its exit
status is its data's: verify checks that the bytes are the ones saved, and a
quarantined step's are (they hold what the checks found).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import click
from rich.console import Console

from ..checkpoint import ItemProblem, verify_file
from ..errors import CheckpointNotFoundError
from ..format import MANIFEST_NAME, checkpoint_url
from ._common import (
    CheckFailed,
    emit_json,
    format_bytes,
    health_of,
    json_option,
    progress,
    resolve,
    stdout_console,
    storage_options_option,
)
from ._parts import (
    EVERY_NODE,
    Absent,
    Parts,
    counted,
    has_node_field,
    node_roots,
    part_hint,
    template_url,
)
from ._summary import health_facts

__all__ = ["check", "expand", "verify"]


def expand(urls: tuple[str, ...], storage_options: dict, *, latest: bool) -> list[Parts]:
    """The committed checkpoints the arguments name (a root: those below it), manifests
    read, each with where its data files are (``{node}``: on every node).

    Raises:
        CheckpointNotFoundError: an argument holds no committed checkpoint.
        ManifestError: a manifest is invalid.
    """
    out: list[Parts] = []
    for url in urls:
        if has_node_field(url):
            out += _expand_nodes(url, storage_options, latest=latest)
            continue
        target = resolve(url, storage_options)
        if target.is_checkpoint:
            out.append(Parts.at(url, storage_options))
            continue
        steps = target.root.steps()
        if not steps:
            # resolve found step directories, none committed.
            newest = target.root.uncommitted()[-1]
            hint = part_hint(target.root.checkpoint(newest), f"step-{newest}")
            raise CheckpointNotFoundError(
                f"no committed checkpoint below {target.root.store.url}: none of its step "
                f"directories holds a {MANIFEST_NAME}"
                + (f"; {hint}" if hint else " (saves that did not finish)"),
                checkpoint=target.root.store.url,
            )
        for step in steps[-1:] if latest else steps:
            out.append(Parts.at(target.root.location(step), storage_options))
    return out


def _expand_nodes(url: str, storage_options: dict, *, latest: bool) -> list[Parts]:
    """:func:`expand` for one argument with ``{node}`` in it: a checkpoint when some
    node's location holds a manifest, else a root (its steps: committed on some node)."""
    roots = node_roots(url, storage_options)
    if any(root.store.exists(MANIFEST_NAME) for root in roots.values()):
        return [Parts.at(url, storage_options)]
    steps = sorted({s for root in roots.values() for s in root.steps()})
    if not steps:
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {template_url(url)}: no node's directory holds a "
            f"{MANIFEST_NAME} or a committed step-<N> ({counted('node', roots)} looked at)",
            checkpoint=template_url(url),
        )
    return [
        Parts.at(checkpoint_url(url, s), storage_options) for s in (steps[-1:] if latest else steps)
    ]


def _problem(p: ItemProblem, node: int | None) -> dict[str, Any]:
    doc = {**asdict(p), "offsets": None if p.offsets is None else list(p.offsets)}
    if node is not None:
        doc["node"] = node
    return doc


def check(parts: Parts, on_bytes: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Check every data file of one checkpoint where it is (each copy, on every node that
    holds one); the report ``verify --json`` prints for it.

    A file missing where it should be makes each of its items a problem (each
    message names its own item); one that is elsewhere (one node's directory
    given: another node's files) is listed under ``elsewhere``, not checked.
    """
    manifest = parts.manifest
    by_file: dict[str, list[Any]] = {}
    for index, loc in manifest.locations.items():
        by_file.setdefault(loc.file, []).append((index, loc))
    problems: list[dict[str, Any]] = []
    checked = 0  # bytes: each copy read, and each missing file (its items are bad)
    for file in sorted(manifest.files):
        items = sorted(by_file.get(file, []), key=lambda e: e[1].offset)
        size = sum(loc.length for _, loc in items)
        for part in parts.holders(file):
            found = verify_file(part.ckpt, file, on_bytes=on_bytes)
            problems += [_problem(p, part.node) for p in found]
            checked += size
        if parts.missing(file):
            # Found missing by the listing: each item is named, with its own message.
            node = parts.expected_node(file)
            for index, loc in items:
                problem = ItemProblem(
                    index.fqn,
                    None if index.offset is None else tuple(index.offset),
                    file,
                    loc.offset,
                    loc.offset + loc.length,
                    "TruncatedDataError",
                    parts.missing_message(file, index.fqn),
                )
                problems.append(_problem(problem, node))
            checked += size
            if on_bytes is not None:
                on_bytes(size)
    absent = parts.absent()
    report: dict[str, Any] = {
        "url": parts.url,
        "ok": not problems and not absent,
        "items": len(manifest.locations),
        "stored_bytes": checked,
        "problems": problems,
        **health_facts(manifest),
    }
    if absent:
        report["elsewhere"] = [a.to_json() for a in absent]
    if parts.expanded:
        report["nodes"] = parts.nodes_json()
    return report


def _health_lines(report: dict[str, Any]) -> list[str]:
    """For a quarantined checkpoint, one line per finding (what its checks found)."""
    health = health_of(report)
    if health is None or not health.quarantined:
        return []
    return [f"  {f.describe()}" for f in health.findings]


def _problem_lines(report: dict[str, Any]) -> list[str]:
    """One line per bad item (lines, not a table: the messages are long and name the file)."""
    lines = []
    for p in report["problems"]:
        where = "" if p["offsets"] is None else f" (chunk at {p['offsets']})"
        on = f" on node {p['node']}" if "node" in p else ""
        lines.append(
            f"  {p['fqn']}{where}{on}: {p['file']} bytes {p['start']}..{p['end']}: "
            f"{p['error']}: {p['message']}"
        )
    return lines


def _node_lines(report: dict[str, Any]) -> list[str]:
    """Parts that hold another save of the step: their files are not this checkpoint's."""
    return [
        f"  node {n['node']} holds another save of this step ({n['other_save']}) at "
        f"{n['url']}: its files were not checked"
        for n in report.get("nodes", [])
        if n["other_save"] is not None
    ]


def _elsewhere_lines(report: dict[str, Any]) -> list[str]:
    """One line per node (or ranks) whose files are not at the location given."""
    return [
        "  not checked: "
        + Absent(tuple(a["ranks"]), a["node"], tuple(a["files"]), a["items"]).describe()
        for a in report.get("elsewhere", [])
    ]


def _head(report: dict[str, Any]) -> str:
    """The verdict: ``ok``, ``BAD`` (a problem), or ``part`` (good, but only in part here)."""
    url, items = report["url"], report["items"]
    if report["problems"]:
        return f"BAD  {url}: {len(report['problems'])} of {items} items bad"
    if "elsewhere" in report:
        unchecked = sum(a["items"] for a in report["elsewhere"])
        return (
            f"part {url}: {items - unchecked} of {items} items checked, all good "
            f"({format_bytes(report['stored_bytes'])}); the other {unchecked} are in "
            "files not on this disk"
        )
    head = f"ok   {url}: {items} items, {format_bytes(report['stored_bytes'])} checked"
    if "nodes" in report:
        held = [n["node"] for n in report["nodes"] if n["files"]]
        manifests = [n["node"] for n in report["nodes"] if n["manifest"]]
        head += f" on {counted('node', held)} (manifest on {counted('node', manifests)})"
    return head


def _print(console: Console, report: dict[str, Any]) -> None:
    """One checkpoint's verdict (:func:`_head`) and its bad items, the files that are
    elsewhere, then, for a quarantined one, why (its data may verify: the two are
    separate verdicts)."""
    head = _head(report)
    quarantine = _health_lines(report)
    if quarantine:
        head += "; QUARANTINED: its health checks found:"
    console.print(head, highlight=False, soft_wrap=True, markup=False)
    lines = quarantine + _problem_lines(report) + _elsewhere_lines(report) + _node_lines(report)
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True, markup=False)


def _failure(reports: list[dict[str, Any]]) -> str:
    """The one line on stderr when some checkpoint is not ``ok``."""
    bad = sum(bool(r["problems"]) for r in reports)
    part = sum(not r["problems"] and "elsewhere" in r for r in reports)
    said = []
    if bad:
        said.append(f"{bad} of {len(reports)} checkpoint(s) failed verification")
    if part:
        said.append(
            f"{part} of {len(reports)} checkpoint(s) checked only in part: other nodes' "
            f"files are not at the location given; {EVERY_NODE}"
        )
    return "; ".join(said)


@click.command("verify")
@click.argument("ckpts", nargs=-1, required=True, metavar="CKPT...")
@click.option(
    "--latest", is_flag=True, help="For a root argument, check only its newest checkpoint."
)
@storage_options_option()
@json_option
def verify(ckpts: tuple[str, ...], latest: bool, storage_options: dict, as_json: bool) -> None:
    """Check the checkpoints CKPT...: read every item, check every checksum, decode
    every compressed chunk. A CKPT that is a root of step-<N> checkpoints (a level)
    stands for all the committed checkpoints below it. A CKPT with {node} in it
    (/nvme/{node}/ckpt/step-5) stands for every node's part, each node's files checked
    against the one manifest.

    Every bad item is named with its FQN, data file and byte range. Exit status
    0 only when every item of every checkpoint is good; 1 otherwise, or when an
    argument holds no committed checkpoint. One node's directory of a level with
    {node} in its path is checked in part: the files other nodes hold are named,
    not checked, and the exit status is 1. A quarantined checkpoint (its save's
    health checks found something) is named as such with what they found; it
    fails only if its data does.
    """
    checkpoints = expand(ckpts, storage_options, latest=latest)
    reports = []
    console = None if as_json else stdout_console()
    for parts in checkpoints:
        total = sum(loc.length for loc in parts.manifest.locations.values())
        with progress(f"verify {parts.url}", total, enabled=not as_json) as advance:
            report = check(parts, on_bytes=advance)
        reports.append(report)
        if console is not None:
            _print(console, report)
    ok = all(r["ok"] for r in reports)
    if as_json:
        emit_json({"ok": ok, "checkpoints": reports})
    if not ok:
        raise CheckFailed(_failure(reports))
