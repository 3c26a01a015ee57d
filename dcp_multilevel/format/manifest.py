"""The manifest: a versioned JSON document that commits one checkpoint.

A checkpoint exists iff its ``manifest.json`` exists: the writer publishes it
last, atomically. It holds everything ``StorageReader.read_metadata`` must
return (DCP's :class:`Metadata`: tensor shapes, dtypes, chunks, bytes items,
the planner's flatten mapping) and, per stored item, where its bytes are and
how to check them. It is JSON, not pickle: loading a checkpoint never runs code.

This module defines the document (:class:`Manifest`, :class:`ItemLocation`)
and encodes it. Its validating decoder, :func:`decode_manifest`, which treats
its input as hostile, is in ``manifest_decode.py`` (both are re-exported by
``format/__init__.py``).

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
before its value (``manifest_digest.py``): a reader checks it before it
parses anything else, and refuses a manifest without one.

A delta checkpoint (format version 2, written only when the checkpoint has
a reference) adds ``"reference": {"save_id": "<hex>", "checkpoint":
"step-8"}``: the checkpoint its delta chunks are coded against, a sibling
directory of this one (so a root moves or copies as a whole), and per item
whose frames hold delta chunks ``"ref": "xxh3_64:<hex>"``: the checksum
the reference's manifest records for the same item on the same level. A
load checks both before it trusts the reference's bytes (``docs/delta.md``).
Releases that read only version 1 refuse version 2 by its number, never by
misreading a delta as data.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from .._version import __version__
from ..errors import UnsupportedStateError
from .dtypes import dtype_name
from .health import Health
from .layout import MANIFEST_NAME, parse_step_dir
from .manifest_digest import DIGEST_FIELD, seal

__all__ = [
    "DELTA_FORMAT_VERSION",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ItemLocation",
    "Manifest",
    "Reference",
    "encode_manifest",
    "locations_to_json",
    "seal_manifest",
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
