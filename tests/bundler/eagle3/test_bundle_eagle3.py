"""EAGLE-3 through the whole path: `bundle create --speculative-config '{"method": "eagle3", ...}'` resolves
and checks the head against the target and packs it; install; serve loads the head and its output is
token-identical to plain greedy decoding."""

from __future__ import annotations

import json

import pytest

from bundler.cli import main
from manifests.errors import ModelError, UsageError
from tests.bundler.pack.helpers import read_layout
from tests.eagle3_models import make_tiny_head
from tests.models import make_tiny_checkpoint
from runtime.serve.generator import Generator


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    from bundler.pack.keys import generate_key

    root = tmp_path_factory.mktemp("eagle3-keys")
    generate_key(root / "key")
    return root


def _create(out, keys, spec, *model, targets="cpu"):
    """No runtime wheelhouse: the head's path is the point here (tests/bundler/wheelhouse covers that part)."""
    return main(["create", *model, "--targets", targets, "--name", "e3", "--version", "1", "--sign-key",
                 str(keys / "key"), "--out", str(out), "--no-progress", "--no-runtime", "--speculative-config", spec])


def _install_and_load(bundle, keys, store, target="cpu", **kw):
    from runtime.server.loader import load_serving_model
    from runtime.store.store import Store
    from runtime.store.trust import trusted_keys

    Store(store).install(bundle, target=target, trusted=trusted_keys([keys / "key.pub"], trust_dir=None))
    return load_serving_model(Store(store).current("e3"), **kw)


def _greedy(model, prompt, n=24):
    from runtime.serve.sampling import SamplingParams

    return [t for s in Generator.over(model.runner).generate(prompt, SamplingParams(temperature=0.0), max_tokens=n)
            for t in s.tokens]


def test_tiny_random_head_resolve_pack_install_serve(tmp_path, keys, capsys):
    target = make_tiny_checkpoint(tmp_path / "target", num_layers=4, seed=2)
    head = make_tiny_head(tmp_path / "head", target, draft_vocab=400)  # default layer ids [2, 2, 1]
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 4})
    assert _create(tmp_path / "b", keys, spec, "--model", str(target)) == 0, capsys.readouterr().err
    manifest = read_layout(tmp_path / "b")[2]
    assert manifest.speculative.method == "eagle3" and manifest.speculative.num_speculative_tokens == 4
    assert [(m.role, m.architecture) for m in manifest.models] == [("target", "LlamaForCausalLM"),
                                                                   ("draft", "LlamaForCausalLMEagle3")]
    paths = {f.path for f in manifest.files}
    assert any(p.endswith("/draft/eagle3.onnx") for p in paths), sorted(paths)
    # the target runs the same batched in-place graph as plain decoding, with the aux output; the head its own
    records = {e.model: e for e in manifest.target("cpu").engines}
    assert records["target"].build["kv_cache"] == "batched" and records["draft"].build["kv_cache"] == "batched"
    served = _install_and_load(tmp_path / "b", keys, tmp_path / "store")
    assert served.runner.method == "eagle3" and served.info["speculative"].startswith("eagle3")
    assert served.runner.target.kv_cache == "batched" and served.runner.target.aux_width == 3 * 64
    assert served.runner.head.kv_cache == "batched"
    assert type(served.runner.head).__name__ == "OnnxSlotsDrafter"  # every slot in one head run
    assert served.runner.head.device == "cpu"
    assert "EAGLE-3 head" in served.info["speculative"] and "slots in one run) on cpu" in served.info["speculative"]
    plain = _install_and_load(tmp_path / "b", keys, tmp_path / "store", no_speculation=True)
    prompt = list(range(5, 40, 3))
    assert _greedy(served, prompt) == _greedy(plain, prompt)
    assert served.runner.stats.num_drafts > 0


def test_demo_target_with_demo_head(tmp_path, keys, capsys):
    """No --model: the demo target with the shipped head (the issue's one-line example)."""
    assert _create(tmp_path / "b", keys, '{"method": "eagle3", "num_speculative_tokens": 3}') == 0, \
        capsys.readouterr().err
    served = _install_and_load(tmp_path / "b", keys, tmp_path / "store")
    assert served.runner.method == "eagle3" and served.runner.num_speculative_tokens == 3
    prompt = served.tokenizer.encode("<|user|>\nWhat does `os.path.join(a, *p)` do?<|end|>\n<|assistant|>\n")
    _greedy(served, prompt, 40)
    assert served.runner.stats.acceptance_rate > 0.3


