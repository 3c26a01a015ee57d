"""``dcp-multilevel inspect CKPT``: one checkpoint's manifest as tables (no data read),
its health record included: the checks its save ran and, when it is quarantined,
every finding (check, message, ranks, items).

Where each data file is comes from one listing of the checkpoint's data
directory (with ``{node}`` in CKPT: of every node's, ``_parts.py``): a file
that is not there is named, as missing or as another node's.
"""

from __future__ import annotations

import difflib
from typing import Any

import click
from rich.table import Table
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..errors import DcpMultilevelError
from ..format import Manifest, dtype_name, rank_of_file
from ._common import (
    emit_json,
    format_bytes,
    format_codecs,
    format_time,
    health_of,
    json_option,
    open_checkpoint,
    stdout_console,
    storage_options_option,
)
from ._parts import Parts, counted, has_node_field
from ._summary import summary

__all__ = ["ItemNotFoundError", "describe", "inspect"]


class ItemNotFoundError(DcpMultilevelError, KeyError):
    """``--item FQN`` names no item of the checkpoint."""

    def __str__(self) -> str:
        # KeyError would quote the message.
        return str(self.args[0])


def _items(manifest: Manifest) -> dict[str, dict[str, Any]]:
    """Every FQN with its type, dtype, shape and stored chunks (sorted by FQN)."""
    chunks: dict[str, list[dict[str, Any]]] = {}
    for index, loc in manifest.locations.items():
        chunks.setdefault(index.fqn, []).append(
            {
                "offsets": None if index.offset is None else list(index.offset),
                "file": loc.file,
                "pos": loc.offset,
                "length": loc.length,
                "raw_length": loc.raw_length,
                "transforms": list(loc.transforms),
                "checksum": loc.checksum,
                "reference_checksum": loc.reference,
            }
        )
    out: dict[str, dict[str, Any]] = {}
    for fqn, md in sorted(manifest.metadata.state_dict_metadata.items()):
        parts = sorted(chunks.get(fqn, []), key=lambda c: c["offsets"] or [])
        entry: dict[str, Any] = {"fqn": fqn}
        if isinstance(md, TensorStorageMetadata):
            entry.update(type="tensor", dtype=dtype_name(md.properties.dtype), shape=list(md.size))
        else:
            assert isinstance(md, BytesStorageMetadata)
            entry.update(type="bytes", dtype=None, shape=None)
        raw = sum(c["raw_length"] for c in parts)
        stored = sum(c["length"] for c in parts)
        entry.update(
            raw_bytes=raw,
            stored_bytes=stored,
            ratio=_ratio(raw, stored),
            codecs=sorted({t for c in parts for t in c["transforms"]}),
            chunks=parts,
        )
        out[fqn] = entry
    return out


def _ratio(raw: int, stored: int) -> float | None:
    """Raw over stored bytes (2.0: stored in half the space); None for an empty item."""
    return round(raw / stored, 3) if stored else None


def describe(manifest: Manifest, url: str, parts: Parts | None = None) -> dict[str, Any]:
    """What ``inspect --json`` prints for a checkpoint; with ``parts``, where its data
    files are: each file's ``present`` (with ``{node}``: and ``nodes``), and ``nodes``
    (each node's part) or ``elsewhere`` (files at another node, one location given)."""
    items = _items(manifest)
    files = []
    ranks: dict[int | None, dict[str, Any]] = {}
    counts: dict[str, int] = {}
    for loc in manifest.locations.values():
        counts[loc.file] = counts.get(loc.file, 0) + 1
    for path, size in sorted(manifest.files.items()):
        rank = rank_of_file(path)
        entry = {"path": path, "bytes": size, "rank": rank, "items": counts.get(path, 0)}
        if parts is not None:
            holders = parts.holders(path)
            entry["present"] = bool(holders)
            if parts.expanded:
                entry["nodes"] = [p.node for p in holders]
        files.append(entry)
        r = ranks.setdefault(rank, {"rank": rank, "bytes": 0, "files": 0})
        r["bytes"] += size
        r["files"] += 1
    doc = {"url": url, **summary(manifest), "dcp_version": manifest.metadata.version}
    # Checked when the manifest was read.
    doc["manifest_digest"] = manifest.digest
    link = manifest.reference
    doc["reference"] = (
        None if link is None else {"checkpoint": link.checkpoint, "save_id": link.save_id}
    )
    # ``items`` and ``files`` are lists here (ls gives their counts).
    doc.update(
        stored_chunks=len(manifest.locations),
        items=list(items.values()),
        files=files,
        ranks=sorted(ranks.values(), key=lambda r: (r["rank"] is None, r["rank"] or 0)),
    )
    absent = [] if parts is None else parts.absent()
    if parts is not None and parts.expanded:
        doc["nodes"] = parts.nodes_json()
    elif absent:
        doc["elsewhere"] = [a.to_json() for a in absent]
    return doc


