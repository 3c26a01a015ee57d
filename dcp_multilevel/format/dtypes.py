"""The dtypes a checkpoint may hold, by their stable names.

Names are written into the manifest and parsed back through this table only
(never ``getattr(torch, name)`` on untrusted text).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedStateError

__all__ = ["DTYPE_BY_NAME", "dtype_from_name", "dtype_name"]

_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex128",
    "complex64",
    "complex32",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)

# Only the names this torch build knows: fp8 variants came in over releases.
DTYPE_BY_NAME: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}
_NAME_BY_DTYPE = {d: n for n, d in DTYPE_BY_NAME.items()}


def dtype_name(dtype: torch.dtype, *, fqn: str = "?") -> str:
    """Stable name of ``dtype``; raises UnsupportedStateError for e.g. quantized dtypes."""
    try:
        return _NAME_BY_DTYPE[dtype]
    except KeyError:
        raise UnsupportedStateError(
            f"tensor {fqn!r} has dtype {dtype}, which dcp_multilevel cannot store; "
            f"supported: {', '.join(sorted(DTYPE_BY_NAME))}. Convert it (e.g. dequantize) "
            "before saving."
        ) from None


def dtype_from_name(name: str) -> torch.dtype | None:
    """The dtype called ``name``, or None when the name is unknown."""
    return DTYPE_BY_NAME.get(name) if isinstance(name, str) else None
