"""CheckpointManager with delta levels (``Level(keyframe_every=...)``): chains on the
first level and on a drained level, retention that keeps every kept step
restorable, a damaged reference, and SIGKILL in the middle of delta saves and drains."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_bit_equal

from dcp_multilevel import CheckpointManager, ConfigError, Level
from dcp_multilevel.checkpoint import CheckpointRoot, StoredCheckpoint
from dcp_multilevel.checkpoint.verify import verify_checkpoint

HERE = Path(__file__).parents[1]  # tests/


def trained(step: int) -> dict:
    """The state after ``step`` small updates (deterministic: any step rebuilt alone)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 1000, generator=g)
    for s in range(step):
        w += torch.randn(300, 1000, generator=torch.Generator().manual_seed(s)) * 1e-4
    return {"w": w, "h": w[:100].to(torch.bfloat16), "meta": {"step": step}}


def blank() -> dict:
    return {
        "w": torch.zeros(300, 1000),
        "h": torch.zeros(100, 1000, dtype=torch.bfloat16),
        "meta": {"step": -1},
    }


def check(loaded: dict, step: int) -> None:
    expected = trained(step)
    assert_bit_equal(loaded["w"], expected["w"], "w")
    assert_bit_equal(loaded["h"], expected["h"], "h")
    assert loaded["meta"] == {"step": step}


def loads_each(mgr: CheckpointManager, steps) -> None:
    """Every step of ``steps`` loads bit-exact through ``mgr``."""
    for s in steps:
        loaded = blank()
        mgr.load(loaded, s)
        check(loaded, s)


def levels(l1: str, remote: str, **first) -> list[Level]:
    return [
        Level(l1, keep=2, **first),
        Level(remote, every=1, keep=4, codec="bytegroup", keyframe_every=3),
    ]


def manifest(root: Path, step: int) -> dict:
    return json.loads((root / f"step-{step}" / "manifest.json").read_text())


def reference(root: Path, step: int) -> str | None:
    ref = manifest(root, step).get("reference")
    return None if ref is None else ref["checkpoint"]


def test_first_level_chains_retention_and_every_kept_step_loads(tmp_path):
    l1 = tmp_path / "l1"
    level = Level(str(l1), keep=2, codec="bytegroup", keyframe_every=4, delta_against="previous")
    mgr = CheckpointManager([level])
    for s in range(10):
        m = mgr.save(trained(s), step=s)
        assert m.bytes_written > 0
    # keep=2 keeps 8 and 9; 9 is a delta of 8, which is the keyframe: nothing else needed
    assert [reference(l1, s) for s in mgr.steps(0)] == [None, "step-8"]
    assert mgr.steps(0) == [8, 9]
    loads_each(mgr, mgr.steps(0))
    mgr.close()


def test_keep_counts_restorable_checkpoints(tmp_path):
    l1 = tmp_path / "l1"
    level = Level(str(l1), keep=2, codec="bytegroup", keyframe_every=4, delta_against="previous")
    mgr = CheckpointManager([level])
    for s in range(7):
        mgr.save(trained(s), step=s)
    # 5 and 6 are kept; 6 -> 5 -> 4 (keyframe): 4 stays although keep=2
    assert mgr.steps(0) == [4, 5, 6]
    assert [reference(l1, s) for s in (4, 5, 6)] == [None, "step-4", "step-5"]
    mgr.close()
    # a restarted manager reads the references from the manifests
    again = CheckpointManager([level])
    loaded = blank()
    assert again.load_latest(loaded) == 6
    check(loaded, 6)
    again.save(trained(7), step=7)  # the chain goes on: 4 is its keyframe, 7 its 4th
    assert reference(l1, 7) == "step-6"
    again.save(trained(8), step=8)  # keyframe_every=4: a new keyframe
    assert reference(l1, 8) is None
    assert again.steps(0) == [4, 5, 6, 7, 8]  # 7 still needs 6, 5 and 4
    loads_each(again, again.steps(0))
    again.close()


