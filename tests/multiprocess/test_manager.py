"""CheckpointManager: levels, intervals, retention, drains, fallback, node loss, crashes."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import _faulty_fs
import pytest
import torch
import torch.distributed as dist
import xxhash
from _dist import run_ranks
from conftest import assert_bit_equal

from dcp_multilevel import (
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    DrainError,
    Level,
)
from dcp_multilevel.checkpoint import CheckpointRoot

HERE = Path(__file__).parents[1]  # tests/


def state(v: int) -> dict:
    g = torch.Generator().manual_seed(v)
    return {
        "w": torch.randn(256, 256, generator=g) * 0.02,
        "b": torch.arange(1000) + v,
        "meta": {"step": v},
    }


def blank() -> dict:
    return {
        "w": torch.zeros(256, 256),
        "b": torch.zeros(1000, dtype=torch.long),
        "meta": {"step": -1},
    }


def check(loaded: dict, v: int) -> None:
    expected = state(v)
    assert_bit_equal(loaded["w"], expected["w"], "w")
    assert_bit_equal(loaded["b"], expected["b"], "b")
    assert loaded["meta"] == {"step": v}


def memory_url() -> str:
    return f"memory://dcp-ml-{uuid.uuid4().hex[:8]}/run"


def test_first_tier_only_keeps_the_newest_and_loads_latest(tmp_path):
    mgr = CheckpointManager([Level(str(tmp_path / "l1"), keep=2)])
    assert mgr.load_latest(blank()) is None  # fresh start
    for s in range(1, 6):
        m = mgr.save(state(s), step=s)
        assert m.bytes_written > 256 * 256 * 4 and m.blocked_seconds > 0
    assert mgr.steps(0) == [4, 5]
    loaded = blank()
    assert mgr.load_latest(loaded) == 5
    check(loaded, 5)
    mgr.close()


def test_remote_every_second_save_survives_losing_the_node(tmp_path):
    remote = memory_url()
    levels = [Level(str(tmp_path / "l1"), keep=1), Level(remote, every=2, codec="bytegroup")]
    mgr = CheckpointManager(levels, drain_policy="wait")
    for s in range(1, 5):
        m = mgr.save(state(s), step=s)
        assert m.drains_started == ([remote] if s % 2 == 0 else [])
    results = mgr.wait()
    assert [r.step for r in results if r.committed] == [2, 4]
    assert all(r.lag_seconds > 0 and r.bytes_stored > 0 for r in results if r.committed)
    assert mgr.steps(1) == [2, 4]
    assert mgr.steps(0) == [4]  # step 3 is not due remotely: retention may drop it
    manifest = json.loads(mgr.drivers[1].root.store.read_bytes("step-4/manifest.json"))
    w = next(i for i in manifest["items"] if i["fqn"] == "w")
    assert w["transforms"] == ["dcp_multilevel.bytegroup/4"] and w["length"] < w["raw_length"]
    mgr.close()

    shutil.rmtree(tmp_path / "l1")  # the node is replaced: its disk is empty
    fresh = CheckpointManager(levels)
    loaded = blank()
    assert fresh.load_latest(loaded) == 4
    check(loaded, 4)
    assert fresh.last_load_sources == {f"{remote}/step-4": 3}
    fresh.close()


def test_a_remote_only_manager(tmp_path):
    mgr = CheckpointManager([Level(memory_url(), codec="zstd")])
    mgr.save(state(7), step=7)
    loaded = blank()
    assert mgr.load_latest(loaded) == 7
    check(loaded, 7)
    mgr.close()


def test_corrupt_first_tier_falls_back_to_remote_and_says_so(tmp_path, caplog):
    remote = memory_url()
    mgr = CheckpointManager([Level(str(tmp_path / "l1")), Level(remote)], drain_policy="wait")
    mgr.save(state(3), step=3)
    mgr.wait()
    manifest = json.loads((tmp_path / "l1" / "step-3" / "manifest.json").read_text())
    w = next(i for i in manifest["items"] if i["fqn"] == "w")
    data = tmp_path / "l1" / "step-3" / w["file"]
    raw = bytearray(data.read_bytes())
    raw[w["pos"] + 100] ^= 0xFF
    data.write_bytes(raw)
    loaded = blank()
    with caplog.at_level(logging.WARNING, logger="dcp_multilevel"):
        assert mgr.load_latest(loaded) == 3
    check(loaded, 3)
    assert f"reading it from {remote}/step-3" in caplog.text
    assert mgr.last_load_sources[f"{remote}/step-3"] == 1
    mgr.close()


def test_a_missing_requested_step_is_an_error_never_a_fresh_start(tmp_path):
    mgr = CheckpointManager([Level(str(tmp_path / "l1"))])
    mgr.save(state(1), step=1)
    with pytest.raises(CheckpointNotFoundError) as info:
        mgr.load(blank(), step=9)
    assert str(info.value).startswith(
        f"step 9 has no complete checkpoint on any level ({tmp_path / 'l1'}: [1] are the newest"
    )
    mgr.close()


def test_configuration_errors():
    with pytest.raises(ConfigError, match="step must be a non-negative integer, got -1"):
        CheckpointManager([Level("/tmp/x", every=2)]).step({}, -1)
    with pytest.raises(ConfigError, match=r"keep must be None or an integer >= 1"):
        Level("/tmp/x", keep=0)


def test_remote_down_keeps_training_and_the_first_tier_and_reports_it(tmp_path):
    down = dict(
        retries=0, skip_instance_cache=True, fail_first={"put_file": 10**9, "pipe_file": 10**9}
    )
    remote = Level("faulty://down/run", storage_options=down)
    mgr = CheckpointManager([Level(str(tmp_path / "l1"), keep=1), remote], drain_policy="wait")
    for s in (1, 2, 3):
        mgr.save(state(s), step=s)
    with pytest.raises(DrainError) as info:
        mgr.wait()
    assert str(info.value).startswith(
        "step 1 to faulty://down/run: RemoteStoreError: remote store:"
    )
    assert str(info.value).endswith("The first level still holds these checkpoints.")
    assert [r.step for r in mgr.drain_results if r.error] == [1, 2, 3]
    assert mgr.steps(0) == [1, 2, 3]  # keep=1, but nothing is on the remote yet
    mgr.close()


def test_flaky_remote_succeeds_after_retries(tmp_path):
    flaky = dict(
        retries=20,
        backoff=0.0,
        skip_instance_cache=True,
        seed=3,
        fail_rate={"put_file": 0.4, "pipe_file": 0.4, "info": 0.2},
    )
    root = f"faulty://flaky-{uuid.uuid4().hex[:6]}/run"
    mgr = CheckpointManager([Level(str(tmp_path / "l1")), Level(root, storage_options=flaky)])
    mgr.save(state(5), step=5)
    mgr.wait()
    assert mgr.steps(1) == [5]
    shutil.rmtree(tmp_path / "l1")
    loaded = blank()
    assert mgr.load_latest(loaded) == 5
    check(loaded, 5)
    mgr.close()


def test_skip_policy_skips_a_step_while_a_drain_runs_and_retention_spares_inflight(tmp_path):
    slow = dict(skip_instance_cache=True, delay={"put_file": 0.5})
    remote = Level(f"faulty://slow-{uuid.uuid4().hex[:6]}/run", storage_options=slow)
    mgr = CheckpointManager([Level(str(tmp_path / "l1"), keep=1), remote], drain_policy="skip")
    first = mgr.save(state(1), step=1)
    second = mgr.save(state(2), step=2)  # step 1 is still draining
    assert first.drains_started == [remote.url]
    assert second.drains_skipped == [remote.url]
    assert 1 in mgr.steps(0)  # keep=1, but step 1 is being drained
    mgr.wait()
    assert mgr.steps(1) == [1]
    assert [r.skipped for r in mgr.drain_results] == [True, False]
    mgr.save(state(3), step=3)
    mgr.wait()
    assert mgr.steps(0) == [3]  # step 2 was skipped on purpose: no longer protected
    mgr.close()


@pytest.mark.slow
def test_sigkill_during_a_drain_then_the_next_run_drains_again(tmp_path):
    l1, remote_dir = tmp_path / "l1", tmp_path / "remote"
    marker = tmp_path / "marker"
    child = subprocess.Popen(
        [sys.executable, str(HERE / "_drain_child.py"), str(l1), str(remote_dir), str(marker)]
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, f"child exited early with {child.returncode}"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)  # the upload of step 2 has begun (the gate)
    finally:
        child.kill()
        child.wait()
    remote = Level(
        f"faulty://{remote_dir}/run",
        storage_options={"target_protocol": "file", "target_options": {"auto_mkdir": True}},
    )
    mgr = CheckpointManager([Level(str(l1)), remote])
    assert mgr.steps(1) == [1]  # step 2 never committed remotely
    loaded = blank()
    assert mgr.load_latest(loaded) == 2  # from the first level, then re-drains step 2
    check(loaded, 2)
    mgr.wait()
    assert mgr.steps(1) == [1, 2]
    mgr.close()


def _replicated(s: int) -> dict:
    # Equal on every rank (data parallel); two tensors so that both ranks write data.
    return {"a": state(1)["w"] + s, "c": state(2)["w"] + s}


def _two_rank_job(rank: int, world: int, l1: str, remote: str) -> None:
    levels = [Level(l1, keep=1), Level(remote, codec="bytegroup")]
    mgr = CheckpointManager(levels, drain_policy="wait")
    for s in (1, 2):
        mgr.save(_replicated(s), step=s)
    mgr.wait()  # on every rank: returns once rank 0 committed the remote manifest
    assert mgr.steps(1) == [1, 2]
    mgr.close()


def _two_rank_load(rank: int, world: int, l1: str, remote: str) -> None:
    levels = [Level(l1, keep=1), Level(remote, codec="bytegroup")]
    mgr = CheckpointManager(levels)
    loaded = {"a": torch.zeros(256, 256), "c": torch.zeros(256, 256)}
    assert mgr.load_latest(loaded) == 2
    expected = _replicated(2)
    assert torch.equal(loaded["a"], expected["a"]) and torch.equal(loaded["c"], expected["c"])
    mgr.close()


@pytest.mark.multiprocess
def test_two_ranks_drain_together_and_load_from_remote_after_node_loss(tmp_path):
    l1, remote = str(tmp_path / "l1"), str(tmp_path / "remote")
    run_ranks(_two_rank_job, 2, l1, remote, timeout=180)
    manifest = json.loads((Path(remote) / "step-2" / "manifest.json").read_text())
    writers = {f.split("/")[1].split("-")[0] for f in manifest["files"]}
    assert writers == {"0", "1"}  # each rank drained its own data files
    shutil.rmtree(l1)
    run_ranks(_two_rank_load, 2, l1, remote, timeout=180)


def test_a_remote_failing_or_stalling_every_call_never_stalls_or_breaks_save(tmp_path):
    # save() must not need the remote: a dead one fails every call, a stalled one
    # holds every call until the test opens its gate, after the saves. Each call
    # records its thread: none may come from the thread that saves.
    ops = ("info", "ls", "cat_file", "pipe_file", "put_file", "rm", "rm_file", "open")
    gate = tmp_path / "gate"
    dead = dict(retries=0, fail_rate=dict.fromkeys(ops, 1.0))
    stalled = dict(wait_for=dict.fromkeys(ops, str(gate)))
    for name, faults in [("dead", dead), ("stalled", stalled)]:
        tag = f"{name}-{uuid.uuid4().hex[:6]}"
        options = {**faults, "record": tag, "skip_instance_cache": True}
        remote = Level(f"faulty://{tag}/run", storage_options=options)
        # No sweep at construction: it lists every level, the remote too, by design.
        mgr = CheckpointManager(
            [Level(str(tmp_path / name), keep=1), remote], sweep_older_than_s=None
        )
        for s in (1, 2):
            mgr.save(state(s), step=s)  # never raises for the remote's sake
        assert mgr.steps(0)[-1] == 2
        saver = threading.current_thread().name
        assert [op for op, thread in _faulty_fs.CALLS.get(tag, []) if thread == saver] == []
        gate.touch()
        if name == "dead":
            with pytest.raises(DrainError):
                mgr.close()
        else:
            mgr.close()
            assert mgr.steps(1) == [1, 2]


# --------------------------------------------------------------------------- node-local L1


def _node_dir(root: str, rank: int) -> str:
    # Two "nodes": each rank's first level is its own directory, invisible to the other.
    return f"{root}/node{rank}/l1"


def _node_local_job(rank: int, world: int, root: str, remote: str) -> None:
    levels = [Level(_node_dir(root, rank), keep=1), Level(remote, keep=2)]
    mgr = CheckpointManager(levels, drain_policy="wait")
    for s in (1, 2, 3):
        mgr.save(_replicated(s), step=s)
        mgr.wait()  # the drain needs rank 0's manifest, which only rank 0's node has
    assert [r.committed for r in mgr.drain_results] == [True] * 3
    if rank == 0:  # rank 0 applies the remote's retention after the commit others wait for
        assert mgr.steps(1) == [2, 3]
    assert mgr.steps(0) == ([3] if rank == 0 else [])  # manifests: on rank 0's node only
    assert sorted(Path(_node_dir(root, rank)).iterdir()) == [Path(_node_dir(root, rank), "step-3")]
    mgr.close()


def _node_local_load(rank: int, world: int, root: str, remote: str, step: int) -> dict[str, int]:
    levels = [Level(_node_dir(root, rank), keep=1), Level(remote, keep=2)]
    mgr = CheckpointManager(levels)
    loaded = {"a": torch.zeros(256, 256), "c": torch.zeros(256, 256)}
    assert mgr.load_latest(loaded) == step
    expected = _replicated(step)
    assert_bit_equal(loaded["a"], expected["a"], "a")
    assert_bit_equal(loaded["c"], expected["c"], "c")
    mgr.close()
    return mgr.last_load_sources


@pytest.mark.multiprocess
def test_node_local_first_tier_drains_and_loads_then_survives_losing_a_node(tmp_path):
    root, remote = str(tmp_path), str(tmp_path / "remote")
    run_ranks(_node_local_job, 2, root, remote, timeout=180)
    assert not (Path(_node_dir(root, 1)) / "step-3" / "manifest.json").exists()
    manifest = json.loads((Path(remote) / "step-3" / "manifest.json").read_text())
    assert {f.split("/")[1].split("-")[0] for f in manifest["files"]} == {"0", "1"}

    # Both nodes up: each rank reads its own files from its node, the rest from remote.
    sources = run_ranks(_node_local_load, 2, root, remote, 3, timeout=180)
    for rank, used in enumerate(sources):
        l1 = f"file://{_node_dir(root, rank)}/step-3"
        assert set(used) == {l1, f"file://{remote}/step-3"} and used[l1] >= 1

    shutil.rmtree(Path(_node_dir(root, 1)).parent)  # node 1 is replaced: an empty disk
    sources = run_ranks(_node_local_load, 2, root, remote, 3, timeout=180)
    assert set(sources[1]) == {f"file://{remote}/step-3"}


def _skip_together(rank: int, world: int, root: str) -> list[list[str]]:
    # Rank 0 applies the remote's retention after each commit; a slow listing keeps
    # its drain busy after rank 1's has ended. Each rank deciding alone, rank 0 would
    # skip step 2 and rank 1 would wait forever for rank 0's share of it.
    options = {
        "target_protocol": "file",
        "target_options": {"auto_mkdir": True},
        "delay": {"ls": 2.0},
        "skip_instance_cache": True,
    }
    remote = Level(f"faulty://{root}/remote", storage_options=options)
    mgr = CheckpointManager(
        [Level(_node_dir(root, rank)), remote], drain_timeout_s=30, drain_policy="skip"
    )
    first = mgr.save(_replicated(1), step=1)
    # The gate: rank 1's drain has ended (polling its outcome, bounded), while rank
    # 0's is still listing the remote (2 s); then both save again.
    deadline = time.monotonic() + 30
    while rank == 1 and not mgr.drain_results:
        assert time.monotonic() < deadline, "rank 1's drain of step 1 never ended"
        time.sleep(0.01)
    dist.barrier()
    second = mgr.save(_replicated(2), step=2)
    mgr.wait()
    mgr.close()
    return [first.drains_skipped, second.drains_skipped]


@pytest.mark.multiprocess
def test_every_rank_follows_rank_0s_skip_decision(tmp_path):
    skipped = run_ranks(_skip_together, 2, str(tmp_path), timeout=120)
    remote = f"faulty://{tmp_path}/remote"
    assert skipped == [[[], [remote]], [[], [remote]]]
    assert (tmp_path / "remote" / "step-1" / "manifest.json").exists()
    assert not (tmp_path / "remote" / "step-2").exists()


def _node_local_only(rank: int, world: int, root: str) -> str:
    mgr = CheckpointManager([Level(_node_dir(root, rank))])
    mgr.save(_replicated(1), step=1)
    with pytest.raises(CheckpointNotFoundError) as info:
        mgr.load_latest({"a": torch.zeros(256, 256), "c": torch.zeros(256, 256)})
    mgr.close()
    return str(info.value)


@pytest.mark.multiprocess
def test_node_local_steps_no_rank_set_can_read_are_an_error_not_a_fresh_start(tmp_path):
    messages = run_ranks(_node_local_only, 2, str(tmp_path), timeout=180)
    for rank, message in enumerate(messages):
        assert re.fullmatch(
            re.escape(
                "committed checkpoints exist (newest: step 1), but for each of them some rank "
                f"cannot reach all of its data files on {_node_dir(str(tmp_path), rank)} (a "
                "node-local level on a lost or new node?) and no higher level holds it (node 0 "
                "(ranks [0]) lacks 1 file(s) of step 1 that no node holds and no level can "
                "rebuild (e.g. data/1-0.@.bin); node 1 (ranks [1]) lacks 1 file(s) of step 1 "
                "that no node holds and no level can rebuild (e.g. data/0-0.@.bin)). Restore "
                "the nodes' disks, or start fresh deliberately with a new level location."
            ).replace("@", "[0-9a-f]+"),
            message,
        ), message


# --------------------------------------------------------------------------- drain copies


@pytest.mark.parametrize(
    ("l1_codec", "remote_codec", "verbatim"),
    [(None, None, True), ("bytegroup", "bytegroup", True), (None, "bytegroup", False)],
)
def test_drain_copies_files_verbatim_when_the_codecs_agree(
    tmp_path, l1_codec, remote_codec, verbatim
):
    remote = memory_url()
    levels = [Level(str(tmp_path / "l1"), codec=l1_codec), Level(remote, codec=remote_codec)]
    mgr = CheckpointManager(levels, drain_policy="wait")
    mgr.save(state(4), step=4)
    (result,) = mgr.wait()
    assert result.committed and result.gbps > 0
    assert (result.details["files_verbatim"] > 0, result.details["files_encoded"] > 0) == (
        verbatim,
        not verbatim,
    )
    ours = json.loads((tmp_path / "l1" / "step-4" / "manifest.json").read_text())
    theirs = json.loads(mgr.drivers[1].root.store.read_bytes("step-4/manifest.json"))
    assert ours["save_id"] == theirs["save_id"]
    if verbatim:  # same bytes at the same offsets, under new file names
        strip = [{k: v for k, v in i.items() if k != "file"} for i in ours["items"]]
        assert strip == [{k: v for k, v in i.items() if k != "file"} for i in theirs["items"]]
    mgr.close()
    shutil.rmtree(tmp_path / "l1")
    fresh = CheckpointManager(levels)
    loaded = blank()
    assert fresh.load_latest(loaded) == 4
    check(loaded, 4)
    fresh.close()


def test_a_recoding_drain_writes_outputs_that_grow_from_small_to_the_cap(tmp_path, monkeypatch):
    # Small first outputs start the uploads early; later ones grow to the cap.
    from dcp_multilevel.checkpoint import copy

    monkeypatch.setattr(copy, "PART_FIRST", 32 << 10)
    monkeypatch.setattr(copy, "PART_BYTES", 128 << 10)
    g = torch.Generator().manual_seed(3)
    sd = {f"t{i:02d}": torch.randn(64, 64, generator=g) for i in range(40)}  # 16 KiB each
    levels = [Level(str(tmp_path / "l1")), Level(memory_url(), codec="bytegroup")]
    mgr = CheckpointManager(levels, drain_policy="wait")
    mgr.save(sd, step=1)
    (result,) = mgr.wait()
    assert result.committed and result.details["files_encoded"] == 7
    items = json.loads(mgr.drivers[1].root.store.read_bytes("step-1/manifest.json"))["items"]
    raw: dict[int, int] = {}  # output number (data/<rank>-<n>.<token>.bin) -> raw bytes
    for item in items:
        n = int(re.fullmatch(r"data/0-(\d+)\.\w+\.bin", item["file"]).group(1))
        raw[n] = raw.get(n, 0) + item["raw_length"]
    assert [raw[n] for n in sorted(raw)] == [s << 10 for s in (32, 64, 128, 128, 128, 128, 32)]
    mgr.close()
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    fresh = CheckpointManager(levels[1:])
    assert fresh.load_latest(out) == 1
    for k, v in sd.items():
        assert_bit_equal(out[k], v, k)
    fresh.close()


@pytest.mark.parametrize("source_kind", ["local", "memory"])
@pytest.mark.parametrize("codec", [None, "bytegroup"])
def test_a_drain_refuses_to_copy_an_item_corrupted_on_the_first_tier(tmp_path, source_kind, codec):
    from dcp_multilevel import MultiLevelWriter
    from dcp_multilevel.checkpoint import StoredCheckpoint
    from dcp_multilevel.errors import ChecksumMismatchError
    from dcp_multilevel.levels import DrainJob, driver_for, run_one
    from dcp_multilevel.stores import store_for

    src = str(tmp_path / "l1" / "step-1") if source_kind == "local" else memory_url() + "/step-1"
    import torch.distributed.checkpoint as dcp

    dcp.save(state(1), storage_writer=MultiLevelWriter(src))
    source = store_for(src)
    manifest = json.loads(source.read_bytes("manifest.json"))
    w = next(i for i in manifest["items"] if i["fqn"] == "w")
    data = bytearray(source.read_bytes(w["file"]))
    data[w["pos"] + 7] ^= 0x10
    with source.open_write(w["file"]) as f:
        f.write(data)
    target = Level(str(tmp_path / "remote"), codec=codec)
    with pytest.raises(ChecksumMismatchError) as info:
        job = DrainJob(1, StoredCheckpoint.at(src), driver_for(target), "corrupt", time.time())
        run_one(job, timeout_s=30)
    start, end = w["pos"], w["pos"] + w["length"]
    assert str(info.value) == (
        f"checksum mismatch for item 'w' in {w['file']!r} of checkpoint {source.url} "
        f"(bytes {start}..{end}): stored {w['checksum']}, read "
        f"xxh3_64:{xxhash.xxh3_64_hexdigest(bytes(data[start:end]))}. The data is corrupt; "
        "load from another copy."
    )
    step_dir = tmp_path / "remote" / "step-1"
    assert not (step_dir / "manifest.json").exists()
    if codec is None and source_kind == "local":  # the upload it overlapped was removed
        assert list((step_dir / "data").iterdir()) == []


# --------------------------------------------------------------------------- metrics, sweep


def test_metrics_are_streamed_to_a_callback_and_a_json_lines_file(tmp_path):
    records = []
    path = tmp_path / "metrics" / "rank{rank}.jsonl"
    levels = [Level(str(tmp_path / "l1")), Level(memory_url(), every=2, codec="bytegroup")]
    mgr = CheckpointManager(
        levels, drain_policy="wait", metrics_path=str(path), on_metrics=records.append
    )
    for s in (1, 2):
        mgr.save(state(s), step=s)
    mgr.wait()
    mgr.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in lines] == [("save", 1), ("save", 2), ("drain", 2)]
    assert [r["step"] for r in records] == [1, 2, 2]
    save, drained = lines[1], lines[2]
    assert save["level"] == levels[0].url and save["rank"] == 0
    assert save["bytes"] == mgr.metrics[1].bytes_written > 256 * 256 * 4
    assert save["blocked_seconds"] >= save["seconds"] > 0 and save["gbps"] > 0
    assert save["drains_started"] == [levels[1].url]
    assert drained["level"] == levels[1].url and drained["committed"] is True
    assert 0 < drained["bytes"] < drained["bytes_read"]  # compressed on the remote
    assert drained["seconds"] > 0 and drained["lag_seconds"] > 0 and drained["gbps"] > 0
    assert drained["files_encoded"] >= 1 and drained["error"] is None


def test_a_failing_metrics_callback_never_breaks_a_save(tmp_path, caplog):
    def broken(record):
        raise RuntimeError("dashboard down")

    mgr = CheckpointManager([Level(str(tmp_path / "l1"))], on_metrics=broken)
    with caplog.at_level(logging.WARNING, logger="dcp_multilevel"):
        mgr.save(state(1), step=1)
    assert "the on_metrics callback failed: RuntimeError('dashboard down')" in caplog.text
    mgr.close()


def test_abandoned_spool_and_temporary_files_are_swept(tmp_path):
    import os

    spool, l1 = tmp_path / "spool", tmp_path / "l1"
    (l1 / "step-1" / "data").mkdir(parents=True)
    spool.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    files = {
        "dead_old": spool / f"dcp-ml-spool-{dead_pid}-abc",
        "alive_old": spool / f"dcp-ml-spool-{os.getpid()}-def",
        "dead_new": spool / f"dcp-ml-spool-{dead_pid}-ghi",
        "other": spool / "unrelated-file",
        "tmp_old": l1 / "step-1" / "data" / "0-0.x.bin.tmp-123456",
        "tmp_new": l1 / "step-1" / "manifest.json.tmp-654321",
    }
    old = time.time() - 7200
    for name, f in files.items():
        f.write_bytes(b"x")
        if name.endswith("old") or name == "other":
            os.utime(f, (old, old))
    remote = Level(memory_url(), storage_options={"spool_dir": str(spool)})
    # A dry run (gc --dry-run) lists what the sweep removes and removes nothing.
    listed = CheckpointRoot(str(l1)).sweep(3600, dry_run=True)
    listed += CheckpointRoot(remote.url, remote.storage_options).sweep(3600, dry_run=True)
    assert sorted(listed) == sorted(["step-1/data/0-0.x.bin.tmp-123456", str(files["dead_old"])])
    assert all(f.exists() for f in files.values())
    CheckpointManager([Level(str(l1)), remote], sweep_older_than_s=3600).close()
    gone = {name for name, f in files.items() if not f.exists()}
    assert gone == {"dead_old", "tmp_old"}


def test_a_remote_first_tier_drains_verbatim_by_streaming(tmp_path):
    # The source has no local path: files are streamed in blocks and verified on the way.
    levels = [Level(memory_url()), Level(str(tmp_path / "archive"))]
    mgr = CheckpointManager(levels, drain_policy="wait")
    mgr.save(state(6), step=6)
    (result,) = mgr.wait()
    assert result.committed and result.details["files_verbatim"] >= 1
    mgr.close()
    fresh = CheckpointManager([Level(str(tmp_path / "archive"))])
    loaded = blank()
    assert fresh.load_latest(loaded) == 6
    check(loaded, 6)
    fresh.close()


def _two_managers_job(rank: int, world: int, root: str) -> list[bool]:
    import time as time_

    from dcp_multilevel.levels import store

    out = []
    for name in ("a", "b"):  # the same steps, other roots, one process group
        if name == "b" and rank == 0:  # rank 0 commits late: nobody may finish before it
            copy = store.copy_rank_files
            store.copy_rank_files = lambda *a, copy=copy: (time_.sleep(1.5), copy(*a))[1]
        mgr = CheckpointManager(
            [Level(f"{root}/{name}/l1"), Level(f"{root}/{name}/remote")], drain_policy="wait"
        )
        mgr.save({"w": torch.full((32, 32), 7.0)}, step=1)  # (replicas: equal)
        done = all(r.committed and r.error is None for r in mgr.wait())
        # A finished drain means "on the level": its manifest is there.
        out.append(done and os.path.exists(f"{root}/{name}/remote/step-1/manifest.json"))
        mgr.close()
    return out


@pytest.mark.multiprocess
def test_two_managers_in_one_process_group_drain_apart(tmp_path):
    # Drains agree through the c10d store, which every manager of the group shares:
    # manager b's ranks must not take manager a's values (its commit, its manifest).
    assert run_ranks(_two_managers_job, 2, str(tmp_path), timeout=180) == [[True, True]] * 2


def test_a_load_reports_its_phases_and_sources_in_the_metrics(tmp_path):
    # A public record of where a load's time went (benchmarks read it; no patching).
    l1, remote = tmp_path / "l1", memory_url()
    mgr = CheckpointManager([Level(str(l1)), Level(remote)])
    mgr.save(state(3), step=3)
    mgr.close()
    shutil.rmtree(l1)
    records: list[dict] = []
    again = CheckpointManager([Level(str(l1)), Level(remote)], on_metrics=records.append)
    loaded = blank()
    assert again.load_latest(loaded) == 3
    check(loaded, 3)
    again.close()
    (load,) = [r for r in records if r["kind"] == "load"]
    assert load["step"] == 3 and load["sources"] == again.last_load_sources
    assert list(load["sources"]) == [f"{remote}/step-3"]
    assert load["plan_seconds"] > 0 and load["read_seconds"] > 0
