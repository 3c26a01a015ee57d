"""Configuration errors found when a Level or CheckpointManager is made, not at a save."""

from __future__ import annotations

import os
import re

import pytest
from conftest import install_fake_distribution

from dcp_multilevel import CheckpointManager, ConfigError, Level
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


def test_different_buckets_and_schemes_are_not_compared(tmp_path):
    levels = [Level(f"{tmp_path}/ckpt"), Level("memory://run"), Level("memory://run2/x")]
    mgr = CheckpointManager(levels, sweep_older_than_s=None)
    mgr.close()
    # The file path /x and the URL memory:///x name different stores.
    mgr = CheckpointManager([Level(f"{tmp_path}/run"), Level(f"memory://{tmp_path}/run")])
    mgr.close()


def test_node_templates_are_compared_per_node(tmp_path):
    one = Topology((0,))
    first, partner = f"{tmp_path}/{{node}}/ckpt", f"partner:{tmp_path}/{{node}}/partner"
    # Distinct on every node: accepted as far as the roots go (a partner level
    # then needs a second node).
    with pytest.raises(ConfigError, match="keeps copies on other nodes, but every rank"):
        CheckpointManager([Level(first), Level(partner)], topology=one)
    mgr = CheckpointManager([Level(first), Level(f"{tmp_path}/{{node}}/more")], topology=one)
    mgr.close()
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
        tmp_path, monkeypatch, "acme-plain",
        "[dcp_multilevel.codecs]\nacme.plain = acme_plain:Plain\n", {"acme_plain": source},
    )  # fmt: skip
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
    levels = [Level(f"{tmp_path}/local", codec="zstd"), Level(f"{tmp_path}/remote", every=2)]
    mgr = CheckpointManager(levels, sweep_older_than_s=None)
    mgr.close()
    assert re.fullmatch(r".*/remote", mgr.levels[1].url)