def test_a_drained_level_stores_deltas_and_restores_alone(tmp_path):
    l1, remote = tmp_path / "l1", tmp_path / "remote"
    mgr = CheckpointManager(levels(str(l1), str(remote)), drain_policy="wait")
    for s in range(7):
        mgr.save(trained(s), step=s)
        mgr.wait()
    assert mgr.steps(1) == [3, 4, 5, 6]
    assert [reference(remote, s) for s in range(3, 7)] == [None, "step-3", "step-3", None]
    full = sum(manifest(remote, 6)["files"].values())
    for s in (4, 5):
        assert sum(manifest(remote, s)["files"].values()) < 0.8 * full
        assert any("ref" in i for i in manifest(remote, s)["items"])
    # The first level held no deltas (no codec): the drains coded them, reading
    # the reference from the first level while it had it, else from the remote.
    assert all(reference(l1, s) is None for s in mgr.steps(0))
    mgr.close()
    shutil.rmtree(l1)  # the node is gone: the remote alone restores every kept step
    fresh = CheckpointManager(levels(str(l1), str(remote)))
    loaded = blank()
    assert fresh.load_latest(loaded) == 6
    check(loaded, 6)
    loads_each(fresh, (3, 4, 5))
    fresh.close()


def test_deltas_on_both_levels_are_copied_verbatim(tmp_path):
    l1, remote = tmp_path / "l1", tmp_path / "remote"
    lv = levels(str(l1), str(remote), codec="bytegroup", keyframe_every=3)
    lv[0] = Level(str(l1), keep=4, codec="bytegroup", keyframe_every=3)
    mgr = CheckpointManager(lv, drain_policy="wait")
    for s in range(3):
        mgr.save(trained(s), step=s)
        mgr.wait()
    assert [reference(l1, s) for s in range(3)] == [None, "step-0", "step-0"]
    assert [reference(remote, s) for s in range(3)] == [None, "step-0", "step-0"]
    drains = [r for r in mgr.drain_results if r.committed]
    assert all(r.details["files_encoded"] == 0 for r in drains)  # every file verbatim
    shutil.rmtree(l1)
    loaded = blank()
    mgr.load(loaded, 2)
    check(loaded, 2)
    mgr.close()


