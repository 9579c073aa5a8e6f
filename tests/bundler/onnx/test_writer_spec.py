"""The one external-data writer (bundler.onnx.writer) and the graph description (bundler.onnx.spec)."""

from __future__ import annotations

import numpy as np
import pytest

from manifests.errors import UsageError


def _model(initializers):
    from onnx import TensorProto as TP
    from onnx import helper as h

    out = h.make_tensor_value_info("y", TP.FLOAT, None)
    graph = h.make_graph([h.make_node("Identity", [initializers[-1].name], ["y"])], "g", [], [out], initializers)
    return h.make_model(graph)


def test_tensor_writer_aligns_streams_and_reads_back(tmp_path):
    import onnx

    from bundler.onnx.writer import ALIGN, TensorWriter, data_path, read_external

    graph = tmp_path / "model.onnx"
    big = np.arange(1000, dtype=np.float32)
    with TensorWriter(data_path(graph)) as w:
        w.add("small", np.ones(3, np.float32))  # under INLINE_BELOW: stays in the graph
        w.add("a", big[:333])
        w.add("b", big)
        assert w.add("b", np.zeros(1, np.float32)) == "b" and len(w.initializers) == 3  # added once
        w.commit(_model(w.initializers), graph)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    model = onnx.load(str(graph), load_external_data=False)
    by_name = {t.name: t for t in model.graph.initializer}
    assert by_name["small"].data_location == onnx.TensorProto.DEFAULT
    files: dict = {}
    for name, want in (("a", big[:333]), ("b", big)):
        offset = int({e.key: e.value for e in by_name[name].external_data}["offset"])
        assert offset % ALIGN == 0
        assert np.array_equal(np.frombuffer(read_external(graph, by_name[name], files), np.float32), want)
    for f in files.values():
        f.close()


def test_tensor_writer_leaves_nothing_when_the_build_fails(tmp_path):
    from bundler.onnx.writer import TensorWriter

    with pytest.raises(RuntimeError):
        with TensorWriter(tmp_path / "model.onnx.data") as w:
            w.add("a", np.zeros(1024, np.float32))
            raise RuntimeError("a block refused the checkpoint")
    assert list(tmp_path.iterdir()) == []


def test_save_model_writes_graph_and_one_data_file(tmp_path):
    import onnx
    from onnx import numpy_helper

    from bundler.onnx.writer import save_model

    weights = np.random.default_rng(0).standard_normal(512).astype(np.float32)
    save_model(_model([numpy_helper.from_array(weights, "w")]), tmp_path / "q.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.onnx", "q.onnx.data"]
    loaded = onnx.load(str(tmp_path / "q.onnx"))
    assert np.array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), weights)


def test_graph_spec_maps_export_keywords():
    from bundler.onnx.spec import GraphSpec

    assert GraphSpec().export_options() == {}
    spec = GraphSpec.of_variant(("batched", "bfloat16", "int4"))
    assert spec.variant == ("batched", "bfloat16", "int4")
    assert spec.export_options() == {"kv_cache": "batched", "dtype": "bfloat16"}  # quantization: applied after
    assert GraphSpec("batched", fusions=["gqa"]).export_options() == {"kv_cache": "batched",
                                                                     "fusions": frozenset({"gqa"})}
    with pytest.raises(UsageError, match="bfloat16"):
        GraphSpec("concat", "bfloat16")
    with pytest.raises(UsageError, match="kv_cache to be one of"):
        GraphSpec("paged")
    with pytest.raises(UsageError, match="batched KV-cache graph"):
        GraphSpec("shared", fusions={"qkv"}).check_fusions()
    static = GraphSpec.of_variant(("batched", "float16", "none", 320))  # what TensorRT targets carry
    assert static.variant == ("batched", "float16", "none", 320)
    assert static.export_options() == {"kv_cache": "batched", "dtype": "float16", "capacity": 320}
    with pytest.raises(UsageError, match="static cache capacity applies to the batched KV-cache graph"):
        GraphSpec("concat", capacity=320)


