"""Facts about one checkpoint computed from its manifest (no data read): sizes, codecs,
health."""

from __future__ import annotations

from typing import Any

from ..format import Manifest

__all__ = ["codecs_of", "health_facts", "raw_bytes", "stored_bytes", "summary"]


def stored_bytes(manifest: Manifest) -> int:
    """Bytes the checkpoint's data files take in the store."""
    return sum(manifest.files.values())


def raw_bytes(manifest: Manifest) -> int:
    """Bytes of the items once decoded (what a load hands DCP)."""
    return sum(loc.raw_length for loc in manifest.locations.values())


def codecs_of(manifest: Manifest) -> list[str]:
    """The codec descriptors items are stored with (sorted); ``[]`` when none is coded."""
    return sorted({t for loc in manifest.locations.values() for t in loc.transforms})


def health_facts(manifest: Manifest) -> dict[str, Any]:
    """The checkpoint's health as JSON-able values (``ls``, ``inspect`` and ``verify``
    share them): ``quarantined``, and ``health``, the manifest's record as it is
    stored (None: no record, a clean step saved without checks)."""
    return {
        "quarantined": manifest.quarantined,
        "health": None if manifest.health is None else manifest.health.to_json(),
    }


def summary(manifest: Manifest) -> dict[str, Any]:
    """One checkpoint's facts as JSON-able values (``ls`` and ``inspect`` share them)."""
    return {
        "save_id": manifest.save_id,
        "created_unix": manifest.created_unix,
        "world_size": manifest.world_size,
        "format_version": manifest.format_version,
        "plugin_version": manifest.plugin_version,
        "torch_version": manifest.torch_version,
        "stored_bytes": stored_bytes(manifest),
        "raw_bytes": raw_bytes(manifest),
        "codecs": codecs_of(manifest),
        "files": len(manifest.files),
        "items": len(manifest.locations),
        # A delta checkpoint needs this sibling to load (docs/delta.md).
        "delta_of": None if manifest.reference is None else manifest.reference.checkpoint,
        **health_facts(manifest),
    }