def _header(doc: dict[str, Any]) -> Table:
    table = Table(title=f"checkpoint {doc['url']}", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("saved (UTC)", format_time(doc["created_unix"])),
        ("save id", doc["save_id"]),
        ("format version", str(doc["format_version"])),
        ("written by", f"dcp_multilevel {doc['plugin_version']}, torch {doc['torch_version']}"),
        ("world size", str(doc["world_size"])),
        ("items", f"{len(doc['items'])} ({doc['stored_chunks']} stored chunks)"),
        (
            "size",
            f"{format_bytes(doc['stored_bytes'])} on disk, "
            f"{format_bytes(doc['raw_bytes'])} raw "
            f"(ratio {_ratio(doc['raw_bytes'], doc['stored_bytes']) or '-'})",
        ),
        ("codecs", format_codecs(doc["codecs"])),
        ("manifest digest", doc["manifest_digest"]),
    ]
    if doc.get("reference"):
        deltas = sum(any(c["reference_checksum"] for c in it["chunks"]) for it in doc["items"])
        ref = doc["reference"]
        rows.append(("delta of", f"{ref['checkpoint']} (save {ref['save_id']}): {deltas} items"))
    if "nodes" in doc:
        manifests = [n["node"] for n in doc["nodes"] if n["manifest"]]
        held = [n["node"] for n in doc["nodes"] if n["files"]]
        rows.append(
            (
                "nodes",
                f"manifest on {counted('node', manifests)}; data files on {counted('node', held)}",
            )
        )
    rows.append(("health", _health_line(doc)))
    for k, v in rows:
        table.add_row(k, v)
    return table


def _health_line(doc: dict[str, Any]) -> str:
    """The header's health row: the verdict and the checks that ran."""
    health = health_of(doc)
    if health is None:
        return "clean (no health record: saved without checks)"
    checked = f"checked: {', '.join(health.checked) or 'none'}"
    if not health.quarantined:
        return f"clean ({checked})"
    n = len(health.findings)
    return (
        f"QUARANTINED: {n} finding{'s' if n > 1 else ''} ({checked}); not drained to other levels"
    )


def _findings_table(doc: dict[str, Any]) -> Table:
    table = Table(title="health findings (why the checkpoint is quarantined)", title_justify="left")
    for name in ("check", "message", "ranks", "items"):
        table.add_column(name)
    for f in doc["health"]["findings"]:
        table.add_row(
            f["check"],
            f["message"],
            ", ".join(map(str, f["ranks"])) or "-",
            ", ".join(f["items"]) or "-",
        )
    return table


def _items_table(items: list[dict[str, Any]]) -> Table:
    table = Table(title="items", title_justify="left")
    for name, justify in [
        ("FQN", "left"),
        ("dtype", "left"),
        ("shape", "left"),
        ("raw", "right"),
        ("stored", "right"),
        ("ratio", "right"),
        ("chunks", "right"),
    ]:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for it in items:
        table.add_row(
            it["fqn"],
            it["dtype"] or "bytes",
            "-" if it["shape"] is None else "x".join(map(str, it["shape"])) or "()",
            str(it["raw_bytes"]),
            str(it["stored_bytes"]),
            str(it["ratio"] or "-"),
            str(len(it["chunks"])),
        )
    return table


