"""The command-line tool, run for real (click's CliRunner calls the same code as the
console script) on checkpoints written by dcp.save: ls, inspect, verify, copy, gc,
their --json shapes, exit codes and one-line errors; copies to and from a real S3
server on loopback (moto)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _damage import flip_byte
from click.testing import CliRunner, Result
from conftest import random_tensor
from test_roundtrip import assert_state_equal, zeros_like_state

from dcp_multilevel import Checks, MultiLevelReader, MultiLevelWriter
from dcp_multilevel.cli import main
from dcp_multilevel.stores.remote import RemoteStore

if TYPE_CHECKING:
    from _s3 import S3Server

pytest_plugins = ["_s3"]

REPO = Path(__file__).resolve().parents[2]


def make_state(seed: int) -> dict:
    """Floats large enough to be compressed (bytegroup codes items of 4 KiB and more)."""
    return {
        "model": {
            "w": torch.randn(64, 48, generator=torch.Generator().manual_seed(seed)),
            "b": random_tensor((48,), torch.float32, seed),
            "h": random_tensor((32, 32), torch.bfloat16, seed + 1),
        },
        "step": seed,
    }


def save(path: Path | str, seed: int, codec: str | None = None, thread_count: int = 1) -> dict:
    state = make_state(seed)
    dcp.save(
        state,
        # Random bits, NaN patterns included: the tools' tests, not the health checks'.
        storage_writer=MultiLevelWriter(
            path, codec=codec, thread_count=thread_count, sync_files=False, checks=Checks.off()
        ),
    )
    return state


def run(*args: str) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def run_json(*args: str, code: int = 0) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == code, result.stderr
    return json.loads(result.stdout)


def assert_one_line_error(result: Result, message: str) -> None:
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == f"error: {message}\n"


def load(path: str, like: dict, storage_options: dict | None = None) -> dict:
    out = zeros_like_state(like)
    dcp.load(out, storage_reader=MultiLevelReader(path, storage_options=storage_options))
    return out


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A level root: steps 10 (uncompressed), 20 and 30 (bytegroup), step 40 incomplete."""
    r = tmp_path / "root"
    save(r / "step-10", 10)
    save(r / "step-20", 20, codec="bytegroup")
    save(r / "step-30", 30, codec="bytegroup")
    (r / "step-40" / "data").mkdir(parents=True)
    return r


def data_files(ckpt: Path) -> list[Path]:
    return sorted((ckpt / "data").iterdir())


# --------------------------------------------------------------------------- entry points


def test_python_m_and_console_script_run():
    module = subprocess.run(
        [sys.executable, "-m", "dcp_multilevel", "--help"],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    )
    assert module.returncode == 0, module.stderr
    for command in ("ls", "inspect", "verify", "copy", "gc"):
        assert command in module.stdout
    script = Path(sys.executable).parent / "dcp-multilevel"
    installed = subprocess.run(
        [str(script), "verify", "--help"], capture_output=True, text=True, check=False
    )
    assert installed.returncode == 0, installed.stderr
    assert "--latest" in installed.stdout


def test_usage_error_exits_2():
    result = run("ls", "somewhere", "--storage-options", "{not json")
    assert result.exit_code == 2
    assert "Invalid value for '--storage-options'" in result.stderr


# --------------------------------------------------------------------------- ls


def test_ls_lists_steps_with_sizes_codecs_and_incomplete(root):
    result = run("ls", root)
    assert result.exit_code == 0, result.stderr
    row = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[│|]", line) if c.strip()]
        if cells and cells[0].isdigit():
            row[int(cells[0])] = line
    assert set(row) == {10, 20, 30, 40}
    assert "none" in row[10] and "complete" in row[10]
    assert "bytegroup/4" in row[20]
    assert "incomplete" in row[40] and " complete" not in row[40]
    assert str(root) in result.stdout


