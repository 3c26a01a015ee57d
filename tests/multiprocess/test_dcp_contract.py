"""Parts of DCP's storage contract that stock callers rely on (docs/interop.md, "Contract").

- ``io.BytesIO`` values come back as a BytesIO of the same bytes (stock: as
  they were given), through ``dcp.save``, ``dcp.async_save`` (thread and
  process executors) and ``CheckpointManager``, and are never unpickled by
  our reader.
- One save id from planning to the reader: ``storage_meta().save_id`` (what
  the planner sees) is ``writer.save_id``, the manifest's, the ``storage_meta``
  of the metadata ``dcp.save`` returns, and the reader's; readers carry a
  ``load_id`` that changes with ``reset``.
- A type the caller allowlisted with ``add_safe_globals`` saves under the
  PROCESS executor (the value check runs in DCP's daemon).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _allowlisted import RunInfo
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful

from dcp_multilevel import (
    BalancedSavePlanner,
    CheckpointManager,
    Level,
    MultiLevelReader,
    MultiLevelWriter,
)
from dcp_multilevel.errors import UnsupportedStateError
from dcp_multilevel.testing import run_ranks


class Trap:
    """Pickles as a call that creates ``path``: unpickling it would leave the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return open, (self.path, "w")


class TrainState(Stateful):
    """Like torchtitan's train state: a step and a loss history as torch.save bytes."""

    def __init__(self, step: int = 0, losses: list[float] | None = None) -> None:
        self.step = step
        self.losses = list(losses or [])

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        return {"step": torch.tensor(self.step), "losses": buf}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        sd["losses"].seek(0)
        self.losses = torch.load(sd["losses"], weights_only=True)


def _state(trap_file: str) -> dict[str, Any]:
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "train": TrainState(7, [2.5, 2.25, 2.0]),
        "blob": io.BytesIO(b"\x00raw bytes\xff" * 100),
        "hostile": io.BytesIO(pickle.dumps(Trap(trap_file))),
    }


def _fresh() -> dict[str, Any]:
    return {
        "w": torch.zeros(3, 4),
        "train": TrainState(),
        "blob": io.BytesIO(),
        "hostile": io.BytesIO(),
    }


def _check(back: dict[str, Any], want: dict[str, Any], trap_file: str) -> None:
    assert torch.equal(back["w"], want["w"])
    assert back["train"].step == 7 and back["train"].losses == [2.5, 2.25, 2.0]
    for key in ("blob", "hostile"):
        assert isinstance(back[key], io.BytesIO)
        assert back[key].getvalue() == want[key].getvalue()
    # The hostile value's bytes came back as bytes: nothing of ours unpickled them.
    assert not os.path.exists(trap_file)


@pytest.mark.parametrize("planner", [None, BalancedSavePlanner], ids=["default", "balanced"])
def test_bytesio_values_round_trip_as_their_bytes(tmp_path: Path, planner: Any) -> None:
    trap = str(tmp_path / "trap")
    sd = _state(trap)
    dcp.save(sd, storage_writer=MultiLevelWriter(tmp_path / "c"), planner=planner and planner())
    back = _fresh()
    dcp.load(back, storage_reader=MultiLevelReader(tmp_path / "c"))
    _check(back, sd, trap)
    # The data file holds the bytes as they are (no pickle around them).
    (data,) = (tmp_path / "c" / "data").iterdir()
    assert sd["blob"].getvalue() in data.read_bytes()


def test_bytesio_values_round_trip_through_the_manager(tmp_path: Path) -> None:
    trap = str(tmp_path / "trap")
    levels = [Level(str(tmp_path / "l1"), keep=2), Level(str(tmp_path / "l2"), every=1)]
    mgr = CheckpointManager(levels)
    sd = _state(trap)
    mgr.save(sd, step=3)
    mgr.wait()
    mgr.close()
    # Both levels' copies carry the stock hint (tools that probe for .metadata see them).
    hints = sorted(p.parent.relative_to(tmp_path) for p in tmp_path.rglob(".metadata"))
    assert [str(h) for h in hints] == ["l1/step-3", "l2/step-3"], hints
    shutil.rmtree(tmp_path / "l1")  # from the second level
    back = _fresh()
    assert CheckpointManager(levels).load_latest(back) == 3
    _check(back, sd, trap)


