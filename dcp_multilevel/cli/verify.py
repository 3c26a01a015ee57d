"""``dcp-multilevel verify CKPT...``: read back every item, verified and decoded.

Each argument is a checkpoint, or a root of ``step-<N>`` checkpoints (a
level), which stands for every committed checkpoint below it (``--latest``:
its newest only). So "every level" is one call with each level's root as an
argument; there is no separate ``--all-levels`` flag. Every bad item is
reported, not only the first; the exit status is 0 only when all are good.

A quarantined checkpoint (its save's health checks found something:
``format/health.py``) is reported as such, with every finding, but its exit
status is its data's: verify checks that the bytes are the ones saved, and a
quarantined step's are (they hold what the checks found).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import click
from rich.console import Console

from ..checkpoint import StoredCheckpoint, VerifyResult, verify_checkpoint
from ._common import (
    CheckFailed,
    emit_json,
    format_bytes,
    health_of,
    json_option,
    open_checkpoint,
    progress,
    resolve,
    stdout_console,
    storage_options_option,
)
from ._summary import health_facts

__all__ = ["expand", "verify"]


def expand(urls: tuple[str, ...], storage_options: dict, *, latest: bool) -> list[StoredCheckpoint]:
    """The committed checkpoints the arguments name (a root: those below it), manifests read.

    Raises:
        CheckpointNotFoundError: an argument holds no committed checkpoint.
        ManifestError: a manifest is invalid.
    """
    out: list[StoredCheckpoint] = []
    for url in urls:
        target = resolve(url, storage_options)
        if target.is_checkpoint:
            out.append(open_checkpoint(url, storage_options))
            continue
        steps = target.root.steps()
        if not steps:
            out.append(open_checkpoint(url, storage_options))  # raises: names the root
        for step in steps[-1:] if latest else steps:
            out.append(open_checkpoint(target.root.location(step), storage_options))
    return out


def _report(ckpt: StoredCheckpoint, result: VerifyResult) -> dict[str, Any]:
    return {
        "url": ckpt.url,
        "ok": result.ok,
        "items": result.items,
        "stored_bytes": result.stored_bytes,
        "problems": [
            {**asdict(p), "offsets": None if p.offsets is None else list(p.offsets)}
            for p in result.problems
        ],
        **health_facts(ckpt.manifest()),
    }


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
        lines.append(
            f"  {p['fqn']}{where}: {p['file']} bytes {p['start']}..{p['end']}: "
            f"{p['error']}: {p['message']}"
        )
    return lines


def _print(console: Console, report: dict[str, Any]) -> None:
    """One checkpoint's verdict: ``ok`` or ``BAD`` and its bad items, then, for a
    quarantined one, why (its data may verify: the two are separate verdicts)."""
    if report["ok"]:
        head = (f"ok   {report['url']}: {report['items']} items, "
                f"{format_bytes(report['stored_bytes'])} checked")  # fmt: skip
    else:
        head = f"BAD  {report['url']}: {len(report['problems'])} of {report['items']} items bad"
    quarantine = _health_lines(report)
    if quarantine:
        head += "; QUARANTINED: its health checks found:"
    console.print(head, highlight=False, soft_wrap=True)
    for line in quarantine + _problem_lines(report):
        console.print(line, highlight=False, soft_wrap=True)


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
    stands for all the committed checkpoints below it.

    Every bad item is named with its FQN, data file and byte range. Exit status
    0 only when every item of every checkpoint is good; 1 otherwise, or when an
    argument holds no committed checkpoint. A quarantined checkpoint (its save's
    health checks found something) is named as such with what they found; it
    fails only if its data does.
    """
    checkpoints = expand(ckpts, storage_options, latest=latest)
    reports = []
    console = None if as_json else stdout_console()
    for ckpt in checkpoints:
        manifest = ckpt.manifest()
        total = sum(loc.length for loc in manifest.locations.values())
        with progress(f"verify {ckpt.url}", total, enabled=not as_json) as advance:
            result = verify_checkpoint(ckpt, on_bytes=advance)
        report = _report(ckpt, result)
        reports.append(report)
        if console is not None:
            _print(console, report)
    ok = all(r["ok"] for r in reports)
    if as_json:
        emit_json({"ok": ok, "checkpoints": reports})
    if not ok:
        bad = sum(not r["ok"] for r in reports)
        raise CheckFailed(f"{bad} of {len(reports)} checkpoint(s) failed verification")
