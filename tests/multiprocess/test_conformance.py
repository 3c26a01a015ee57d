"""Every built-in store level kind and codec passes the shipped conformance suites
(``dcp_multilevel.testing``); the store suite runs in ``test_stores.py`` and
``test_remote_store.py``, an outside level kind in ``test_outside_level.py``."""

from __future__ import annotations

import pytest

from dcp_multilevel import Level
from dcp_multilevel.codecs import CODECS
from dcp_multilevel.testing import CodecTests, LevelTests


@pytest.mark.multiprocess
class TestStoreLevel(LevelTests):
    world, ranks_per_node = 2, 1

    @classmethod
    def level(cls, root):
        return Level(f"{root}/remote", codec="bytegroup")


@pytest.mark.multiprocess
class TestPartnerLevel(LevelTests):
    world, ranks_per_node = 4, 2

    @classmethod
    def level(cls, root):
        return Level(f"partner:{root}/n{{node}}/partner", replicas=2)


@pytest.mark.multiprocess
class TestErasureLevel(LevelTests):
    world, ranks_per_node = 3, 1

    @classmethod
    def level(cls, root):
        return Level(f"erasure:{root}/n{{node}}/erasure", data=2, parity=1)


class TestBytegroupCodec(CodecTests):
    @pytest.fixture
    def codec(self):
        return CODECS.get("dcp_multilevel.bytegroup")(1)


class TestZstdCodec(CodecTests):
    @pytest.fixture
    def codec(self):
        return CODECS.get("dcp_multilevel.zstd")(3)