def _async_job(rank: int, world: int, root: str, mode: str) -> bool:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's PROCESS daemon rendezvous
    multiprocessing.current_process().daemon = False  # the daemon is a child of this rank
    trap = os.path.join(root, "trap")
    sd = _state(trap)
    fut = dcp.async_save(
        sd,
        storage_writer=MultiLevelWriter(os.path.join(root, "c")),
        async_checkpointer_type=AsyncCheckpointerType[mode],
    )
    sd["blob"].write(b"changed after async_save returned")
    fut.result()
    back = _fresh()
    dcp.load(back, storage_reader=MultiLevelReader(os.path.join(root, "c")))
    _check(back, _state(trap), trap)
    return True


@pytest.mark.parametrize("mode", ["THREAD", "PROCESS"])
def test_bytesio_values_round_trip_through_async_save(tmp_path: Path, mode: str) -> None:
    assert run_ranks(_async_job, 2, str(tmp_path), mode, timeout=180) == [True, True]


# ------------------------------------------------------------------ save and load ids


class _Recording(DefaultSavePlanner):
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:  # type: ignore[override]
        self.seen_save_id = storage_meta.save_id if storage_meta else None
        super().set_up_planner(state_dict, storage_meta, is_coordinator)


def test_one_save_id_from_planning_to_the_reader(tmp_path: Path) -> None:
    w = MultiLevelWriter(tmp_path / "a")
    assert w.storage_meta().save_id == w.storage_meta().save_id == w.save_id  # stable, as stock
    planner = _Recording()
    md = dcp.save({"x": torch.ones(2)}, storage_writer=w, planner=planner)
    r = MultiLevelReader(tmp_path / "a")
    read = r.read_metadata().storage_meta
    assert planner.seen_save_id == w.save_id == md.storage_meta.save_id == read.save_id
    assert read.checkpoint_id == md.storage_meta.checkpoint_id
    # The reader's load id: stable until reset, then new (as stock readers').
    assert read.load_id == r.load_id == r.read_metadata().storage_meta.load_id
    first = r.load_id
    r.reset()
    assert r.load_id != first and r.read_metadata().storage_meta.load_id == r.load_id
    # The same writer saving again: a new save gets a new id (ours name one save each).
    w2 = MultiLevelWriter(tmp_path / "b")
    dcp.save({"x": torch.ones(2)}, storage_writer=w2)
    one = w2.save_id
    dcp.save({"x": torch.ones(2)}, storage_writer=w2, checkpoint_id=tmp_path / "c")
    assert w2.save_id != one
    assert MultiLevelReader(tmp_path / "c").read_metadata().storage_meta.save_id == w2.save_id


# ------------------------------------------------------------------ allowlisted types


def _allowlist_job(rank: int, world: int, root: str, allow: bool) -> str:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    multiprocessing.current_process().daemon = False
    if allow:
        torch.serialization.add_safe_globals([RunInfo])
    sd = {"w": torch.ones(4), "info": RunInfo("run-1", 42)}
    path = os.path.join(root, "c")
    try:
        dcp.async_save(
            sd,
            storage_writer=MultiLevelWriter(path),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        ).result()
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return f"failed: {e}"
    back = {"w": torch.zeros(4), "info": None}
    dcp.load(back, storage_reader=MultiLevelReader(path))
    assert back["info"] == RunInfo("run-1", 42)
    return "loaded"


def test_an_allowlisted_type_saves_under_the_process_executor(tmp_path: Path) -> None:
    assert run_ranks(_allowlist_job, 1, str(tmp_path / "a"), True, timeout=180) == ["loaded"]
    # Not allowlisted: refused in the daemon, with the advice to allowlist it.
    (out,) = run_ranks(_allowlist_job, 1, str(tmp_path / "b"), False, timeout=180)
    assert out.startswith("failed:") and "add_safe_globals" in out, out


def test_writer_refuses_a_value_it_could_not_load_back(tmp_path: Path) -> None:
    with pytest.raises(BaseException) as err:  # DCP wraps it in a CheckpointException
        dcp.save({"info": RunInfo("x", 1)}, storage_writer=MultiLevelWriter(tmp_path / "c"))
    text = str(err.value)
    assert UnsupportedStateError.__name__ in text and "add_safe_globals" in text, text
    assert not (tmp_path / "c" / "manifest.json").exists()
