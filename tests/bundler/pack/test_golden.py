"""The signed bytes are a contract: fixed input + fixed clock must give byte-identical manifest bytes.

Update after an intended format change with: pytest tests/bundler/pack/test_golden.py --update-golden
(part digests also change if the bundled libzstd changes its level-3 output: that is worth knowing).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bundler.pack.create import ModelInput, CreateOptions, create_bundle
from manifests.schema import Builder, Manifest, ModelSource
from tests.bundler.pack.helpers import read_layout

GOLDEN = Path(__file__).parent / "golden" / "manifest.json"
NOW = datetime(2026, 11, 29, 14, 0, 0, tzinfo=timezone.utc)
BUILDER = Builder(tool="bundle", tool_version="0.0.0-golden", platform="linux-aarch64")


def _fixed_model(root: Path, role: str, seed: int) -> ModelInput:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                  "max_position_embeddings": 8192}, sort_keys=True))
    (root / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    weights = np.random.default_rng(seed).standard_normal(200_000, dtype=np.float32)
    (root / "model.safetensors").write_bytes((weights.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    return ModelInput(role=role, local_dir=root, name=f"golden-{role}",
                      source=ModelSource(type="local"))


def test_manifest_bytes_match_golden(tmp_path, update_golden, signing_key):
    model = _fixed_model(tmp_path / "t", "target", 0)
    draft = _fixed_model(tmp_path / "d", "draft", 1)
    manifest = create_bundle(tmp_path / "b", CreateOptions(name="golden", version=7, model=model, draft=draft,
                             targets=["jetson-thor", "igx-thor"], sign_keys=[signing_key],
                             max_part_size=128 * 1024, expires="90d", now=NOW, jobs=2, progress=False,
                             builder=BUILDER))
    got = manifest.to_json_bytes()
    assert read_layout(tmp_path / "b")[2].to_json_bytes() == got
    if update_golden:
        GOLDEN.write_bytes(got)
    assert GOLDEN.exists(), f"{GOLDEN} is missing: run pytest {__file__} --update-golden"
    assert got == GOLDEN.read_bytes(), "manifest bytes changed; if intended, rerun with --update-golden"
    # The golden file also stays parseable and canonical (parse -> serialise is the identity).
    assert Manifest.from_json_bytes(GOLDEN.read_bytes()).to_json_bytes() == GOLDEN.read_bytes()


def test_same_bytes_with_one_worker_or_many(tmp_path, signing_key):
    """Streaming multithreaded zstd output does not depend on the worker count: same blobs everywhere."""
    model = _fixed_model(tmp_path / "t", "target", 0)
    kw = dict(name="golden", version=7, model=model, draft=None, targets=["cpu"], sign_keys=[signing_key],
              max_part_size=128 * 1024, now=NOW, progress=False, builder=BUILDER)
    one = create_bundle(tmp_path / "one", CreateOptions(jobs=1, **kw))
    many = create_bundle(tmp_path / "many", CreateOptions(jobs=6, **kw))
    assert one.to_json_bytes() == many.to_json_bytes()
