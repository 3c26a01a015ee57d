"""The state stored in tests/golden/: deterministic, small, every dtype family."""

from __future__ import annotations

import torch


def golden_state() -> dict:
    """The state every golden checkpoint but the delta pair's holds.

    ``sq`` is an Adam ``exp_avg_sq``-like positive tensor, whose planes take
    bytegroup's third plane method (a split with a constant sign), and
    ``pruned`` a tensor of mostly zeros, whose planes are stored sparse.
    """
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(64, 48, generator=g) * 0.02
    return {
        "model": {
            "w": w,
            "w_bf16": w.to(torch.bfloat16),
            "w_fp16": w.to(torch.float16),
            "w_fp64": w.double(),
            "bias": torch.linspace(-1, 1, 48),
            "ids": torch.arange(-50, 50, dtype=torch.int64),
            "mask": torch.arange(30) % 3 == 0,
            "small": torch.arange(256, dtype=torch.uint8),
            "fp8": (w[:8] * 10).to(torch.float8_e4m3fn),
            "complex": torch.complex(w[:4], -w[4:8]),
            "scalar": torch.tensor(0.5),
            "empty": torch.empty(0, 4),
            "sq": (w * w).contiguous(),
            # Mostly zeros (|w| under 1.5 sigma): sparse planes.
            "pruned": torch.where(w.abs() > 0.03, w, 0.0),
        },
        "step": 42,
        "info": {"name": "golden", "lr": 3e-4, "tags": ["a", "b"]},
    }


def golden_delta_states() -> tuple[dict, dict]:
    """The two checkpoints of ``tests/golden/0.1.0-delta``: ``step-0`` (whole) and
    ``step-1`` (format version 2, its floats stored as deltas against ``step-0``)."""
    first = golden_state()
    second = golden_state()
    g = torch.Generator().manual_seed(99)
    for key in ("w", "sq"):
        t = first["model"][key]
        second["model"][key] = t + torch.randn(t.shape, generator=g) * 1e-4
    second["model"]["w_bf16"] = second["model"]["w"].to(torch.bfloat16)
    second["step"] = 43
    return first, second
