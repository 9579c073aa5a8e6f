"""bundle.lock.json: round trip, rebuild from it, and refusal naming what drifted."""

from __future__ import annotations

import json
import re

import pytest

from bundler.resolve.lockfile import (LOCK_NAME, entry_from_resolved, read_lock, refs_from_lock, write_lock)
from bundler.resolve.checkpoint import resolve_model, resolve_models
from bundler.resolve.errors import LockMismatch
from manifests.errors import UsageError
from tests.bundler.resolve.hub_server import copy_checkpoint


def test_round_trip_and_rebuild(hub, hf_cache, tmp_path):
    models = resolve_models("acme/tiny-llama@v1", "acme/tiny-draft", cache_dir=hf_cache, endpoint=hub.url)
    lock = write_lock(tmp_path / LOCK_NAME, models)
    doc = json.loads(lock.read_text())
    assert doc["models"]["target"]["revision"] == hub.shas["v1"]
    assert doc["models"]["target"]["requested_revision"] == "v1"
    assert {"path": "model.safetensors", "size": models["target"].files[-3].size,
            "sha256": models["target"].files[-3].sha256} in doc["models"]["target"]["files"]
    entries = read_lock(lock)
    assert entries == {role: entry_from_resolved(m) for role, m in models.items()}
    assert refs_from_lock(entries) == {"target": f"acme/tiny-llama@{hub.shas['v1']}",
                                       "draft": f"acme/tiny-draft@{hub.shas['draft']}"}
    again = resolve_models("acme/tiny-llama@v1", "acme/tiny-draft", lock_path=lock, cache_dir=hf_cache,
                           endpoint=hub.url)
    assert {r: m.files for r, m in again.items()} == {r: m.files for r, m in models.items()}


def test_branch_moved_is_refused_before_downloading_weights(hub, hf_cache, tmp_path, checkpoints):
    first = hub.repos.commit("acme/moving", copy_checkpoint(checkpoints.draft))
    lock = write_lock(tmp_path / LOCK_NAME, [resolve_model("acme/moving", role="target", cache_dir=hf_cache,
                                                           endpoint=hub.url)])
    cfg = json.loads((checkpoints.draft / "config.json").read_text()) | {"note": "retrained"}
    second = hub.repos.commit("acme/moving", {"config.json": json.dumps(cfg).encode()})
    hub.proxy.reset()
    with pytest.raises(LockMismatch, match=rf"target model differs from the lock file: revision: lock has {first}, "
                                           rf"resolved {second} \(to rebuild the locked bytes, use "
                                           rf"acme/moving@{first}\)") as e:
        resolve_models("acme/moving", lock_path=lock, cache_dir=hf_cache / "fresh", endpoint=hub.url)
    assert re.search(r"config\.json: lock has \d+ bytes, resolved \d+", str(e.value))
    assert hub.gets("model.safetensors") == [] and hub.gets("config.json") == []
    # The hint works: the locked commit still rebuilds.
    again = resolve_models(f"acme/moving@{first}", lock_path=lock, cache_dir=hf_cache, endpoint=hub.url)
    assert again["target"].revision == first


def test_changed_filters_are_drift(hub, hf_cache, tmp_path):
    lock = write_lock(tmp_path / LOCK_NAME, resolve_models("acme/tiny-llama@v1", cache_dir=hf_cache,
                                                           endpoint=hub.url))
    with pytest.raises(LockMismatch, match=r"README\.md: resolved now, not in the lock"):
        resolve_models("acme/tiny-llama@v1", include=["README.md"], lock_path=lock, cache_dir=hf_cache,
                       endpoint=hub.url)
    with pytest.raises(LockMismatch, match=r"lock file has models target, the command asks for draft, target"):
        resolve_models("acme/tiny-llama@v1", "acme/tiny-draft", lock_path=lock, cache_dir=hf_cache,
                       endpoint=hub.url)


def test_local_folder_drift(tmp_path, checkpoints, local_copy):
    folder = local_copy(checkpoints.draft)
    lock = write_lock(tmp_path / LOCK_NAME, resolve_models(str(folder)))
    assert read_lock(lock)["target"].revision.startswith("sha256:")
    resolve_models(str(folder), lock_path=lock)  # unchanged: accepted
    cfg = folder / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace("<|end|>", "<|eot|>"))
    with pytest.raises(LockMismatch, match=r"revision: lock has sha256:[0-9a-f]{64}, resolved sha256:[0-9a-f]{64}; "
                                           r"tokenizer_config\.json: lock has sha256"):
        resolve_models(str(folder), lock_path=lock)


@pytest.mark.parametrize("content, expected", [
    ("not json", r"expected JSON"),
    ('{"lock_version": 9, "models": {}}', r"expected lock_version 1, found 9"),
    ('{"lock_version": 1, "models": {"draft": {}}}', r"expected a 'models' object with a 'target' entry"),
    ('{"lock_version": 1, "models": {"target": {"source": "huggingface", "repo": "a/b", "revision": "x", '
     '"files": [{"path": "config.json", "size": 1, "sha256": "zz"}]}}}', r"expected files as \{path, size, sha256\}"),
])
def test_malformed_lock_is_a_usage_error(tmp_path, content, expected):
    p = tmp_path / LOCK_NAME
    p.write_text(content)
    with pytest.raises(UsageError, match=expected):
        read_lock(p)


def test_missing_lock_file(tmp_path):
    with pytest.raises(UsageError, match=r"cannot read it"):
        read_lock(tmp_path / "nope.json")
