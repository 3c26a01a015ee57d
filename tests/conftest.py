"""Shared by the tests: deterministic states covering every dtype, bit-exact checks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from dcp_multilevel.format.dtypes import DTYPE_BY_NAME

HERE = Path(__file__).parent
#: The folders of tests, by what they test (``tests/README.md``).
KINDS = ("unit", "multiprocess", "stacks")
# The helpers (``tests/_*.py``, this file) and the test modules of every folder
# import by their names, here and in every process a test starts (ranks, children).
_PATHS = [str(HERE), *(str(HERE / kind) for kind in KINDS)]
sys.path[:0] = [p for p in _PATHS if p not in sys.path]
os.environ["PYTHONPATH"] = os.pathsep.join([*_PATHS, os.environ.get("PYTHONPATH", "")])


def random_tensor(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Deterministic tensor of any dtype, random in every bit (fp8/complex32 included)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    numel = 1
    for s in shape:
        numel *= s
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert as_bytes(actual) == as_bytes(expected), f"{what}: bytes differ"


ALL_DTYPES = sorted(DTYPE_BY_NAME.values(), key=str)


@pytest.fixture
def all_dtypes_state():
    """A nested state with every storable dtype, 0-d, empty and non-tensor values."""
    state = {
        f"t_{str(d).split('.')[-1]}": random_tensor((3, 5), d, seed=i)
        for i, d in enumerate(ALL_DTYPES)
    }
    state["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    state["empty"] = torch.empty(0, 7)
    state["nested"] = {
        "layer": {"w": random_tensor((4, 4), torch.bfloat16, 99), "step": 12},
        "list": [random_tensor((2,), torch.int64, 98), "text", {"deep": 1.5}],
    }
    state["info"] = {"name": "run-1", "lr": 3e-4, "tags": ["a", "b"]}
    return state


def rank_errors(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions DCP wrapped into a CheckpointException."""
    return [failure[0] for failure in exc.failures.values()]


def install_fake_distribution(root, monkeypatch, name: str, entry_points: str, modules=None):
    """Put a fake installed distribution on sys.path, as a third-party package would be.

    ``entry_points`` is the text of its ``entry_points.txt``; ``modules`` maps
    module names to source code placed beside it. Refresh the registries after.
    """
    for module, source in (modules or {}).items():
        (root / f"{module}.py").write_text(source)
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)
    monkeypatch.syspath_prepend(str(root))
