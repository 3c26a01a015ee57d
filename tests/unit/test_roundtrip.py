"""Single-process round trips through dcp.save / dcp.load (no process group)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ALL_DTYPES, assert_bit_equal, random_tensor, rank_errors
from torch.distributed.checkpoint.api import CheckpointException

from dcp_multilevel import ConfigError, MultiLevelReader, MultiLevelWriter
from dcp_multilevel.errors import UnsupportedStateError


def zeros_like_state(state):
    """Same structure as ``state`` with every tensor zeroed and other values blanked."""
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None


def assert_state_equal(actual, expected, path="state"):
    if isinstance(expected, dict):
        assert set(actual) == set(expected), path
        for k in expected:
            assert_state_equal(actual[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_state_equal(a, e, f"{path}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert_bit_equal(actual, expected, path)
    else:
        assert actual == expected, path


@pytest.mark.parametrize("thread_count", [1, 3])
def test_every_dtype_nested_and_objects_round_trip_bit_exact(
    tmp_path, all_dtypes_state, thread_count
):
    path = tmp_path / "ckpt"
    dcp.save(all_dtypes_state, storage_writer=MultiLevelWriter(path, thread_count=thread_count))
    loaded = zeros_like_state(all_dtypes_state)
    dcp.load(loaded, storage_reader=MultiLevelReader(path, thread_count=thread_count))
    assert_state_equal(loaded, all_dtypes_state)


def test_thread_count_spreads_items_over_that_many_files(tmp_path, all_dtypes_state):
    dcp.save(all_dtypes_state, storage_writer=MultiLevelWriter(tmp_path / "c", thread_count=3))
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    names = sorted(f.rsplit("/", 1)[1].split(".")[0] for f in manifest["files"])
    assert names == ["0-0", "0-1", "0-2"]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_zero_dim_and_empty_tensors(tmp_path, dtype):
    state = {"zero_dim": random_tensor((), dtype, 1), "empty": random_tensor((0, 3), dtype, 2)}
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c"))
    loaded = {"zero_dim": torch.zeros((), dtype=dtype), "empty": torch.zeros((0, 3), dtype=dtype)}
    dcp.load(loaded, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert_state_equal(loaded, state)


def test_non_contiguous_sources_store_only_their_projection(tmp_path):
    base = random_tensor((8, 6), torch.float32, 3)
    state = {
        "transposed": base.t(),
        "strided": base[:, ::2],
        "expanded": random_tensor((1, 6), torch.float32, 4).expand(5, 6),
        "narrowed": base[2:5],
    }
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c"))
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    # 48 + 24 + 30 + 18 floats: the projections, not the 48-float base each time.
    assert sum(manifest["files"].values()) == (48 + 24 + 30 + 18) * 4
    loaded = {k: torch.zeros(v.shape) for k, v in state.items()}
    dcp.load(loaded, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert_state_equal(loaded, {k: v.contiguous() for k, v in state.items()})


@pytest.mark.parametrize(
    "how", ["save", "replica check", "async", "overlap", "fence check", "fence check, live"]
)
def test_conjugate_and_negative_views_store_their_values(tmp_path, how):
    # Their memory is not their values (torch resolves the bit lazily): the bytes
    # stored, and those the checks hash, must be the values', however read.
    from dcp_multilevel import BalancedSavePlanner, StagingConfig

    c = random_tensor((6,), torch.complex64, 6)
    state = {"conj": c.conj(), "neg": torch._neg_view(random_tensor((5,), torch.float64, 7))}
    want = {k: v.resolve_conj().resolve_neg() for k, v in state.items()}
    if how in ("save", "replica check"):
        planner = BalancedSavePlanner(verify_replicas=how == "replica check")
        dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c"), planner=planner)
    else:
        staging = StagingConfig(
            overlap=how != "async",
            check_fence=how.startswith("fence check"),
            budget_bytes=0 if how.endswith("live") else None,
        )
        r = dcp.async_save(state, storage_writer=MultiLevelWriter(tmp_path / "c", staging=staging))
        (r if how == "async" else r.upload_completion).result()
    loaded = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(loaded, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert_state_equal(loaded, want)


def test_load_into_non_contiguous_and_other_dtype_destinations(tmp_path):
    src = random_tensor((4, 6), torch.float32, 5)
    dcp.save({"w": src, "v": src}, storage_writer=MultiLevelWriter(tmp_path / "c"))
    holder = torch.zeros(6, 4)
    dest = {"w": holder.t(), "v": torch.zeros(4, 6, dtype=torch.float64)}
    dcp.load(dest, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert torch.equal(holder.t(), src)  # written through the transposed view
    assert torch.equal(dest["v"], src.double())  # cast like stock DCP's copy_


def test_parameters_and_module_state_round_trip(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7}
    expected = copy.deepcopy(state)
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c"))

    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    opt2 = torch.optim.AdamW(model2.parameters())
    model2(torch.randn(2, 8)).sum().backward()
    opt2.step()
    target = {"model": model2.state_dict(), "optim": opt2.state_dict(), "step": 0}
    dcp.load(target, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert_state_equal(target["model"], expected["model"])
    assert_state_equal(target["optim"]["state"], expected["optim"]["state"])
    assert target["step"] == 7


def test_checkpoint_id_argument_overrides_the_constructor_path(tmp_path):
    state = {"x": torch.arange(5)}
    writer = MultiLevelWriter(tmp_path / "unused")
    dcp.save(state, storage_writer=writer, checkpoint_id=tmp_path / "real")
    assert (tmp_path / "real" / "manifest.json").exists()
    assert not (tmp_path / "unused").exists()
    loaded = {"x": torch.zeros(5, dtype=torch.long)}
    dcp.load(
        loaded, storage_reader=MultiLevelReader(tmp_path / "x"), checkpoint_id=tmp_path / "real"
    )
    assert torch.equal(loaded["x"], state["x"])


def test_file_url_locations_work(tmp_path):
    url = f"file://{tmp_path}/c"
    dcp.save({"x": torch.ones(3)}, storage_writer=MultiLevelWriter(url))
    loaded = {"x": torch.zeros(3)}
    dcp.load(loaded, storage_reader=MultiLevelReader(url))
    assert torch.equal(loaded["x"], torch.ones(3))


def test_manifest_records_versions_and_no_pickle_anywhere(tmp_path, all_dtypes_state):
    dcp.save(all_dtypes_state, storage_writer=MultiLevelWriter(tmp_path / "c"))
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["format"] == "dcp_multilevel"
    assert manifest["format_version"] == 1
    assert manifest["plugin_version"] == "0.1.0"
    assert manifest["torch_version"] == torch.__version__
    # Tensor bytes are raw memory: no torch.save zip archives or pickle protocol headers,
    # except inside bytes items (non-tensor objects, loaded with weights_only=True).
    bytes_fqns = {k for k, v in manifest["state_dict"].items() if v["type"] == "bytes"}
    for item in manifest["items"]:
        if item["fqn"] in bytes_fqns:
            continue
        data = (tmp_path / "c" / item["file"]).read_bytes()[
            item["pos"] : item["pos"] + item["length"]
        ]
        expected = all_dtypes_state
        for part in manifest["planner_data"][item["fqn"]]:
            expected = expected[part]
        assert data == expected.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_quantized_tensor_is_refused_before_anything_is_written(tmp_path):
    q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"q": q}, storage_writer=MultiLevelWriter(tmp_path / "c"))
    assert any(isinstance(e, UnsupportedStateError) for e in rank_errors(info.value))
    assert "tensor 'q' has dtype torch.qint8, which dcp_multilevel cannot store" in str(info.value)
    assert not (tmp_path / "c" / "data").exists()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_bad_thread_count_is_a_config_error(tmp_path, bad):
    with pytest.raises(ConfigError, match=f"thread_count must be an integer >= 1, got {bad!r}"):
        MultiLevelWriter(tmp_path, thread_count=bad)
    with pytest.raises(ConfigError, match="thread_count must be an integer >= 1"):
        MultiLevelReader(tmp_path, thread_count=bad)


def test_use_collectives_false_is_refused_with_a_clear_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        dcp.save(
            {"x": torch.ones(1)},
            storage_writer=MultiLevelWriter(tmp_path / "c"),
            use_collectives=False,
        )
    assert str(info.value) == (
        "MultiLevelWriter needs dcp.save(..., use_collectives=True) (the default): "
        "the checkpoint is committed once, by the coordinator, for all ranks"
    )


def test_value_that_could_not_be_loaded_back_is_refused_at_save_time(tmp_path):
    with pytest.raises(CheckpointException) as info:
        dcp.save({"v": torch.__version__}, storage_writer=MultiLevelWriter(tmp_path / "c"))
    (err,) = rank_errors(info.value)
    assert isinstance(err, UnsupportedStateError)
    assert str(err) == (
        "value 'v' cannot be saved: loading it back with weights_only=True would fail "
        "(Unsupported global: GLOBAL torch.torch_version.TorchVersion was not an allowed "
        "global by default. Please use `torch.serialization.add_safe_globals("
        "[torch.torch_version.TorchVersion])` or the `torch.serialization.safe_globals("
        "[torch.torch_version.TorchVersion])` context manager to allowlist this global if you "
        "trust this class/function.). Store it as plain Python data (str, int, float, list, "
        "dict, tensor), or allowlist its type with torch.serialization.add_safe_globals([...]) "
        "in the saving and the loading process."
    )
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_a_value_that_loaded_back_once_is_checked_again_under_another_allowlist(tmp_path):
    # The check's verdict is kept for the same bytes, but only under the same
    # allowlist: a type taken off it is refused again.
    value = {"v": torch.__version__}
    saved = list(torch.serialization.get_safe_globals())
    try:
        torch.serialization.add_safe_globals([type(torch.__version__)])
        for step in range(2):  # the second save finds the verdict
            dcp.save(value, storage_writer=MultiLevelWriter(tmp_path / f"ok{step}"))
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)
        with pytest.raises(CheckpointException) as info:
            dcp.save(value, storage_writer=MultiLevelWriter(tmp_path / "refused"))
        (err,) = rank_errors(info.value)
        assert isinstance(err, UnsupportedStateError) and "TorchVersion" in str(err)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)
