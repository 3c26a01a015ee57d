"""Same state, two storage backends: stock ``FileSystemWriter`` and ours.

Saving one state with DCP's own filesystem storage and with dcp_multilevel,
then loading each with its own reader, must give identical tensors, bit for
bit (random bit patterns, so NaN payloads and signed zeros are covered), and
equal non-tensor values. Once in a single process without a process group,
once with two gloo ranks holding replicated tensors and DTensor shards.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import run_ranks
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dcp_multilevel import MultiLevelReader, MultiLevelWriter

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex128,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint64,
    torch.uint32,
    torch.uint16,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random in every bit (NaN payloads, -0.0, subnormals), bool as 0/1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _state() -> dict[str, Any]:
    """Every dtype, 0-d, empty, non-contiguous views, nested and non-tensor values."""
    base = _random((6, 8), torch.float32, seed=100)
    return {
        "dtypes": {
            str(d).removeprefix("torch."): _random((3, 5), d, i) for i, d in enumerate(DTYPES)
        },
        "scalar_f64": torch.tensor(-2.5, dtype=torch.float64),
        "scalar_bool": torch.tensor(True),
        "scalar_c64": torch.tensor(1 - 2j, dtype=torch.complex64),
        "empty": torch.empty(0, 7),
        "empty_bf16": torch.empty(4, 0, dtype=torch.bfloat16),
        "transposed": base.t(),  # non-contiguous
        "row_slice": base[2:4],  # a view on a larger storage
        "nested": {
            "layer": {"w": _random((4, 4), torch.bfloat16, 101), "step": 12},
            "mixed": [_random((2,), torch.int64, 102), "text", {"deep": 1.5}],
        },
        "info": {"name": "run-1", "lr": 3e-4, "tags": ["a", "b"], "epoch": 7},
    }


def _blank(value: Any) -> Any:
    """A load destination shaped like ``value`` but holding other values."""
    if isinstance(value, DTensor):
        return distribute_tensor(
            torch.zeros(value.shape, dtype=value.dtype), value.device_mesh, value.placements
        )
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_blank(v) for v in value]
    if isinstance(value, str):
        return ""
    return type(value)(-1)  # int, float


def _assert_same(actual: Any, expected: Any, where: str = "state") -> None:
    """Bit-exact tensors (full tensors of DTensors), equal everything else."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: got {type(actual).__name__}"
        if isinstance(expected, DTensor):
            assert isinstance(actual, DTensor), f"{where}: got a plain tensor"
            assert actual.placements == expected.placements, where
            actual, expected = actual.full_tensor(), expected.full_tensor()
        assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: {actual.shape} != {expected.shape}"
        a = actual.detach().contiguous().reshape(-1).view(torch.uint8)
        b = expected.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{where}: bytes differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: got {type(actual).__name__}"
        assert sorted(actual) == sorted(expected), where
        for key in expected:  # fixed order: full_tensor() is a collective
            _assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list), f"{where}: got {type(actual).__name__}"
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{where}[{i}]")
    else:
        assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _save_both_and_load(state: dict[str, Any], root: Path) -> dict[str, dict[str, Any]]:
    """Save ``state`` with the stock and our writer; load each with its own reader."""
    loaded = {}
    backends = {
        "stock": (FileSystemWriter, FileSystemReader),
        "ours": (MultiLevelWriter, MultiLevelReader),
    }
    for name, (writer, reader) in backends.items():
        dcp.save(state, storage_writer=writer(root / name))
        loaded[name] = _blank(state)
        dcp.load(loaded[name], storage_reader=reader(root / name))
    return loaded


def test_single_process_same_tensors_as_stock_filesystem(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    state = _state()
    loaded = _save_both_and_load(state, tmp_path)
    _assert_same(loaded["stock"], state, "stock")
    _assert_same(loaded["ours"], state, "ours")
    _assert_same(loaded["ours"], loaded["stock"], "ours-vs-stock")


def _two_rank_job(rank: int, world_size: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    state = _state()
    # Every rank builds the same full tensors; each keeps its own shard.
    state["sharded"] = {
        "rows": distribute_tensor(_random((7, 5), torch.float32, 200), mesh, [Shard(0)]),
        "cols": distribute_tensor(_random((3, 6), torch.bfloat16, 201), mesh, [Shard(1)]),
        "ids": distribute_tensor(_random((5,), torch.int64, 202), mesh, [Shard(0)]),
    }
    loaded = _save_both_and_load(state, Path(root))
    _assert_same(loaded["stock"], state, "stock")
    _assert_same(loaded["ours"], state, "ours")
    _assert_same(loaded["ours"], loaded["stock"], "ours-vs-stock")


@pytest.mark.multiprocess
def test_two_ranks_same_tensors_as_stock_filesystem(tmp_path: Path) -> None:
    run_ranks(_two_rank_job, 2, str(tmp_path))
