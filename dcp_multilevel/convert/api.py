"""``convert``: one checkpoint in another format, in memory bounded by its largest tensor."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ..checkpoint import StoredCheckpoint
from ..codecs import codec_for
from ..codecs.options import Compression
from ..errors import CheckpointExistsError, ConfigError, ConvertError
from .progress import Progress, ProgressCallback
from .scratch import Scratch
from .sources import OURS, STOCK_DCP, TORCH_SAVE, detect_source, is_url, local_path, open_source
from .to_dcp import write_ours, write_stock_dcp
from .to_file import safetensors_problems, write_safetensors, write_torch_save

__all__ = ["TARGET_KINDS", "ConvertReport", "convert"]

SAFETENSORS = "safetensors"
#: What ``convert(..., to=...)`` can write.
TARGET_KINDS = (TORCH_SAVE, SAFETENSORS, STOCK_DCP, OURS)


@dataclass(frozen=True)
class ConvertReport:
    """What one :func:`convert` call did.

    Attributes:
        source_kind: ``"ours"``, ``"dcp"`` (a stock DCP directory) or ``"torch"``.
        target_kind: ``"torch"``, ``"safetensors"``, ``"dcp"`` or ``"ours"``.
        src, dst: the locations as given.
        items: values written (tensors and non-tensor values, by flattened key).
        tensor_bytes: bytes of the tensors written (whole tensors, uncompressed).
        seconds: wall-clock time of the whole conversion.
        skipped: keys of non-tensor values left out (safetensors with
            ``skip_non_tensors=True``), sorted.
    """

    source_kind: str
    target_kind: str
    src: str
    dst: str
    items: int
    tensor_bytes: int
    seconds: float
    skipped: tuple[str, ...] = ()


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str,
    codec: Compression | str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    dst_storage_options: Mapping[str, Any] | None = None,
    progress: ProgressCallback | None = None,
    overwrite: bool = False,
    skip_non_tensors: bool = False,
    scratch_dir: str | os.PathLike[str] | None = None,
) -> ConvertReport:
    """Convert the checkpoint at ``src`` into format ``to`` at ``dst``.

    The source kind is detected: a dcp_multilevel checkpoint (its
    ``manifest.json``; a local path or any URL our stores open), a stock DCP
    directory (its ``.metadata``) or a ``torch.save`` file (zip format).
    Sharded tensors (several ranks' chunks, DTensor shards, split pieces) come
    out whole; the nested structure is the one ``dcp_to_torch_save`` rebuilds.

    Memory: tensors are decoded one item at a time into file-backed scratch
    tensors (``scratch_dir``) and written from there, so the process's
    anonymous memory grows by about the largest tensor, not the checkpoint.
    A ``torch.save`` source is memory-mapped instead (no scratch).

    Args:
        src: the checkpoint to read.
        dst: where to write: a file (``"torch"``, ``"safetensors"``), a directory
            (``"dcp"``), or a path or URL (``"ours"``).
        to: ``"torch"`` (one ``torch.save`` file), ``"safetensors"`` (tensors only,
            flattened keys such as ``model.layer.weight``), ``"dcp"`` (a stock
            ``FileSystemWriter`` directory) or ``"ours"`` (a dcp_multilevel
            checkpoint).
        codec: for ``to="ours"``: ``None``, ``"zstd"``, ``"bytegroup"`` or a
            :class:`~dcp_multilevel.Compression`.
        storage_options: options for the store of ``src`` (our checkpoints only).
        dst_storage_options: options for the store of ``dst`` (``to="ours"`` only).
        progress: called as ``progress(done_bytes, total_bytes)`` while it runs;
            ``total_bytes`` is fixed and counts the tensor bytes once per pass
            (decoding the source into scratch is one pass, writing ``dst``
            another; a torch.save source has only the second). The last call
            has ``done_bytes == total_bytes``.
        overwrite: replace an existing ``dst`` (default: refuse).
        skip_non_tensors: for ``to="safetensors"``: leave non-tensor values out
            (listed in the report) instead of refusing them.
        scratch_dir: where scratch files go (needs free space for the tensors;
            must be a disk, not tmpfs); default: the directory ``dst`` is in,
            or the system temporary directory for a remote ``dst``.

    Returns:
        What was done (:class:`ConvertReport`).

    Raises:
        ConfigError: ``to`` is unknown, or an option does not apply to it.
        RegistryError: ``codec`` names no installed codec.
        CheckpointNotFoundError: nothing is at ``src``.
        ConvertError: ``src`` is not a checkpoint; ``dst`` exists; safetensors
            cannot hold a value or dtype (the message names them).
        CheckpointExistsError: ``to="ours"`` and a committed checkpoint is at ``dst``.
        UnsafeObjectError: a non-tensor value is refused by ``weights_only`` loading.
        CorruptCheckpointError: an item of a source of ours fails its checksum.
    """
    began = time.monotonic()
    src, dst = os.fspath(src), os.fspath(dst)
    _check_options(src, dst, to, codec, dst_storage_options, skip_non_tensors)
    kind = detect_source(src, storage_options)
    _check_dst(dst, to, overwrite, dst_storage_options)
    source = open_source(kind, src, storage_options)
    skipped: tuple[str, ...] = ()
    if to == SAFETENSORS:  # before decoding anything
        skipped = _safetensors_check(source.entries, src, dst, skip_non_tensors)
    total = source.tensor_bytes * (2 if source.decode_pass else 1)
    done = Progress(total, progress)
    write_start = total - source.tensor_bytes
    scratch = Scratch(scratch_dir or _scratch_parent(dst, to)) if source.decode_pass else None
    try:
        state = source.load(scratch, done)
        done.reach(write_start)
        flat, _ = flatten_state_dict(state)
        if to == TORCH_SAVE:
            write_torch_save(state, dst, done, write_start)
        elif to == SAFETENSORS:
            tensors = {k: _standalone(v) for k, v in flat.items() if isinstance(v, torch.Tensor)}
            write_safetensors(tensors, dst, done, write_start)
        elif to == STOCK_DCP:
            write_stock_dcp(state, dst, done)
        else:
            write_ours(
                state,
                dst,
                done,
                codec=codec,
                overwrite=overwrite,
                storage_options=dst_storage_options,
            )
        nbytes = sum(v.nbytes for v in flat.values() if isinstance(v, torch.Tensor))
        items = len(flat) - len(skipped)
    finally:
        if scratch is not None:
            scratch.close()
    done.finish()
    return ConvertReport(kind, to, src, dst, items, nbytes, time.monotonic() - began, skipped)


def _check_options(
    src: str,
    dst: str,
    to: str,
    codec: Any,
    dst_storage_options: Mapping[str, Any] | None,
    skip_non_tensors: bool,
) -> None:
    """Refuse an impossible request before touching anything."""
    if to not in TARGET_KINDS:
        raise ConfigError(
            f"cannot convert {src} to {to!r}: unknown target format; use one of "
            f"{', '.join(repr(k) for k in TARGET_KINDS)}"
        )
    if codec is not None and to != OURS:
        raise ConfigError(f"codec={codec!r} applies only to to='ours' (converting {src} to {to!r})")
    if codec is not None:
        # An unknown codec fails now (RegistryError naming it), not after decoding.
        codec_for(Compression.of(codec))
    if dst_storage_options and to != OURS:
        raise ConfigError(
            f"dst_storage_options apply only to to='ours' (converting {src} to {to!r})"
        )
    if skip_non_tensors and to != SAFETENSORS:
        raise ConfigError(
            f"skip_non_tensors applies only to to='safetensors' (converting {src} to {to!r})"
        )
    if to != OURS and is_url(dst):
        raise ConfigError(
            f"cannot write {to!r} to {dst}: only to='ours' writes to URLs; give a local path"
        )
    if os.path.abspath(local_path(src)) == os.path.abspath(local_path(dst)):
        raise ConfigError(f"cannot convert {src} onto itself; give another destination")


def _check_dst(
    dst: str, to: str, overwrite: bool, dst_storage_options: Mapping[str, Any] | None
) -> None:
    """Refuse an existing destination unless ``overwrite`` (before any work)."""
    if to == OURS:
        if not overwrite and StoredCheckpoint.at(dst, dst_storage_options).is_committed():
            raise CheckpointExistsError(
                f"cannot convert to {dst}: a committed checkpoint is there already; "
                "pass overwrite=True to replace it",
                checkpoint=dst,
            )
        return
    path = local_path(dst)
    if to == STOCK_DCP:
        exists = os.path.isfile(path) or (os.path.isdir(path) and bool(os.listdir(path)))
        if exists and overwrite and os.path.isdir(path):
            exists = False  # FileSystemWriter replaces the files it writes
    else:
        exists = os.path.exists(path) and (os.path.isdir(path) or not overwrite)
    if exists:
        raise ConvertError(
            f"cannot convert to {dst}: it exists already"
            + ("" if overwrite else "; pass overwrite=True to replace it")
            + (" (a directory cannot be replaced by a file)" if os.path.isdir(path) else ""),
            path=dst,
        )
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


def _scratch_parent(dst: str, to: str) -> str | None:
    """Beside the output (same disk, which must hold it anyway); temp dir for URLs."""
    if is_url(dst):
        return None
    return os.path.dirname(os.path.abspath(local_path(dst)))


def _safetensors_check(
    entries: dict[str, torch.dtype | None], src: str, dst: str, skip_non_tensors: bool
) -> tuple[str, ...]:
    """The non-tensor keys to skip; refuses what safetensors cannot hold."""
    others, bad = safetensors_problems(entries)
    if bad:
        raise ConvertError(
            f"cannot convert {src} to safetensors {dst}: safetensors has no dtype for "
            f"{', '.join(bad)}; convert to 'torch', 'dcp' or 'ours' instead",
            path=dst,
        )
    if others and not skip_non_tensors:
        names = ", ".join(sorted(others)[:10]) + (" ..." if len(others) > 10 else "")
        raise ConvertError(
            f"cannot convert {src} to safetensors {dst}: safetensors holds tensors only, "
            f"and {len(others)} value(s) are not tensors: {names}. Pass "
            "skip_non_tensors=True to leave them out, or convert to 'torch' instead",
            path=dst,
        )
    return tuple(sorted(others))


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it owns its storage (scratch tensors always do), else a copy:
    safetensors refuses views and tensors sharing memory (a torch.save source may hold them)."""
    t = t.detach()
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)
