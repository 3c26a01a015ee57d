"""The command-line tool on quarantined checkpoints (their save's health checks found
something): ``ls`` marks them with the reason, ``verify`` and ``inspect`` report every
finding, ``gc`` counts them after the clean ones. Checkpoints written by dcp.save, a
health record then sealed into their manifests; the CLI run for real (CliRunner)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _damage import flip_byte
from click.testing import CliRunner, Result

from dcp_multilevel import MultiLevelWriter
from dcp_multilevel.cli import main
from dcp_multilevel.cli.ls import REASON_WIDTH
from dcp_multilevel.format import Finding, Health, seal_manifest

NONFINITE = Finding("nonfinite", "2 non-finite values in 1 tensor", ("w",), (0,))
POISON = Health(("nonfinite",), (NONFINITE,))
CLEAN = Health(("nonfinite",))
REASON = "nonfinite: 2 non-finite values in 1 tensor (rank 0; 'w')"


def save(path: Path, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    state = {"w": torch.randn(32, 16, generator=gen), "b": torch.randn(16, generator=gen)}
    dcp.save(state, storage_writer=MultiLevelWriter(path, sync_files=False))


def set_health(ckpt: Path, health: Health | None) -> None:
    """Seal ``health`` into the checkpoint's manifest, as a save whose checks ran would
    (None: no record, as a manifest written before checks existed)."""
    manifest = ckpt / "manifest.json"
    doc = json.loads(manifest.read_bytes())
    doc.pop("health", None)
    if health is not None:
        doc["health"] = health.to_json()
    manifest.write_bytes(seal_manifest(doc))


def run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def run_json(*args: object, code: int = 0) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == code, result.stderr
    return json.loads(result.stdout)


def rows(stdout: str) -> dict[int, str]:
    """The table rows of ``ls`` output by step."""
    out = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[│|]", line) if c.strip()]
        if cells and cells[0].isdigit():
            out[int(cells[0])] = line
    return out


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Steps 1 and 2 clean (1: no health record, as before checks existed; 2: checked,
    nothing found), 3, 4 and 5 quarantined."""
    r = tmp_path / "root"
    for step in range(1, 6):
        save(r / f"step-{step}", step)
    set_health(r / "step-1", None)
    set_health(r / "step-2", CLEAN)
    for step in (3, 4, 5):
        set_health(r / f"step-{step}", POISON)
    return r


# --------------------------------------------------------------------------- ls


def test_ls_marks_quarantined_steps_with_their_reason(root):
    result = run("ls", root)
    assert result.exit_code == 0, result.stderr
    by_step = rows(result.stdout)
    assert sorted(by_step) == [1, 2, 3, 4, 5]
    for step in (3, 4, 5):
        assert f"QUARANTINED: {REASON}" in by_step[step]
    for step in (1, 2):  # no record (old), and checked with nothing found: clean
        assert "clean" in by_step[step] and "QUARANTINED" not in by_step[step]
        assert "complete" in by_step[step]


def test_ls_json_carries_quarantined_and_the_health_record(root):
    (listing,) = run_json("ls", root)["roots"]
    by_step = {c["step"]: c for c in listing["checkpoints"]}
    assert by_step[1]["quarantined"] is False and by_step[1]["health"] is None
    assert by_step[2]["quarantined"] is False
    assert by_step[2]["health"] == {"checked": ["nonfinite"], "findings": []}
    for step in (3, 4, 5):
        assert by_step[step]["quarantined"] is True
        assert by_step[step]["health"] == {
            "checked": ["nonfinite"],
            "findings": [
                {
                    "check": "nonfinite",
                    "message": "2 non-finite values in 1 tensor",
                    "items": ["w"],
                    "ranks": [0],
                }
            ],
        }


def test_ls_shortens_a_long_reason_and_shows_a_checked_clean_step_as_clean(tmp_path):
    r = tmp_path / "root"
    save(r / "step-1", 1)
    save(r / "step-2", 2)
    set_health(r / "step-1", Health(("nonfinite", "replicas")))  # checks ran, found nothing
    items = tuple(f"model.layers.{i}.attention.wq.weight" for i in range(20))
    many = Finding(
        "replicas", "replicas of 20 tensors differ across data-parallel ranks", items, (0, 1, 2, 3)
    )
    set_health(r / "step-2", Health(("nonfinite", "replicas"), (many, NONFINITE)))
    by_step = rows(run("ls", r).stdout)
    assert "clean" in by_step[1] and "QUARANTINED" not in by_step[1]
    shown = by_step[2].split("QUARANTINED: ", 1)[1]
    assert shown.startswith("replicas: replicas of 20 tensors differ")
    assert "…" in shown and len(shown.split("…")[0]) < REASON_WIDTH
    (listing,) = run_json("ls", r)["roots"]
    checked, poisoned = listing["checkpoints"]
    assert checked["quarantined"] is False
    assert checked["health"] == {"checked": ["nonfinite", "replicas"], "findings": []}
    assert poisoned["quarantined"] is True and len(poisoned["health"]["findings"]) == 2


# --------------------------------------------------------------------------- verify


