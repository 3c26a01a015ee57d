"""On-disk format: manifest (JSON, versioned), data-file layout, checksums, dtypes.

Pure data handling: nothing here does I/O or knows about writers and readers.
"""

from .checksum import Hasher, checksum_of
from .dtypes import dtype_from_name, dtype_name
from .health import Finding, Health
from .layout import (
    DATA_DIR,
    MANIFEST_NAME,
    PLACEMENT_NAME,
    TMP_MARKER,
    checkpoint_url,
    data_file_path,
    is_rank_file,
    parse_step_dir,
    rank_files,
    rank_of_file,
    step_dir,
    validate_relpath,
)
from .manifest import (
    DELTA_FORMAT_VERSION,
    FORMAT_VERSION,
    ItemLocation,
    Manifest,
    Reference,
    decode_manifest,
    encode_manifest,
    locations_from_json,
    locations_to_json,
    seal_manifest,
)

__all__ = [
    "DATA_DIR",
    "DELTA_FORMAT_VERSION",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "PLACEMENT_NAME",
    "TMP_MARKER",
    "Finding",
    "Hasher",
    "Health",
    "ItemLocation",
    "Manifest",
    "Reference",
    "checkpoint_url",
    "checksum_of",
    "data_file_path",
    "decode_manifest",
    "dtype_from_name",
    "dtype_name",
    "encode_manifest",
    "is_rank_file",
    "locations_from_json",
    "locations_to_json",
    "parse_step_dir",
    "rank_files",
    "rank_of_file",
    "seal_manifest",
    "step_dir",
    "validate_relpath",
]
