"""The MoE and recurrent families on the `cuda` target, through the whole path on a machine without a GPU:
`bundle create --targets cuda` (the fp16 batched graph; with `--quantization int4` its MatMulNBits and, where
the expert width allows, QMoE), `bundle install --target cuda`, and a real server driven by the official
`openai` client. Without onnxruntime-gpu the cuda bundle runs on ONNX Runtime's CPU provider
(runtime.engines._on_cuda, recorded as a fallback): that fallback must serve these graphs, and greedy text
must not depend on speculation (the draft's rejected tokens are rolled back, recurrent states by replay).
The same graphs on a GPU: tests/runtime/engines/test_cuda_families.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import once_per_run
from tests.models import NEMOTRON_MOE, make_tiny_checkpoint
from tests.runtime.serve.conftest import RunningServer, signed_bundle, tiny_dense_draft

PROMPTS = ["def read(path):\n    with open(path) as f:\n", "The quick brown fox", "import os\nimport sys\n"]
#: name -> (family, config overrides, seed, quantization); the int4 MoE models have experts 64 wide, which
#: ONNX Runtime's CUDA QMoE takes (bundler.onnx.blocks.moe.CUDA_QMOE_INTER_MULTIPLE)
MODELS = {"qwen3_moe": ("qwen3_moe", None, 5, None),
          "qwen3_5_text": ("qwen3_5_text", None, 3, None),
          "nemotron_h_moe": ("nemotron_h", NEMOTRON_MOE, 7, None),
          "qwen3_moe-int4": ("qwen3_moe", {"moe_intermediate_size": 64}, 5, "int4"),
          "nemotron_h_moe-int4": ("nemotron_h", {**NEMOTRON_MOE, "moe_intermediate_size": 64}, 7, "int4")}


@pytest.fixture(scope="module", params=sorted(MODELS))
def cuda_store(tmp_path_factory, request) -> tuple[str, Path]:
    which = request.param
    family, overrides, seed, quant = MODELS[which]

    def build(root: Path) -> Path:
        from manifests.quantization import QuantizeOptions

        target = make_tiny_checkpoint(root / "target", family=family, seed=seed, overrides=overrides)
        options = QuantizeOptions(mode=quant, max_quality_loss=10.0) if quant else None
        return signed_bundle(root, "fam", target, tiny_dense_draft(root, target, seed=4), targets=("cuda",),
                             install="cuda", quantization=options)

    return which, once_per_run(tmp_path_factory, f"cuda-family-bundle-{which}", build)


def _serve(store: Path, **load):
    from runtime.server.app import OpenAIServer
    from runtime.server.loader import load_serving_model
    from runtime.server.serving_engine import ServeOptions
    from runtime.store.store import Store

    serving = load_serving_model(Store(store).current("fam"), **load)
    serving.runner.speculation.adaptive = False  # every step verifies its full proposal
    return RunningServer(OpenAIServer(serving, ServeOptions(max_num_seqs=2, log_interval_s=60.0)))


def _greedy(server) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = []
    for p in PROMPTS:
        r = client.completions.create(model="fam", prompt=p, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 20
        out.append(r.choices[0].text)
    return out


def test_cuda_bundle_serves_on_the_cpu_fallback_and_speculation_keeps_greedy_text(cuda_store, tmp_path):
    import onnx

    from runtime.store.store import Store

    which, store = cuda_store
    installed = Store(store).current("fam")
    target = next(p for p in Path(installed.path).rglob("model.onnx") if "target" in p.parts)
    model = onnx.load(str(target), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["bundle.dtype"] == "float16" and meta["bundle.kv_cache"] == "batched"
    ops = {n.op_type for n in model.graph.node}
    if which.endswith("int4"):
        assert {"MatMulNBits", "QMoE"} <= ops
    server = _serve(store, no_speculation=True, cache_dir=tmp_path)
    try:
        engine = server.serving.model.runner.target
        assert engine.choice.runs == "onnxruntime-cpu" and engine.choice.wanted == "onnxruntime-cuda"
        assert engine.kv_dtype.itemsize == 2 and engine.recurrent == (not which.startswith("qwen3_moe"))
        plain = _greedy(server)
    finally:
        server.stop()
    server = _serve(store, cache_dir=tmp_path)  # the bundle's draft model speculates
    try:
        assert server.serving.model.runner.draft is not None
        speculative = _greedy(server)
        stats = server.serving.model.runner.stats
    finally:
        server.stop()
    assert all(plain), f"expected text from every prompt, found {plain}"
    assert speculative == plain
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # some drafts were rejected and rolled back
