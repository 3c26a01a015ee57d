"""The command-line tool on levels whose path has ``{node}`` in it: each node's disk
holds a part of every step (its own ranks' files; the first level's manifest only on
the coordinator's node, an erasure level's on every node).

The layout is made for real: four ranks on two simulated nodes (``DCP_ML_NODE``
per process), a first level ``<root>/n{node}/l1`` and an erasure level
``<root>/n{node}/ec`` (which records each rank's node in ``placement.json``),
two steps saved by :class:`~dcp_multilevel.CheckpointManager`. The CLI then
runs in this process (click's CliRunner) on a copy of it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from dcp_multilevel import CheckpointManager, Level
from dcp_multilevel.cli import main
from dcp_multilevel.cli._common import format_bytes
from tests._dist import run_ranks

pytestmark = pytest.mark.multiprocess

RANKS_PER_NODE = 2
STEPS = (1, 2)
EVERY_NODE = (
    "pass the level's path with {node} in place of the node's index to see every node's part"
)


def _levels(root: str) -> list[Level]:
    return [
        Level(f"{root}/n{{node}}/l1"),
        Level(f"erasure:{root}/n{{node}}/ec", data=1, parity=1),
    ]


def _state(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(step)
    mine = torch.Generator().manual_seed(100 * step + rank)
    return {
        "w": torch.randn(64, 64, generator=g),  # replicated: the same on every rank
        f"own{rank}": torch.randn(300, generator=mine),  # each rank's own
        "step": step,
    }


def _save_job(rank: int, world: int, root: str) -> list[tuple[str, int, bool]]:
    os.environ["DCP_ML_NODE"] = str(rank // RANKS_PER_NODE)
    mgr = CheckpointManager(_levels(root))
    for step in STEPS:
        mgr.save(_state(step, rank), step=step)
    results = mgr.wait()
    mgr.close()
    return [(r.level, r.step, r.committed) for r in results]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("node-local")
    results = run_ranks(_save_job, 2 * RANKS_PER_NODE, str(root), timeout=240)
    assert all(committed for r in results for _, _, committed in r), results
    return root


@pytest.fixture
def root(saved: Path, tmp_path: Path) -> Path:
    """A copy of the saved layout, for a test to damage: ``n0/`` and ``n1/`` are the nodes."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    return run


def run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


def data_file(ckpt: Path, rank: int) -> Path:
    (path,) = (ckpt / "data").glob(f"{rank}-*.bin")
    return path


def items_of(doc: dict, ranks: range) -> list[dict]:
    """The manifest's items stored in the files of ``ranks``, in file then offset order."""
    mine = [i for i in doc["items"] if int(i["file"].split("/")[1].split("-")[0]) in ranks]
    return sorted(mine, key=lambda i: (i["file"], i["pos"]))


def stored(items: list[dict]) -> str:
    return format_bytes(sum(i["length"] for i in items))


def chunk(item: dict) -> str:
    return "" if item["offsets"] is None else f" (chunk at {item['offsets']})"


# --------------------------------------------------------------------------- verify


def test_verify_every_node_part_of_healthy_steps_is_ok(root: Path):
    docs = {s: manifest(root / "n0" / "l1" / f"step-{s}") for s in STEPS}
    result = run("verify", root / "n{node}" / "l1")
    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout == "".join(
        f"ok   file://{root}/n{{node}}/l1/step-{s}: {len(doc['items'])} items, "
        f"{stored(doc['items'])} checked on nodes 0-1 (manifest on node 0)\n"
        for s, doc in docs.items()
    )
    # The erasure level commits every node's part; its parity is no data file.
    ec = run("verify", root / "n{node}" / "ec" / "step-2")
    assert (ec.exit_code, ec.stderr) == (0, "")
    assert ec.stdout == (
        f"ok   file://{root}/n{{node}}/ec/step-2: {len(docs[2]['items'])} items, "
        f"{stored(docs[2]['items'])} checked on nodes 0-1 (manifest on nodes 0-1)\n"
    )
    doc = json.loads(run("verify", root / "n{node}" / "l1" / "step-2", "--json").stdout)
    (report,) = doc["checkpoints"]
    assert doc["ok"] and report["problems"] == []
    assert report["nodes"] == [
        {
            "node": 0,
            "url": f"file://{root}/n0/l1/step-2",
            "manifest": True,
            "files": 2,
            "other_save": None,
        },
        {
            "node": 1,
            "url": f"file://{root}/n1/l1/step-2",
            "manifest": False,
            "files": 2,
            "other_save": None,
        },
    ]


