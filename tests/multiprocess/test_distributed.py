"""Real multi-process saves and loads: gloo process groups, DTensors, resharding.

Every scenario starts processes of their own (see ``_dist.run_ranks``); these
scenarios were grouped when each process cost seconds to import torch, so one
job checks several things:

* ``saved_by_2`` / ``saved_by_4``: save replicated + sharded state with 2 and 4
  ranks; every rank checks the commit (only rank 0 writes the one manifest),
  the data layout, a same-world-size load, and that a save failing on rank 1
  commits nothing and leaves the previous checkpoint intact. The 4-rank job
  also loads the 2-rank checkpoint (2 -> 4).
* ``test_reshard_load``: load both checkpoints with 2 and 3 ranks, and with
  one process and no process group (DTensors loaded as plain full tensors).

All data is seeded, so every process rebuilds the expected full tensors on its
own and compares them bit for bit (NaN, -0.0 and infinities included).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import RankError, run_ranks
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from dcp_multilevel import MultiLevelReader, MultiLevelWriter

pytestmark = pytest.mark.multiprocess

SEED = 20250611

# name -> (shape, dtype, placement when saved, placement when loaded)
SHARDED: dict[str, tuple[tuple[int, ...], torch.dtype, Placement, Placement]] = {
    # Saved row-sharded, loaded column-sharded: resharding across dimensions.
    "row": ((8, 12), torch.float32, Shard(0), Shard(1)),
    "col": ((5, 12), torch.bfloat16, Shard(1), Shard(1)),
    # 7 rows: 4+3 over 2 ranks, 3+3+1 over 3, 2+2+2+1 over 4.
    "uneven": ((7, 3), torch.float64, Shard(0), Shard(0)),
    # 5 rows over 4 ranks is 2+2+1+0: the last rank holds an empty shard.
    "short": ((5, 2), torch.int64, Shard(0), Shard(0)),
    # Replicated DTensor (DCP stores it once), loaded as shards.
    "replicated": ((3, 4), torch.int32, Replicate(), Shard(0)),
}

# data/<rank>-<n>.<token>.bin: the n-th file of one rank's save (format/layout.py).
_DATA_FILE = re.compile(r"^(?P<rank>\d+)-(?P<n>\d+)\.(?P<token>[0-9a-f]+)\.bin$")


# --------------------------------------------------------------------------- states


def _replicated_state() -> dict[str, Any]:
    """What every rank holds in full: a small model's state and plain objects."""
    g = torch.Generator().manual_seed(SEED)
    weight = torch.randn(16, 8, generator=g)
    weight[0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), float("-inf")])
    return {
        "model": {
            "encoder.weight": weight,
            "encoder.bias": torch.randn(16, generator=g),
            "embed.weight": torch.randn(10, 4, generator=g).to(torch.bfloat16),
            "norm.running_var": torch.rand(16, generator=g, dtype=torch.float64),
            "norm.num_batches_tracked": torch.tensor(42),  # 0-d int64
            "vocab_ids": torch.randint(-(2**40), 2**40, (6,), generator=g),
        },
        "meta": {"epoch": 3, "name": "run-a", "lrs": [0.1, 0.01]},
    }


def _full(name: str) -> torch.Tensor:
    """The full (unsharded) value of ``SHARDED[name]``."""
    shape, dtype, _, _ = SHARDED[name]
    g = torch.Generator().manual_seed(SEED + 1 + sorted(SHARDED).index(name))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _state_to_save(mesh: DeviceMesh) -> dict[str, Any]:
    state = _replicated_state()
    state["sharded"] = {
        name: distribute_tensor(_full(name), mesh, [placement])
        for name, (_, _, placement, _) in SHARDED.items()
    }
    return state


def _state_to_load(mesh: DeviceMesh | None) -> dict[str, Any]:
    """Zeroed destinations: DTensors on ``mesh``, or plain full tensors when None."""
    state = _replicated_state()
    state["model"] = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    state["meta"] = {"epoch": -1, "name": "", "lrs": [0.0]}
    sharded: dict[str, Any] = {}
    for name, (shape, dtype, _, placement) in SHARDED.items():
        zeros = torch.zeros(shape, dtype=dtype)
        sharded[name] = zeros if mesh is None else distribute_tensor(zeros, mesh, [placement])
    state["sharded"] = sharded
    return state


# --------------------------------------------------------------------------- checks


def _assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    # Compare bytes: torch.equal says NaN != NaN and -0.0 == 0.0.
    a = actual.detach().contiguous().reshape(-1).view(torch.uint8)
    b = expected.detach().contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(a, b), f"{what}: bytes differ"