def test_ls_json_shape(root):
    doc = run_json("ls", root)
    (listing,) = doc["roots"]
    assert listing["kind"] == "root"
    assert listing["url"] == f"file://{root}"
    by_step = {c["step"]: c for c in listing["checkpoints"]}
    assert sorted(by_step) == [10, 20, 30, 40]
    c10, c20, c40 = by_step[10], by_step[20], by_step[40]
    assert c10["complete"] and c10["codecs"] == [] and c10["world_size"] == 1
    assert c10["stored_bytes"] == sum(f.stat().st_size for f in data_files(root / "step-10"))
    assert c10["raw_bytes"] == c10["stored_bytes"]  # uncompressed: nothing framed
    assert c20["codecs"] == ["dcp_multilevel.bytegroup/4"]
    assert c20["stored_bytes"] < c20["raw_bytes"]
    assert set(c20) >= {"save_id", "created_unix", "files", "items", "url", "error"}
    assert c40 == {"step": 40, "url": f"file://{root}/step-40", "complete": False, "error": None}


def test_ls_of_one_checkpoint_and_several_levels(root, tmp_path):
    single = run("ls", root / "step-20")
    assert single.exit_code == 0
    assert "one checkpoint, not a root" in single.stdout
    save(tmp_path / "l2" / "step-20", 20, codec="zstd")
    doc = run_json("ls", root, tmp_path / "l2")
    assert [r["level"] for r in doc["roots"]] == ["L1", "L2"]
    assert [c["step"] for c in doc["roots"][1]["checkpoints"]] == [20]
    human = run("ls", root, tmp_path / "l2").stdout
    assert f"L1: file://{root}" in human and f"L2: file://{tmp_path / 'l2'}" in human


def test_ls_memory_url():
    url = f"memory://dcp-ml-{uuid.uuid4().hex[:12]}/run"
    try:
        save(f"{url}/step-5", 5)
        doc = run_json("ls", url)
        assert [c["step"] for c in doc["roots"][0]["checkpoints"]] == [5]
    finally:
        RemoteStore(url).remove_tree("")


def test_missing_path_and_not_a_checkpoint_exit_1(tmp_path):
    missing = tmp_path / "nope"
    assert_one_line_error(
        run("ls", missing),
        f"no checkpoint at file://{missing}: it has no manifest.json and no step-<N> "
        "directories (check the path, or the storage options for a remote URL)",
    )
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("hi")
    assert_one_line_error(
        run("inspect", junk),
        f"no committed checkpoint at file://{junk} (no manifest.json: not a checkpoint, "
        "or a save that did not finish)",
    )
    assert run("verify", junk).exit_code == 1
    assert run("gc", junk, "--keep", "1").exit_code == 1


# --------------------------------------------------------------------------- inspect


def test_inspect_tables(root):
    result = run("inspect", root / "step-20")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    for fact in (
        "model.w",
        "model.b",
        "model.h",
        "step",
        "float32",
        "bfloat16",
        "64x48",
        "32x32",
        "bytegroup/4",
        torch.__version__,
        "format version",
        "bytes per rank",
        data_files(root / "step-20")[0].name,
    ):
        assert fact in out, fact


def test_inspect_json_shape(root):
    doc = run_json("inspect", root / "step-20")
    assert doc["format_version"] == 1
    assert doc["torch_version"] == torch.__version__
    assert doc["world_size"] == 1
    items = {it["fqn"]: it for it in doc["items"]}
    assert set(items) == {"model.w", "model.b", "model.h", "step"}
    w = items["model.w"]
    assert (w["type"], w["dtype"], w["shape"], w["raw_bytes"]) == (
        "tensor",
        "float32",
        [64, 48],
        64 * 48 * 4,
    )
    assert w["stored_bytes"] < w["raw_bytes"] and w["ratio"] > 1
    assert w["codecs"] == ["dcp_multilevel.bytegroup/4"]
    (chunk,) = w["chunks"]
    assert set(chunk) == {
        "offsets",
        "file",
        "pos",
        "length",
        "raw_length",
        "transforms",
        "checksum",
        "reference_checksum",
    }
    assert chunk["reference_checksum"] is None and doc["reference"] is None
    assert items["step"]["type"] == "bytes" and items["step"]["shape"] is None
    (f,) = doc["files"]
    assert f["rank"] == 0 and f["items"] == 4
    assert doc["ranks"] == [{"rank": 0, "bytes": f["bytes"], "files": 1}]
    assert doc["stored_bytes"] == f["bytes"]


