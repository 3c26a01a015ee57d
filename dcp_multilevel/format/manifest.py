"""The manifest: a versioned JSON document that commits one checkpoint, sealed
by a digest of its own bytes, and its validating decoder.

A checkpoint exists iff its ``manifest.json`` exists: the writer publishes it
last, atomically. It holds everything ``StorageReader.read_metadata`` must
return (DCP's :class:`Metadata`: tensor shapes, dtypes, chunks, bytes items,
the planner's flatten mapping) and, per stored item, where its bytes are and
how to check them. It is JSON, not pickle: loading a checkpoint never runs code.

This module defines the document (:class:`Manifest`, :class:`ItemLocation`),
encodes and seals it (:func:`encode_manifest`, :func:`seal_manifest`), and
decodes it with :func:`decode_manifest`, which treats its input as hostile
(all re-exported by ``format/__init__.py``).

Layout (format version 1; version 2 adds the two delta fields below)::

    {"format": "dcp_multilevel", "format_version": 1,
     "plugin_version": "0.1.0", "torch_version": "2.13.0+cpu",
     "save_id": "<hex>", "created_unix": 1.7e9, "world_size": 4,
     "dcp_version": "1.0.0",
     "planner_data": {"fqn": ["path", "elements", 0]} | null,
     "state_dict": {"fqn": {"type": "tensor", "dtype": "float32", "size": [..],
                            "requires_grad": false,
                            "chunks": [{"offsets": [..], "sizes": [..]}]}
                    | {"type": "bytes"}},
     "files": {"data/0-0.<token>.bin": <size in bytes>},
     "items": [{"fqn": "..", "offsets": [..] | null, "file": "..", "pos": 0,
                "length": 16, "raw_length": 16, "transforms": [],
                "checksum": "xxh3_64:<hex>"}],
     "health": {"checked": [..], "findings": [..]},       (optional, health.py)
     "digest": "xxh3_64:<hex>"}

``digest``, always the last field, is the xxh3-64 of every byte of the file
before its value (below): a reader checks it before it parses anything else,
and refuses a manifest without one.

A delta checkpoint (format version 2, written only when the checkpoint has
a reference) adds ``"reference": {"save_id": "<hex>", "checkpoint":
"step-8"}``: the checkpoint its delta chunks are coded against, a sibling
directory of this one (so a root moves or copies as a whole), and per item
whose frames hold delta chunks ``"ref": "xxh3_64:<hex>"``: the checksum
the reference's manifest records for the same item on the same level. A
load checks both before it trusts the reference's bytes (``docs/delta.md``).
Releases that read only version 1 refuse version 2 by its number, never by
misreading a delta as data.

The digest checks every byte of a manifest. Item checksums only help if the
manifest that records them is right: a manifest whose ``"float32"`` became
``"int32"`` (same width) would load wrong values from intact data. So a
manifest ends with one more field, the xxh3-64 of every byte before that
field's value (:func:`seal`)::

    {"format":"dcp_multilevel", ... ,"items":[...],"digest":"xxh3_64:<16 hex>"}
    \\_______________________ hashed ________________________/

The field is the document's last bytes, exactly as above, so the digest
covers the file as written (whitespace and key order included) and a reader
checks it before parsing anything (:func:`verify_sealed`). Any change to the
hashed bytes is a mismatch; a change to the field itself leaves a value that
is not the recorded hash, bytes that are not JSON, or a document with no
valid digest. Every manifest a release writes is sealed, so one that does not
end with a digest had its digest field damaged or was not written by
dcp_multilevel, and is refused (:func:`unsealed_error`).

The decoder trusts no byte of its input. Before anything is parsed, the
manifest's bytes are checked against the digest it ends with, so an edited or
damaged manifest is refused even where every field would still pass, and so
is one without a digest. Then every field is type- and range-checked, every
path is validated, and every item must lie inside a file whose size the
manifest records, so a reader never reads outside the checkpoint nor trusts a
size it has not bounded. :func:`locations_from_json` applies the same
per-entry checks to item locations sent on their own (e.g. by another rank).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
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
from ..errors import (
    ManifestDigestError,
    ManifestError,
    UnsupportedFormatVersionError,
    UnsupportedStateError,
)
from .checksum import checksum_of, is_valid_checksum
from .dtypes import dtype_from_name, dtype_name
from .health import Health, health_from_json
from .layout import MANIFEST_NAME, parse_step_dir, validate_relpath

__all__ = [
    "DELTA_FORMAT_VERSION",
    "DIGEST_FIELD",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ItemLocation",
    "Manifest",
    "Reference",
    "decode_manifest",
    "encode_manifest",
    "locations_from_json",
    "locations_to_json",
    "seal",
    "seal_manifest",
    "unsealed_error",
    "verify_sealed",
]


FORMAT_NAME = "dcp_multilevel"
FORMAT_VERSION = 1
#: Written instead of :data:`FORMAT_VERSION` by checkpoints with a reference.
DELTA_FORMAT_VERSION = 2


@dataclass(frozen=True)
class ItemLocation:
    """Where one stored item's bytes are, inside one checkpoint.

    ``length`` counts the stored bytes at ``file[offset:offset+length]``;
    ``raw_length`` the bytes after undoing ``transforms`` (equal when there
    are none). ``checksum`` covers the stored bytes. ``reference``: for an
    item with delta chunks, the checksum of the same item in the checkpoint's
    :class:`Reference` (as that checkpoint's manifest records it), else None.
    """

    file: str
    offset: int
    length: int
    raw_length: int
    checksum: str
    transforms: tuple[str, ...] = ()
    reference: str | None = None


@dataclass(frozen=True)
class Reference:
    """The checkpoint a delta checkpoint's delta chunks are coded against.

    Attributes:
        save_id: the reference's ``save_id`` (the same on every level that holds it).
        checkpoint: its directory's name, a sibling of the delta checkpoint's
            (``step-8``): one path component.
    """

    save_id: str
    checkpoint: str


@dataclass(frozen=True)
class Manifest:
    """A decoded (validated) manifest."""

    metadata: Metadata
    locations: dict[MetadataIndex, ItemLocation]
    files: dict[str, int]
    save_id: str
    world_size: int
    plugin_version: str
    torch_version: str
    created_unix: float
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    reference: Reference | None = None
    #: The digest the manifest's bytes matched (every decoded manifest has one).
    digest: str | None = None
    #: What the save's checks found (``health.py``); None: no record, a clean step.
    health: Health | None = None

    @property
    def quarantined(self) -> bool:
        """True when the save's checks found something (``docs/health.md``)."""
        return self.health is not None and self.health.quarantined

    @property
    def reference_step(self) -> int | None:
        """The step whose checkpoint the deltas are coded against (None: stored whole,
        or a reference directory not named ``step-<N>``)."""
        return None if self.reference is None else parse_step_dir(self.reference.checkpoint)


# --------------------------------------------------------------------------- encode


def encode_manifest(
    metadata: Metadata,
    locations: Mapping[MetadataIndex, ItemLocation],
    files: Mapping[str, int],
    *,
    save_id: str,
    world_size: int,
    created_unix: float,
    reference: Reference | None = None,
    extra: Mapping[str, Any] | None = None,
    health: Health | None = None,
) -> bytes:
    """Serialize a checkpoint's manifest to UTF-8 JSON bytes, sealed by its digest.

    ``reference``: the checkpoint the items' delta chunks are coded against
    (format version 2); required when an item has a ``reference`` checksum.
    ``extra``: what a tool keeps with the checkpoint (the manager: its
    schedule's state), plain JSON; no load depends on it.
    ``health``: what the save's checks found (``health.py``).

    Raises UnsupportedStateError when the planner's ``planner_data`` is not
    made of plain strings and ints (it must survive JSON), or an item names a
    reference the checkpoint does not have.
    """
    if reference is None and any(loc.reference is not None for loc in locations.values()):
        raise UnsupportedStateError(
            "an item is stored as a delta but the checkpoint names no reference"
        )
    head = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION if reference is None else DELTA_FORMAT_VERSION,
        "plugin_version": __version__,
        "torch_version": torch.__version__,
        "save_id": save_id,
        "created_unix": created_unix,
        "world_size": world_size,
        "dcp_version": metadata.version,
        "planner_data": _encode_planner_data(metadata.planner_data),
    }
    # The same text as one json.dumps of the whole document, written a batch of
    # entries at a time: each batch's dicts are gone before the next are made. A
    # document of dicts, one per tensor and per item with their lists (about
    # 10,000 objects for 1,168 tensors), lived long enough for the cyclic collector
    # to move it to its oldest generation, and so brought on full collections of
    # the whole heap, on the save's thread, holding the GIL.
    enc = _ENCODER.encode
    state = ",".join(
        enc(dict(batch))[1:-1]
        for batch in _batches(
            (fqn, _state_entry(fqn, md)) for fqn, md in metadata.state_dict_metadata.items()
        )
    )
    items = ",".join(enc(batch)[1:-1] for batch in _batches(_item_entries(locations)))
    parts = [
        enc(head)[:-1],
        f',"state_dict":{{{state}}}',
        f',"files":{enc(dict(sorted(files.items())))}',
        f',"items":[{items}]',
    ]
    if reference is not None:
        ref = {"save_id": reference.save_id, "checkpoint": reference.checkpoint}
        parts.append(f',"reference":{enc(ref)}')
    if extra:
        try:
            parts.append(f',"extra":{enc(dict(extra))}')
        except (TypeError, ValueError) as e:  # only extra can hold what JSON cannot
            raise UnsupportedStateError(
                f"the manifest's extra values must be plain JSON (no NaN or infinity): {e}"
            ) from None
    if health is not None:
        parts.append(f',"health":{enc(health.to_json())}')
    parts.append("}")
    return seal("".join(parts))


