"""--no-checkpoint-weights: the engines carry the weights, so the checkpoint's copy can stay home."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

import pytest

from bundler.create import create_bundle, local_model
from bundler.engines import target_files_hook
from manifests.errors import UsageError
from runtime.store import Store
from runtime.trust import load_public_key

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def test_weights_left_out_are_listed_and_the_bundle_still_serves(tiny_pair, signing_key, key_paths, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "lean"
    manifest = create_bundle(out, name="lean", version=1, model=local_model(target, "target"),
                             draft=local_model(draft, "draft"), targets=["cpu"], sign_keys=[signing_key], now=NOW,
                             progress=False, target_files=target_files_hook(), checkpoint_weights=False)
    assert not [f.path for f in manifest.files if f.path.endswith(".safetensors")]
    omitted = manifest.model("target").extra["omitted_files"]
    data = (target / "model.safetensors").read_bytes()
    assert omitted == [{"path": "model.safetensors", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    assert manifest.model("draft").extra["omitted_files"][0]["path"] == "model.safetensors"

    trusted = dict([load_public_key(key_paths[0].with_name(key_paths[0].name + ".pub"))])
    installed = Store(tmp_path / "store").install(out, target="cpu", trusted=trusted)
    assert installed.manifest.model("target").extra["omitted_files"] == omitted  # signed, survives the trip
    from runtime.sampling import SamplingParams
    from runtime.server.loader import load_serving_model

    model = load_serving_model(installed)
    steps = model.generator.generate([5, 6, 7], SamplingParams(temperature=0.0), max_tokens=4)
    assert sum(len(s.tokens) for s in steps) >= 1


def test_weights_cannot_be_left_out_when_they_are_the_only_copy(tiny_pair, signing_key, tmp_path):
    with pytest.raises(UsageError, match="only copy"):
        create_bundle(tmp_path / "b", name="x", version=1, model=local_model(tiny_pair[0], "target"), draft=None,
                      targets=["cpu"], sign_keys=[signing_key], now=NOW, progress=False, checkpoint_weights=False)
    assert not (tmp_path / "b").exists()
