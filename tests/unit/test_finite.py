"""Counting non-finite values in raw bytes: the native kernel, its numpy fallback,
and the device count, against torch's own ``isfinite`` for every float dtype."""

from __future__ import annotations

import pytest
import torch
from _required import missing

from dcp_multilevel.format.tensor_bytes import byte_view
from dcp_multilevel.health import finite
from dcp_multilevel.health.finite import DeviceCount, count, count_on_device, rule_for

FLOATS = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
]
FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def _poisoned(dtype: torch.dtype, n: int = 1001) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n, generator=g, dtype=torch.float64) * 100
    base[7], base[500], base[1000] = float("nan"), float("inf"), float("-inf")
    return torch.complex(base, base.flip(0)).to(dtype) if dtype.is_complex else base.to(dtype)


def _expected(t: torch.Tensor) -> int:
    if t.is_complex():
        t = torch.view_as_real(t)
    return int((~torch.isfinite(t.float())).sum())


@pytest.mark.parametrize("dtype", FLOATS + FLOAT8, ids=str)
@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_counts_as_torch_does(dtype, native, monkeypatch):
    if native and not finite.NATIVE:
        missing("the native kernel (health/_finite.c) is not built here")
    if not native:
        monkeypatch.setattr(finite, "_native", None)
    t = _poisoned(dtype)
    want = _expected(t)
    assert want > 0
    assert count(byte_view(t), rule_for(dtype)) == want
    assert count(byte_view(torch.zeros(64, dtype=dtype)), rule_for(dtype)) == 0


def test_finite_extremes_are_not_counted():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        info = torch.finfo(dtype)
        t = torch.tensor([info.max, -info.max, info.tiny, 0.0, -0.0], dtype=dtype)
        assert count(byte_view(t), rule_for(dtype)) == 0


def test_dtypes_without_non_finite_values_have_no_rule():
    for dtype in (torch.int64, torch.uint8, torch.bool, torch.int8):
        assert rule_for(dtype) is None


@pytest.mark.parametrize("dtype", FLOATS + FLOAT8, ids=str)
def test_the_device_count_agrees(dtype):
    t = _poisoned(dtype)
    counted = count_on_device(t)  # (on the CPU here: the same kernels a device runs)
    assert isinstance(counted, DeviceCount)
    assert counted.result() == _expected(t)
    assert count_on_device(torch.ones(16, dtype=dtype)).result() == 0
    assert count_on_device(torch.ones(0, dtype=dtype)).result() == 0
    assert count_on_device(torch.arange(4)) is None
