"""A GPU target's fp16 graph on a device without TensorRT: ONNX Runtime runs it, and speculation stays exact.

Greedy speculative decoding (draft proposes, target verifies, rejected tokens rolled back) must give
token for token what plain greedy decoding on the same fp16 target gives: the fp16 cache buffers,
their rollback and the float32 logits all take part.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.runtime.engines.standin import StandInBackend
from tests.runtime.engines.test_load_engine import install_tree


def noisy_copy(checkpoint, out, scale: float = 0.1):
    """The checkpoint with noise on its matrices: a draft that agrees with it often, not always."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    weights, rng = load_file(out / "model.safetensors"), torch.Generator().manual_seed(1)
    save_file({k: v + scale * v.std() * torch.randn(v.shape, generator=rng) if v.ndim > 1 else v
               for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def fp16_bundle(tiny_export, tmp_path_factory):
    """An igx-thor bundle (target + draft, same tokenizer) laid out as installed."""
    from bundler.pack.engines import prepare_targets

    root = tmp_path_factory.mktemp("fp16-bundle")
    target = tiny_export[0]
    draft = noisy_copy(target, root / "draft")
    files, targets = prepare_targets(["igx-thor"], {"target": target, "draft": draft}, root / "work",
                                     {"max_model_len": 128}, backend=StandInBackend(None))
    return root / "installed", install_tree(files, targets, root / "installed")


def test_fallback_runs_the_fp16_graph_and_speculation_equals_plain_greedy(fp16_bundle, tmp_path):
    from runtime.engines import load_engine
    from runtime.engines.tensorrt import TensorRTBackend
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.generator import Generator

    if TensorRTBackend().device() is not None:
        pytest.skip("a real TensorRT GPU is present; the ONNX Runtime fallback is not taken")
    root, manifest = fp16_bundle
    records = manifest.target("igx-thor").engines
    assert {e.path for e in records} == {"engines/onnx-fp16/target/model.onnx", "engines/onnx-fp16/draft/model.onnx"}
    engines = {role: load_engine(root, manifest, "igx-thor", role, cache_dir=tmp_path / "cache")
               for role in ("target", "draft")}
    for engine in engines.values():
        assert engine.kv_dtype == np.float16 and "fallback from TensorRT" in engine.description
    logits = engines["target"].forward_one([1, 2, 3])
    assert logits.dtype == np.float32 and logits.shape == (3, 512)
    engines["target"].release(0)

    prompt, greedy = [5, 17, 42, 9, 300], SamplingParams(temperature=0.0)
    plain = [t for s in Generator(engines["target"]).generate(prompt, greedy, max_tokens=40) for t in s.tokens]
    spec = Generator(engines["target"], engines["draft"], "draft_model", 3)
    steps = list(spec.generate(prompt, greedy, max_tokens=40))
    assert [t for s in steps for t in s.tokens] == plain and len(plain) == 40
    # Every kind of verification happened: all accepted, some (a partial rollback), none.
    assert {"all", "some", "none"} <= {"all" if s.accepted == s.drafted else "none" if s.accepted == 0 else "some"
                                       for s in steps if s.drafted}
