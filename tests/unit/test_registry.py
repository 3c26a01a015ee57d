"""Plugin registry: entry points for real (a fake installed distribution on sys.path)."""

from __future__ import annotations

import textwrap
from importlib.metadata import entry_points

import pytest
from conftest import install_fake_distribution

from dcp_multilevel import ConfigError
from dcp_multilevel._registry import Registry
from dcp_multilevel.errors import RegistryError
from dcp_multilevel.stores import STORES, store_for
from dcp_multilevel.stores.local import LocalStore


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    """Install ``fake-store-pkg`` (one module + dist-info with an entry point) on sys.path."""
    source = textwrap.dedent(
        """
        from dcp_multilevel.stores.local import LocalStore

        class FakeStore(LocalStore):
            def __init__(self, where, **options):
                super().__init__(where.split("://", 1)[1], **options)
        """
    )
    install_fake_distribution(
        tmp_path,
        monkeypatch,
        "fake-store-pkg",
        "[dcp_multilevel.stores]\nfake = fake_store_mod:FakeStore\nbroken = no_such_module:X\n",
        {"fake_store_mod": source},
    )
    STORES.refresh()
    yield tmp_path
    STORES.refresh()


def test_builtin_file_store_is_registered_through_the_entry_point_group():
    (ep,) = [e for e in entry_points(group="dcp_multilevel.stores") if e.name == "file"]
    assert ep.value == "dcp_multilevel.stores.local:LocalStore"
    assert STORES.get("file") is LocalStore


def test_third_party_store_is_found_by_url_scheme(fake_distribution):
    store = store_for(f"fake://{fake_distribution}/root")
    assert type(store).__name__ == "FakeStore"
    store.write_atomic("x.bin", b"1")
    assert (fake_distribution / "root" / "x.bin").read_bytes() == b"1"
    assert "fake" in STORES.names()


def test_unimportable_plugin_names_its_entry_point(fake_distribution):
    with pytest.raises(RegistryError) as info:
        store_for("broken://x")
    assert str(info.value).startswith(
        "store 'broken' is registered by no_such_module:X but cannot be imported: "
    )


def test_unknown_scheme_lists_known_ones():
    with pytest.raises(RegistryError) as info:
        store_for("nosuch://bucket/x")
    assert str(info.value) == (
        f"unknown store 'nosuch' (known: {', '.join(STORES.names())}). "
        "Third-party stores register in entry-point group 'dcp_multilevel.stores'."
    )
    assert isinstance(info.value, LookupError)


def test_other_fsspec_protocols_use_the_remote_store():
    store = store_for("http://127.0.0.1:9/x")  # built without connecting
    assert type(store).__name__ == "RemoteStore"


def test_local_paths_refuse_remote_storage_options(tmp_path):
    with pytest.raises(ConfigError) as info:
        store_for(tmp_path, retries=3)
    assert str(info.value) == (
        f"options ['retries'] do not apply to the local directory store at {str(tmp_path)!r} "
        "(storage options are for remote URLs such as s3://)"
    )


def test_registering_a_taken_name_needs_clobber():
    reg: Registry[type] = Registry("dcp_multilevel.stores", "store")
    with pytest.raises(RegistryError) as info:
        reg.register("file", dict)
    assert str(info.value) == (
        "store 'file' is already registered; pass clobber=True to replace it"
    )
    reg.register("file", dict, clobber=True)
    assert reg.get("file") is dict
    reg.register("mine", list)
    with pytest.raises(RegistryError):
        reg.register("mine", tuple)


@pytest.fixture
def fake_codec_distribution(tmp_path, monkeypatch):
    """Install ``acme-codec`` (a Codec subclass + entry point) on sys.path."""
    from dcp_multilevel.codecs import CODECS

    source = textwrap.dedent(
        """
        from dcp_multilevel.codecs.base import Codec

        class XorCodec(Codec):
            name = "acme.xor"
            version = 3

            def encode(self, chunk, width, rotate):
                return bytes(b ^ 0x5A for b in chunk)

            def decode(self, payload, out, width, rotate):
                out[:] = bytes(b ^ 0x5A for b in payload)
        """
    )
    install_fake_distribution(
        tmp_path,
        monkeypatch,
        "acme-codec",
        "[dcp_multilevel.codecs]\nacme.xor = acme_codec:XorCodec\n",
        {"acme_codec": source},
    )
    CODECS.refresh()
    yield tmp_path
    CODECS.refresh()


def test_third_party_codec_saves_and_loads_through_dcp(fake_codec_distribution, tmp_path):
    import json

    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_multilevel import MultiLevelReader, MultiLevelWriter

    state = {"w": torch.arange(5000, dtype=torch.float32)}
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c", codec="acme.xor"))
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["items"][0]["transforms"] == ["acme.xor/3"]
    loaded = {"w": torch.zeros(5000)}
    dcp.load(loaded, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert torch.equal(loaded["w"], state["w"])