def _chunks_table(item: dict[str, Any]) -> Table:
    table = Table(title=f"stored chunks of {item['fqn']}", title_justify="left")
    for name in ("offsets", "file", "bytes", "raw", "codec", "checksum"):
        table.add_column(name)
    for c in item["chunks"]:
        table.add_row(
            "-" if c["offsets"] is None else str(c["offsets"]),
            c["file"],
            f"{c['pos']}..{c['pos'] + c['length']}",
            str(c["raw_length"]),
            format_codecs(c["transforms"]),
            c["checksum"],
        )
    return table


def _files_table(doc: dict[str, Any]) -> Table:
    table = Table(title="files", title_justify="left")
    for name, justify in [
        ("file", "left"),
        ("rank", "right"),
        ("items", "right"),
        ("bytes", "right"),
    ]:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    # Where each file is: with {node}, its nodes; else only when one is not here.
    where = "nodes" in doc or any(not f.get("present", True) for f in doc["files"])
    if where:
        table.add_column("where")
    elsewhere = {f for a in doc.get("elsewhere", []) for f in a["files"]}
    for f in doc["files"]:
        row = [f["path"], str(f["rank"]), str(f["items"]), str(f["bytes"])]
        if "nodes" in f:
            row.append(counted("node", f["nodes"]) if f["nodes"] else "missing")
        elif where:
            row.append(
                "here" if f["present"] else "elsewhere" if f["path"] in elsewhere else "missing"
            )
        table.add_row(*row)
    return table


def _ranks_table(doc: dict[str, Any]) -> Table:
    table = Table(title="bytes per rank", title_justify="left")
    for name in ("rank", "files", "bytes"):
        table.add_column(name, justify="right")
    for r in doc["ranks"]:
        table.add_row(str(r["rank"]), str(r["files"]), format_bytes(r["bytes"]))
    return table


@click.command("inspect")
@click.argument("ckpt", metavar="CKPT")
@click.option("--item", "fqn", metavar="FQN", help="Show one item and its stored chunks.")
@storage_options_option()
@json_option
def inspect(ckpt: str, fqn: str | None, storage_options: dict, as_json: bool) -> None:
    """Show the manifest of the checkpoint CKPT: items (FQN, dtype, shape, raw and
    stored bytes, compression ratio), data files, bytes per rank, versions, and
    its health (the checks its save ran; for a quarantined one, what they found).

    Reads the manifest and lists the data files. A CKPT with {node} in it
    (/nvme/{node}/ckpt/step-5) stands for every node's part: the files table
    says which node holds each file. Exit status 1 when CKPT is not a committed
    checkpoint or --item names no item (the message suggests close names).
    """
    if not has_node_field(ckpt):
        open_checkpoint(ckpt, storage_options)  # its errors name a root's newest step
    parts = Parts.at(ckpt, storage_options)
    doc = describe(parts.manifest, parts.url, parts)
    url = parts.url
    if fqn is not None:
        by_fqn = {it["fqn"]: it for it in doc["items"]}
        if fqn not in by_fqn:
            close = difflib.get_close_matches(fqn, list(by_fqn), n=5, cutoff=0.5)
            hint = f"; close names: {', '.join(close)}" if close else ""
            raise ItemNotFoundError(
                f"no item {fqn!r} in checkpoint {url} ({len(by_fqn)} items){hint}"
            )
        item = by_fqn[fqn]
        if as_json:
            emit_json({"url": url, "item": item})
            return
        console = stdout_console()
        console.print(_items_table([item]))
        console.print(_chunks_table(item))
        return
    if as_json:
        emit_json(doc)
        return
    console = stdout_console()
    console.print(_header(doc))
    if doc["quarantined"]:
        console.print(_findings_table(doc))
    console.print(_items_table(doc["items"]))
    console.print(_files_table(doc))
    for a in parts.absent():
        console.print(a.describe(), highlight=False, soft_wrap=True, markup=False)
    console.print(_ranks_table(doc))