def test_inspect_one_item_and_a_missing_one(root):
    doc = run_json("inspect", root / "step-10", "--item", "model.b")
    assert doc["item"]["fqn"] == "model.b" and doc["item"]["shape"] == [48]
    assert (
        "stored chunks of model.b" in run("inspect", root / "step-10", "--item", "model.b").stdout
    )
    assert_one_line_error(
        run("inspect", root / "step-10", "--item", "model.x"),
        f"no item 'model.x' in checkpoint file://{root}/step-10 (4 items); "
        "close names: model.w, model.h, model.b",
    )


# --------------------------------------------------------------------------- verify


@pytest.mark.parametrize("codec", [None, "bytegroup"])
def test_verify_passes_on_an_intact_checkpoint(tmp_path, codec):
    save(tmp_path / "c", 1, codec=codec)
    result = run("verify", tmp_path / "c")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(f"ok   file://{tmp_path}/c: 4 items")
    doc = run_json("verify", tmp_path / "c")
    assert doc == {
        "ok": True,
        "checkpoints": [
            {
                "url": f"file://{tmp_path}/c",
                "ok": True,
                "items": 4,
                "stored_bytes": doc["checkpoints"][0]["stored_bytes"],
                "problems": [],
                "quarantined": False,
                "health": {"checked": [], "findings": []},
            }
        ],
    }


@pytest.mark.parametrize(
    ("codec", "error"),
    [(None, "ChecksumMismatchError"), ("bytegroup", "CorruptCheckpointError")],
)
def test_verify_names_a_flipped_byte_and_exits_1(tmp_path, codec, error):
    save(tmp_path / "c", 1, codec=codec)
    w = run_json("inspect", tmp_path / "c", "--item", "model.w")["item"]["chunks"][0]
    (data,) = data_files(tmp_path / "c")
    flip_byte(data, w["pos"] + 100)
    doc = run_json("verify", tmp_path / "c", code=1)
    assert doc["ok"] is False
    (report,) = doc["checkpoints"]
    (problem,) = report["problems"]
    assert problem["fqn"] == "model.w"
    assert problem["file"] == w["file"] == f"data/{data.name}"
    assert (problem["start"], problem["end"]) == (w["pos"], w["pos"] + w["length"])
    assert problem["error"] == error
    human = run("verify", tmp_path / "c")
    assert human.exit_code == 1
    assert "BAD" in human.stdout and "model.w" in human.stdout and data.name in human.stdout
    assert f"{w['pos']}..{w['pos'] + w['length']}" in human.stdout
    assert human.stderr == "error: 1 of 1 checkpoint(s) failed verification\n"


def test_verify_reports_every_bad_item_and_every_checkpoint(root):
    ckpt = root / "step-10"
    items = run_json("inspect", ckpt)["items"]
    (data,) = data_files(ckpt)
    for it in items:
        if it["fqn"] in ("model.b", "model.h"):
            flip_byte(data, it["chunks"][0]["pos"])
    doc = run_json("verify", root, code=1)  # a root: all its committed steps
    reports = {r["url"].rsplit("/", 1)[1]: r for r in doc["checkpoints"]}
    assert sorted(reports) == ["step-10", "step-20", "step-30"]
    assert sorted(p["fqn"] for p in reports["step-10"]["problems"]) == ["model.b", "model.h"]
    assert reports["step-20"]["ok"] and reports["step-30"]["ok"]
    latest = run_json("verify", root, "--latest")
    assert [r["url"] for r in latest["checkpoints"]] == [f"file://{root}/step-30"]


def test_verify_missing_data_file_names_each_of_its_items(root):
    ckpt = root / "step-20"
    (data,) = data_files(ckpt)
    data.unlink()
    doc = run_json("verify", ckpt, code=1)
    problems = doc["checkpoints"][0]["problems"]
    assert sorted(p["fqn"] for p in problems) == ["model.b", "model.h", "model.w", "step"]
    assert {p["error"] for p in problems} == {"TruncatedDataError"}
    # Each problem names the item it is about (all four are in the missing file).
    for p in problems:
        assert p["message"] == (
            f"data file 'data/{data.name}' of checkpoint file://{ckpt} is missing (needed for "
            f"{p['fqn']!r}); the checkpoint is damaged"
        )
    human = run("verify", ckpt).stdout.splitlines()
    assert human[0] == f"BAD  file://{ckpt}: 4 of 4 items bad"
    assert len(human) == 5
    for line in human[1:]:
        fqn = line.split()[0].rstrip(":")
        assert line.endswith(f"is missing (needed for {fqn!r}); the checkpoint is damaged")


