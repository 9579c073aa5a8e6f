"""load_engine: the engine a device gets, and what is recorded when it is not the shipped one.

TensorRT cannot exist here: `StandInBackend` implements its interface over ONNX Runtime, so the
key check, cache, local build and fallback paths run for real.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from manifests.schema import Builder, FileEntry, Manifest, Model, ModelSource
from tests.runtime.engines.standin import StandInBackend


def install_tree(files, targets, root: Path) -> Manifest:
    """Lay files out as an installed bundle would, with a manifest describing them."""
    from runtime.fsutil import file_sha256

    entries = []
    for pf in files:
        dest = root / pf.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pf.src, dest)
        entries.append(FileEntry(pf.path, dest.stat().st_size, file_sha256(dest), (), pf.targets))
    return Manifest(name="demo", version=1, created="2026-11-29T14:00:00Z", builder=Builder(),
                    models=(Model("target", "tiny", "models/target", ModelSource("local")),),
                    files=tuple(entries), targets=tuple(targets), serve={"max_model_len": 128})


def plan_bundle(tiny_exports, tmp_path, target_ids, host_backend, **options):
    from bundler.pack.engines import prepare_targets

    def export(ckpt, out_dir, kv_cache="concat", dtype="float32", capacity=None):  # every layout exported once
        if capacity is not None:  # TensorRT targets that parse ONNX Attention: the static batched graph
            assert capacity == 192, capacity  # max_model_len 128 + the spare rows
            return tiny_exports["static-fp16" if dtype == "float16" else "static"]
        return tiny_exports["fp16" if dtype == "float16" else kv_cache]

    files, targets = prepare_targets(target_ids, {"target": tiny_exports["checkpoint"]}, tmp_path / "work",
                                     {"max_model_len": 128}, backend=host_backend, export=export, **options)
    root = tmp_path / "installed"
    return root, install_tree(files, targets, root)


def test_cpu_target_runs_onnxruntime_over_the_shipped_onnx(tiny_exports, tmp_path):
    from runtime.engines import load_engine

    root, manifest = plan_bundle(tiny_exports, tmp_path, ["cpu"], StandInBackend(None))
    (record,) = manifest.target("cpu").engines
    assert record.path == "engines/onnx-batched/target/model.onnx" and record.build["kv_cache"] == "batched"
    assert record.key["onnxruntime_min"] == "1.30"
    engine = load_engine(root, manifest, "cpu", "target", cache_dir=tmp_path / "cache")
    assert engine.description.startswith("onnxruntime") and engine.max_context == 128
    assert engine.kv_cache == "batched" and engine.description.endswith("kv-cache batched") and engine.batched
    assert engine.forward_one([1, 2, 3]).shape == (3, 512)
    assert not (tmp_path / "cache").exists()  # nothing to build or record on cpu


def test_cpu_target_can_ship_the_concat_graph(tiny_exports, tmp_path):
    from runtime.engines import load_engine

    root, manifest = plan_bundle(tiny_exports, tmp_path, ["cpu"], StandInBackend(None), kv_cache="concat")
    (record,) = manifest.target("cpu").engines
    assert record.path == "engines/onnx/target/model.onnx" and record.build["kv_cache"] == "concat"
    engine = load_engine(root, manifest, "cpu", "target")
    assert engine.kv_cache == "concat" and engine.forward_one([1, 2, 3]).shape == (3, 512)


def test_a_record_whose_layout_differs_from_the_graph_is_refused(tiny_exports, tmp_path):
    import dataclasses

    from manifests.errors import ModelError
    from runtime.engines import load_engine

    root, manifest = plan_bundle(tiny_exports, tmp_path, ["cpu"], StandInBackend(None))
    (record,) = manifest.target("cpu").engines
    wrong = dataclasses.replace(record, build={**record.build, "kv_cache": "concat"})
    target = dataclasses.replace(manifest.target("cpu"), engines=(wrong,))
    manifest = dataclasses.replace(manifest, targets=(target,))
    with pytest.raises(ModelError, match="expects a 'concat' KV-cache graph, the graph is 'batched'"):
        load_engine(root, manifest, "cpu", "target")


def test_no_shipped_engine_builds_locally_once_and_caches(tiny_exports, tmp_path):
    from runtime.engines.cache import BUILD_NAME, KEY_NAME
    from runtime.engines import load_engine

    root, manifest = plan_bundle(tiny_exports, tmp_path, ["jetson-thor"], StandInBackend(None))
    assert [e.format for e in manifest.target("jetson-thor").engines] == ["onnx"]
    device = StandInBackend("11.0", "10.13.3.9")
    engine = load_engine(root, manifest, "jetson-thor", "target", cache_dir=tmp_path / "cache", backend=device)
    assert len(device.builds) == 1 and engine.plan["built_for"] == ["11.0", "10.13.3.9"]
    entry = device.loads[0].parent
    key = json.loads((entry / KEY_NAME).read_text())
    assert key["compute_capability"] == "11.0" and key["tensorrt_version"] == "10.13.3.9"
    assert key == manifest.target("jetson-thor").engines[0].key  # the device is exactly the profile
    assert "ships no TensorRT engine" in json.loads((entry / BUILD_NAME).read_text())["reason"]

    again = load_engine(root, manifest, "jetson-thor", "target", cache_dir=tmp_path / "cache", backend=device)
    assert len(device.builds) == 1 and device.loads[-1] == device.loads[0]  # second start: no build
    np.testing.assert_allclose(again.forward_one([4, 5]), engine.forward_one([4, 5]), atol=1e-6)


def test_shipped_plan_is_used_when_its_key_matches(tiny_exports, tmp_path):
    from runtime.engines import load_engine

    host = StandInBackend("11.0", "10.13.3.9")  # a build host that is a Thor with the fleet's TensorRT
    root, manifest = plan_bundle(tiny_exports, tmp_path, ["jetson-thor"], host)
    formats = [e.format for e in manifest.target("jetson-thor").engines]
    assert formats == ["onnx", "tensorrt-plan"] and len(host.builds) == 1
    device = StandInBackend("11.0", "10.13.3.9")
    load_engine(root, manifest, "jetson-thor", "target", cache_dir=tmp_path / "cache", backend=device)
    assert device.builds == [] and device.loads == [root / "engines/plans/jetson-thor/target/engine.plan"]


@pytest.mark.parametrize("field, value", [("onnx_sha256", "0" * 64), ("build_options_sha256", "1" * 64)])
def test_a_shipped_plan_built_from_another_graph_or_options_is_not_used(tiny_exports, tmp_path, field, value):
    """The plan's key must match the shipped ONNX and its build options, not merely itself."""
    import dataclasses

    from runtime.engines.cache import canonical_sha256
    from runtime.engines import load_engine

    host = StandInBackend("11.0", "10.13.3.9")
    root, manifest = plan_bundle(tiny_exports, tmp_path, ["jetson-thor"], host)
    onnx, plan = manifest.target("jetson-thor").engines
    stale = dataclasses.replace(plan, key={**plan.key, field: value})  # e.g. built from last release's export
    if field == "build_options_sha256":  # options changed with it, consistently, as a real stale plan has
        options = {**plan.build, "max_context": 64}
        stale = dataclasses.replace(stale, build=options, key={**plan.key, field: canonical_sha256(options)})
    target = dataclasses.replace(manifest.target("jetson-thor"), engines=(onnx, stale))
    manifest = dataclasses.replace(manifest, targets=(target,))
    device = StandInBackend("11.0", "10.13.3.9")
    engine = load_engine(root, manifest, "jetson-thor", "target", cache_dir=tmp_path / "cache", backend=device)
    assert len(device.builds) == 1 and device.loads[0] != root / plan.path  # rebuilt from the shipped ONNX
    assert engine.plan["onnx"] == str(root / onnx.path)


