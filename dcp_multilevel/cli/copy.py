"""``dcp-multilevel copy CKPT DEST``: one committed checkpoint to another place, verified.

The copy keeps the source's file names, offsets and manifest bytes, so it
is the same checkpoint (same ``save_id``, same checksums), bit for bit:

1. each data file is copied as it is (``checkpoint/copy.py``'s verbatim
   copy), every item verified against the source's checksums on the way;
2. a data file already at DEST is kept when it has the recorded size and
   every item in it checks out (a re-run after an interruption resumes
   there); otherwise it is copied again;
3. the manifest is written last (the commit): an interrupted copy is never
   a committed checkpoint. Afterwards, anything else under DEST's ``data/``
   (an earlier attempt's debris) is removed, as a save does after its commit.

DEST that holds a different committed checkpoint is refused
(:class:`CheckpointExistsError`, nothing touched) unless asked to replace it
(``--overwrite``): then the new data files are copied beside the old ones
(their names are the source's, which another save never shares), the
manifest is written last, and only then are the old files removed, so the
old checkpoint stays loadable until the new one commits. One that holds
this very checkpoint (the same manifest) is left alone.
"""

from __future__ import annotations

from typing import Any

import click

from ..checkpoint import StoredCheckpoint, verify_file
from ..checkpoint.copy import copy_file_verbatim
from ..errors import BrokenChainError, CheckpointExistsError, ConfigError, DcpMultilevelError
from ..format import checkpoint_url, parse_step_dir
from ..stores import store_for
from ._common import (
    emit_json,
    format_bytes,
    json_option,
    open_checkpoint,
    options_for,
    progress,
    stdout_console,
    storage_options_option,
)

__all__ = ["copy", "copy_checkpoint"]


def _check_reference(staged: StoredCheckpoint) -> None:
    """A delta checkpoint's copy (``staged``: the source's manifest at the destination)
    needs its reference beside it: refuse before copying."""
    link = staged.manifest().reference
    sibling = staged.reference()
    if link is None or sibling is None:
        return
    try:
        there = sibling.manifest().save_id
    except (DcpMultilevelError, OSError):
        there = None
    if there != link.save_id:
        raise BrokenChainError(
            f"the checkpoint is a delta against {link.checkpoint} (save {link.save_id}), and "
            f"{sibling.url} does not hold that save, so the copy at {staged.url} could not be "
            f"loaded. Copy {link.checkpoint} there first (and its own reference, if it is a "
            "delta too), or store this step whole with 'dcp-multilevel convert SRC DST --to "
            "ours --codec bytegroup'.",
            checkpoint=staged.url,
            chain=(staged.url, sibling.url),
        )


