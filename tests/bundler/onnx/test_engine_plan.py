"""Per-target plan: each ONNX layout stored once, exact build options, engine keys, optimisation profiles."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.runtime.engines.standin import StandInBackend


def exported_once(family_exports, family_batched_exports, family_fp16_exports, family="llama"):
    """An `export` for prepare_targets that hands out the session's exports of each (layout, dtype)."""
    results = {("concat", "float32"): family_exports[family][1],
               ("batched", "float32"): family_batched_exports[family][1],
               ("concat", "float16"): family_fp16_exports[family][1]}
    return lambda ckpt, out, kv_cache="concat", dtype="float32": results[kv_cache, dtype]


@pytest.fixture(scope="module")
def planned(family_exports, family_batched_exports, family_fp16_exports, tmp_path_factory):
    from bundler.pack.engines import prepare_targets

    checkpoint, result = family_exports["llama"]
    work = tmp_path_factory.mktemp("plan")
    files, targets = prepare_targets(["jetson-thor", "igx-thor", "cpu"], {"target": checkpoint}, work,
                                     {"max_model_len": 256, "prefill_chunk": 64}, num_speculative_tokens=3,
                                     backend=StandInBackend(None),
                                     export=exported_once(family_exports, family_batched_exports,
                                                          family_fp16_exports))
    return files, targets


def test_each_onnx_layout_is_stored_once_for_the_targets_that_run_it(planned):
    files, targets = planned
    thors = ("jetson-thor", "igx-thor")
    assert [(f.path, f.targets) for f in files] == [("engines/onnx-fp16/target/model.onnx", thors),
                                                    ("engines/onnx-fp16/target/model.onnx.data", thors),
                                                    ("engines/onnx-batched/target/model.onnx", ("cpu",)),
                                                    ("engines/onnx-batched/target/model.onnx.data", ("cpu",))]
    assert [t.id for t in targets] == ["jetson-thor", "igx-thor", "cpu"]
    assert {e.path for t in targets[:2] for e in t.engines} == {"engines/onnx-fp16/target/model.onnx"}
    (cpu,) = targets[2].engines  # ONNX Runtime gets the batched in-place graph (TensorScatter + Attention)
    assert cpu.path == "engines/onnx-batched/target/model.onnx" and cpu.build["kv_cache"] == "batched"


def test_one_graph_for_every_target_is_not_restricted(family_exports, family_batched_exports, family_fp16_exports,
                                                      tmp_path):
    from bundler.pack.engines import prepare_targets

    checkpoint, _ = family_exports["llama"]
    export = exported_once(family_exports, family_batched_exports, family_fp16_exports)
    files, (thor, cpu) = prepare_targets(["jetson-thor", "cpu"], {"target": checkpoint}, tmp_path, {},
                                         backend=StandInBackend(None), export=export, kv_cache="concat")
    # Same layout, but the Thor's is fp16 and the cpu's fp32: two graphs, each for its target.
    assert [(f.path, f.targets) for f in files] == [("engines/onnx-fp16/target/model.onnx", ("jetson-thor",)),
                                                    ("engines/onnx-fp16/target/model.onnx.data", ("jetson-thor",)),
                                                    ("engines/onnx/target/model.onnx", ("cpu",)),
                                                    ("engines/onnx/target/model.onnx.data", ("cpu",))]
    assert cpu.engines[0].build["kv_cache"] == "concat" and cpu.engines[0].key["onnxruntime_min"] == "1.18"
    assert thor.engines[0].build["dtype"] == "float16" and cpu.engines[0].path == "engines/onnx/target/model.onnx"
    files, _ = prepare_targets(["jetson-thor", "igx-thor"], {"target": checkpoint}, tmp_path, {},
                               backend=StandInBackend(None), export=export)
    assert [f.targets for f in files] == [None, None]
    files, (cpu,) = prepare_targets(["cpu"], {"target": checkpoint}, tmp_path, {}, export=export)
    assert [f.targets for f in files] == [None, None] and cpu.engines[0].key["onnxruntime_min"] == "1.30"


def test_gpu_targets_carry_exact_build_options_and_key(planned):
    from runtime.engines.cache import canonical_sha256

    _, targets = planned
    thor, igx, cpu = targets
    (engine,) = thor.engines
    assert (engine.backend, engine.format, engine.model) == ("tensorrt", "onnx", "target")
    assert engine.files == ("engines/onnx-fp16/target/model.onnx", "engines/onnx-fp16/target/model.onnx.data")
    assert engine.key["build_options_sha256"] == canonical_sha256(engine.build)
    assert (engine.key["compute_capability"], engine.key["tensorrt_version"]) == ("11.0", "10.13.3.9")
    assert engine.build["precision"] == "fp16" and engine.build["max_context"] == 256
    assert engine.build["dtype"] == "float16"  # the graph itself is fp16 (TensorRT 11: no FP16 flag)
    assert igx.engines[0].key == engine.key  # same GPU, same TensorRT, same options: same engine
    assert thor.build == {"compute_capability": "11.0", "tensorrt_version": "10.13.3.9", "cuda_version": "13.0",
                          "precision": "fp16", "max_context": 256}
    assert cpu.engines[0].backend == "onnxruntime" and cpu.engines[0].key["onnx_sha256"] != engine.key["onnx_sha256"]


