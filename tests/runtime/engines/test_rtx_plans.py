"""TensorRT-RTX plans built ahead of time on the build host (no GPU) for the targets whose SM it knows
(dgx-spark, sm_121), signed into the bundle under their engine key; the runtime loads one when the key
matches its TensorRT-RTX and builds its own otherwise.

The real builder runs where the `rtx` extra is installed (scripts/setup installs it on x86_64); a device
cannot exist here, so loading goes through the stand-in backend of the key's flavour.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import once_per_run
from tests.runtime.engines.standin import StandInBackend
from tests.runtime.engines.test_load_engine import plan_bundle

RTX = "rtx-1.7.1.116"
HAVE_RTX = any(importlib.util.find_spec(m) for m in ("tensorrt_rtx", "tensorrt_rtx_bindings"))
NO_RTX = "TensorRT-RTX is not installed (pip install 'bundle[rtx]'; scripts/setup does on x86_64)"


class FakeAot:
    """The interface of bundler.pack.aot.RtxBuilder; its "plan" names what it was built from and for."""

    version = RTX
    targets = ("8.9", "12.0", "12.1")

    def __init__(self):
        self.builds: list[tuple[str, str]] = []

    def compute_capability_for(self, profile):
        return profile.compute_capability if profile.backend == "tensorrt" and \
            profile.compute_capability in self.targets else None

    def build(self, onnx_path, options, out_plan, compute_capability):
        self.builds.append((Path(out_plan).parent.parent.name, compute_capability))
        Path(out_plan).write_text(json.dumps({"onnx": str(onnx_path), "options": options,
                                              "built_for": [compute_capability, self.version]}))


def test_spark_gets_an_ahead_of_time_plan_and_thor_does_not(tiny_exports, tmp_path):
    aot = FakeAot()
    root, manifest = plan_bundle(tiny_exports, tmp_path, ["dgx-spark", "jetson-thor"], StandInBackend(None), aot=aot)
    assert aot.builds == [("dgx-spark", "12.1")]
    onnx, plan = manifest.target("dgx-spark").engines
    assert plan.format == "tensorrt-plan" and plan.path == "engines/plans/dgx-spark/target/engine.plan"
    assert plan.key == {**onnx.key, "compute_capability": "12.1", "tensorrt_version": RTX}
    assert [e.format for e in manifest.target("jetson-thor").engines] == ["onnx"]


def test_the_runtime_loads_the_rtx_plan_when_its_key_matches_and_rebuilds_otherwise(tiny_exports, tmp_path):
    from runtime.engines import load_engine

    root, manifest = plan_bundle(tiny_exports, tmp_path, ["dgx-spark"], StandInBackend(None), aot=FakeAot())
    shipped = root / "engines/plans/dgx-spark/target/engine.plan"
    spark = StandInBackend("12.1", RTX)
    engine = load_engine(root, manifest, "dgx-spark", "target", cache_dir=tmp_path / "cache", backend=spark)
    assert spark.loads == [shipped] and spark.builds == []
    assert engine.choice.runs == "tensorrt" and "shipped plan" in engine.choice.reason

    # the platform's TensorRT beside it (which cannot run an RTX plan) does not take it either
    platform, rtx = StandInBackend("12.1", "10.16.1.11"), StandInBackend("12.1", RTX)
    load_engine(root, manifest, "dgx-spark", "target", cache_dir=tmp_path / "cache", backend=[platform, rtx])
    assert rtx.loads == [shipped] and platform.loads == [] and platform.builds == []

    newer = StandInBackend("12.1", "rtx-1.8.0.1")  # another TensorRT-RTX: its own plan, built and cached
    engine = load_engine(root, manifest, "dgx-spark", "target", cache_dir=tmp_path / "cache", backend=newer)
    assert len(newer.builds) == 1 and newer.loads[0] != shipped
    assert "tensorrt_version is 'rtx-1.7.1.116', this device needs 'rtx-1.8.0.1'" in engine.choice.reason

    only_platform = StandInBackend("12.1", "10.16.1.11")
    engine = load_engine(root, manifest, "dgx-spark", "target", cache_dir=tmp_path / "cache",
                         backend=only_platform)
    assert len(only_platform.builds) == 1
    assert f"needs TensorRT-RTX {RTX}, which is not installed here" in engine.choice.reason


def _demo_spark_bundle(root: Path) -> dict:
    """`bundle create` of the demo pair for dgx-spark with --rtx-engines: the real builder, no GPU."""
    from click.testing import CliRunner

    from bundler.cli.pack import create

    out = root / "bundle"
    r = CliRunner().invoke(create, ["--targets", "dgx-spark,jetson-thor", "--rtx-engines", "--name", "demo",
                                    "--version", "1", "--unsigned", "--no-runtime", "--out", str(out),
                                    "--no-progress", "--max-model-len", "256"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return {"bundle": out, "output": r.output}


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_RTX, reason=NO_RTX)
def test_create_builds_real_rtx_plans_for_the_demo_pair_with_no_gpu(tmp_path_factory, tmp_path):
    from runtime.engines import load_engine
    from runtime.store.store import Store

    made = once_per_run(tmp_path_factory, "demo-rtx-spark", _demo_spark_bundle)
    assert "rtx:      jetson-thor: TensorRT-RTX 1.7.1.116 builds for sm_75, sm_80, sm_86, sm_89, sm_120, sm_121, " \
           "not sm_110: its plan is built on the device" in made["output"]
    assert "rtx:      dgx-spark: 2 TensorRT-RTX 1.7.1.116 plans for sm_121 built here ahead of time, signed in" \
        in made["output"]
    assert "tensorrt: dgx-spark: batched graph (cache capacity 320, up to 8 slots a call)" in made["output"]
    assert "tensorrt: jetson-thor: concat graph, one slot a call (its TensorRT 10.13.3.9 parses no ONNX Attention)" \
        in made["output"]
    store = Store(tmp_path / "store")
    store.install(made["bundle"], target="dgx-spark", trusted={}, allow_unsigned=True)
    installed = store.current("demo")
    manifest, root = installed.manifest, Path(installed.path)
    for role in ("target", "draft"):
        onnx, plan = (e for e in manifest.target("dgx-spark").engines if e.model == role)
        assert plan.key["tensorrt_version"].startswith("rtx-") and plan.key["compute_capability"] == "12.1"
        assert plan.key["onnx_sha256"] == onnx.key["onnx_sha256"]
        weights = root / Path(onnx.path).with_suffix(".onnx.data")
        assert (root / plan.path).stat().st_size > weights.stat().st_size  # a real plan: it holds the weights
        # DGX OS's TensorRT parses ONNX Attention: the Spark's plan is of the batched graph, capacity 256 + 64
        assert onnx.path == f"engines/onnx-batched-fp16-c320/{role}/model.onnx" and plan.build == onnx.build
        assert (onnx.build["kv_cache"], onnx.build["capacity"]) == ("batched", 320)
    assert [e.format for e in manifest.target("jetson-thor").engines] == ["onnx", "onnx"]
    assert {e.build["kv_cache"] for e in manifest.target("jetson-thor").engines} == {"concat"}  # JetPack 7: 10.13

    # A Spark whose TensorRT-RTX is the builder's loads the shipped plan (the stand-in runs its ONNX instead).
    class Spark(StandInBackend):
        def load(self, plan, *, options, max_context=None):
            if Path(plan).read_bytes()[:1] == b"{":
                return super().load(plan, options=options, max_context=max_context)
            self.loads.append(Path(plan))
            copy = tmp_path / "as-json.plan"
            copy.write_text(json.dumps({"onnx": str(root / onnx_of(plan).path), "built_for": []}))
            return super().load(copy, options=options, max_context=max_context)

    def onnx_of(plan):
        return next(e for e in manifest.target("dgx-spark").engines if e.format == "onnx" and
                    str(plan).endswith(f"/{e.model}/engine.plan"))

    from bundler.pack.aot import RtxBuilder

    spark = Spark("12.1", RtxBuilder().version)
    engine = load_engine(root, manifest, "dgx-spark", "target", cache_dir=tmp_path / "cache", backend=spark)
    assert spark.builds == [] and spark.loads[0] == root / "engines/plans/dgx-spark/target/engine.plan"
    assert engine.batched and engine.forward_one([1, 2, 3]).shape[0] == 3  # the batched engine (stand-in plan)
    shutil.rmtree(tmp_path / "store")


def _network(trt, graph: Path):
    """TensorRT-RTX's network of `graph` (strongly typed, as the builder parses it), or its parser's errors."""
    logger = trt.Logger(trt.Logger.ERROR)
    network = trt.Builder(logger).create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(graph)):
        return None, " ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
    return network, ""


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_RTX, reason=NO_RTX)
def test_tensorrt_rtx_takes_the_batched_graph_as_kv_cache_update_and_attention_layers_only_with_a_static_capacity(
        tmp_path):
    """What the batched TensorRT engine relies on: each TensorScatter becomes TensorRT's KV-cache update layer
    (in place: present shares its past's memory) and each Attention TensorRT's attention layer; with the cache
    axis dynamic, the parser refuses it (why TensorRT targets get a graph with the capacity fixed)."""
    from collections import Counter

    from bundler.demo import DEMO_TARGET_DIR
    from bundler.onnx.export import export_onnx
    from runtime.engines.tensorrt import tensorrt_module

    trt = tensorrt_module("rtx")
    static = export_onnx(DEMO_TARGET_DIR, tmp_path / "static", kv_cache="batched", dtype="float16", capacity=320)
    network, errors = _network(trt, static.graph)
    assert network is not None, errors
    layers = Counter(network.get_layer(i).type for i in range(network.num_layers))
    assert layers[trt.LayerType.KV_CACHE_UPDATE] == 2 * static.num_layers
    assert layers[trt.LayerType.ATTENTION_INPUT] == static.num_layers
    inputs = {network.get_input(i).name: tuple(network.get_input(i).shape) for i in range(network.num_inputs)}
    assert inputs["past_key_values.0.key"] == (-1, static.num_kv_heads, 320, static.head_dim)
    assert inputs["attention_mask"] == (-1, 1, -1, -1)  # rows, new tokens and the window stay dynamic

    dynamic = export_onnx(DEMO_TARGET_DIR, tmp_path / "dynamic", kv_cache="batched", dtype="float16")
    network, errors = _network(trt, dynamic.graph)
    assert network is None and "must have a static sequence length dimension" in errors


def test_rtx_engines_without_tensorrt_rtx_is_one_line_naming_the_extra(monkeypatch):
    import runtime.engines.tensorrt as trt
    from bundler.pack.aot import RtxBuilder
    from manifests.errors import EnvironmentProblem

    def missing(flavour="tensorrt"):
        raise EnvironmentProblem(trt.RTX_NOT_INSTALLED)

    monkeypatch.setattr(trt, "tensorrt_module", missing)
    with pytest.raises(EnvironmentProblem) as e:
        RtxBuilder()
    assert str(e.value).startswith("--rtx-engines needs TensorRT-RTX's builder: TensorRT-RTX is not installed")
    assert "pip install 'bundle[rtx]'" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_RTX, reason=NO_RTX)
def test_int4_for_tensorrt_targets_is_blocked_int4_dequantize_linear_that_tensorrt_rtx_builds(
        tmp_path_factory, tmp_path):
    """--quantization int4 on TensorRT targets keeps them on TensorRT: their graph (dgx-spark: the static batched
    one; a Thor: concat) with its weights as INT4 initializers behind blocked DequantizeLinear (no MatMulNBits,
    which TensorRT lacks), the record in the engine key, the quality measured on it, and TensorRT-RTX builds a
    real plan from it here, with no GPU, smaller than the fp16 graph's plan of the same run (its weights stay
    4-bit inside)."""
    import onnx
    from click.testing import CliRunner

    from bundler.cli.pack import create
    from manifests.quantization import Quantization
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from runtime.store.store import Store

    fp16 = once_per_run(tmp_path_factory, "demo-rtx-spark", _demo_spark_bundle)
    out = tmp_path / "bundle"
    r = CliRunner().invoke(create, ["--targets", "dgx-spark,jetson-thor", "--rtx-engines", "--quantization", "int4",
                                    "--name", "demo", "--version", "1", "--unsigned", "--no-runtime", "--out",
                                    str(out), "--no-progress", "--max-model-len", "256"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "tensorrt: dgx-spark: batched graph (cache capacity 320, up to 8 slots a call)" in r.output
    store = Store(tmp_path / "store")
    store.install(out, target="dgx-spark", trusted={}, allow_unsigned=True)
    installed = store.current("demo")
    manifest, root = installed.manifest, Path(installed.path)
    target = manifest.target("dgx-spark")
    assert target.backend == "tensorrt" and target.build["quantization"] == "int4"
    onnx_rec, plan_rec = (e for e in target.engines if e.model == "target")
    assert onnx_rec.backend == plan_rec.backend == "tensorrt"
    assert onnx_rec.path.startswith("engines/onnx-batched-fp16-int4-qdq-c320/")
    assert plan_rec.build["kv_cache"] == "batched"
    thor = [e for e in manifest.target("jetson-thor").engines if e.model == "target"]
    assert [e.path.split("/")[1] for e in thor] == ["onnx-fp16-int4-qdq"]  # JetPack 7: the concat graph
    q = Quantization.from_dict(onnx_rec.build["quantization"])
    assert q.operator == "DequantizeLinear" and q.symmetric and q.bits == 4 and q.quality is not None
    assert plan_rec.key["build_options_sha256"] == onnx_rec.key["build_options_sha256"]  # the record: in both keys
    assert plan_rec.build["quantization"] == onnx_rec.build["quantization"]
    graph = onnx.load(str(root / onnx_rec.path), load_external_data=False)
    ops = {n.op_type for n in graph.graph.node}
    assert "DequantizeLinear" in ops and "MatMulNBits" not in ops
    int4 = [t for t in graph.graph.initializer if t.data_type == onnx.TensorProto.INT4]
    assert len(int4) == len(q.layers) > 0
    fp16_manifest = Store(tmp_path / "fp16-store")
    fp16_manifest.install(fp16["bundle"], target="dgx-spark", trusted={}, allow_unsigned=True)
    fp16_installed = fp16_manifest.current("demo")
    fp16_plan = next(e for e in fp16_installed.manifest.target("dgx-spark").engines
                     if e.model == "target" and e.format == "tensorrt-plan")
    assert (root / plan_rec.path).stat().st_size < (Path(fp16_installed.path) / fp16_plan.path).stat().st_size
    # the same graph runs on ONNX Runtime's CPU provider: where create measured its quality, and a device's fallback
    engine = OnnxRuntimeEngine(root / onnx_rec.path, max_context=64)
    assert engine.forward_one([1, 2, 3]).shape[0] == 3