def test_verify_of_one_node_directory_names_the_other_node_files_not_damage(root: Path):
    ckpt = root / "n0" / "l1" / "step-2"
    doc = manifest(ckpt)
    here, there = items_of(doc, range(0, 2)), items_of(doc, range(2, 4))
    result = run("verify", ckpt)
    assert result.exit_code == 1
    assert "damaged" not in result.stdout and "BAD" not in result.stdout
    assert result.stdout == (
        f"part file://{ckpt}: {len(here)} of {len(doc['items'])} items checked, all good "
        f"({stored(here)}); the other {len(there)} are in files not on this disk\n"
        f"  not checked: the files of ranks 2-3 (2 data file(s), {len(there)} item(s)) are not "
        f"on this disk: on a level with {{node}} in its path they are on their ranks' node "
        f"({EVERY_NODE}); on any other level they are lost\n"
    )
    assert result.stderr == (
        "error: 1 of 1 checkpoint(s) checked only in part: other nodes' files are not at the "
        f"location given; {EVERY_NODE}\n"
    )
    # The erasure level records each rank's node: node 1's directory names node 0.
    ec = run("verify", root / "n1" / "ec" / "step-2")
    assert ec.exit_code == 1 and "damaged" not in ec.stdout
    assert ec.stdout.splitlines()[1] == (
        f"  not checked: node 0's files (ranks 0-1; 2 data file(s), {len(here)} item(s)) are "
        "on node 0, not here"
    )
    report = json.loads(run("verify", ckpt, "--json").stdout)["checkpoints"][0]
    assert (report["ok"], report["problems"]) == (False, [])
    assert report["elsewhere"] == [
        {
            "node": None,
            "ranks": [2, 3],
            "items": len(there),
            "files": sorted({i["file"] for i in there}),
        }
    ]


def test_verify_names_a_truncated_file_on_node_1_bad(root: Path):
    ckpt = root / "n1" / "l1" / "step-2"
    damaged = data_file(ckpt, 2)
    size = damaged.stat().st_size
    with damaged.open("r+b") as f:
        f.truncate(size - 1)
    name = f"data/{damaged.name}"
    items = [
        i for i in items_of(manifest(root / "n0" / "l1" / "step-2"), range(4)) if i["file"] == name
    ]
    result = run("verify", root / "n{node}" / "l1" / "step-2")
    assert result.exit_code == 1
    assert result.stderr == "error: 1 of 1 checkpoint(s) failed verification\n"
    message = (
        f"data file {name!r} of checkpoint file://{ckpt} is {size - 1} bytes, the manifest "
        f"says {size}; the checkpoint is damaged"
    )
    assert result.stdout.splitlines()[1:] == [
        f"  {i['fqn']}{chunk(i)} on node 1: {name} bytes {i['pos']}..{i['pos'] + i['length']}: "
        f"TruncatedDataError: {message}"
        for i in items
    ]
    assert result.stdout.startswith(f"BAD  file://{root}/n{{node}}/l1/step-2: {len(items)} of ")
    # The other step is untouched: a root checks every step, and only one is bad.
    both = run("verify", root / "n{node}" / "l1")
    assert both.stdout.splitlines()[0].startswith(f"ok   file://{root}/n{{node}}/l1/step-1: ")
    assert both.stderr == "error: 1 of 2 checkpoint(s) failed verification\n"


def test_verify_names_a_file_missing_from_its_node_and_each_of_its_items(root: Path):
    doc = manifest(root / "n0" / "l1" / "step-2")
    gone = data_file(root / "n1" / "l1" / "step-2", 3)
    gone.unlink()
    name = f"data/{gone.name}"
    items = [i for i in items_of(doc, range(4)) if i["file"] == name]
    assert len(items) > 1  # each problem names its own item, not the file's first
    result = run("verify", root / "n{node}" / "l1" / "step-2")
    assert result.exit_code == 1
    assert result.stdout.splitlines()[1:] == [
        f"  {i['fqn']}{chunk(i)}: {name} bytes {i['pos']}..{i['pos'] + i['length']}: "
        f"TruncatedDataError: data file {name!r} (rank 3's) of checkpoint "
        f"file://{root}/n{{node}}/l1/step-2 is on no node's disk (nodes 0-1 looked at; no node "
        f"holds any file of rank 3; needed for {i['fqn']!r}); the checkpoint is damaged"
        for i in items
    ]
    # The erasure level's placement names the node that should hold it.
    (root / "n1" / "ec" / "step-2" / "data" / gone.name).unlink()
    ec = run("verify", root / "n{node}" / "ec" / "step-2")
    assert ec.exit_code == 1
    assert ec.stdout.splitlines()[1] == (
        f"  {items[0]['fqn']}{chunk(items[0])} on node 1: {name} bytes "
        f"{items[0]['pos']}..{items[0]['pos'] + items[0]['length']}: TruncatedDataError: data "
        f"file {name!r} (rank 3's) of checkpoint file://{root}/n{{node}}/ec/step-2 is missing "
        f"on node 1, which rank 3 was on (needed for {items[0]['fqn']!r}); node 1's part is "
        "damaged"
    )