# --------------------------------------------------------------------------- copy


def test_copy_local_to_s3_and_back_is_bit_exact(tmp_path, s3_server: S3Server):
    state = save(tmp_path / "src" / "step-7", 7, codec="bytegroup", thread_count=2)
    bucket = s3_server.new_bucket()
    opts = s3_server.storage_options
    remote = f"s3://{bucket}/run1"
    up = run_json(
        "copy",
        tmp_path / "src" / "step-7",
        remote,
        "--into-root",
        "--storage-options",
        json.dumps(opts),
    )
    assert up["status"] == "copied" and len(up["copied"]) == 2
    assert s3_server.keys(bucket)[-1] == "run1/step-7/manifest.json"
    assert_state_equal(load(f"{remote}/step-7", state, opts), state)
    ls = run_json("ls", remote, "--storage-options", json.dumps(opts))
    assert [c["step"] for c in ls["roots"][0]["checkpoints"]] == [7]
    assert run("verify", f"{remote}/step-7", "--storage-options", json.dumps(opts)).exit_code == 0

    back = tmp_path / "back" / "step-7"
    down = run_json("copy", f"{remote}/step-7", back, "--storage-options", json.dumps(opts))
    assert down["status"] == "copied"
    assert (back / "manifest.json").read_bytes() == (
        tmp_path / "src" / "step-7" / "manifest.json"
    ).read_bytes()
    for a, b in zip(data_files(tmp_path / "src" / "step-7"), data_files(back), strict=True):
        assert a.name == b.name and a.read_bytes() == b.read_bytes()
    assert_state_equal(load(str(back), state), state)


def test_interrupted_copy_resumes_and_replaces_a_bad_file(tmp_path):
    state = save(tmp_path / "src", 3, thread_count=3)
    dest = tmp_path / "dest"
    first = run_json("copy", tmp_path / "src", dest)
    assert first["status"] == "copied" and len(first["copied"]) == 3
    # An interruption: no manifest (the commit is written last), one file never arrived,
    # one arrived damaged.
    (dest / "manifest.json").unlink()
    gone, damaged, intact = data_files(dest)
    gone.unlink()
    flip_byte(damaged, 0)
    assert run("ls", dest).exit_code == 1  # not a checkpoint now
    assert run("inspect", dest).exit_code == 1
    again = run_json("copy", tmp_path / "src", dest)
    assert again["status"] == "resumed"
    assert again["kept"] == [f"data/{intact.name}"]
    assert sorted(again["copied"]) == sorted([f"data/{gone.name}", f"data/{damaged.name}"])
    assert run("verify", dest).exit_code == 0
    assert_state_equal(load(str(dest), state), state)
    human = run("copy", tmp_path / "src", dest)
    assert human.stdout == f"file://{dest} already holds this checkpoint; nothing copied\n"


def test_copy_refuses_a_different_committed_checkpoint(tmp_path):
    save(tmp_path / "a", 1)
    save(tmp_path / "b", 2)
    before = (tmp_path / "b" / "manifest.json").read_bytes()
    result = run("copy", tmp_path / "a", tmp_path / "b")
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"error: Checkpoint already exists at file://{tmp_path}/b: it holds a different "
        "committed checkpoint (save "
    )
    assert result.stderr.endswith(
        "and nothing there was changed. Pass --overwrite to replace it (the old one stays "
        "loadable until the new one commits), delete it first, or pick another destination\n"
    )
    assert (tmp_path / "b" / "manifest.json").read_bytes() == before


def test_copy_of_a_corrupt_source_fails_and_commits_nothing(tmp_path):
    save(tmp_path / "src", 1)
    (data,) = data_files(tmp_path / "src")
    flip_byte(data, 10)
    result = run("copy", tmp_path / "src", tmp_path / "dest")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: checksum mismatch for item ")
    assert not (tmp_path / "dest" / "manifest.json").exists()