def test_graph_spec_names_the_bundle_folders_bundles_already_use():
    """The folders are in signed bundles and lock files: a GraphSpec must name the same ones."""
    from bundler.onnx.spec import GraphSpec

    assert GraphSpec().folder == "engines/onnx"
    assert GraphSpec("concat", "float16").folder == "engines/onnx-fp16"
    assert GraphSpec("concat", "float16", quantization="int4-qdq").folder == "engines/onnx-fp16-int4-qdq"
    assert GraphSpec("batched").folder == "engines/onnx-batched"
    assert GraphSpec("batched", "bfloat16", quantization="int4").folder == "engines/onnx-batched-bf16-int4"
    assert GraphSpec("shared", "float16").folder == "engines/onnx-shared-fp16"
    # the folder and the target match by layout, dtype and quantization only
    assert GraphSpec.of_variant(("batched", "float16")) == GraphSpec("batched", "float16")
    assert GraphSpec("batched", "float16", capacity=320).folder == "engines/onnx-batched-fp16-c320"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensor_writer_stores_floats_in_the_graph_dtype_but_inside_float32(dtype, tmp_path):
    """One writer for every dtype: float32 arrays are stored as the graph's dtype (inline or external by their
    stored size), int64 as they are, and what a block adds inside float32() (a float32 computation) stays
    float32."""
    import onnx
    from onnx import numpy_helper

    from bundler.onnx.writer import TensorWriter, data_path, to_bfloat16_bits

    graph = tmp_path / "model.onnx"
    weight = np.linspace(-3, 3, 400, dtype=np.float32)  # 1600 bytes in float32, 800 in half: inline
    big = np.linspace(-3, 3, 1000, dtype=np.float32)
    with TensorWriter(data_path(graph), dtype) as w:
        w.add("weight", weight)
        w.add("big", big)
        w.add("shape", np.array([2, 3], np.int64))
        with w.float32():
            w.add("router", big)
        w.commit(_model(w.initializers), graph)
    by_name = {t.name: t for t in onnx.load(str(graph)).graph.initializer}
    T = onnx.TensorProto
    half = T.FLOAT16 if dtype == "float16" else T.BFLOAT16
    assert {n: t.data_type for n, t in by_name.items()} == {"weight": half, "big": half, "shape": T.INT64,
                                                             "router": T.FLOAT}
    assert onnx.load(str(graph), load_external_data=False).graph.initializer[0].data_location == T.DEFAULT
    want = big.astype(np.float16).view(np.uint16) if dtype == "float16" else to_bfloat16_bits(big)
    assert np.frombuffer(by_name["big"].raw_data, np.uint16).tolist() == want.tolist()
    assert np.array_equal(numpy_helper.to_array(by_name["router"]), big)


def test_a_float32_graph_gets_no_casts_and_a_half_one_one_each(tmp_path):
    """The blocks write one graph for every dtype: GraphBuilder's casts are Casts in a half-precision graph and
    nothing in a float32 one, where a named output is the producer's own (the float32 graphs stay as they were)."""
    from bundler.onnx.blocks.graph import FLOAT32_REGION, GraphBuilder
    from bundler.onnx.writer import TensorWriter

    built = {}
    for dtype in ("float32", "float16"):
        with TensorWriter(tmp_path / f"{dtype}.onnx.data", dtype) as w:
            g = GraphBuilder(w, {}, dtype)
            with g.float32_region():
                y = g.node("Relu", [g.to_float32("x")])
            g.to_float32(g.node("Neg", [g.to_graph_dtype(y)]), "out")
            w.abort()
        built[dtype] = [(n.op_type, list(n.input), list(n.output), n.name.startswith(FLOAT32_REGION))
                        for n in g.nodes]
    assert built["float32"] == [("Relu", ["x"], ["/Relu_0/out"], True), ("Neg", ["/Relu_0/out"], ["out"], False)]
    assert [(op, region) for op, _, _, region in built["float16"]] == [
        ("Cast", True), ("Relu", True), ("Cast", False), ("Neg", False), ("Cast", False)]
    assert built["float16"][-1][2] == ["out"]