def test_verify_of_a_node_directory_without_manifest_says_where_it_is(root: Path):
    result = run("verify", root / "n1" / "l1" / "step-2")
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == (
        f"error: no committed checkpoint at file://{root}/n1/l1/step-2: it has no "
        "manifest.json; it holds the data files of ranks 2-3 only: one node's part of a "
        "checkpoint on a level with {node} in its path, whose manifest the coordinator "
        f"(rank 0) writes on its own node. Look there, or {EVERY_NODE}\n"
    )


# --------------------------------------------------------------------------- ls


def _rows(out: str) -> dict[int, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│|]", line) if c.strip()]
        if cells and cells[0].isdigit():
            rows[int(cells[0])] = cells
    return rows


def test_ls_of_node_1_names_its_parts_not_incomplete(root: Path):
    result = run("ls", root / "n1" / "l1")
    assert result.exit_code == 0, result.stderr
    assert "incomplete" not in result.stdout
    assert {s: cells[-2] for s, cells in _rows(result.stdout).items()} == {
        s: "part of ranks 2-3, manifest on rank 0's node" for s in STEPS
    }
    (listing,) = json.loads(run("ls", root / "n1" / "l1", "--json").stdout)["roots"]
    assert listing["checkpoints"] == [
        {
            "step": s,
            "url": f"file://{root}/n1/l1/step-{s}",
            "complete": False,
            "error": None,
            "part_ranks": [2, 3],
        }
        for s in STEPS
    ]


def test_ls_with_node_lists_every_node_part(root: Path):
    shutil.rmtree(root / "n1" / "l1" / "step-1")  # node 1's part of step 1 is lost
    result = run("ls", root / "n{node}" / "l1")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"file://{root}/n{{node}}/l1"
    assert {s: cells[-2] for s, cells in _rows(result.stdout).items()} == {
        1: "complete: manifest on node 0, part on node 0, none on node 1",
        2: "complete: manifest on node 0, parts on nodes 0-1",
    }
    (listing,) = json.loads(run("ls", root / "n{node}" / "l1", "--json").stdout)["roots"]
    assert listing["nodes"] == {"0": f"file://{root}/n0/l1", "1": f"file://{root}/n1/l1"}
    found = [
        (c["step"], c["complete"], c["manifest_nodes"], c["part_nodes"])
        for c in listing["checkpoints"]
    ]
    assert found == [(1, True, [0], [0]), (2, True, [0], [0, 1])]
    assert listing["checkpoints"][1]["world_size"] == 4


# --------------------------------------------------------------------------- inspect


def test_inspect_says_where_each_file_is(root: Path):
    doc = json.loads(run("inspect", root / "n{node}" / "l1" / "step-2", "--json").stdout)
    assert doc["url"] == f"file://{root}/n{{node}}/l1/step-2"
    assert [(f["rank"], f["present"], f["nodes"]) for f in doc["files"]] == [
        (0, True, [0]),
        (1, True, [0]),
        (2, True, [1]),
        (3, True, [1]),
    ]
    human = run("inspect", root / "n{node}" / "l1" / "step-2").stdout
    assert "│ nodes           │ manifest on node 0; data files on nodes 0-1" in human
    one = json.loads(run("inspect", root / "n0" / "l1" / "step-2", "--json").stdout)
    assert [(f["rank"], f["present"]) for f in one["files"]] == [
        (0, True),
        (1, True),
        (2, False),
        (3, False),
    ]
    assert [(a["node"], a["ranks"]) for a in one["elsewhere"]] == [(None, [2, 3])]
    table = run("inspect", root / "n0" / "l1" / "step-2").stdout
    assert [line.split()[-2] for line in table.splitlines() if "data/" in line] == [
        "here",
        "here",
        "elsewhere",
        "elsewhere",
    ]


# --------------------------------------------------------------------------- gc


def test_gc_of_node_1_keeps_its_parts_of_good_steps(root: Path):
    """Node 1's directory holds no manifest, only its ranks' files of good steps: gc
    with a zero age bound must not take them for the debris of crashed saves."""
    result = run("gc", root / "n1" / "l1", "--keep", "1", "--older-than", "0")
    assert result.exit_code == 0, result.stderr
    for step in STEPS:
        assert f"kept step {step} (part of a node-local step, manifest on rank 0's node)" in (
            result.stdout
        )
        assert data_file(root / "n1" / "l1" / f"step-{step}", 2).exists()
    assert "abandoned" not in result.stdout