# --------------------------------------------------------------------------- gc


def test_gc_dry_run_deletes_nothing_and_gc_deletes_what_it_listed(root):
    (root / "step-15" / "data").mkdir(parents=True)  # abandoned: below the newest committed
    tmp = root / "step-30" / "data" / f"0-9.abc.bin.tmp-{uuid.uuid4().hex[:12]}"
    tmp.write_bytes(b"x")
    old = time.time() - 7200
    os.utime(tmp, (old, old))
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    plan = run_json("gc", root, "--keep", "2", "--dry-run")
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    assert plan["expired"] == [10]
    assert plan["abandoned"] == [15]
    assert plan["temporaries"] == [str(tmp.relative_to(root))]
    assert plan["kept"] == [20, 30] and plan["dry_run"] is True
    human = run("gc", root, "--keep", "2", "--dry-run").stdout
    assert "would delete step 10 (expired)" in human
    assert "would delete step 15 (incomplete, abandoned)" in human

    done = run_json("gc", root, "--keep", "2")
    assert {**done, "dry_run": True} == plan
    assert sorted(p.name for p in root.iterdir()) == ["step-20", "step-30", "step-40"]
    assert not tmp.exists()
    assert run("verify", root).exit_code == 0


def test_gc_never_deletes_the_newest_and_old_incomplete_dirs_go(root):
    # step-40 (newer than every committed step) goes only once it is older than --older-than.
    assert 40 not in run_json("gc", root, "--keep", "1", "--dry-run")["abandoned"]
    done = run_json("gc", root, "--keep", "1", "--older-than", "0")
    assert done["expired"] == [10, 20] and done["abandoned"] == [40] and done["kept"] == [30]
    assert sorted(p.name for p in root.iterdir()) == ["step-30"]
    assert run_json("gc", root, "--keep", "1")["kept"] == [30]
    assert run("gc", root, "--keep", "0").exit_code == 2


# --------------------------------------------------------------------------- convert


def test_convert_writes_torch_save_and_stock_dcp_that_stock_tools_load(root: Path, tmp_path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    expected = make_state(20)
    out = tmp_path / "model.pt"
    result = run("convert", root / "step-20", out, "--to", "torch")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(f"converted ours {root / 'step-20'} -> torch {out}: 4 items")
    loaded = torch.load(out, weights_only=True)
    assert loaded["step"] == 20
    for key in ("w", "b", "h"):
        assert torch.equal(
            loaded["model"][key].view(torch.uint8), expected["model"][key].view(torch.uint8)
        )
    doc = run_json("convert", root / "step-20", tmp_path / "stock", "--to", "dcp")
    assert doc["source_kind"] == "ours" and doc["target_kind"] == "dcp"
    assert doc["items"] == 4 and doc["tensor_bytes"] == (64 * 48 + 48) * 4 + 32 * 32 * 2
    back = zeros_like_state(expected)
    dcp.load(back, storage_reader=FileSystemReader(tmp_path / "stock"))
    assert_state_equal(back, expected)
    # And back into ours, re-encoded: the CLI's --codec reaches the writer.
    doc = run_json(
        "convert", tmp_path / "stock", tmp_path / "ours", "--to", "ours", "--codec", "zstd"
    )
    assert doc["source_kind"] == "dcp"
    assert_state_equal(load(str(tmp_path / "ours"), expected), expected)
    assert "zstd" in run("inspect", tmp_path / "ours").stdout


def test_convert_failures_are_one_line(root: Path, tmp_path: Path):
    missing = tmp_path / "nothing-here"
    result = run("convert", missing, tmp_path / "x.pt", "--to", "torch")
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith("error: ") and str(missing) in result.stderr
    assert result.stderr.count("\n") == 1
    run("convert", root / "step-20", tmp_path / "x.pt", "--to", "torch")
    again = run("convert", root / "step-20", tmp_path / "x.pt", "--to", "torch")
    assert again.exit_code == 1 and "x.pt" in again.stderr
    assert run("convert", root / "step-20", tmp_path / "x.pt", "--to", "nope").exit_code == 2