def test_verify_passes_a_quarantined_checkpoint_and_says_why(root):
    result = run("verify", root / "step-3")
    assert result.exit_code == 0, result.stderr
    head, finding = result.stdout.splitlines()
    assert head.startswith(f"ok   file://{root}/step-3: 2 items")
    assert "QUARANTINED" in head
    assert finding == f"  {REASON}"
    doc = run_json("verify", root)
    assert doc["ok"] is True
    reports = {r["url"].rsplit("/", 1)[1]: r for r in doc["checkpoints"]}
    assert all(r["ok"] for r in reports.values())
    assert [s for s, r in sorted(reports.items()) if r["quarantined"]] == [
        "step-3",
        "step-4",
        "step-5",
    ]
    assert reports["step-3"]["health"] == POISON.to_json()
    assert reports["step-1"]["health"] is None
    clean = run("verify", root / "step-1").stdout
    assert clean.startswith("ok   ") and "QUARANTINED" not in clean


def test_verify_of_a_bad_quarantined_checkpoint_reports_both(root):
    ckpt = root / "step-4"
    (data,) = sorted((ckpt / "data").iterdir())
    w = run_json("inspect", ckpt, "--item", "w")["item"]["chunks"][0]
    flip_byte(data, w["pos"] + 10)
    result = run("verify", ckpt)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"BAD  file://{ckpt}: 1 of 2 items bad; QUARANTINED")
    assert f"  {REASON}" in lines and any(line.startswith("  w (chunk at") for line in lines)
    (report,) = run_json("verify", ckpt, code=1)["checkpoints"]
    assert report["ok"] is False and report["quarantined"] is True


# --------------------------------------------------------------------------- inspect


def test_inspect_shows_the_health_record_and_every_finding(root):
    out = run("inspect", root / "step-5").stdout
    assert "QUARANTINED: 1 finding (checked: nonfinite)" in out
    assert "health findings" in out
    (row,) = [line for line in out.splitlines() if "2 non-finite values in 1 tensor" in line]
    cells = [c.strip() for c in re.split(r"[│|]", row) if c.strip()]
    assert cells == ["nonfinite", "2 non-finite values in 1 tensor", "0", "w"]
    doc = run_json("inspect", root / "step-5")
    assert doc["quarantined"] is True and doc["health"] == POISON.to_json()
    old = run("inspect", root / "step-1").stdout
    assert "clean (no health record: saved without checks)" in old
    assert "health findings" not in old
    assert run_json("inspect", root / "step-1")["health"] is None
    checked = run("inspect", root / "step-2").stdout
    assert "clean (checked: nonfinite)" in checked and "health findings" not in checked


# --------------------------------------------------------------------------- gc


def test_gc_retires_quarantined_steps_first_and_names_them(root):
    plan = run_json("gc", root, "--keep", "2", "--dry-run")
    # 1 and 2 are the clean steps --keep counts; 5, quarantined but newer than every
    # clean step, stays to be inspected; 3 and 4 take no place.
    assert plan["kept"] == [1, 2, 5] and plan["kept_as_reference"] == []
    assert plan["expired"] == [3, 4]
    assert plan["quarantined"] == [3, 4, 5]
    human = run("gc", root, "--keep", "2", "--dry-run").stdout
    assert "keeping steps 1, 2, 5 (5: quarantined)" in human
    assert "would delete step 3 (expired, quarantined)" in human
    assert "would delete step 4 (expired, quarantined)" in human

    done = run_json("gc", root, "--keep", "2")
    assert {**done, "dry_run": True} == plan
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2", "step-5"]
    assert run("verify", root).exit_code == 0


def test_gc_keeps_quarantined_steps_in_free_places_only(root):
    # Room for all: quarantined steps stay while clean ones leave places free.
    assert run_json("gc", root, "--keep", "5", "--dry-run")["expired"] == []
    # 2 clean steps and --keep 3: one free place, for the newest quarantined step.
    assert run_json("gc", root, "--keep", "3", "--dry-run")["kept"] == [1, 2, 5]
    # A clean step newer than them all: the quarantined ones go first, every one.
    save(root / "step-6", 6)
    plan = run_json("gc", root, "--keep", "2", "--dry-run")
    assert plan["kept"] == [2, 6] and plan["expired"] == [1, 3, 4, 5]
    assert plan["quarantined"] == [3, 4, 5]
    # Only the steps newer than the kept clean ones are read for their health.
    assert run_json("gc", root, "--keep", "1", "--dry-run")["quarantined"] == []


# --------------------------------------------------------------------------- a real save


def test_a_save_of_non_finite_values_is_listed_quarantined(tmp_path):
    """The writer's own checks, not a record sealed in afterwards."""
    w = torch.ones(8, 4)
    w[0, 0], w[1, 1] = float("nan"), float("inf")
    dcp.save(
        {"w": w}, storage_writer=MultiLevelWriter(tmp_path / "root" / "step-1", sync_files=False)
    )
    save(tmp_path / "root" / "step-2", 2)
    by_step = rows(run("ls", tmp_path / "root").stdout)
    assert "QUARANTINED: nonfinite" in by_step[1]
    assert "clean" in by_step[2]
    (listing,) = run_json("ls", tmp_path / "root")["roots"]
    poisoned, clean = listing["checkpoints"]
    assert poisoned["quarantined"] is True and clean["quarantined"] is False
    (finding,) = poisoned["health"]["findings"]
    assert finding["check"] == "nonfinite" and finding["items"] == ["w"]