def copy_checkpoint(
    source: StoredCheckpoint,
    dest: StoredCheckpoint,
    *,
    show_progress: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Copy the committed checkpoint ``source`` to ``dest`` (resumable; see the module).

    ``overwrite``: replace a different committed checkpoint at ``dest``,
    atomically (the old one stays loadable until the new manifest commits).
    Returns what ``copy --json`` prints.

    Raises:
        CheckpointExistsError: ``dest`` holds a different committed checkpoint (and
            ``overwrite`` is False, or a data file of both has other bytes at
            ``dest``: replacing it would break the old one before the commit).
        BrokenChainError: ``source`` is a delta checkpoint whose reference is not
            beside ``dest`` (the copy could not be loaded).
        CorruptCheckpointError: an item of ``source`` does not match its checksum.
        OSError: a store could not be read or written.
    """
    manifest = source.manifest()
    manifest_bytes = source.manifest_bytes()
    result: dict[str, Any] = {
        "source": source.url,
        "dest": dest.url,
        "save_id": manifest.save_id,
        "status": "copied",
        "copied": [],
        "kept": [],
        "bytes_copied": 0,
    }
    old: dict[str, int] = {}  # the files of the checkpoint this copy replaces
    if dest.is_committed():
        if dest.manifest_bytes() == manifest_bytes:
            result["status"] = "already-present"
            return result
        other = dest.manifest().save_id
        if not overwrite:
            what = (
                f"another copy of save {other}, stored differently (other codec or files)"
                if other == manifest.save_id
                else f"save {other}, copying save {manifest.save_id}"
            )
            raise CheckpointExistsError(
                f"Checkpoint already exists at {dest.url}: it holds a different committed "
                f"checkpoint ({what}), and nothing there was changed. Pass --overwrite to "
                "replace it (the old one stays loadable until the new one commits), delete "
                "it first, or pick another destination",
                checkpoint=dest.url,
            )
        old = dict(dest.manifest().files)
    # The source's manifest, read against DEST's files: checks what an earlier run left.
    staged = StoredCheckpoint(
        dest.store,
        location=dest.location,
        manifest_bytes=manifest_bytes,
        storage_options=dest.storage_options,
    )
    _check_reference(staged)
    kept = {f for f in manifest.files if dest.store.exists(f) and not verify_file(staged, f)}
    clash = sorted((set(manifest.files) & set(old)) - kept)
    if clash:  # before any byte is written: the old checkpoint must stay whole
        raise CheckpointExistsError(
            f"Checkpoint already exists at {dest.url}, and replacing it would rewrite its "
            f"data file {clash[0]!r} before the new manifest commits (the old checkpoint "
            "would be damaged if the copy stopped); nothing there was changed. Delete it "
            "first, or pick another destination",
            checkpoint=dest.url,
        )
    total = sum(manifest.files.values())
    with progress(f"copy to {dest.url}", total, enabled=show_progress) as advance:
        for file, size in sorted(manifest.files.items()):
            if file in kept:
                result["kept"].append(file)
                advance(size)
                continue
            copy_file_verbatim(source, file, dest.store, file)
            result["copied"].append(file)
            result["bytes_copied"] += size
            advance(size)
    if result["kept"]:
        result["status"] = "resumed"
    if old:
        result["status"] = "replaced"
    dest.commit_manifest(manifest_bytes)  # the commit: from here on the new checkpoint
    dest.sweep(keep=manifest.files)  # then the old one's files go
    return result


@click.command("copy")
@click.argument("ckpt", metavar="CKPT")
@click.argument("dest", metavar="DEST")
@click.option(
    "--into-root",
    is_flag=True,
    help="DEST is a root (a level): copy to DEST/step-<N>, N from CKPT's step-<N> name.",
)
@storage_options_option(
    help_text="Store options (JSON object) for CKPT, and for DEST too "
    "unless --dest-storage-options is given."
)
@storage_options_option("--dest-storage-options", help_text="Store options (JSON) for DEST.")
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace a different committed checkpoint at DEST (atomically: it stays loadable "
    "until the copy commits).",
)
@json_option
def copy(
    ckpt: str,
    dest: str,
    into_root: bool,
    storage_options: dict,
    dest_storage_options: dict,
    overwrite: bool,
    as_json: bool,
) -> None:
    """Copy the committed checkpoint CKPT to DEST (another directory, bucket or level),
    bit for bit, verifying every item on the way.

    Resumable: after an interruption, run it again; data files already complete
    and correct at DEST are kept. The manifest is written last, so an interrupted
    copy is never a committed checkpoint. Refuses to overwrite a different
    committed checkpoint at DEST (exit status 1) unless --overwrite; then the old
    one stays loadable until the copy commits.
    """
    source = open_checkpoint(ckpt, storage_options)
    if into_root:
        step = parse_step_dir(ckpt.rstrip("/").rsplit("/", 1)[-1])
        if step is None:
            raise ConfigError(
                f"--into-root needs CKPT named step-<N> (as below a level's root), got {ckpt!r}"
            )
        dest = checkpoint_url(dest, step)
    options = options_for(dest, dest_storage_options or storage_options)
    target = StoredCheckpoint(store_for(dest, **options), location=dest)
    result = copy_checkpoint(source, target, show_progress=not as_json, overwrite=overwrite)
    if as_json:
        emit_json(result)
        return
    console = stdout_console()
    if result["status"] == "already-present":
        console.print(
            f"{target.url} already holds this checkpoint; nothing copied", highlight=False
        )
        return
    kept = result["kept"]
    resumed = f"; kept {len(kept)} complete file(s) from an earlier run" if kept else ""
    if result["status"] == "replaced":
        resumed += "; replaced the checkpoint that was there"
    console.print(
        f"copied {source.url} -> {target.url}: {len(result['copied'])} file(s), "
        f"{format_bytes(result['bytes_copied'])}{resumed}",
        highlight=False,
    )