def seal_manifest(doc: Mapping[str, Any]) -> bytes:
    """A manifest document (a decoded manifest.json, its ``digest`` dropped) encoded as the
    writer does and sealed with a fresh digest: how a tool that must change a manifest
    on purpose writes one that a reader accepts. Nothing checks its content here.
    """
    return seal(_ENCODER.encode({k: v for k, v in doc.items() if k != DIGEST_FIELD}))


#: ``json.dumps(..., separators=(",", ":"), allow_nan=False)``, made once.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)

#: Entries encoded together: a few hundred objects alive at once, and one encoder
#: call per batch (a call per entry pays the encoder's fixed cost per call for each).
_BATCH = 64


def _batches(entries: Iterable[Any]) -> Iterator[list[Any]]:
    it = iter(entries)
    while batch := list(itertools.islice(it, _BATCH)):
        yield batch


def _state_entry(fqn: str, md: Any) -> dict[str, Any]:
    """The manifest's ``state_dict`` entry of one item's DCP storage metadata."""
    if isinstance(md, BytesStorageMetadata):
        return {"type": "bytes"}
    if isinstance(md, TensorStorageMetadata):
        return {
            "type": "tensor",
            "dtype": dtype_name(md.properties.dtype, fqn=fqn),
            "size": list(md.size),
            "requires_grad": bool(md.properties.requires_grad),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    # (unreachable: DCP has only these two kinds)
    raise UnsupportedStateError(f"item {fqn!r} has unknown storage metadata {md!r}")


def _encode_planner_data(data: Any) -> Any:
    if data is None:
        return None
    ok = isinstance(data, Mapping) and all(
        isinstance(k, str)
        and isinstance(v, (tuple, list))
        and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in v)
        for k, v in data.items()
    )
    if not ok:
        raise UnsupportedStateError(
            "the save planner's planner_data is not a mapping of str to a path of str/int "
            f"(got {type(data).__name__}); dcp_multilevel stores it as JSON. Use "
            "DefaultSavePlanner / BalancedSavePlanner or keep planner_data JSON-friendly."
        )
    return dict(data)  # its tuples are JSON arrays as they are: no list made per entry


