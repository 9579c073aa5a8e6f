"""`bundle create` reads each weight file once: the resolver leaves the hashing to pack and checks what
pack found against the hub's (or the lock's) digests before the bundle is finished."""

from __future__ import annotations

import hashlib

import pytest
import zstandard

from bundler.resolve import checkpoint as resolve_module
from bundler.pack.create import CreateOptions, create_bundle, input_from_resolved
from bundler.resolve.lockfile import LOCK_NAME, write_lock
from bundler.resolve.checkpoint import check_packed, fetch_model, plan_model, resolve_model, resolve_models
from bundler.resolve.errors import DigestMismatch, LockMismatch
from manifests.layout import BLOBS_DIR, COMPLETE_MARKER, INDEX_FILE


def _spy_hashing(monkeypatch) -> list[str]:
    hashed, real = [], resolve_module._hash_file
    monkeypatch.setattr(resolve_module, "_hash_file", lambda path, *a: (hashed.append(path.name), real(path, *a))[1])
    return hashed


def _create(out, model):
    return create_bundle(out, CreateOptions(name="one-pass", version=1, model=model, draft=None, targets=["cpu"],
                         sign_keys=[], unsigned=True, progress=False, max_part_size=256 * 1024))


def test_weights_are_not_hashed_before_pack(hub, hf_cache, monkeypatch, tmp_path):
    hashed = _spy_hashing(monkeypatch)
    plan = plan_model("acme/tiny-llama@v1", role="target", cache_dir=hf_cache, endpoint=hub.url)
    deferred = fetch_model(plan, hash_files=False)
    weights = next(f for f in deferred.files if f.path == "model.safetensors")
    assert "model.safetensors" not in hashed and not weights.checked
    assert weights.sha256 == plan.expected["model.safetensors"].lfs_sha256  # what the hub declares
    manifest = _create(tmp_path / "b", input_from_resolved(deferred))
    assert "model.safetensors" not in hashed  # pack hashed it, beside its compression
    packed = {f.path.removeprefix("models/target/"): (f.size, f.sha256) for f in manifest.files}
    checked = check_packed(deferred, packed)
    monkeypatch.undo()
    assert checked.files == resolve_model("acme/tiny-llama@v1", role="target", cache_dir=hf_cache,
                                          endpoint=hub.url).files  # the same digests as hashing up front
    assert all(f.checked for f in checked.files)


def test_hub_digest_mismatch_found_by_pack_fails_the_create(hub, hf_cache, tmp_path):
    resolved = resolve_models("acme/corrupt", cache_dir=hf_cache, endpoint=hub.url, hash_files=False)["target"]
    bad = (resolved.local_dir / "model.safetensors").read_bytes()
    out = tmp_path / "b"
    with pytest.raises(DigestMismatch, match=r"model\.safetensors does not match the hub's metadata: expected "
                                             r"sha256 [0-9a-f]{64}, found [0-9a-f]{64}") as e:
        _create(out, input_from_resolved(resolved))
    assert e.value.exit_code == 7
    assert not (out / INDEX_FILE).exists() and not (out / COMPLETE_MARKER).exists()
    # No blob holds the bad bytes (nobody signed them); the good files' blobs stay for a resumed run.
    blobs = list((out / BLOBS_DIR).iterdir())
    assert blobs
    dctx = zstandard.ZstdDecompressor()
    found = b"".join(dctx.decompress(p.read_bytes()) for p in blobs if p.stat().st_size)
    assert bad[:4096] not in found and hashlib.sha256(bad).hexdigest() not in {p.name for p in blobs}
    snap = hf_cache / "models--acme--corrupt" / "snapshots" / hub.shas["corrupt"]
    assert not (snap / "model.safetensors").exists()  # evicted: a retry downloads it again
    assert (snap / "config.json").exists()


def test_local_folder_drift_from_the_lock_is_found_after_one_pass(tmp_path, checkpoints, local_copy, monkeypatch):
    folder = local_copy(checkpoints.draft)
    lock = write_lock(tmp_path / LOCK_NAME, resolve_models(str(folder)))
    cfg = folder / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace("<|end|>", "<|eot|>"))  # same size, other bytes
    hashed = _spy_hashing(monkeypatch)
    resolved = resolve_models(str(folder), lock_path=lock, hash_files=False)["target"]  # sizes agree
    assert hashed == [] and resolved.revision == ""  # pinned once pack has hashed the files
    out = tmp_path / "b"
    with pytest.raises(LockMismatch, match=r"revision: lock has sha256:[0-9a-f]{64}, resolved sha256:[0-9a-f]{64}; "
                                           r"tokenizer_config\.json: lock has sha256"):
        _create(out, input_from_resolved(resolved))
    assert not (out / INDEX_FILE).exists() and not (out / COMPLETE_MARKER).exists()
