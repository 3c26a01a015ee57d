"""``dcp-multilevel convert SRC DST --to KIND``: a checkpoint into another format.

A thin command over :func:`dcp_multilevel.convert.convert` (which detects the
source: one of our checkpoints, a stock DCP directory or a ``torch.save``
file, and keeps memory bounded by about the largest tensor): this module only
turns options into its arguments, draws its progress, and prints its report.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from ..convert import TARGET_KINDS
from ..convert import convert as convert_checkpoint
from ._common import (
    emit_json,
    format_bytes,
    json_option,
    options_for,
    progress,
    storage_options_option,
)

__all__ = ["convert"]


@click.command()
@click.argument("src")
@click.argument("dst")
@click.option(
    "--to",
    "to",
    required=True,
    type=click.Choice(TARGET_KINDS),
    help="torch: one torch.save file; safetensors: one .safetensors file (tensors "
    "only); dcp: a stock FileSystemWriter directory; ours: a dcp_multilevel "
    "checkpoint.",
)
@click.option(
    "--codec",
    default=None,
    metavar="NAME",
    help="With --to ours: none (default), zstd or bytegroup.",
)
@click.option("--overwrite", is_flag=True, help="Replace what is at DST.")
@click.option(
    "--skip-non-tensors",
    is_flag=True,
    help="With --to safetensors: leave non-tensor values out instead of failing.",
)
@click.option(
    "--scratch-dir",
    default=None,
    metavar="DIR",
    help="Where decoded tensors are spooled, file-backed (default: beside DST; a disk, not tmpfs).",
)
@storage_options_option(help_text="Store options for SRC when it is a remote URL (JSON).")
@storage_options_option(
    "--dest-storage-options", help_text="Store options for DST when it is a remote URL (JSON)."
)
@json_option
def convert(
    src: str,
    dst: str,
    to: str,
    codec: str | None,
    overwrite: bool,
    skip_non_tensors: bool,
    scratch_dir: str | None,
    storage_options: dict[str, Any],
    dest_storage_options: dict[str, Any],
    as_json: bool,
) -> None:
    """Convert the checkpoint SRC (ours, a stock DCP directory or a torch.save file)
    into DST in the format --to."""
    codec = None if codec in (None, "none") else codec
    state = {"done": 0}
    with progress(f"convert to {to}", None, enabled=not as_json) as advance:

        def report(done: int, total: int) -> None:
            # The total is known only once the source is open: convert() gives it each call.
            advance(done - state["done"], total=total)
            state["done"] = done

        result = convert_checkpoint(
            src,
            dst,
            to=to,
            codec=codec,
            storage_options=options_for(src, storage_options) or None,
            dst_storage_options=options_for(dst, dest_storage_options) or None,
            progress=report,
            overwrite=overwrite,
            skip_non_tensors=skip_non_tensors,
            scratch_dir=scratch_dir,
        )
    if as_json:
        emit_json({**dataclasses.asdict(result), "skipped": list(result.skipped)})
        return
    click.echo(
        f"converted {result.source_kind} {src} -> {result.target_kind} {result.dst}: "
        f"{result.items} items, {format_bytes(result.tensor_bytes)} of tensors "
        f"in {result.seconds:.1f} s"
    )
    if result.skipped:
        click.echo(
            f"left out {len(result.skipped)} non-tensor values: "
            + ", ".join(result.skipped[:5])
            + (" ..." if len(result.skipped) > 5 else "")
        )
