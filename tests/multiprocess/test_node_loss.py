"""Levels between nodes: partner copies and erasure parity restore a lost node.

Real processes (gloo), real files: each simulated node is a directory
(``DCP_ML_NODE`` per process, ``{node}`` in the level paths), and losing a
node is deleting its directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
from pathlib import Path

import pytest
import torch
from _damage import flip_byte

from dcp_multilevel import CheckpointManager, Level
from dcp_multilevel.errors import CheckpointNotFoundError
from dcp_multilevel.testing.levels import bit_equal
from tests._dist import RankError, run_ranks

pytestmark = pytest.mark.multiprocess


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(256, 256, generator=g),
        "b": torch.randn(4096, generator=g).to(torch.bfloat16),
        "layers": {str(i): torch.randn(64, 128, generator=g) for i in range(6)},
        "step": step,
    }


def _blank() -> dict:
    return {
        "w": torch.zeros(256, 256),
        "b": torch.zeros(4096, dtype=torch.bfloat16),
        "layers": {str(i): torch.zeros(64, 128) for i in range(6)},
        "step": -1,
    }


def _levels(root: str, kind: str, options: dict, remote: bool = False) -> list[Level]:
    levels = [
        Level(f"{root}/n{{node}}/l1", keep=2),
        Level(f"{kind}:{root}/n{{node}}/{kind}", keep=2, **options),
    ]
    if remote:  # a store every node reaches (a shared path stands in for s3://)
        levels.append(Level(f"{root}/remote", keep=2))
    return levels


def _save_job(
    rank: int,
    world: int,
    root: str,
    per_node: int,
    kind: str,
    options: dict,
    steps: list[int],
    remote: bool = False,
) -> list[dict]:
    os.environ["DCP_ML_NODE"] = str(rank // per_node)
    mgr = CheckpointManager(_levels(root, kind, options, remote), drain_policy="wait")
    for step in steps:
        metrics = mgr.save(_state(step), step=step)
        assert metrics.drains_started  # in the background: save returned after the first level
    results = mgr.wait()
    mgr.close()
    last = [r for r in results if r.step == steps[-1]]
    assert last and all(r.committed and r.error is None for r in last), results
    return [r.record(rank) for r in last]


def _load_job(
    rank: int,
    world: int,
    root: str,
    per_node: int,
    kind: str,
    options: dict,
    remote: bool = False,
) -> tuple[int | None, bool, dict, dict | str]:
    """(step, bit-exact, what the restore brought, the reader's sources or the error)."""
    os.environ["DCP_ML_NODE"] = str(rank // per_node)
    return load_latest_report(_levels(root, kind, options, remote), _state)


def load_latest_report(levels: list[Level], state_of) -> tuple[int | None, bool, dict, dict | str]:
    """A new manager's ``load_latest`` into a blank state: (step, bit-exact against
    ``state_of(step)``, what the restore brought, the reader's sources or the error).
    ``close()`` waits for the copies a restore makes again."""
    mgr = CheckpointManager(levels)
    state = _blank()
    try:
        step = mgr.load_latest(state)
    except CheckpointNotFoundError as e:
        mgr.close()
        return None, False, {}, str(e)
    mgr.close()
    received = mgr.last_restore.received if mgr.last_restore else {}
    exact = bit_equal(state, state_of(step)) if step is not None else False
    return step, exact, received, mgr.last_load_sources


def _flip_byte(path) -> None:
    flip_byte(path, path.stat().st_size // 2, 0x40)


def test_partner_level_restores_a_replaced_node_and_a_shrunk_world(tmp_path):
    root = str(tmp_path)
    opts = {"replicas": 2}
    records = run_ranks(_save_job, 4, root, 2, "partner", opts, [1, 2, 3], timeout=240)
    # Metrics per level: the receiving ranks stored bytes, every rank sent its files.
    partner = [r for rank in records for r in rank if r["level"].startswith("partner:")]
    assert len(partner) == 4 and all(r["bytes"] > 0 and r["bytes_sent"] > 0 for r in partner)
    # Retention per node (keep=2), and node 1 holds copies of node 0's files and
    # its own files (hard links).
    for node in (0, 1):
        assert sorted(p.name for p in (tmp_path / f"n{node}/partner").iterdir()) == [
            "step-2",
            "step-3",
        ]
    held = sorted(p.name.split("-")[0] for p in (tmp_path / "n1/partner/step-3/data").iterdir())
    assert held == ["0", "1", "2", "3"]
    assert (tmp_path / "n1/partner/step-3/manifest.json").exists()
    shutil.rmtree(tmp_path / "n1")  # node 1 is lost with its disk; a new one replaces it
    out = run_ranks(_load_job, 4, root, 2, "partner", opts, timeout=240)
    assert [o[:2] for o in out] == [(3, True)] * 4, "not bit-exact"
    # The replaced node got node 1's files from the copies on node 0, and node 0's
    # from node 0's first level; node 0 linked node 1's copies into its first level.
    assert out[2][2] == {
        f"partner:{root}/n{{node}}/partner (node 0)": 2,
        f"{root}/n{{node}}/l1 (node 0)": 2,
    }, out[2][2]
    assert out[0][2] == {f"partner:{root}/n{{node}}/partner (this node)": 2}, out[0][2]
    # The replaced node's first level holds its files again.
    names = sorted(p.name[:2] for p in (tmp_path / "n1/l1/step-3/data").iterdir())
    assert names == ["0-", "1-", "2-", "3-"]

    # Fewer ranks: the job restarts with 2 ranks, one on node 0 and one on a new,
    # empty node 1; DCP reshards from the restored files.
    shutil.rmtree(tmp_path / "n1")
    out = run_ranks(_load_job, 2, root, 1, "partner", opts, timeout=240)
    assert [o[:2] for o in out] == [(3, True), (3, True)]


def _ring_load_job(rank: int, world: int, root: str, per_node: int, kind: str, options: dict):
    os.environ["DCP_ML_RING_NODES"] = "0"  # rings from 2 nodes on (default: where faster)
    return _load_job(rank, world, root, per_node, kind, options)


@pytest.mark.parametrize(
    ("kind", "opts", "nodes", "per_node"),
    [("partner", {"replicas": 2}, 3, 2), ("erasure", {"data": 2, "parity": 1}, 4, 1)],
)
def test_replicated_state_goes_around_a_ring_onto_every_node(tmp_path, kind, opts, nodes, per_node):
    # Replicated state spread over every rank: every node needs every node's files.
    # Node 1 replaced; the files go around a ring (levels/restore_plan.py), node to node, the
    # replaced node's own ones entering it first (copied from its partner, or rebuilt).
    root, world = str(tmp_path), nodes * per_node
    run_ranks(_save_job, world, root, per_node, kind, opts, [1, 2], timeout=240)
    shutil.rmtree(tmp_path / "n1")
    out = run_ranks(_ring_load_job, world, root, per_node, kind, opts, timeout=240)
    assert [o[:2] for o in out] == [(2, True)] * world, out
    ring = f"{root}/n{{node}}/l1 (around a ring of {nodes} nodes)"
    by_node = [out[n * per_node][2] for n in range(nodes)]
    assert all(got.get(ring, 0) > 0 for got in by_node), by_node
    # No point-to-point copies besides the replaced node's entries.
    assert all(
        all("(node " not in source for source in got) for n, got in enumerate(by_node) if n != 1
    ), by_node
    files = sorted(p.name for p in (tmp_path / "n0/l1/step-2/data").iterdir())
    assert sorted(p.name for p in (tmp_path / "n1/l1/step-2/data").iterdir()) == files


def test_a_restore_onto_a_replaced_node_protects_the_step_again(tmp_path):
    # After node 1 is replaced and restored, the partner copies it held for node
    # 0 are made again in the background (mgr.close() waits for them): losing
    # node 0 next, and node 1's first level, with no save in between, still
    # restores bit-exact, from them alone. (Rank 0's node held the step's first-
    # level manifest: it is written there again by that restore.)
    root, opts = str(tmp_path), {"replicas": 2}
    run_ranks(_save_job, 4, root, 2, "partner", opts, [1], timeout=240)
    shutil.rmtree(tmp_path / "n1")
    out = run_ranks(_load_job, 4, root, 2, "partner", opts, timeout=240)
    assert [o[:2] for o in out] == [(1, True)] * 4
    held = sorted(p.name[:2] for p in (tmp_path / "n1/partner/step-1/data").iterdir())
    assert held == ["0-", "1-", "2-", "3-"]
    assert (tmp_path / "n1/partner/step-1/manifest.json").exists()
    shutil.rmtree(tmp_path / "n0")
    shutil.rmtree(tmp_path / "n1" / "l1")
    out = run_ranks(_load_job, 4, root, 2, "partner", opts, timeout=240)
    assert [o[:2] for o in out] == [(1, True)] * 4
    assert out[0][2] == {f"partner:{root}/n{{node}}/partner (node 1)": 4}, out[0][2]
    assert out[2][2] == {f"partner:{root}/n{{node}}/partner (this node)": 4}, out[2][2]
    assert (tmp_path / "n0/l1/step-1/manifest.json").exists()


def test_erasure_level_rebuilds_any_lost_node(tmp_path):
    root = str(tmp_path)
    opts = {"data": 2, "parity": 1}
    run_ranks(_save_job, 3, root, 1, "erasure", opts, [1, 2], timeout=240)
    # Groups: nodes {0, 1} with parity on node 2; node {2} with parity on node 0.
    assert sorted(p.name for p in (tmp_path / "n2/erasure/step-2/parity").iterdir()) == [
        "0-2.bin",
        "group-0.json",
        "group-1.json",
    ]
    saved = tmp_path.parent / f"{tmp_path.name}-saved"
    shutil.copytree(tmp_path, saved)
    for lost in (0, 2):  # a member of group 0; its parity node (also group 1's member)
        # A restore adds files to the survivors too: start over each time.
        shutil.rmtree(tmp_path)
        shutil.copytree(saved, tmp_path)
        shutil.rmtree(tmp_path / f"n{lost}")
        out = run_ranks(_load_job, 3, root, 1, "erasure", opts, timeout=240)
        assert [o[:2] for o in out] == [(2, True)] * 3, (lost, out)
        # The lost member is rebuilt once, on the first node that needs it; the
        # other nodes copy the rebuilt files from there.
        rebuilt = [o[2] for o in out if any("rebuilt" in source for source in o[2])]
        assert len(rebuilt) == 1, (lost, [o[2] for o in out])


def test_files_are_forwarded_by_nodes_that_received_them_in_the_same_restore(tmp_path):
    # Replicated state on 4 nodes, RS(2+1), node 1 replaced: every node needs every
    # node's file. The replaced node held nothing before the restore, so any file
    # another node gets from it was forwarded (the plan's choice when node 1 is
    # the idle source); every load is bit-exact either way.
    root = str(tmp_path)
    opts = {"data": 2, "parity": 1}
    run_ranks(_save_job, 4, root, 1, "erasure", opts, [1, 2], timeout=240)
    shutil.rmtree(tmp_path / "n1")
    out = run_ranks(_load_job, 4, root, 1, "erasure", opts, timeout=240)
    assert [o[:2] for o in out] == [(2, True)] * 4, out
    received = [o[2] for o in out]
    assert any("(node 1)" in source for r in (0, 2, 3) for source in received[r]), received
    assert sum(n for got in received for n in got.values()) == 13  # 12 copies, 1 rebuild


def test_erasure_with_two_parity_blocks_survives_losing_two_nodes(tmp_path):
    root = str(tmp_path)
    opts = {"data": 2, "parity": 2}
    run_ranks(_save_job, 4, root, 1, "erasure", opts, [1], timeout=240)
    shutil.rmtree(tmp_path / "n0")
    shutil.rmtree(tmp_path / "n1")  # both members of group 0: rebuilt from its two parity blocks
    out = run_ranks(_load_job, 4, root, 1, "erasure", opts, timeout=240)
    assert [o[:2] for o in out] == [(1, True)] * 4
    assert any("rebuilt from nodes [2, 3]" in source for source in out[0][2]), out[0][2]


def test_losing_more_nodes_than_erasure_tolerates_falls_back_to_the_remote(tmp_path):
    root = str(tmp_path)
    opts = {"data": 2, "parity": 1}
    run_ranks(_save_job, 3, root, 1, "erasure", opts, [1, 2], True, timeout=240)
    shutil.rmtree(tmp_path / "n0")
    shutil.rmtree(tmp_path / "n1")  # two of group 0's three blocks: RS(2+1) cannot rebuild
    out = run_ranks(_load_job, 3, root, 1, "erasure", opts, True, timeout=240)
    assert [o[:2] for o in out] == [(2, True)] * 3
    assert all(f"{root}/remote/step-2" in " ".join(o[3]) for o in out), out
    # Without the remote: a clear error naming the step, the level, the group, the nodes.
    shutil.rmtree(tmp_path / "n0")
    shutil.rmtree(tmp_path / "n1")
    out = run_ranks(_load_job, 3, root, 1, "erasure", opts, False, timeout=240)
    message = out[0][3]
    assert out[0][0] is None and isinstance(message, str)
    assert f"erasure:{root}/n{{node}}/erasure: step 2: group 0: RS(2+1)" in message
    assert "RS(2+1) needs 2 intact blocks, has 1 (blocks of nodes [0, 1] lost" in message
    assert "(lost or replaced): [0, 1]" in message


def test_a_flipped_byte_in_a_partner_copy_is_never_loaded(tmp_path):
    root = str(tmp_path)
    opts = {"replicas": 2}
    run_ranks(_save_job, 4, root, 2, "partner", opts, [1], True, timeout=240)
    (copy,) = (tmp_path / "n0/partner/step-1/data").glob("2-*.bin")
    _flip_byte(copy)  # node 0's copy of rank 2's file
    shutil.rmtree(tmp_path / "n1")
    out = run_ranks(_load_job, 4, root, 2, "partner", opts, True, timeout=240)
    assert [o[:2] for o in out] == [(1, True)] * 4
    # The damaged copy was refused (never sent); rank 2's items came from the remote.
    assert out[2][2][f"partner:{root}/n{{node}}/partner (node 0)"] == 1  # rank 3's file only
    assert any("remote" in url for url in out[2][3]), out[2][3]


def test_a_flipped_byte_in_a_parity_chunk_is_detected_and_the_remote_serves(tmp_path):
    root = str(tmp_path)
    opts = {"data": 2, "parity": 1}
    run_ranks(_save_job, 3, root, 1, "erasure", opts, [1], True, timeout=240)
    _flip_byte(tmp_path / "n2/erasure/step-1/parity/0-2.bin")
    shutil.rmtree(tmp_path / "n0")
    out = run_ranks(_load_job, 3, root, 1, "erasure", opts, True, timeout=240)
    assert [o[:2] for o in out] == [(1, True)] * 3
    assert not any("rebuilt" in source for o in out for source in o[2]), out
    assert any("remote" in url for url in out[0][3]), out[0][3]


def die_after_first_send() -> None:
    """Make this process die by SIGKILL right after its next block sent between nodes
    (the receiver is then in the middle of a file)."""
    from dcp_multilevel import _dist

    send = _dist.send_bytes

    def send_then_die(buf, dst, group):
        send(buf, dst, group)
        os.kill(os.getpid(), signal.SIGKILL)

    _dist.send_bytes = send_then_die


def save_then_die_in_last_copy(mgr, state, steps: list[int], rank: int, dying: int) -> None:
    """Save ``steps`` (each copied between nodes before the next); rank ``dying`` dies
    by SIGKILL in the middle of the last one's copy."""
    for step in steps[:-1]:
        mgr.save(state(step), step=step)
        mgr.wait()
    if rank == dying:
        die_after_first_send()
    mgr.save(state(steps[-1]), step=steps[-1])
    mgr.wait()


def _killed_mid_transfer_job(rank: int, world: int, root: str) -> None:
    """Saves step 1 (copied to partners), then dies by SIGKILL in step 2's copy."""
    os.environ["DCP_ML_NODE"] = str(rank // 2)
    mgr = CheckpointManager(_levels(root, "partner", {"replicas": 2}), drain_policy="wait")
    save_then_die_in_last_copy(mgr, _state, [1, 2], rank, dying=3)


def test_sigkill_during_the_copy_leaves_the_previous_step_restorable(tmp_path):
    root = str(tmp_path)
    with pytest.raises(RankError):
        run_ranks(_killed_mid_transfer_job, 4, root, timeout=240)
    for node in (0, 1):  # step 2 is committed on the first level, on no node's partner part
        assert (tmp_path / f"n{node}/partner/step-1/manifest.json").exists()
        assert not (tmp_path / f"n{node}/partner/step-2/manifest.json").exists()
    assert (tmp_path / "n0/l1/step-2/manifest.json").exists()
    shutil.rmtree(tmp_path / "n1")
    out = run_ranks(_load_job, 4, root, 2, "partner", {"replicas": 2}, timeout=240)
    assert [o[:2] for o in out] == [(1, True)] * 4


def test_a_damaged_first_level_file_is_fetched_intact_from_another_node(tmp_path):
    root = str(tmp_path)
    opts = {"replicas": 2}
    run_ranks(_save_job, 2, root, 1, "partner", opts, [1], timeout=240)
    (own,) = (tmp_path / "n0/l1/step-1/data").glob("0-*.bin")
    _flip_byte(own)  # no node is lost, and there is no remote: node 1's copy is intact
    out = run_ranks(_load_job, 2, root, 1, "partner", opts, timeout=240)
    assert [o[:2] for o in out] == [(1, True)] * 2
    # Node 1's copy (its partner copy, which node 1's restore also linked into its
    # first level) replaced the damaged file; the report also has the first pass
    # (node 0 linked its copy of rank 1's file).
    fetched = {source: n for source, n in out[0][2].items() if source.endswith("(node 1)")}
    assert list(fetched.values()) == [1], out[0][2]
    # The damaged file is kept aside for inspection, the intact one took its place.
    assert len(list((tmp_path / "n0/l1/step-1/data").glob("0-*.bin.damaged-*"))) == 1


def test_damage_found_while_copying_falls_back_to_an_older_whole_step(tmp_path):
    root = str(tmp_path)
    opts = {"replicas": 2}
    run_ranks(_save_job, 4, root, 2, "partner", opts, [1, 2], timeout=240)
    (copy,) = (tmp_path / "n0/partner/step-2/data").glob("2-*.bin")
    _flip_byte(copy)  # the only surviving copy of rank 2's file of step 2
    shutil.rmtree(tmp_path / "n1")
    out = run_ranks(_load_job, 4, root, 2, "partner", opts, timeout=240)
    assert [o[:2] for o in out] == [(1, True)] * 4


# --------------------------------------------------------------------------- sharded state


def _shard(rank: int, step: int) -> dict:
    """Rank ``rank``'s own tensors (keys no other rank has), 6 MiB: two 4 MiB chunks.

    Nothing replicated: a replicated value (a ``"step"`` every rank holds) lives in
    one rank's file, which every node then fetches whole to read it.
    """
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {f"rank{rank}.w": torch.randn(1536, 1024, generator=g)}


def _sharded_save_job(rank: int, world: int, root: str, options: dict) -> None:
    os.environ["DCP_ML_NODE"] = str(rank)
    mgr = CheckpointManager(_levels(root, "erasure", options), drain_policy="wait")
    mgr.save(_shard(rank, 1), step=1)
    results = mgr.wait()
    mgr.close()
    assert results and all(r.committed and r.error is None for r in results), results


def _sharded_load_job(rank: int, world: int, root: str, options: dict) -> tuple:
    os.environ["DCP_ML_NODE"] = str(rank)
    mgr = CheckpointManager(_levels(root, "erasure", options))
    state = {f"rank{rank}.w": torch.zeros(1536, 1024)}
    step = mgr.load_latest(state)
    mgr.close()
    received = mgr.last_restore.received if mgr.last_restore else {}
    return step, bit_equal(state, _shard(rank, 1)), received


def test_sharded_state_restores_only_the_lost_nodes_member(tmp_path):
    # Each rank saves and loads keys of its own: the load planner's dry run asks for
    # the rank's own file, so after losing node 1 only node 1 receives anything (its
    # member, rebuilt over the wire in several chunks, read ahead and written behind),
    # and the survivors copy nothing.
    root, opts = str(tmp_path), {"data": 2, "parity": 1}
    run_ranks(_sharded_save_job, 3, root, opts, timeout=240)
    shutil.rmtree(tmp_path / "n1")
    out = run_ranks(_sharded_load_job, 3, root, opts, timeout=240)
    assert [(step, exact) for step, exact, _ in out] == [(1, True)] * 3
    assert out[0][2] == {} and out[2][2] == {}
    level = f"erasure:{root}/n{{node}}/erasure"
    assert out[1][2] == {f"{level} (rebuilt from nodes [0, 2])": 1}


def _fsdp_like(rank: int, step: int) -> dict:
    """Rank ``rank``'s shards plus values every rank holds (an optimizer's step count
    per parameter, the epoch): what sharded training (FSDP) saves. The balanced
    planner spreads the replicated values over the ranks' files."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        **{f"rank{rank}.w{i}": torch.randn(512, 512, generator=g) for i in range(3)},
        **{f"opt.step{i}": torch.tensor(float(step * 10 + i)) for i in range(8)},
        "epoch": step,
    }


def _fsdp_blank(rank: int) -> dict:
    return {
        **{f"rank{rank}.w{i}": torch.zeros(512, 512) for i in range(3)},
        **{f"opt.step{i}": torch.tensor(-1.0) for i in range(8)},
        "epoch": -1,
    }


_ERASURE = {"data": 2, "parity": 1}


def _fsdp_save_job(rank: int, world: int, root: str) -> None:
    os.environ["DCP_ML_NODE"] = str(rank)
    mgr = CheckpointManager(_levels(root, "erasure", _ERASURE), drain_policy="wait")
    mgr.save(_fsdp_like(rank, 1), step=1)
    results = mgr.wait()
    mgr.close()
    assert results and all(r.committed and r.error is None for r in results), results


def _fsdp_load_job(rank: int, world: int, root: str, whole: bool = False) -> tuple:
    os.environ["DCP_ML_NODE"] = str(rank)
    mgr = CheckpointManager(_levels(root, "erasure", _ERASURE), restore_whole_files=whole)
    state = _fsdp_blank(rank)
    step = mgr.load_latest(state)
    mgr.close()
    received = mgr.last_restore.received if mgr.last_restore else {}
    return step, bit_equal(state, _fsdp_like(rank, 1)), received, mgr.last_load_sources


def _data_files(directory: Path) -> set[str]:
    return {p.name for p in (directory / "data").iterdir()} if directory.exists() else set()


def test_restore_whole_files_brings_the_files_not_the_items(tmp_path):
    # The same restore with CheckpointManager(restore_whole_files=True): each file a
    # node reads part of is copied whole (the restore as it was before items).
    root = str(tmp_path)
    run_ranks(_fsdp_save_job, 3, root, timeout=240)
    out = run_ranks(_fsdp_load_job, 3, root, True, timeout=240)
    assert [(step, exact) for step, exact, _, _ in out] == [(1, True)] * 3
    received = [key for _, _, got, _ in out for key in got]
    assert received and not [k for k in received if "items only" in k], received


def test_values_every_rank_holds_are_fetched_as_items_not_whole_files(tmp_path):
    # 3 nodes, RS(2+1), sharded state plus replicated values spread over every
    # rank's file. A node needs only a few hundred bytes of the other nodes'
    # files: a restart copies those items (into the step's parts copy), never the
    # files whole; the first level keeps exactly the node's own file.
    root = str(tmp_path)
    run_ranks(_fsdp_save_job, 3, root, timeout=240)
    step_dir = lambda node: tmp_path / f"n{node}" / "l1" / "step-1"  # noqa: E731
    own = {node: _data_files(step_dir(node)) for node in range(3)}
    assert all(len(files) == 1 for files in own.values()), own
    manifest = json.loads((step_dir(0) / "manifest.json").read_text())
    shared = {i["file"].split("/")[1] for i in manifest["items"] if not i["fqn"].startswith("rank")}
    # The nodes whose file holds some of the replicated values (the planner's choice).
    holders = [n for n in range(3) if own[n] & shared]
    assert len(holders) >= 2, (own, shared)
    out = run_ranks(_fsdp_load_job, 3, root, timeout=240)
    assert [(step, exact) for step, exact, _, _ in out] == [(1, True)] * 3
    first = f"{root}/n{{node}}/l1"
    for node in range(3):
        others = [n for n in holders if n != node]
        assert out[node][2] == {f"{first} (node {n}, items only)": 1 for n in others}
        assert _data_files(step_dir(node)) == own[node]
        parts = step_dir(node) / ".parts"
        assert (parts / "manifest.json").exists()
        assert _data_files(parts) == set().union(*(own[n] for n in others))
        # Only the items: the holes cost no disk.
        used = sum(f.stat().st_blocks * 512 for f in (parts / "data").iterdir())
        assert used < 64 << 10, used
        assert any(".parts" in url for url in out[node][3]), out[node][3]
    # Losing node 1: its member is rebuilt whole onto it (its shards are in it);
    # the others take node 1's items from there, node 1 theirs from them.
    shutil.rmtree(tmp_path / "n1")
    out = run_ranks(_fsdp_load_job, 3, root, timeout=240)
    assert [(step, exact) for step, exact, _, _ in out] == [(1, True)] * 3
    level = f"erasure:{root}/n{{node}}/erasure"
    assert out[1][2] == {
        f"{level} (rebuilt from nodes [0, 2])": 1,
        **{f"{first} (node {n}, items only)": 1 for n in holders if n != 1},
    }
    assert out[0][2] == ({f"{first} (node 1, items only)": 1} if 1 in holders else {})
    assert _data_files(step_dir(1)) == own[1]


def test_a_damaged_source_of_items_is_never_read(tmp_path):
    # The items other nodes take from a node's file come from a copy with a flipped
    # byte in one of them: detected while sending, reported, and the load still
    # ends bit-exact (the member is rebuilt from the erasure level instead).
    root = str(tmp_path)
    run_ranks(_fsdp_save_job, 3, root, timeout=240)
    step_dir = lambda node: tmp_path / f"n{node}" / "l1" / "step-1"  # noqa: E731
    manifest = json.loads((step_dir(0) / "manifest.json").read_text())
    item = next(i for i in manifest["items"] if i["fqn"].startswith("opt.step"))
    damaged = next(n for n in range(3) if (step_dir(n) / item["file"]).exists())
    path = step_dir(damaged) / item["file"]
    data = bytearray(path.read_bytes())
    data[item["pos"]] ^= 0x40
    path.write_bytes(bytes(data))
    out = run_ranks(_fsdp_load_job, 3, root, timeout=240)
    assert [(step, exact) for step, exact, _, _ in out] == [(1, True)] * 3
    # Nothing was taken from the damaged file (a failed transfer is not counted);
    # its member was rebuilt from the erasure level.
    received = [key for _, _, got, _ in out for key in got]
    assert not [key for key in received if f"(node {damaged}, items only)" in key], received
    assert any("rebuilt from nodes" in key for key in received), received


# --------------------------------------------------------------------------- the wire


class _FailingStore:
    """A store whose writes fail after ``ok`` of them (a disk filling up)."""

    def __init__(self, ok: int) -> None:
        self.ok = ok

    @contextlib.contextmanager
    def open_write(self, path: str):
        store = self

        class _Handle:
            def write(self, view) -> None:
                if store.ok <= 0:
                    raise OSError(28, "No space left on device", path)
                store.ok -= 1

        yield _Handle()


def _wire_job(rank: int, world: int, root: str) -> list[str]:
    """Rank 0 streams three files of 1 MiB blocks; rank 1 receives them into a
    store, a store that fails after 5 writes, then the store again."""
    from dcp_multilevel.levels.wire import OutStream, recv_file
    from dcp_multilevel.stores.local import LocalStore

    size, block = (21 << 20) + 12345, 1 << 20
    data = (
        torch.randint(
            0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
        )
        .numpy()
        .tobytes()
    )
    outcomes = []
    for name in ("a.bin", "b.bin", "c.bin"):
        if rank == 0:
            out = OutStream(size, 1, None, block=block)
            for i in range(0, size, 3 << 20):  # pieces unaligned with the blocks
                out.write(data[i : i + (3 << 20)])
            out.finish(True)
            outcomes.append("sent")
            continue
        store = LocalStore(root) if name != "b.bin" else _FailingStore(5)
        try:
            kept = recv_file(store, name, size, 0, None, block)
            same = (Path(root) / name).read_bytes() == data
            outcomes.append(f"kept={kept} same={same}")
        except OSError as e:
            outcomes.append(f"OSError {e.errno}")
    return outcomes


def test_a_received_file_is_written_behind_intact_and_a_failed_write_keeps_the_stream(tmp_path):
    # 22 blocks through 4 receive buffers: the writes run behind the receives without
    # a block overwritten before it was written. A write that fails mid-file is
    # raised once the stream was taken to its end (the sender is not left blocked),
    # and the next transfer between the two ranks is intact.
    out = run_ranks(_wire_job, 2, str(tmp_path), timeout=120)
    assert out[0] == ["sent"] * 3
    assert out[1] == ["kept=True same=True", "OSError 28", "kept=True same=True"]


def _stream_job(rank: int, world: int, length: int, block: int, cuts: list[int]) -> bytes | None:
    from dcp_multilevel.levels.wire import OutStream, receive, status

    data = bytes(random.Random(length).randbytes(length))
    if rank == 1:
        got = b"".join(bytes(view) for view in receive(length, 0, None, block))
        return got if status(0, None) else None
    out = OutStream(length, 1, None, block)
    scratch = bytearray(max([*cuts, 1]))
    pos = 0
    for n in cuts:
        piece = memoryview(scratch)[:n]
        piece[:] = data[pos : pos + n]
        out.write(piece)
        piece[:] = b"\xff" * n  # the caller may reuse its buffer once write returns
        pos += n
    out.finish(True)
    return data


@pytest.mark.parametrize(
    "cuts",
    [[4096] * 4, [1000, 3096, 4096, 4096, 4096], [7, 4089, 8192, 4096, 4], [4096, 4096, 8196]],
)
def test_a_stream_sends_whole_blocks_whatever_the_pieces_written(cuts):
    # Whole blocks go out from the writer's buffer and partial ones through the
    # stream's own: the receiver, taking fixed blocks, gets every byte in order.
    length = sum(cuts)
    sent, got = run_ranks(_stream_job, 2, length, 4096, cuts, timeout=120)
    assert got == sent