def test_head_for_another_target_refused_at_create_leaving_nothing(tmp_path, keys, capsys):
    target = make_tiny_checkpoint(tmp_path / "target", num_layers=4, seed=2)
    other = make_tiny_checkpoint(tmp_path / "other", hidden_size=32, num_layers=4, num_heads=2, seed=3)
    head = make_tiny_head(tmp_path / "head", other)
    spec = json.dumps({"method": "eagle3", "model": str(head)})
    capsys.readouterr()  # the fixtures' own progress output (transformers' "Writing model shards")
    assert _create(tmp_path / "b", keys, spec, "--model", str(target)) == ModelError.exit_code
    err = capsys.readouterr().err
    assert "expected target hidden size 64" in err and "found 32" in err and err.count("\n") == 1
    assert not (tmp_path / "b").exists()


def _host_cuda(graph, record, max_context):
    """load_engine's `cuda` seam: the real CUDA engine class over the bundle's graphs, on host memory and
    ONNX Runtime's CPU provider (tests/runtime/engines/host_memory.py); no GPU here."""
    from runtime.engines import decode_graph_of
    from runtime.engines.cuda import CudaEngine
    from tests.runtime.engines.host_memory import HostMemory

    return CudaEngine(graph, max_context=max_context, kv_cache=record.build.get("kv_cache"),
                      decode_graph=decode_graph_of(graph, record), memory=HostMemory()), None


def test_cuda_target_create_install_serve_through_the_cuda_engine(tmp_path, keys, capsys):
    """`--targets cuda` with EAGLE-3 is no longer refused: the fp16 Attention graph and its GroupQueryAttention
    decode graph both return the aux rows, and the CUDA engine (host mode) serves the head greedy-identically."""
    import functools

    import onnx

    from runtime.engines import load_engine

    target = make_tiny_checkpoint(tmp_path / "target", num_layers=4, seed=2)
    head = make_tiny_head(tmp_path / "head", target, draft_vocab=400)
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    assert _create(tmp_path / "b", keys, spec, "--model", str(target), targets="cuda") == 0, capsys.readouterr().err
    manifest = read_layout(tmp_path / "b")[2]
    records = {e.model: e for e in manifest.target("cuda").engines}
    assert records["target"].backend == "onnxruntime-cuda" and records["target"].build["kv_cache"] == "batched"
    assert records["target"].build["decode_graph"].endswith("/target/decode.onnx")
    assert records["draft"].path.endswith("/draft/eagle3.onnx")
    load = functools.partial(load_engine, cuda=_host_cuda)
    served = _install_and_load(tmp_path / "b", keys, tmp_path / "store", target="cuda", load_engine=load)
    engine = served.runner.target
    assert type(engine).__name__ == "CudaEngine" and engine.dual and engine.aux_width == 3 * 64
    assert engine.precision == "fp16" and served.runner.method == "eagle3"
    assert served.runner.head.device == "cpu"  # beside a GPU target the CUDA provider's, which is absent here
    for graph in (engine._graph, engine._decode_graph):
        outputs = [o.name for o in onnx.load(str(graph), load_external_data=False).graph.output]
        assert "aux_hidden_states" in outputs, graph
    plain = _install_and_load(tmp_path / "b", keys, tmp_path / "store", target="cuda", load_engine=load,
                              no_speculation=True)
    prompt = list(range(5, 40, 3))
    assert _greedy(served, prompt) == _greedy(plain, prompt)
    assert served.runner.stats.num_drafts > 0


def test_tensorrt_target_still_refused(tmp_path, keys, capsys):
    target = make_tiny_checkpoint(tmp_path / "target", num_layers=4, seed=2)
    head = make_tiny_head(tmp_path / "head", target)
    spec = json.dumps({"method": "eagle3", "model": str(head)})
    capsys.readouterr()
    assert _create(tmp_path / "b", keys, spec, "--model", str(target), targets="cuda,jetson-thor") \
        == UsageError.exit_code
    err = capsys.readouterr().err
    assert "EAGLE-3 runs on ONNX Runtime targets" in err and "jetson-thor" in err and "cuda" not in err.split(":")[-1]
    assert not (tmp_path / "b").exists()