def locations_to_json(locations: Mapping[MetadataIndex, ItemLocation]) -> list[dict[str, Any]]:
    """Item locations as the manifest's ``items`` entries (JSON-able; sorted by file, offset)."""
    return list(_item_entries(locations))


def _item_entries(locations: Mapping[MetadataIndex, ItemLocation]) -> Iterator[dict[str, Any]]:
    """The ``items`` entries one by one, sorted by file and offset (so that the same
    checkpoint always encodes to the same bytes)."""
    for index, loc in sorted(locations.items(), key=_by_place):
        item = {
            "fqn": index.fqn,
            "offsets": None if index.offset is None else list(index.offset),
            "file": loc.file,
            "pos": loc.offset,
            "length": loc.length,
            "raw_length": loc.raw_length,
            "transforms": list(loc.transforms),
            "checksum": loc.checksum,
        }
        if loc.reference is not None:
            item["ref"] = loc.reference
        yield item


def _by_place(entry: tuple[MetadataIndex, ItemLocation]) -> tuple[str, int]:
    return entry[1].file, entry[1].offset


# --------------------------------------------------------------------------- digest


DIGEST_FIELD = "digest"

_OPEN = f',"{DIGEST_FIELD}":"'.encode()
_CLOSE = b'"}'
#: The last bytes of a sealed manifest: the digest field, then the closing brace.
_TRAILER = re.compile(rb',"' + DIGEST_FIELD.encode() + rb'":"(xxh3_64:[0-9a-f]{16})"\}\Z')
_TRAILER_LEN = len(_OPEN) + len("xxh3_64:") + 16 + len(_CLOSE)