def test_a_damaged_reference_makes_the_next_save_whole(tmp_path, caplog):
    l1 = tmp_path / "l1"
    level = Level(str(l1), codec="bytegroup", keyframe_every=8)
    mgr = CheckpointManager([level])
    mgr.save(trained(0), step=0)
    mgr.save(trained(1), step=1)
    assert reference(l1, 1) == "step-0"
    data = next((l1 / "step-0" / "data").glob("*.bin"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(raw)
    with caplog.at_level("WARNING", logger="dcp_multilevel"):
        mgr.save(trained(2), step=2)
    assert reference(l1, 2) is None  # whole, not against the damaged step 0
    assert "saving it whole" in caplog.text
    loaded = blank()
    assert mgr.load_latest(loaded) == 2
    check(loaded, 2)
    mgr.save(trained(3), step=3)
    assert reference(l1, 3) == "step-2"  # the new keyframe starts the chain
    mgr.close()


def test_a_broken_first_level_chain_falls_back_to_the_remote(tmp_path):
    l1, remote = tmp_path / "l1", tmp_path / "remote"
    lv = [Level(str(l1), keep=3, codec="bytegroup", keyframe_every=3), Level(str(remote))]
    mgr = CheckpointManager(lv, drain_policy="wait")
    for s in range(3):
        mgr.save(trained(s), step=s)
        mgr.wait()
    shutil.rmtree(l1 / "step-0")  # the keyframe steps 1 and 2 need
    loaded = blank()
    assert mgr.load_latest(loaded) == 2
    check(loaded, 2)
    assert any("remote" in url for url in mgr.last_load_sources)
    problems = verify_checkpoint(StoredCheckpoint.at(l1 / "step-2")).problems
    assert problems and {p.error for p in problems} == {"BrokenChainError"}
    mgr.close()


def test_delta_configuration_errors(tmp_path):
    with pytest.raises(ConfigError, match="give the level a codec"):
        Level(str(tmp_path), keyframe_every=4)
    with pytest.raises(ConfigError, match="delta_against"):
        Level(str(tmp_path), codec="zstd", keyframe_every=4, delta_against="oldest")
    with pytest.raises(ConfigError, match="keyframe_every"):
        Level(str(tmp_path), codec="zstd", keyframe_every=0)
    with pytest.raises(ConfigError, match="deltas are stored on store levels"):
        CheckpointManager(
            [
                Level(str(tmp_path / "l1")),
                Level(f"partner:{tmp_path}/p", replicas=2, codec="zstd", keyframe_every=3),
            ]
        )


def test_sigkill_during_delta_saves_and_drains_leaves_every_checkpoint_restorable(tmp_path):
    l1, remote = str(tmp_path / "l1"), str(tmp_path / "remote")
    rng = random.Random(3)
    for round_ in range(4):
        marker = tmp_path / f"marker-{round_}"
        log = tmp_path / f"child-{round_}.log"
        with log.open("w") as err:
            child = subprocess.Popen(
                [sys.executable, str(HERE / "_delta_child.py"), l1, remote, str(marker)],
                cwd=HERE,
                stderr=err,
            )
        try:
            deadline = time.monotonic() + 120
            while not marker.exists():
                assert child.poll() is None, (
                    f"child exited early with {child.returncode}: {log.read_text()[-3000:]}"
                )
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(rng.uniform(0.2, 1.5))  # somewhere inside a save or a drain
            assert child.poll() is None, f"child failed: {log.read_text()[-3000:]}"
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
        for root in (l1, remote):
            for step in CheckpointRoot(root).steps():
                result = verify_checkpoint(CheckpointRoot(root).checkpoint(step))
                assert result.ok, (root, step, result.problems)
    mgr = CheckpointManager(levels(l1, remote))
    saved = CheckpointRoot(l1).steps()
    assert saved, "no save committed"
    loads_each(mgr, sorted(set(saved) | set(CheckpointRoot(remote).steps())))
    mgr.close()


# --------------------------------------------------------------------------- several ranks


def _delta_levels(l1: str, remote: str) -> list[Level]:
    return [
        Level(l1, keep=3, codec="bytegroup", keyframe_every=3),
        Level(remote, codec="bytegroup", keyframe_every=3, delta_against="previous"),
    ]


def _ranks_save(rank: int, world: int, l1: str, remote: str) -> list[str | None]:
    # Replicated state: the balanced planner splits "w" into row chunks over the ranks.
    mgr = CheckpointManager(_delta_levels(l1, remote), drain_policy="wait")
    for s in range(2):
        mgr.save(trained(s), step=s)
        mgr.wait()
    mgr.close()
    # A restart: load_latest gives every rank the chains (rank 0 reads them); step 2
    # goes on with them.
    again = CheckpointManager(_delta_levels(l1, remote), drain_policy="wait")
    loaded = blank()
    assert again.load_latest(loaded) == 1
    check(loaded, 1)
    again.save(trained(2), step=2)
    again.wait()
    again.close()
    return [r.details.get("files_encoded") for r in again.drain_results]


def _ranks_load(rank: int, world: int, l1: str, remote: str) -> None:
    from dcp_multilevel import MultiLevelReader

    for root in (l1, remote):
        loaded = blank()
        torch.distributed.checkpoint.load(loaded, storage_reader=MultiLevelReader(f"{root}/step-2"))
        check(loaded, 2)


@pytest.mark.multiprocess
def test_deltas_saved_by_two_ranks_load_in_other_world_sizes(tmp_path):
    from _dist import run_ranks

    from dcp_multilevel import MultiLevelReader

    l1, remote = str(tmp_path / "l1"), str(tmp_path / "remote")
    run_ranks(_ranks_save, 2, l1, remote, timeout=240)
    for root in (Path(l1), Path(remote)):
        doc = manifest(root, 2)
        assert {f.split("/")[1].split("-")[0] for f in doc["files"]} == {"0", "1"}
        assert any("ref" in i for i in doc["items"])  # both ranks' shares are deltas
    assert reference(Path(remote), 2) == "step-1"  # previous-save references
    assert reference(Path(l1), 2) == "step-0"  # keyframe references
    # 2 -> 1: in this process, without a process group
    for root in (l1, remote):
        loaded = blank()
        torch.distributed.checkpoint.load(
            loaded, storage_reader=MultiLevelReader(f"{root}/step-2"), no_dist=True
        )
        check(loaded, 2)
    # 2 -> 3 ranks
    run_ranks(_ranks_load, 3, l1, remote, timeout=240)
