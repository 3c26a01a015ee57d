"""What the examples share and is not about checkpointing: a bit-for-bit comparison of
state dicts, byte sizes for humans, and a clean exit under torchrun."""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import torch

__all__ = ["diff_tree", "exit_now", "human"]


def diff_tree(expected: Any, actual: Any, path: str) -> list[str]:
    """Paths where ``actual`` differs from ``expected``; tensors must be bit-identical."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{path}: expected a tensor, got {type(actual).__name__}"]
        if expected.dtype != actual.dtype or expected.shape != actual.shape:
            return [
                f"{path}: {expected.dtype}{list(expected.shape)} vs "
                f"{actual.dtype}{list(actual.shape)}"
            ]
        # Bits, not values: torch.equal calls NaN unequal to itself and -0.0 equal to 0.0.
        bits = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (expected, actual)]
        return [] if torch.equal(*bits) else [f"{path}: values differ"]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or expected.keys() != actual.keys():
            return [f"{path}: keys differ"]
        return [d for k in expected for d in diff_tree(expected[k], actual[k], f"{path}[{k!r}]")]
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(expected) != len(actual):
            return [f"{path}: {expected!r} vs {actual!r}"]
        return [
            d
            for i, (e, a) in enumerate(zip(expected, actual, strict=True))
            for d in diff_tree(e, a, f"{path}[{i}]")
        ]
    return [] if expected == actual else [f"{path}: {expected!r} vs {actual!r}"]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def exit_now(status: int) -> NoReturn:
    """Leave with ``status`` without interpreter teardown.

    With torch 2.13 (CPU, gloo), about one run in 20 aborts *after* all work is
    done and the process group destroyed: native teardown at exit hits
    "terminate called without an active exception" (SIGABRT, no Python frame
    on any thread). Nothing is left to clean up by then.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