_WHAT_TO_DO = (
    "The checkpoint's manifest was modified or damaged after it was written; load the "
    "checkpoint from another level's copy, or an earlier checkpoint."
)


def seal(body: str) -> bytes:
    """``body`` (one JSON object's text, ending in ``}``) with the digest field added last."""
    if not body.endswith("}") or body == "{}":
        raise ValueError("a manifest body must be one non-empty JSON object")
    hashed = body[:-1].encode("utf-8") + _OPEN
    return b"".join((hashed, checksum_of(hashed).encode(), _CLOSE))


def _where(checkpoint: str | None) -> str:
    return f"{checkpoint.rstrip('/')}/{MANIFEST_NAME}" if checkpoint else MANIFEST_NAME


def verify_sealed(data: bytes, *, checkpoint: str | None) -> str | None:
    """The digest ``data`` ends with, checked against its bytes; None when it ends with none.

    Raises:
        ManifestDigestError: the bytes do not hash to the recorded digest.
    """
    match = _TRAILER.search(data, max(0, len(data) - _TRAILER_LEN))
    if match is None:
        return None
    recorded = match.group(1).decode()
    actual = checksum_of(memoryview(data)[: match.start(1)])
    if actual != recorded:
        raise ManifestDigestError(
            f"manifest {_where(checkpoint)} does not match its digest: it records "
            f"{recorded}, its bytes hash to {actual}. {_WHAT_TO_DO}",
            checkpoint=checkpoint,
        )
    return recorded


def unsealed_error(
    fields: set[str] | frozenset[str], *, checkpoint: str | None
) -> ManifestDigestError:
    """The error for a manifest that does not end with its digest.

    ``fields``: its top-level field names, which tell a malformed digest field
    from a missing one.
    """
    trailer = f',"{DIGEST_FIELD}":"xxh3_64:<16 hex digits>"}}'
    if DIGEST_FIELD in fields:
        problem = (
            f"has a malformed digest: the field '{DIGEST_FIELD}' must be the file's last bytes,"
        )
    else:
        problem = "has no digest: every manifest dcp_multilevel writes ends with"
    return ManifestDigestError(
        f"manifest {_where(checkpoint)} {problem} {trailer}. {_WHAT_TO_DO}", checkpoint=checkpoint
    )


# --------------------------------------------------------------------------- decode


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