def _assert_loaded(state: dict[str, Any]) -> None:
    """``state`` (from ``_state_to_load``, after dcp.load) holds the saved values.

    Collective when ``state`` holds DTensors (``full_tensor``): every rank must
    call it, and the fixed key order keeps the collectives matched.
    """
    expected = _replicated_state()
    assert sorted(state["model"]) == sorted(expected["model"])
    for key, value in expected["model"].items():
        _assert_bit_equal(state["model"][key], value, f"model.{key}")
    assert state["meta"] == expected["meta"]
    for name, (_, _, _, placement) in SHARDED.items():
        got = state["sharded"][name]
        if isinstance(got, DTensor):
            assert got.placements == (placement,), f"sharded.{name}: {got.placements}"
            got = got.full_tensor()
        _assert_bit_equal(got, _full(name), f"sharded.{name}")


def _load_and_check(ckpt: Path, mesh: DeviceMesh | None, thread_count: int = 1) -> None:
    state = _state_to_load(mesh)
    dcp.load(state, storage_reader=MultiLevelReader(ckpt, thread_count=thread_count))
    _assert_loaded(state)


def _check_layout(ckpt: Path, world_size: int) -> list[str]:
    """One manifest; data only as ``data/<rank>-<n>.<token>.bin``, all named by it.

    Returns the file names without their token (``<rank>-<n>``), sorted.
    """
    manifests = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*manifest*"))
    assert manifests == ["manifest.json"], manifests
    assert sorted(os.listdir(ckpt)) == [".metadata", "data", "manifest.json"]  # + stock hint
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == world_size
    names = sorted(os.listdir(ckpt / "data"))
    on_disk = {f"data/{n}": (ckpt / "data" / n).stat().st_size for n in names}
    assert on_disk == manifest["files"]  # no stray, temporary or missing files
    matches = [_DATA_FILE.match(n) for n in names]
    assert all(matches), names
    tokens: dict[int, set[str]] = {}
    for m in matches:
        assert m is not None
        tokens.setdefault(int(m["rank"]), set()).add(m["token"])
    # Every rank holds shards of its own, so every rank wrote at least one
    # file; the files of one rank's save share its token.
    assert sorted(tokens) == list(range(world_size)), names
    assert all(len(t) == 1 for t in tokens.values()), names
    return sorted(f"{m['rank']}-{m['n']}" for m in matches if m)


def _digest(paths: list[Path]) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(paths)}


class _Unpicklable:
    """A state_dict value whose ``torch.save`` fails (on purpose, during write_data)."""

    def __reduce__(self) -> Any:
        raise RuntimeError("_Unpicklable refuses to be pickled")


class _SpyWriter(MultiLevelWriter):
    """Counts ``finish`` calls: the one place a manifest is written."""

    finish_calls = 0

    def finish(self, metadata: Any, results: Any) -> None:
        self.finish_calls += 1
        super().finish(metadata, results)


def _check_failed_saves(rank: int, ckpt: Path, fresh: Path, mesh: DeviceMesh) -> str:
    """A save failing on rank 1 raises everywhere and commits nothing.

    Tried at ``fresh`` (nothing there before) and over the committed ``ckpt``
    with ``overwrite=True``. Returns the manifest's sha256, unchanged by them.
    """
    manifest = ckpt / "manifest.json"
    before = manifest.read_bytes()
    old_data = _digest(list(ckpt.glob("data/*")))
    dist.barrier()  # nobody starts failing before everyone has looked
    for target, overwrite in ((fresh, False), (ckpt, True)):
        state = _state_to_save(mesh)
        if rank == 1:
            state["extra"] = _Unpicklable()
        writer = _SpyWriter(target, overwrite=overwrite, thread_count=1, sync_files=True)
        with pytest.raises(CheckpointException) as info:
            dcp.save(state, storage_writer=writer)
        assert info.value.args[0] == "write", str(info.value)  # failed in write_data
        assert set(info.value.failures) == {1}, str(info.value)
        assert "_Unpicklable refuses to be pickled" in str(info.value)
        assert writer.finish_calls == 0
    assert not (fresh / "manifest.json").exists()
    with pytest.raises(CheckpointException) as info:
        dcp.load(_state_to_load(mesh), storage_reader=MultiLevelReader(fresh))
    # torch 2.13 wraps read_metadata's error (CheckpointNotFoundError) into an
    # AssertionError of its own; our message survives in the text.
    assert "no committed checkpoint at file://" in str(info.value)
    assert "manifest.json is missing" in str(info.value)
    assert manifest.read_bytes() == before
    # The data the manifest names is untouched (the failed save's own data
    # files are garbage for the next commit to sweep).
    manifest_files = [ckpt / f for f in json.loads(before)["files"]]
    assert _digest(manifest_files) == old_data
    _load_and_check(ckpt, mesh)
    return hashlib.sha256(before).hexdigest()


# --------------------------------------------------------------------------- rank jobs


def _save_job(
    rank: int, world_size: int, root: str, thread_count: int, also_load: tuple[str, ...]
) -> dict[str, Any]:
    ckpt, fresh = Path(root) / "ckpt", Path(root) / "never-committed"
    mesh = init_device_mesh("cpu", (world_size,))
    writer = _SpyWriter(ckpt, overwrite=False, thread_count=thread_count, sync_files=True)
    dcp.save(_state_to_save(mesh), storage_writer=writer)
    # dcp.save returns on every rank only after the coordinator committed.
    assert writer.finish_calls == (1 if rank == 0 else 0)
    files = _check_layout(ckpt, world_size)
    _load_and_check(ckpt, mesh, thread_count=2)
    manifest_sha = _check_failed_saves(rank, ckpt, fresh, mesh)
    for other in also_load:
        _load_and_check(Path(other), mesh)
    return {"finish_calls": writer.finish_calls, "files": files, "manifest_sha": manifest_sha}