def test_key_mismatch_falls_back_to_a_local_build_and_records_why(tiny_exports, tmp_path):
    from runtime.engines.cache import BUILD_NAME
    from runtime.engines import load_engine

    root, manifest = plan_bundle(tiny_exports, tmp_path, ["jetson-thor"], StandInBackend("11.0", "10.13.3.9"))
    newer = StandInBackend("11.0", "10.14.1.48")  # same GPU, newer JetPack: the shipped plan is useless
    engine = load_engine(root, manifest, "jetson-thor", "target", cache_dir=tmp_path / "cache", backend=newer)
    assert len(newer.builds) == 1 and engine.plan["built_for"] == ["11.0", "10.14.1.48"]
    record = json.loads((newer.loads[0].parent / BUILD_NAME).read_text())
    assert record["reason"] == "tensorrt_version is '10.13.3.9', this device needs '10.14.1.48'"
    assert record["source"] == "engines/onnx-fp16/target/model.onnx" and record["bundle"] == "demo:1"

    other_gpu = StandInBackend("12.1", "10.13.3.9")  # never confused across devices: its own entry
    load_engine(root, manifest, "jetson-thor", "target", cache_dir=tmp_path / "cache", backend=other_gpu)
    assert len(other_gpu.builds) == 1 and other_gpu.loads[0].parent != newer.loads[0].parent


