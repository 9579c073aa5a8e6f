"""Target profiles: the built-in table, user profile files, target lists."""

from __future__ import annotations

import json

import pytest

from manifests.errors import UsageError
from manifests.targets import all_profiles, get_profile, parse_targets

BUILT_IN = {"jetson-thor", "igx-thor", "drive-agx-thor", "dgx-spark", "jetson-agx-orin", "jetson-orin-nano", "cpu"}


def test_built_in_profiles_carry_the_target_facts():
    profiles = {p.id: p for p in all_profiles()}
    assert BUILT_IN <= set(profiles)
    thor = profiles["jetson-thor"]
    assert (thor.cpu_arch, thor.compute_capability, thor.backend) == ("aarch64", "11.0", "tensorrt")
    assert thor.matches_compute_capability("10.1")  # what CUDA 12.9 and older call Thor
    assert {"fp8", "nvfp4"} <= set(thor.precisions)
    assert profiles["dgx-spark"].compute_capability == "12.1"
    assert profiles["jetson-agx-orin"].compute_capability == "8.7"
    assert "fp8" not in profiles["jetson-orin-nano"].precisions
    assert profiles["jetson-orin-nano"].memory_bytes == 8 * 1024**3
    assert profiles["cpu"].backend == "onnxruntime" and profiles["cpu"].compute_capability is None


def test_user_profile_adds_a_device_and_overrides_a_built_in(tmp_path):
    (tmp_path / "orin-nx.json").write_text(json.dumps({
        "id": "jetson-orin-nx", "name": "Orin NX 16GB", "cpu_arch": "aarch64", "compute_capability": "8.7",
        "memory_bytes": "16G", "precisions": ["fp32", "fp16"], "backend": "tensorrt",
        "device_tree_models": ["Jetson Orin NX"], "vendor_note": "kept"}))
    (tmp_path / "spark.json").write_text(json.dumps({**get_profile("dgx-spark").to_dict(), "memory_bytes": "64G"}))
    assert get_profile("jetson-orin-nx", [tmp_path]).memory_bytes == 16 * 1024**3
    assert get_profile("jetson-orin-nx", [tmp_path]).extra == {"vendor_note": "kept"}
    spark = get_profile("dgx-spark", [tmp_path])
    assert spark.memory_bytes == 64 * 1024**3 and spark.source.endswith("spark.json")
    assert parse_targets("jetson-orin-nx,cpu", [tmp_path]) == ["jetson-orin-nx", "cpu"]
    assert get_profile("dgx-spark").memory_bytes == 128 * 1024**3  # without the directory: built-in


@pytest.mark.parametrize("profile,message", [
    ({"id": "x", "backend": "tensorrt", "memory_bytes": 1, "precisions": ["fp32"]},
     "expected a compute_capability for a tensorrt target, found null"),
    ({"id": "x", "backend": "openvino", "memory_bytes": 1, "precisions": ["fp32"]},
     "expected backend one of tensorrt, onnxruntime, onnxruntime-cuda, found 'openvino'"),
    ({"id": "X Y", "backend": "onnxruntime", "memory_bytes": 1, "precisions": ["fp32"]}, "expected id of"),
    ({"id": "x", "backend": "onnxruntime", "memory_bytes": 0, "precisions": ["fp32"]}, "expected memory_bytes > 0"),
    ({"id": "x", "backend": "tensorrt", "compute_capability": "sm_110", "memory_bytes": 1, "precisions": ["fp32"]},
     "expected compute_capability like '11.0'"),
    ({"id": "x", "backend": "tensorrt", "compute_capability": "12.1", "memory_bytes": 1, "precisions": ["fp32"],
      "tensorrt_onnx_attention": "yes"}, "expected tensorrt_onnx_attention true, false or absent, found 'yes'"),
])
def test_bad_user_profile_names_the_file_and_field(tmp_path, profile, message):
    (tmp_path / "bad.json").write_text(json.dumps(profile))
    with pytest.raises(UsageError, match="bad.json") as e:
        all_profiles([tmp_path])
    assert message in str(e.value)


def test_which_tensorrt_targets_parse_onnx_attention_and_so_get_the_batched_graph(tmp_path):
    """DGX OS's TensorRT 10.16 parses ONNX Attention; JetPack 7's 10.13 does not (the Thors run slot by slot);
    a profile without the field is decided by its TensorRT version (10.14 added the importer)."""
    profiles = {p.id: p for p in all_profiles()}
    assert profiles["dgx-spark"].parses_onnx_attention
    assert not any(profiles[t].parses_onnx_attention for t in ("jetson-thor", "igx-thor", "drive-agx-thor",
                                                                "jetson-agx-orin", "cpu", "cuda"))
    base = {"backend": "tensorrt", "compute_capability": "12.0", "memory_bytes": "32G", "precisions": ["fp16"]}
    for name, version, expected in (("a", "10.14.1.48", True), ("b", "10.13.3.9", False), ("c", "11.0", True)):
        (tmp_path / f"{name}.json").write_text(json.dumps({**base, "id": name, "tensorrt_version": version}))
        assert get_profile(name, [tmp_path]).parses_onnx_attention is expected, version
    (tmp_path / "d.json").write_text(json.dumps({**base, "id": "d", "tensorrt_version": "10.16",
                                                 "tensorrt_onnx_attention": False}))
    assert not get_profile("d", [tmp_path]).parses_onnx_attention
    assert get_profile("d", [tmp_path]).to_dict()["tensorrt_onnx_attention"] is False


def test_profile_file_that_is_not_json(tmp_path):
    (tmp_path / "broken.json").write_text("{nope")
    with pytest.raises(UsageError, match="broken.json: expected JSON"):
        all_profiles([tmp_path])


def test_parse_targets():
    assert parse_targets(" jetson-thor , igx-thor") == ["jetson-thor", "igx-thor"]
    with pytest.raises(UsageError, match="unknown target 'jetson-nano'; expected one of: cpu, cuda, dgx-spark"):
        parse_targets("jetson-nano")
    with pytest.raises(UsageError, match="listed twice"):
        parse_targets("cpu,cpu")
    with pytest.raises(UsageError, match="comma-separated"):
        parse_targets("cpu,")
    with pytest.raises(UsageError, match="unknown target"):
        get_profile("tpu")
