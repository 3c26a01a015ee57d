"""The validating decoder of manifests: every byte of its input is untrusted.

:func:`decode_manifest` treats its input as hostile. Every field is type- and
range-checked, every path is validated, and every item must lie inside a file
whose size the manifest records, so a reader never reads outside the
checkpoint nor trusts a size it has not bounded. :func:`locations_from_json`
applies the same per-entry checks to item locations sent on their own (e.g.
by another rank). The document itself, and its encoder, are in ``manifest.py``.

Before anything is parsed, the manifest's bytes are checked against the digest
it ends with (``manifest_digest.py``), so an edited or damaged manifest is
refused even where every field would still pass, and so is one without a
digest: every manifest a release writes has one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .._version import __version__
from ..errors import ManifestError, UnsupportedFormatVersionError
from .checksum import is_valid_checksum
from .dtypes import dtype_from_name, dtype_name
from .health import health_from_json
from .manifest import (
    DELTA_FORMAT_VERSION,
    FORMAT_NAME,
    FORMAT_VERSION,
    ItemLocation,
    Manifest,
    Reference,
)
from .manifest_digest import unsealed_error, verify_sealed
from .paths import validate_relpath

__all__ = ["decode_manifest", "locations_from_json"]

# Hard bounds on untrusted numbers: no tensor or file is this big, and they keep
# products like prod(sizes) * itemsize inside what Python ints and seeks accept.
_MAX_INT = 2**62
_MAX_DIMS = 64
_MAX_MANIFEST_BYTES = 1 << 30


class _Checker:
    """Field accessors that raise ManifestError naming the checkpoint and field."""

    def __init__(self, checkpoint: str | None) -> None:
        self.checkpoint = checkpoint

    def fail(self, msg: str) -> ManifestError:
        where = f"manifest of checkpoint {self.checkpoint!r}" if self.checkpoint else "manifest"
        return ManifestError(
            f"{where} is invalid: {msg}. The checkpoint is damaged or was not written by "
            "dcp_multilevel; load it from another level or copy.",
            checkpoint=self.checkpoint,
        )

    def get(self, obj: Mapping[str, Any], key: str, typ: type | tuple[type, ...], what: str) -> Any:
        if key not in obj:
            raise self.fail(f"{what} lacks field {key!r}")
        value = obj[key]
        # bool is an int in Python; a manifest that says true where a size goes is broken.
        if isinstance(value, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,)):
            raise self.fail(f"{what}.{key} must be {_tname(typ)}, got a boolean")
        if not isinstance(value, typ):
            raise self.fail(f"{what}.{key} must be {_tname(typ)}, got {type(value).__name__}")
        return value

    def count(self, value: Any, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_INT:
            raise self.fail(f"{what} must be a non-negative integer below 2**62, got {value!r}")
        return value

    def shape(self, value: Any, what: str) -> list[int]:
        if not isinstance(value, list) or len(value) > _MAX_DIMS:
            raise self.fail(f"{what} must be a list of at most {_MAX_DIMS} integers")
        return [self.count(v, f"{what}[{i}]") for i, v in enumerate(value)]


def _tname(typ: type | tuple[type, ...]) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        int: "an integer",
        float: "a number",
        type(None): "null",
        bool: "a boolean",
    }
    types = typ if isinstance(typ, tuple) else (typ,)
    return " or ".join(names.get(t, t.__name__) for t in types)


def decode_manifest(data: bytes, *, checkpoint: str | None = None) -> Manifest:
    """Check manifest bytes against their digest, parse and validate them; raise
    ManifestError on anything wrong (:class:`ManifestDigestError` when the bytes
    are not those the writer sealed).

    ``checkpoint`` (its path or URL) only names the checkpoint in messages.
    """
    c = _Checker(checkpoint)
    if len(data) > _MAX_MANIFEST_BYTES:
        raise c.fail(f"it is {len(data)} bytes, more than the 1 GiB limit")
    digest = verify_sealed(data, checkpoint=checkpoint)
    try:
        doc = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise c.fail(f"it is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise c.fail("the top level must be an object")
    if doc.get("format") != FORMAT_NAME:
        raise c.fail(f"field 'format' is {doc.get('format')!r}, expected {FORMAT_NAME!r}")
    if digest is None:
        raise unsealed_error(set(doc), checkpoint=checkpoint)
    version = c.get(doc, "format_version", int, "manifest")
    if version not in (FORMAT_VERSION, DELTA_FORMAT_VERSION):
        where = f"checkpoint {checkpoint!r}" if checkpoint else "this checkpoint"
        raise UnsupportedFormatVersionError(
            f"{where} uses dcp_multilevel format version {version} (written by plugin "
            f"{doc.get('plugin_version')!r}); this is plugin {__version__}, which reads "
            f"format versions {FORMAT_VERSION} and {DELTA_FORMAT_VERSION}. Install a "
            "dcp_multilevel release that supports it.",
            checkpoint=checkpoint,
        )

    save_id = c.get(doc, "save_id", str, "manifest")
    world_size = c.count(c.get(doc, "world_size", int, "manifest"), "world_size")
    created = c.get(doc, "created_unix", (int, float), "manifest")
    plugin_version = c.get(doc, "plugin_version", str, "manifest")
    torch_version = c.get(doc, "torch_version", str, "manifest")
    dcp_version = c.get(doc, "dcp_version", (str, type(None)), "manifest")

    planner_data = _decode_planner_data(c, doc.get("planner_data"))
    state = _decode_state(c, c.get(doc, "state_dict", dict, "manifest"))

    files: dict[str, int] = {}
    for path, size in c.get(doc, "files", dict, "manifest").items():
        validate_relpath(path, what="data file path", checkpoint=checkpoint)
        files[path] = c.count(size, f"size of file {path!r}")

    locations = _decode_items(c, c.get(doc, "items", list, "manifest"), state, files)
    reference = _decode_reference(c, doc.get("reference"), version)
    extra = doc.get("extra", {})
    if not isinstance(extra, dict):
        raise c.fail("extra must be an object")
    if reference is None and any(loc.reference is not None for loc in locations.values()):
        raise c.fail("an item is stored as a delta ('ref') but the manifest names no reference")
    health = health_from_json(doc.get("health"), c.fail)

    metadata = Metadata(
        state_dict_metadata=state,
        planner_data=planner_data,
        storage_data=locations,
        storage_meta=StorageMeta(checkpoint_id=checkpoint, save_id=save_id),
        version=dcp_version,
    )
    return Manifest(
        metadata=metadata,
        locations=locations,
        files=files,
        save_id=save_id,
        world_size=world_size,
        plugin_version=plugin_version,
        torch_version=torch_version,
        created_unix=float(created),
        format_version=version,
        extra=extra,
        reference=reference,
        digest=digest,
        health=health,
    )


def _decode_reference(c: _Checker, raw: Any, version: int) -> Reference | None:
    """The ``reference`` field: present exactly in format version 2; a sibling directory."""
    if version == FORMAT_VERSION:
        if raw is not None:
            raise c.fail(f"format version {FORMAT_VERSION} has no 'reference'")
        return None
    if not isinstance(raw, dict):
        raise c.fail(f"format version {DELTA_FORMAT_VERSION} needs a 'reference' object")
    save_id = c.get(raw, "save_id", str, "reference")
    name = c.get(raw, "checkpoint", str, "reference")
    # One safe path component: a manifest may only send a load to a sibling.
    validate_relpath(name, what="reference.checkpoint", checkpoint=c.checkpoint)
    if "/" in name:
        raise c.fail(f"reference.checkpoint {name!r} is not a sibling directory's name")
    return Reference(save_id, name)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _decode_planner_data(c: _Checker, data: Any) -> dict[str, tuple[str | int, ...]] | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise c.fail("planner_data must be an object or null")
    out: dict[str, tuple[str | int, ...]] = {}
    for fqn, path in data.items():
        if not isinstance(path, list) or not all(
            isinstance(p, (str, int)) and not isinstance(p, bool) for p in path
        ):
            raise c.fail(f"planner_data[{fqn!r}] must be a list of strings and integers")
        out[fqn] = tuple(path)
    return out


def _decode_state(c: _Checker, raw: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for fqn, entry in raw.items():
        what = f"state_dict[{fqn!r}]"
        if not isinstance(entry, dict):
            raise c.fail(f"{what} must be an object")
        kind = entry.get("type")
        if kind == "bytes":
            state[fqn] = BytesStorageMetadata()
            continue
        if kind != "tensor":
            raise c.fail(f"{what}.type must be 'tensor' or 'bytes', got {kind!r}")
        name = c.get(entry, "dtype", str, what)
        dtype = dtype_from_name(name)
        if dtype is None:
            raise c.fail(f"{what}.dtype {name!r} is not a dtype this release knows")
        size = c.shape(c.get(entry, "size", list, what), f"{what}.size")
        chunks = []
        for i, ch in enumerate(c.get(entry, "chunks", list, what)):
            cw = f"{what}.chunks[{i}]"
            if not isinstance(ch, dict):
                raise c.fail(f"{cw} must be an object")
            offsets = c.shape(c.get(ch, "offsets", list, cw), f"{cw}.offsets")
            sizes = c.shape(c.get(ch, "sizes", list, cw), f"{cw}.sizes")
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise c.fail(f"{cw} has {len(offsets)}/{len(sizes)} dims, the tensor {len(size)}")
            if any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
                raise c.fail(f"{cw} (offsets {offsets}, sizes {sizes}) lies outside size {size}")
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        requires_grad = c.get(entry, "requires_grad", bool, what)
        state[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype, requires_grad=requires_grad),
            size=torch.Size(size),
            chunks=chunks,
        )
    return state


def _decode_items(
    c: _Checker, raw: list[Any], state: dict[str, Any], files: dict[str, int]
) -> dict[MetadataIndex, ItemLocation]:
    locations: dict[MetadataIndex, ItemLocation] = {}
    for what, fqn, offsets_raw, loc in _entries(c, raw):
        file, pos, length, raw_length = loc.file, loc.offset, loc.length, loc.raw_length
        md = state.get(fqn)
        if md is None:
            raise c.fail(f"{what} names {fqn!r}, which is not in state_dict")
        if file not in files:
            raise c.fail(f"{what}.file {file!r} is not listed in 'files'")
        if pos + length > files[file]:
            raise c.fail(
                f"{what} ({fqn!r}) spans bytes {pos}..{pos + length} of {file!r}, "
                f"past its recorded size {files[file]}"
            )

        if isinstance(md, BytesStorageMetadata):
            if offsets_raw is not None:
                raise c.fail(f"{what} ({fqn!r}) is a bytes item but has tensor offsets")
            index = MetadataIndex(fqn)
        else:
            offsets = c.shape(offsets_raw, f"{what}.offsets") if offsets_raw is not None else None
            chunk = next((ch for ch in md.chunks if list(ch.offsets) == offsets), None)
            if chunk is None:
                raise c.fail(f"{what} ({fqn!r}) offsets {offsets} match no chunk of the tensor")
            expected = math.prod(chunk.sizes) * md.properties.dtype.itemsize
            if raw_length != expected:
                raise c.fail(
                    f"{what} ({fqn!r}) raw_length {raw_length} != {expected} bytes of a "
                    f"{list(chunk.sizes)} {dtype_name(md.properties.dtype)} chunk"
                )
            index = MetadataIndex(fqn, offsets)
        if index in locations:
            raise c.fail(f"{what} ({fqn!r}, offsets {offsets_raw}) is stored twice")
        locations[index] = loc

    # Every chunk and bytes item must be stored somewhere, or a load would fail late.
    for fqn, md in state.items():
        if isinstance(md, BytesStorageMetadata):
            keys = [MetadataIndex(fqn)]
        else:
            keys = [MetadataIndex(fqn, ch.offsets) for ch in md.chunks]
        for key in keys:
            if key not in locations:
                raise c.fail(f"{fqn!r} (offsets {key.offset}) has no stored item")
    return locations


def _entries(
    c: _Checker, items: list[Any]
) -> Iterator[tuple[str, str, list[Any] | None, ItemLocation]]:
    """``(where, fqn, raw offsets, location)`` of each item entry, each checked on its own."""
    for i, item in enumerate(items):
        what = f"items[{i}]"
        if not isinstance(item, dict):
            raise c.fail(f"{what} must be an object")
        yield (what, *_decode_location(c, item, what))


def _decode_location(
    c: _Checker, item: Mapping[str, Any], what: str
) -> tuple[str, list[Any] | None, ItemLocation]:
    """``(fqn, raw offsets, location)`` of one item entry, checked on its own."""
    fqn = c.get(item, "fqn", str, what)
    offsets_raw = c.get(item, "offsets", (list, type(None)), what)
    file = validate_relpath(
        c.get(item, "file", str, what), what=f"{what}.file", checkpoint=c.checkpoint
    )
    pos = c.count(c.get(item, "pos", int, what), f"{what}.pos")
    length = c.count(c.get(item, "length", int, what), f"{what}.length")
    raw_length = c.count(c.get(item, "raw_length", int, what), f"{what}.raw_length")
    transforms = c.get(item, "transforms", list, what)
    if not all(isinstance(t, str) for t in transforms):
        raise c.fail(f"{what}.transforms must be a list of strings")
    checksum = c.get(item, "checksum", str, what)
    if not is_valid_checksum(checksum):
        raise c.fail(f"{what}.checksum {checksum!r} is not of the form 'xxh3_64:<16 hex>'")
    if not transforms and length != raw_length:
        raise c.fail(f"{what} ({fqn!r}) has no transforms but length != raw_length")
    ref = c.get(item, "ref", str, what) if "ref" in item else None
    if ref is not None:
        if not is_valid_checksum(ref):
            raise c.fail(f"{what}.ref {ref!r} is not of the form 'xxh3_64:<16 hex>'")
        if len(transforms) != 1:
            raise c.fail(f"{what} ({fqn!r}) is a delta ('ref') but is not framed by one codec")
    return (
        fqn,
        offsets_raw,
        ItemLocation(file, pos, length, raw_length, checksum, tuple(transforms), ref),
    )


def locations_from_json(
    items: Any, *, checkpoint: str | None = None
) -> dict[MetadataIndex, ItemLocation]:
    """Parse :func:`locations_to_json` output (e.g. sent by another rank), checking each entry.

    Only each entry's own shape is checked here; :func:`encode_manifest` and
    :func:`decode_manifest` check the whole set against the state it describes.

    Raises:
        ManifestError: an entry is malformed (names ``checkpoint`` in the message).
    """
    c = _Checker(checkpoint)
    if not isinstance(items, list):
        raise c.fail("item locations must be a list")
    out: dict[MetadataIndex, ItemLocation] = {}
    for what, fqn, offsets_raw, loc in _entries(c, items):
        offsets = None if offsets_raw is None else c.shape(offsets_raw, f"{what}.offsets")
        out[MetadataIndex(fqn, offsets)] = loc
    return out
