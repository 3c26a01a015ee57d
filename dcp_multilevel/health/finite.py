"""Counting non-finite values (NaN, infinity) in the bytes a save writes.

The writer counts each floating-point item's values as it hashes or codes
them (``plugin/writer.py``): the count runs on a slice of at most a MiB
just before the hash or the coder reads the same slice, so the bytes come
from memory once, not twice. On a CUDA tensor the count runs on the device
(:func:`count_on_device`), before the copy to the host.

A value is non-finite when every bit of its exponent field is set, so one
mask per dtype says it (:func:`rule_for`), for every float width.

The count is a native kernel (``_finite.c``: one vectorized pass, no
temporary, the GIL released; built for AVX2 too, which the loader picks
where the CPU has it). numpy's count (``count_nonzero`` of a masked compare)
makes two temporaries and two passes: counted before each slice's hash, it
slows hashing several times over, where the kernel costs a fraction of that.
In cache the kernel also counts faster than numpy's ``isfinite(a).all()``
and much faster than torch's ``isfinite`` (``benchmarks/bench_health.py``
measures what the checks cost a save). numpy stays as the fallback where no
C compiler built it (:data:`NATIVE` says which).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["NATIVE", "DeviceCount", "count", "count_on_device", "rule_for"]

try:
    from . import _finite as _native
except ImportError:  # no compiler at install: the numpy fallback
    _native = None  # type: ignore[assignment]

#: True when the native kernel counts (else numpy: same counts, slower).
NATIVE = _native is not None

#: dtype -> (element width in bytes, exponent mask): non-finite iff all its bits are set.
#: float8 ``fnuz`` types are left out: their one NaN is the bit pattern of -0.
_RULES: dict[torch.dtype, tuple[int, int]] = {
    torch.float64: (8, 0x7FF0000000000000),
    torch.float32: (4, 0x7F800000),
    torch.float16: (2, 0x7C00),
    torch.bfloat16: (2, 0x7F80),
    torch.complex128: (8, 0x7FF0000000000000),
    torch.complex64: (4, 0x7F800000),
    torch.complex32: (2, 0x7C00),
}
for _name, _rule in (
    ("float8_e4m3fn", (1, 0x7F)),  # no infinity; NaN is S.1111.111
    ("float8_e5m2", (1, 0x7C)),
    ("float8_e8m0fnu", (1, 0xFF)),
):
    if hasattr(torch, _name):
        _RULES[getattr(torch, _name)] = _rule

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def rule_for(dtype: torch.dtype) -> tuple[int, int] | None:
    """``(width, mask)`` for counting ``dtype``'s non-finite values; None: it has none."""
    return _RULES.get(dtype)


def count(data: memoryview | bytes, rule: tuple[int, int]) -> int:
    """Non-finite values in ``data`` (raw bytes of one dtype; ``rule`` from :func:`rule_for`).

    A trailing partial element (a slice cut mid-value) is not counted: the
    caller slices at multiples of the width.
    """
    width, mask = rule
    if _native is not None:
        return _native.count(data, width, mask)
    n = len(data) // width
    values = np.frombuffer(data, dtype=_UINT[width], count=n)
    m = _UINT[width](mask)
    return int(np.count_nonzero((values & m) == m))


class DeviceCount:
    """The non-finite values of a device tensor, counted on its device (:func:`count_on_device`).

    One reduction is queued on the tensor's stream: the infinity norm, which is
    NaN or infinite exactly when some value is, and needs no temporary the size
    of the tensor (a mask of it would take an eighth to a half of its memory
    again, on a device that may be full). :meth:`result` reads it once the
    device got there; only a poisoned tensor is counted value by value then.
    """

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t
        if t.is_complex():
            t = torch.view_as_real(t)
        if t.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            t = t.float()  # float8: no reduction kernel of its own on every device
        self._values = t
        self._norm = torch.linalg.vector_norm(t, float("inf")) if t.numel() else None

    def result(self) -> int:
        """The count (waits for the device; call it after the copy it rode along with)."""
        if self._norm is None or bool(torch.isfinite(self._norm)):
            return 0
        return int(torch.count_nonzero(~torch.isfinite(self._values)))


def count_on_device(t: torch.Tensor) -> DeviceCount | None:
    """Start counting the non-finite values of a device tensor on its device (before
    its copy to the host is queued); None for a dtype without non-finite values."""
    if rule_for(t.dtype) is None:
        return None
    return DeviceCount(t)
