"""Configuration errors found when a Level or CheckpointManager is made, not at a save."""

from __future__ import annotations

import os
import uuid

import fsspec
import pytest
import torch
from conftest import install_fake_distribution

from dcp_multilevel import CheckpointManager, ConfigError, Level
from dcp_multilevel.checkpoint import StoredCheckpoint
from dcp_multilevel.codecs import CODECS
from dcp_multilevel.levels.topology import Topology

REASON = (
    ": each level needs a root of its own, outside the others' (a level's retention, "
    "crash sweeps and loads would see the other's checkpoints)"
)


def refused(levels, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        CheckpointManager(levels, sweep_older_than_s=None, **kwargs)
    return str(info.value)


def test_the_same_path_on_two_levels_is_refused(tmp_path):
    a, b = f"{tmp_path}/ckpt", f"{tmp_path}/./ckpt/"
    assert refused([Level(a), Level(b)]) == (
        f"levels 0 ({a!r}) and 1 ({b!r}) are the same location ({b})" + REASON
    )


def test_a_plain_path_and_its_file_url_are_one_location(tmp_path):
    a, b = f"{tmp_path}/ckpt", f"file://{tmp_path}/x/../ckpt"
    assert refused([Level(a), Level("memory://r"), Level(b)]) == (
        f"levels 0 ({a!r}) and 2 ({b!r}) are the same location ({b})" + REASON
    )


def test_a_relative_path_is_compared_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = f"{tmp_path}/ckpt"
    assert refused([Level(a), Level("ckpt")]) == (
        f"levels 0 ({a!r}) and 1 ('ckpt') are the same location (ckpt)" + REASON
    )


def test_a_level_inside_another_is_refused(tmp_path):
    a, b = f"{tmp_path}/ckpt", f"{tmp_path}/ckpt/remote"
    assert refused([Level(a), Level(b)]) == (
        f"level 1 ({b!r}) is inside level 0 ({a!r}) ({b} is in {a})" + REASON
    )
    # The other way round, and a sibling whose name only starts alike is fine.
    assert refused([Level(b), Level(f"{tmp_path}/ckpt-other"), Level(a)]) == (
        f"level 0 ({b!r}) is inside level 2 ({a!r}) ({b} is in {a})" + REASON
    )


def test_one_fsspec_url_with_and_without_trailing_slash_is_refused(tmp_path):
    first = f"{tmp_path}/ckpt"
    assert refused([Level(first), Level("memory://bucket/run"), Level("memory://bucket/run/")]) == (
        "levels 1 ('memory://bucket/run') and 2 ('memory://bucket/run/') are the same "
        "location (memory://bucket/run/)" + REASON
    )
    assert refused([Level(first), Level("s3://b/run//"), Level("s3a://b/run/x")]) == (
        "level 2 ('s3a://b/run/x') is inside level 1 ('s3://b/run//') "
        "(s3a://b/run/x is in s3://b/run//)" + REASON
    )


def _saved_once(levels, **kwargs) -> tuple[list, list]:
    """Save step 1 through a manager over ``levels``: each level's steps, and each
    drain's (step, level, committed, error)."""
    mgr = CheckpointManager(levels, sweep_older_than_s=None, **kwargs)
    try:
        mgr.save({"w": torch.arange(64, dtype=torch.float32)}, step=1)
        drains = sorted((r.step, r.level, r.committed, r.error) for r in mgr.wait())
        return [mgr.steps(i) for i in range(len(levels))], drains
    finally:
        mgr.close()


def test_different_buckets_and_schemes_are_not_compared(tmp_path):
    # Buckets whose names only start alike (memory://<u>run, memory://<u>run2) are
    # different stores: accepted, and each level holds a copy of its own.
    u = uuid.uuid4().hex[:8]
    run, run2 = f"memory://{u}run", f"memory://{u}run2/x"
    steps, drains = _saved_once([Level(f"{tmp_path}/ckpt"), Level(run), Level(run2)])
    assert steps == [[1], [1], [1]]
    assert drains == [(1, run, True, None), (1, run2, True, None)]
    memory = fsspec.filesystem("memory")
    assert memory.exists(f"/{u}run/step-1/manifest.json")
    assert memory.exists(f"/{u}run2/x/step-1/manifest.json")
    # The file path /x and the URL memory:///x name different stores.
    first, second = f"{tmp_path}/run", f"memory://{tmp_path}/run"
    steps, drains = _saved_once([Level(first), Level(second)])
    assert steps == [[1], [1]]
    assert drains == [(1, second, True, None)]
    assert os.listdir(first) == ["step-1"]
    assert memory.exists(f"{tmp_path}/run/step-1/manifest.json")


def test_node_templates_are_compared_per_node(tmp_path):
    one = Topology((0,))
    first, partner = f"{tmp_path}/{{node}}/ckpt", f"partner:{tmp_path}/{{node}}/partner"
    # Distinct on every node: accepted as far as the roots go (a partner level
    # then needs a second node).
    with pytest.raises(ConfigError) as info:
        CheckpointManager([Level(first), Level(partner)], topology=one)
    assert str(info.value) == (
        f"level {partner.replace('{node}', '0')!r} keeps copies on other nodes, but every "
        "rank is on node 0: a copy on the same node is lost with it. Run on several nodes "
        "(set DCP_ML_NODE per process to simulate them on one machine), or drop this level."
    )
    # Two templates, each filled in with the node: two levels of their own there.
    steps, drains = _saved_once([Level(first), Level(f"{tmp_path}/{{node}}/more")], topology=one)
    assert steps == [[1], [1]]
    assert drains == [(1, f"{tmp_path}/0/more", True, None)]
    assert sorted(os.listdir(tmp_path / "0")) == ["ckpt", "more"]
    assert os.listdir(tmp_path / "0" / "more") == ["step-1"]
    # The same after the node is filled in.
    pinned = f"{tmp_path}/0/ckpt"
    assert refused([Level(first), Level(pinned)], topology=one) == (
        f"levels 0 ({first!r}) and 1 ({pinned!r}) are the same location on node 0 "
        f"({pinned})" + REASON
    )
    # The same on every node: a partner level where the checkpoints are.
    same = f"partner:{tmp_path}/{{node}}/ckpt"
    assert refused([Level(first), Level(same)], topology=one) == (
        f"levels 0 ({first!r}) and 1 ({same!r}) are the same location on node 0 "
        f"({same.replace('{node}', '0')})" + REASON
    )
    inside = f"erasure:{tmp_path}/{{node}}/ckpt/erasure"
    assert refused([Level(first), Level(inside, data=2, parity=1)], topology=one) == (
        f"level 1 ({inside!r}) is inside level 0 ({first!r}) on node 0 "
        f"({inside.replace('{node}', '0')} is in {first.replace('{node}', '0')})" + REASON
    )


UNKNOWN = (
    "Level({url!r}).codec='lz5' is not a codec this process can use (built-ins: 'zstd', "
    "'bytegroup'): unknown codec 'lz5' (known: dcp_multilevel.bytegroup, "
    "dcp_multilevel.zstd). Third-party codecs register in entry-point group "
    "'dcp_multilevel.codecs'."
)


def test_an_unknown_codec_is_refused_by_the_level(tmp_path):
    with pytest.raises(ConfigError) as info:
        Level(str(tmp_path), codec="lz5")
    assert str(info.value) == UNKNOWN.format(url=str(tmp_path))


def test_a_codec_known_but_not_installed_gets_the_registry_hint(tmp_path, monkeypatch):
    install_fake_distribution(
        tmp_path, monkeypatch, "acme-gone", "[dcp_multilevel.codecs]\nacme.gone = acme_gone:Codec\n"
    )
    CODECS.refresh()
    try:
        with pytest.raises(ConfigError) as info:
            Level(str(tmp_path), codec="acme.gone")
    finally:
        monkeypatch.undo()
        CODECS.refresh()
    assert str(info.value) == (
        f"Level({str(tmp_path)!r}).codec='acme.gone' is not a codec this process can use "
        "(built-ins: 'zstd', 'bytegroup'): codec 'acme.gone' is registered by acme_gone:Codec "
        "but cannot be imported: No module named 'acme_gone'"
    )


def test_a_codec_gone_since_the_level_was_made_is_refused_by_the_manager(tmp_path, monkeypatch):
    source = (
        "from dcp_multilevel.codecs.base import Codec\n\n"
        "class Plain(Codec):\n"
        "    name = 'acme.plain'\n"
        "    version = 1\n"
    )
    install_fake_distribution(
        tmp_path,
        monkeypatch,
        "acme-plain",
        "[dcp_multilevel.codecs]\nacme.plain = acme_plain:Plain\n",
        {"acme_plain": source},
    )
    CODECS.refresh()
    first = str(tmp_path / "ckpt")
    level = Level(first, codec="acme.plain")  # installed now
    monkeypatch.undo()  # uninstalled
    CODECS.refresh()
    with pytest.raises(ConfigError) as info:
        CheckpointManager([level], sweep_older_than_s=None)
    assert str(info.value) == UNKNOWN.format(url=first).replace("'lz5'", "'acme.plain'")
    assert not os.path.exists(first)  # refused before anything was made


def test_a_valid_ladder_is_accepted(tmp_path):
    local, remote = f"{tmp_path}/local", f"{tmp_path}/remote"
    levels = [Level(local, codec="zstd"), Level(remote, every=2)]
    mgr = CheckpointManager(levels, sweep_older_than_s=None)
    try:
        state = {"w": torch.arange(4096, dtype=torch.float32)}  # compressible
        for step in (1, 2):
            mgr.save(state, step=step)
        drains = [(r.step, r.level, r.committed, r.error) for r in mgr.wait()]
        # What each level was configured with: the first takes every save, zstd-coded;
        # the second every 2nd, uncoded.
        assert (mgr.steps(0), mgr.steps(1)) == ([1, 2], [2])
        assert drains == [(2, remote, True, None)]
        coded = StoredCheckpoint.at(f"{local}/step-2").manifest().locations
        plain = StoredCheckpoint.at(f"{remote}/step-2").manifest().locations
        assert [loc.transforms for loc in coded.values()] == [("dcp_multilevel.zstd/1",)]
        assert [loc.transforms for loc in plain.values()] == [()]
        loaded = {"w": torch.zeros(4096)}
        assert mgr.load_latest(loaded) == 2
        assert torch.equal(loaded["w"], state["w"])
    finally:
        mgr.close()