def test_a_cache_entry_with_another_key_is_not_used(tiny_exports, tmp_path):
    from runtime.engines.cache import KEY_NAME
    from runtime.engines import load_engine

    root, manifest = plan_bundle(tiny_exports, tmp_path, ["jetson-thor"], StandInBackend(None))
    device = StandInBackend()
    load_engine(root, manifest, "jetson-thor", "target", cache_dir=tmp_path / "cache", backend=device)
    key_file = device.loads[0].parent / KEY_NAME
    key_file.write_text(key_file.read_text().replace("10.13.3.9", "10.3.0"))  # e.g. a copied-in cache
    load_engine(root, manifest, "jetson-thor", "target", cache_dir=tmp_path / "cache", backend=device)
    assert len(device.builds) == 2


def test_without_tensorrt_onnxruntime_stands_in_and_it_is_recorded(tiny_exports, tmp_path, caplog):
    from runtime.engines.cache import FALLBACK_NAME
    from runtime.engines import load_engine
    from runtime.engines.tensorrt import NOT_INSTALLED, TensorRTBackend

    if TensorRTBackend().device() is not None:
        pytest.skip("a real TensorRT GPU is present; the fallback path is not taken")
    root, manifest = plan_bundle(tiny_exports, tmp_path, ["igx-thor"], StandInBackend(None))
    with caplog.at_level(logging.WARNING):
        engine = load_engine(root, manifest, "igx-thor", "target", cache_dir=tmp_path / "cache",
                             cuda=lambda *_: (None, "no NVIDIA GPU"))
    assert engine.description.startswith("onnxruntime") and NOT_INSTALLED in engine.fallback
    records = list((tmp_path / "cache").glob(f"*/{FALLBACK_NAME}"))
    assert len(records) == 1
    data = json.loads(records[0].read_text())
    assert data["used"] == "onnxruntime" and NOT_INSTALLED in data["reason"]
    assert data["key"]["compute_capability"] == "11.0"
    assert "instead of TensorRT" in caplog.text
    assert engine.forward_one([1, 2]).shape == (2, 512)


def test_unknown_role_and_target_are_clear_errors(tiny_exports, tmp_path):
    from manifests.errors import EnvironmentProblem
    from runtime.engines import load_engine

    root, manifest = plan_bundle(tiny_exports, tmp_path, ["cpu"], StandInBackend(None))
    with pytest.raises(EnvironmentProblem, match="no engine for model 'draft'"):
        load_engine(root, manifest, "cpu", "draft")
    with pytest.raises(EnvironmentProblem, match="no engines for target 'jetson-thor'; it has: cpu"):
        load_engine(root, manifest, "jetson-thor", "target")
