"""The manifest parser against hostile input: targeted cases and Hypothesis fuzzing."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_multilevel import CheckpointNotFoundError, ConfigError, MultiLevelReader, MultiLevelWriter
from dcp_multilevel.errors import ManifestError, UnsupportedFormatVersionError
from dcp_multilevel.format import decode_manifest, encode_manifest
from dcp_multilevel.format.manifest import seal

SUFFIX = (
    ". The checkpoint is damaged or was not written by dcp_multilevel; load it from another "
    "level or copy."
)


@pytest.fixture(scope="module")
def valid_doc(tmp_path_factory) -> dict:
    """A real manifest (tensor chunks, a bytes item, planner data) as a dict."""
    path = tmp_path_factory.mktemp("m") / "c"
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "meta": {"step": 3}}
    dcp.save(state, storage_writer=MultiLevelWriter(path))
    return json.loads((path / "manifest.json").read_text())


def _sealed(doc) -> bytes:
    """``doc`` as manifest bytes with a valid digest (the field checks run past it)."""
    return seal(json.dumps({k: v for k, v in doc.items() if k != "digest"}))


def _decode(doc) -> object:
    return decode_manifest(_sealed(doc), checkpoint="ck")


def _item(doc, fqn):
    return next(i for i in doc["items"] if i["fqn"] == fqn)


def test_valid_manifest_decodes_to_dcp_metadata(valid_doc):
    m = _decode(valid_doc)
    w = m.metadata.state_dict_metadata["w"]
    assert w.size == torch.Size([3, 4]) and w.properties.dtype == torch.float32
    assert m.metadata.planner_data["meta.step"] == ("meta", "step")
    assert len(m.locations) == 2


def test_encoding_is_deterministic(valid_doc):
    m = _decode(valid_doc)
    kwargs = dict(save_id=m.save_id, world_size=m.world_size, created_unix=m.created_unix)
    a = encode_manifest(m.metadata, m.locations, m.files, **kwargs)
    b = encode_manifest(m.metadata, dict(reversed(m.locations.items())), m.files, **kwargs)
    assert a == b
    assert _decode(json.loads(a)).locations == m.locations


def test_the_manifest_is_one_json_document_written_in_batches(tmp_path):
    # Encoded a batch of entries at a time (no dict per entry outlives its batch):
    # the text must be that of one json.dumps of the document, across batches.
    from dcp_multilevel.format import Reference

    state = {f"layer{i}": {"w": torch.full((2, i % 3 + 1), float(i))} for i in range(150)}
    state["meta"] = {"step": 3, "name": "run é"}
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c"))
    raw = (tmp_path / "c" / "manifest.json").read_bytes()
    one = json.dumps(json.loads(raw), separators=(",", ":"), allow_nan=False).encode()
    assert raw == one
    m = decode_manifest(raw, checkpoint="ck")
    assert len(m.locations) == 152
    out = encode_manifest(
        m.metadata,
        m.locations,
        m.files,
        save_id="s",
        world_size=2,
        created_unix=1.5,
        reference=Reference(save_id="r", checkpoint="step-8"),
        extra={"k": [1, 2.5, None]},
    )
    doc = json.loads(out)
    assert out == json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    assert doc["reference"] == {"save_id": "r", "checkpoint": "step-8"}
    assert doc["extra"] == {"k": [1, 2.5, None]} and doc["format_version"] == 2
    assert decode_manifest(out, checkpoint="ck").locations == m.locations


def mutate(doc, fn):
    doc = copy.deepcopy(doc)
    fn(doc)
    return doc


HOSTILE = {
    "parent_dir_path": (
        lambda d: _item(d, "w").update(file="../../etc/passwd"),
        "items[{w}].file '../../etc/passwd' in checkpoint 'ck' is not a safe relative path "
        "(component '..'); a checkpoint may only name files inside itself",
    ),
    "absolute_path_in_files": (
        lambda d: d["files"].update({"/etc/passwd": 10}),
        "data file path '/etc/passwd' in checkpoint 'ck' is not a safe relative path "
        "(component ''); a checkpoint may only name files inside itself",
    ),
    "range_past_file_end": (
        lambda d: _item(d, "w").update(pos=10**6),
        None,  # message checked by prefix below (file name contains the save id)
    ),
    "unknown_dtype": (
        lambda d: d["state_dict"]["w"].update(dtype="float128"),
        "manifest of checkpoint 'ck' is invalid: state_dict['w'].dtype 'float128' is not a "
        "dtype this release knows" + SUFFIX,
    ),
    "dtype_disagrees_with_stored_length": (
        lambda d: d["state_dict"]["w"].update(dtype="float64"),
        "manifest of checkpoint 'ck' is invalid: items[{w}] ('w') raw_length 48 != 96 bytes of "
        "a [3, 4] float64 chunk" + SUFFIX,
    ),
    "chunk_outside_tensor": (
        lambda d: d["state_dict"]["w"]["chunks"][0].update(offsets=[2, 0]),
        "manifest of checkpoint 'ck' is invalid: state_dict['w'].chunks[0] (offsets [2, 0], "
        "sizes [3, 4]) lies outside size [3, 4]" + SUFFIX,
    ),
    "negative_length": (
        lambda d: _item(d, "w").update(length=-1),
        "manifest of checkpoint 'ck' is invalid: items[{w}].length must be a non-negative "
        "integer below 2**62, got -1" + SUFFIX,
    ),
    "boolean_as_integer": (
        lambda d: _item(d, "w").update(pos=True),
        "manifest of checkpoint 'ck' is invalid: items[{w}].pos must be an integer, got a "
        "boolean" + SUFFIX,
    ),
    "item_for_unknown_fqn": (
        lambda d: _item(d, "w").update(fqn="nope"),
        "manifest of checkpoint 'ck' is invalid: items[{w}] names 'nope', which is not in "
        "state_dict" + SUFFIX,
    ),
    "chunk_without_item": (
        lambda d: d.update(items=[i for i in d["items"] if i["fqn"] != "w"]),
        "manifest of checkpoint 'ck' is invalid: 'w' (offsets torch.Size([0, 0])) has no "
        "stored item" + SUFFIX,
    ),
    "duplicate_item": (
        lambda d: d["items"].append(copy.deepcopy(_item(d, "w"))),
        "manifest of checkpoint 'ck' is invalid: items[{n}] ('w', offsets [0, 0]) is stored "
        "twice" + SUFFIX,
    ),
    "bad_checksum_form": (
        lambda d: _item(d, "w").update(checksum="md5:abc"),
        "manifest of checkpoint 'ck' is invalid: items[{w}].checksum 'md5:abc' is not of the "
        "form 'xxh3_64:<16 hex>'" + SUFFIX,
    ),
    "missing_field": (
        lambda d: d.pop("items"),
        "manifest of checkpoint 'ck' is invalid: manifest lacks field 'items'" + SUFFIX,
    ),
    "not_our_format": (
        lambda d: d.update(format="something-else"),
        "manifest of checkpoint 'ck' is invalid: field 'format' is 'something-else', expected "
        "'dcp_multilevel'" + SUFFIX,
    ),
    "bytes_item_with_offsets": (
        lambda d: _item(d, "meta.step").update(offsets=[0]),
        "manifest of checkpoint 'ck' is invalid: items[{m}] ('meta.step') is a bytes item but "
        "has tensor offsets" + SUFFIX,
    ),
}


def test_extra_values_round_trip_and_are_plain_json(valid_doc, tmp_path):
    """A writer's extra values come back as Manifest.extra; old manifests have none;
    what JSON cannot hold is refused when the writer is built, not at its commit."""
    assert _decode(valid_doc).extra == {}
    m = _decode(valid_doc)
    kwargs = dict(save_id=m.save_id, world_size=m.world_size, created_unix=m.created_unix)
    extra = {"tool": {"clock": 12.5, "last": {"0": [3, 1.5]}, "curve": None}}
    doc = encode_manifest(m.metadata, m.locations, m.files, extra=extra, **kwargs)
    assert _decode(json.loads(doc)).extra == extra
    with pytest.raises(ManifestError, match="extra must be an object"):
        _decode(mutate(valid_doc, lambda d: d.update(extra=[1])))
    path = tmp_path / "c"
    dcp.save({"w": torch.ones(3)}, storage_writer=MultiLevelWriter(path, extra=extra))
    assert decode_manifest((path / "manifest.json").read_bytes()).extra == extra
    with pytest.raises(ConfigError, match="plain JSON"):
        MultiLevelWriter(path, extra={"x": float("nan")})


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifest_is_a_clear_manifest_error(valid_doc, case):
    fn, message = HOSTILE[case]
    fqns = [i["fqn"] for i in valid_doc["items"]]
    idx = {"w": fqns.index("w"), "m": fqns.index("meta.step"), "n": len(fqns)}
    with pytest.raises(ManifestError) as info:
        _decode(mutate(valid_doc, fn))
    if message is None:
        assert str(info.value).startswith(
            f"manifest of checkpoint 'ck' is invalid: items[{idx['w']}] ('w') spans bytes "
            "1000000..1000048"
        )
        assert "past its recorded size" in str(info.value)
    else:
        assert str(info.value) == message.format(**idx)
    assert info.value.checkpoint == "ck"


def test_unknown_format_version_says_what_to_do(valid_doc):
    doc = mutate(valid_doc, lambda d: d.update(format_version=99, plugin_version="9.0"))
    with pytest.raises(UnsupportedFormatVersionError) as info:
        _decode(doc)
    assert str(info.value) == (
        "checkpoint 'ck' uses dcp_multilevel format version 99 (written by plugin '9.0'); "
        "this is plugin 0.1.0, which reads format versions 1 and 2. Install a dcp_multilevel "
        "release that supports it."
    )


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"", "it is not valid JSON"),
        (b"\xff\xfe", "it is not valid JSON"),
        (b'{"format": NaN}', "it is not valid JSON (non-standard JSON constant NaN"),
        (b"[1, 2]", "the top level must be an object"),
        (b"[" * 100000 + b"]" * 100000, "it is not valid JSON"),
    ],
)
def test_garbage_is_rejected_not_crashed_on(raw, why):
    with pytest.raises(ManifestError) as info:
        decode_manifest(raw, checkpoint="ck")
    assert str(info.value).startswith(f"manifest of checkpoint 'ck' is invalid: {why}")


def test_reader_reports_a_missing_checkpoint(tmp_path):
    reader = MultiLevelReader(tmp_path / "nothing")
    with pytest.raises(CheckpointNotFoundError) as info:
        reader.read_metadata()
    assert str(info.value) == (
        f"no committed checkpoint at file://{tmp_path}/nothing: manifest.json is missing (a "
        "save that did not finish leaves none). Check the path, or load an earlier checkpoint."
    )
    assert isinstance(info.value, FileNotFoundError)


# ----------------------------------------------------------------------------- fuzzing

json_leaf = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text()
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _check_decoded(m) -> None:
    """Whatever decodes must be safe to act on."""
    for loc in m.locations.values():
        assert loc.offset + loc.length <= m.files[loc.file]
        assert not loc.file.startswith("/") and ".." not in loc.file.split("/")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=512))
def test_fuzz_arbitrary_bytes_only_raise_manifest_error(data):
    try:
        _check_decoded(decode_manifest(data))
    except ManifestError:
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_mutated_real_manifest_only_raises_manifest_error(valid_doc, data):
    doc = copy.deepcopy(valid_doc)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(json_value)
    try:
        _check_decoded(decode_manifest(_sealed(doc)))
    except ManifestError:
        pass