def test_optimisation_profiles_follow_serve_settings(planned):
    _, targets = planned
    decode, prefill = targets[0].engines[0].build["profiles"]
    assert decode["name"] == "decode" and prefill["name"] == "prefill"
    assert decode["shapes"]["input_ids"] == {"min": [1, 1], "opt": [1, 4], "max": [1, 4]}  # 3 draft tokens + 1
    assert prefill["shapes"]["input_ids"]["max"] == [1, 64]  # the prefill chunk
    past = prefill["shapes"]["past_key_values.1.value"]
    assert past["min"] == [1, 2, 0, 16] and past["max"] == [1, 2, 255, 16]  # max context - 1 past tokens
    assert prefill["shapes"]["attention_mask"]["max"] == [1, 256]


def test_serve_settings_beyond_the_model_are_refused(family_exports, family_batched_exports, family_fp16_exports,
                                                     tmp_path):
    from bundler.pack.engines import prepare_targets
    from manifests.errors import ModelError

    checkpoint, result = family_exports["llama"]
    with pytest.raises(ModelError, match="max_model_len 100000 exceeds the model's limit; expected at most 512"):
        prepare_targets(["cpu"], {"target": checkpoint}, tmp_path, {"max_model_len": 100000},
                        export=exported_once(family_exports, family_batched_exports, family_fp16_exports))


def test_bundle_for_two_thor_targets_stores_the_onnx_once(planned, tmp_path):
    from bundler.pack.pack import PackFile, PackOptions, pack_bundle
    from manifests.schema import Model, ModelSource

    files, targets = planned
    readme = tmp_path / "README.txt"
    readme.write_text("tiny")
    manifest = pack_bundle(tmp_path / "b", PackOptions(name="tiny", version=1,
                           models=[Model("target", "tiny", "models/target", ModelSource("local", revision="x"))],
                           files=[*[f for f in files if f.targets != ("cpu",)],
                                  PackFile(readme, "models/target/README.txt")], targets=targets[:2],
                           speculative=None, serve={"max_model_len": 256}, expires=None,
                           sign_keys=[Ed25519PrivateKey.generate()], progress=False))
    onnx_entries = [f for f in manifest.files if f.path.startswith("engines/onnx-fp16/")]
    assert len(onnx_entries) == 2 and all(f.targets == ("jetson-thor", "igx-thor") for f in onnx_entries)
    assert {t.id for t in manifest.targets} == {"jetson-thor", "igx-thor"}
    stored = sum(p.stat().st_size for p in (tmp_path / "b" / "blobs" / "sha256").iterdir())
    data = next(f for f in onnx_entries if f.path.endswith(".data"))
    assert stored < 2 * sum(p.size for p in data.parts)  # one copy of the weights, not one per target


def test_build_engines_makes_a_signed_next_version_with_plans(planned, tmp_path):
    from bundler.pack.engines import build_engines_bundle
    from bundler.pack.keys import public_key_id
    from bundler.pack.pack import PackOptions, pack_bundle
    from manifests.schema import Model, ModelSource
    from runtime.engines import onnx_sha256_of
    from runtime.store.verify import verify_bundle

    files, targets = planned
    release, lab = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    pack_bundle(tmp_path / "v1", PackOptions(name="tiny", version=1,
                models=[Model("target", "tiny", "models/target", ModelSource("local", revision="x"))],
                files=files, targets=targets, speculative=None, serve={"max_model_len": 256}, expires=None,
                sign_keys=[release], progress=False))
    device = StandInBackend("11.0", "10.13.3.9")
    new = build_engines_bundle(tmp_path / "v1", "jetson-thor", tmp_path / "v2", sign_keys=[lab],
                               trusted={public_key_id(release): release.public_key()}, backend=device,
                               progress=False)
    assert new.version == 2 and len(device.builds) == 1
    verified = verify_bundle(tmp_path / "v2", {public_key_id(lab): lab.public_key()})
    thor = verified.manifest.target("jetson-thor")
    onnx, plan = thor.engines
    assert plan.format == "tensorrt-plan" and plan.path == "engines/plans/jetson-thor/target/engine.plan"
    assert plan.key["onnx_sha256"] == onnx_sha256_of(verified.manifest, onnx) == onnx.key["onnx_sha256"]
    assert plan.key["build_options_sha256"] == onnx.key["build_options_sha256"]
    entry = next(f for f in verified.manifest.files if f.path == plan.path)
    assert entry.targets == ("jetson-thor",)
    assert verified.manifest.target("igx-thor").engines == targets[1].engines  # other targets untouched
    assert not list(tmp_path.glob("bundle-build-engines-*"))  # the unpacked copy is gone


def test_build_engines_refuses_another_gpu(planned, tmp_path):
    from bundler.pack.engines import build_engines_bundle
    from bundler.pack.keys import public_key_id
    from bundler.pack.pack import PackOptions, pack_bundle
    from manifests.errors import EnvironmentProblem
    from manifests.schema import Model, ModelSource

    files, targets = planned
    key = Ed25519PrivateKey.generate()
    pack_bundle(tmp_path / "v1", PackOptions(name="tiny", version=1,
                models=[Model("target", "tiny", "models/target", ModelSource("local", revision="x"))],
                files=files, targets=targets, speculative=None, serve={}, expires=None, sign_keys=[key],
                progress=False))
    with pytest.raises(EnvironmentProblem, match="compute capability 12.1; target 'jetson-thor' expects 11.0"):
        build_engines_bundle(tmp_path / "v1", "jetson-thor", tmp_path / "v2", sign_keys=[key],
                             trusted={public_key_id(key): key.public_key()},
                             backend=StandInBackend("12.1", "10.16.1.11"), progress=False)
    assert not (tmp_path / "v2").exists()