def _load_job(rank: int, world_size: int, ckpts: tuple[str, ...]) -> int:
    mesh = init_device_mesh("cpu", (world_size,))
    for ckpt in ckpts:
        _load_and_check(Path(ckpt), mesh)
    return rank


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError(f"planted failure on rank {rank} of {world_size}")
    dist.barrier()  # rank 0 waits for a peer that is gone


# --------------------------------------------------------------------------- tests


class Saved(NamedTuple):
    root: Path
    reports: list[dict[str, Any]]

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"


@pytest.fixture(scope="module")
def saved_by_2(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    root = tmp_path_factory.mktemp("saved-by-2")
    # Two writer threads per rank: files <rank>-0.<token>.bin and <rank>-1.<token>.bin.
    return Saved(root, run_ranks(_save_job, 2, str(root), 2, ()))


@pytest.fixture(scope="module")
def saved_by_4(tmp_path_factory: pytest.TempPathFactory, saved_by_2: Saved) -> Saved:
    root = tmp_path_factory.mktemp("saved-by-4")
    return Saved(root, run_ranks(_save_job, 4, str(root), 1, (str(saved_by_2.ckpt),)))


def test_two_ranks_save_commit_once_and_reload(saved_by_2: Saved) -> None:
    assert [r["finish_calls"] for r in saved_by_2.reports] == [1, 0]
    files = ["0-0", "0-1", "1-0", "1-1"]
    assert [r["files"] for r in saved_by_2.reports] == [files] * 2


def test_four_ranks_save_commit_once_reload_and_load_two_rank_checkpoint(
    saved_by_4: Saved,
) -> None:
    assert [r["finish_calls"] for r in saved_by_4.reports] == [1, 0, 0, 0]
    files = ["0-0", "1-0", "2-0", "3-0"]
    assert [r["files"] for r in saved_by_4.reports] == [files] * 4


@pytest.mark.parametrize("fixture", ["saved_by_2", "saved_by_4"])
def test_failure_on_one_rank_commits_nothing(request: pytest.FixtureRequest, fixture: str) -> None:
    saved: Saved = request.getfixturevalue(fixture)
    assert not (saved.root / "never-committed" / "manifest.json").exists()
    # The committed checkpoint every rank saw before the failed overwrite is
    # still the one on disk (and the ranks loaded it after the failure).
    current = hashlib.sha256((saved.ckpt / "manifest.json").read_bytes()).hexdigest()
    assert {r["manifest_sha"] for r in saved.reports} == {current}


# One rank is covered without spawning: test_load_in_one_process_without_process_group.
@pytest.mark.parametrize("world_size", [2, 3])
def test_reshard_load(saved_by_2: Saved, saved_by_4: Saved, world_size: int) -> None:
    ckpts = (str(saved_by_4.ckpt), str(saved_by_2.ckpt))
    assert run_ranks(_load_job, world_size, ckpts) == list(range(world_size))


def test_load_in_one_process_without_process_group(saved_by_2: Saved, saved_by_4: Saved) -> None:
    """4 -> 1 and 2 -> 1, in the test process itself (DCP's no-process-group path)."""
    assert not dist.is_initialized()
    for saved in (saved_by_2, saved_by_4):
        _load_and_check(saved.ckpt, mesh=None)  # DTensors come back as plain full tensors


def test_harness_reports_the_failing_rank() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(_fail_on_rank_1, 2, timeout=60)
    assert 1 in info.value.failures
    assert "ValueError: planted failure on rank 1 of 2" in info.value.failures[1]
    assert "rank 1 failed:\nTraceback (most recent call last):" in str(info.value)


def _rank_env_and_pid(rank: int, world_size: int) -> tuple[str | None, int]:
    return os.environ.get("DCP_ML_TEST_MARKER"), os.getpid()


def test_harness_ranks_see_the_callers_environment_now_and_are_new_processes(monkeypatch):
    # The fork server may have started before this test (with an older
    # environment): each rank must still see the caller's environment of now.
    run_ranks(_rank_env_and_pid, 1, timeout=60)
    monkeypatch.setenv("DCP_ML_TEST_MARKER", "set after the server started")
    first = run_ranks(_rank_env_and_pid, 2, timeout=60)
    monkeypatch.delenv("DCP_ML_TEST_MARKER")
    second = run_ranks(_rank_env_and_pid, 2, timeout=60)
    assert [env for env, _ in first] == ["set after the server started"] * 2
    assert [env for env, _ in second] == [None, None]
    pids = [pid for _, pid in first + second]
    assert len(set(pids)) == 4 and os.getpid() not in pids
