"""The manifest schema: lossless round trip, unknown fields kept, unsafe paths refused."""

from __future__ import annotations

import copy
import json

import pytest

from manifests.errors import BadBundleError, PolicyError
from manifests.limits import LIMITS
from manifests.schema import FORMAT_VERSION, Manifest, safe_relative_path

HEX = "ab" * 32


def sample() -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "name": "demo",
        "version": 3,
        "created": "2026-11-29T14:00:00Z",
        "expires": "2027-11-29T14:00:00Z",
        "builder": {"tool": "bundle", "tool_version": "0.1.0", "host": "spark", "platform": "linux-aarch64"},
        "models": [{"role": "target", "name": "demo-target", "root": "models/target",
                    "source": {"type": "huggingface", "repo": "org/m", "revision": "c" * 40,
                               "requested_revision": "main"}, "architecture": "LlamaForCausalLM"}],
        "files": [
            {"path": "models/target/config.json", "size": 10, "sha256": HEX,
             "parts": [{"digest": "sha256:" + HEX, "size": 20, "offset": 0, "length": 10}]},
            {"path": "engines/cpu/model.onnx", "size": 15, "sha256": HEX, "targets": ["cpu"],
             "parts": [{"digest": "sha256:" + HEX, "size": 9, "offset": 0, "length": 10},
                       {"digest": "sha256:" + "cd" * 32, "size": 9, "offset": 10, "length": 5}]},
        ],
        "targets": [{"id": "cpu", "backend": "onnxruntime",
                     "engines": [{"model": "target", "backend": "onnxruntime", "format": "onnx",
                                  "path": "engines/cpu/model.onnx", "files": ["engines/cpu/model.onnx"],
                                  "key": {"onnx_sha256": HEX}, "build": {}}], "build": {}}],
        "speculative": {"method": "draft_model", "num_speculative_tokens": 3, "model": "draft"},
        "serve": {"max_model_len": 2048},
    }


def test_round_trip_is_lossless_and_keeps_unknown_fields():
    d = sample()
    d["future_field"] = {"x": [1, 2]}
    d["files"][0]["xattrs"] = {"user.a": "b"}
    d["targets"][0]["engines"][0]["new_key"] = 7
    m = Manifest.from_dict(d)
    assert m.to_dict() == d
    again = Manifest.from_json_bytes(m.to_json_bytes())
    assert again == m and again.to_json_bytes() == m.to_json_bytes()
    assert again.extra == {"future_field": {"x": [1, 2]}}


def test_canonical_bytes_are_sorted_and_compact():
    b = Manifest.from_dict(sample()).to_json_bytes()
    assert b == json.dumps(json.loads(b), sort_keys=True, separators=(",", ":")).encode()


def test_files_for_target_filters_by_target():
    m = Manifest.from_dict(sample())
    assert [f.path for f in m.files_for("cpu")] == ["models/target/config.json", "engines/cpu/model.onnx"]
    assert [f.path for f in m.files_for("jetson-thor")] == ["models/target/config.json"]


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "models/../../x", "a//b", "./a", "a/./b", "", "a\\b"])
def test_unsafe_paths_refused(bad):
    with pytest.raises(BadBundleError):
        safe_relative_path(bad)
    d = sample()
    d["files"][0]["path"] = bad
    with pytest.raises(BadBundleError):
        Manifest.from_dict(d)


def test_case_insensitive_collision_refused():
    d = sample()
    dup = copy.deepcopy(d["files"][0])
    dup["path"] = "models/target/CONFIG.json"
    d["files"].append(dup)
    with pytest.raises(BadBundleError, match="colliding"):
        Manifest.from_dict(d)


def test_file_that_is_also_a_directory_refused():
    d = sample()
    dup = copy.deepcopy(d["files"][0])
    dup["path"] = "models/target/config.json/inner"
    d["files"].append(dup)
    with pytest.raises(BadBundleError, match="directory"):
        Manifest.from_dict(d)


def test_parts_must_cover_the_file_exactly():
    d = sample()
    d["files"][1]["parts"][1]["offset"] = 11
    with pytest.raises(BadBundleError, match="offset"):
        Manifest.from_dict(d)
    d = sample()
    d["files"][0]["size"] = 11
    with pytest.raises(BadBundleError, match="cover"):
        Manifest.from_dict(d)


def test_newer_format_version_is_a_policy_refusal():
    d = sample()
    d["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(PolicyError, match="format_version"):
        Manifest.from_dict(d)


@pytest.mark.parametrize("field,value", [("version", 0), ("version", "3"), ("version", True), ("name", "Bad Name")])
def test_bad_scalars_refused(field, value):
    d = sample()
    d[field] = value
    with pytest.raises(BadBundleError):
        Manifest.from_dict(d)


def test_oversized_and_non_json_manifests_refused():
    with pytest.raises(BadBundleError, match="at most"):
        Manifest.from_json_bytes(b" " * (LIMITS.manifest_bytes + 1))
    with pytest.raises(BadBundleError, match="JSON"):
        Manifest.from_json_bytes(b"\xff\xfe{")


def test_part_digests_of_the_uncompressed_bytes_are_optional_and_checked():
    d = sample()
    d["files"][1]["parts"][0]["sha256"] = "ab" * 32
    d["files"][1]["parts"][1]["sha256"] = "cd" * 32
    m = Manifest.from_dict(d)
    assert [p.sha256 for p in m.files[1].parts] == ["ab" * 32, "cd" * 32]
    assert m.to_dict() == d and m.files[0].parts[0].sha256 is None  # absent stays absent (format-1 bytes)
    assert "sha256" not in json.loads(Manifest.from_dict(sample()).to_json_bytes())["files"][1]["parts"][0]
    bad = copy.deepcopy(d)
    bad["files"][1]["parts"][0]["sha256"] = "AB" * 32
    with pytest.raises(BadBundleError, match="expected part sha256 of 64 lowercase hex digits, found 'ABAB"):
        Manifest.from_dict(bad)
    one = sample()
    one["files"][0]["parts"][0]["sha256"] = "ee" * 32  # the only part of a file is the file
    with pytest.raises(BadBundleError, match="config.json: expected the sha256 of its only part to be the file's"):
        Manifest.from_dict(one)
