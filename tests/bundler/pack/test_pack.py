"""Packing a real checkpoint into an OCI layout that tools nobody here wrote can read."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidSignature

from bundler.pack.create import CreateOptions, create_bundle, local_model
from bundler.pack.keys import public_key_id
from bundler.pack.pack import PackFile, PackOptions, pack_bundle, part_length
from manifests.errors import UsageError
from manifests.layout import (
    BLOBS_DIR, COMPLETE_MARKER, DSSE_PAYLOAD_TYPE, MANIFEST_MEDIA_TYPE, PART_MEDIA_TYPE, SIGNATURE_MEDIA_TYPE,
    pae, unb64,
)
from manifests.schema import Target
from tests.bundler.pack.helpers import read_layout, unpack_file

NOW = datetime(2026, 11, 29, 14, 0, 0, tzinfo=timezone.utc)


def _skopeo() -> str:
    path = shutil.which("skopeo")
    if path is None:
        subprocess.run(["apt-get", "install", "-y", "-q", "skopeo"], capture_output=True, timeout=600)
        path = shutil.which("skopeo")
    if path is None:
        pytest.skip("skopeo is not installed and `apt-get install -y skopeo` failed")
    return path


def _create(out, model_dir, keys, draft_dir=None, **kw):
    return create_bundle(out, CreateOptions(name="assistant", version=3, model=local_model(model_dir, "target"),
                         draft=local_model(draft_dir, "draft") if draft_dir else None,
                         targets=kw.pop("targets", ["jetson-thor", "cpu"]), sign_keys=keys,
                         now=kw.pop("now", NOW), progress=False, **kw))


@pytest.fixture(scope="module")
def packed(tiny_pair, key_paths, tmp_path_factory):
    """The tiny pair packed once with two signatures and 1 MiB parts."""
    from bundler.pack.keys import load_private_key

    out = tmp_path_factory.mktemp("bundle") / "assistant-3"
    keys = [load_private_key(p) for p in key_paths]
    manifest = _create(out, tiny_pair[0], keys, draft_dir=tiny_pair[1], max_part_size=1024 * 1024,
                       expires="2027-06-01")
    return out, manifest, keys


def test_skopeo_reads_the_layout(packed):
    out, manifest, _ = packed
    raw = subprocess.run([_skopeo(), "inspect", "--raw", f"oci:{out}:assistant:3"],
                         check=True, capture_output=True, text=True).stdout
    oci = json.loads(raw)
    assert oci["config"]["mediaType"] == MANIFEST_MEDIA_TYPE
    assert {layer["mediaType"] for layer in oci["layers"][:-1]} == {PART_MEDIA_TYPE}
    assert oci["layers"][-1]["mediaType"] == SIGNATURE_MEDIA_TYPE
    assert {layer["digest"] for layer in oci["layers"][:-1]} == manifest.blob_digests


def test_every_file_comes_back_byte_exact_through_zstd_cli(packed, tiny_pair):
    out, manifest, _ = packed
    _, _, on_disk, _ = read_layout(out)
    assert on_disk.to_json_bytes() == manifest.to_json_bytes()
    sources = {f"models/target/{p.name}": p for p in tiny_pair[0].iterdir()}
    sources.update({f"models/draft/{p.name}": p for p in tiny_pair[1].iterdir()})
    assert {f.path for f in manifest.files} == set(sources)
    for entry in manifest.files:
        data = unpack_file(out, entry)
        assert data == sources[entry.path].read_bytes(), entry.path
        assert hashlib.sha256(data).hexdigest() == entry.sha256
    weights = next(f for f in manifest.files if f.path == "models/target/model.safetensors")
    assert weights.size > 15 * 1024 * 1024 and len(weights.parts) >= 15  # really chunked


def test_manifest_records_models_targets_and_settings(packed, tiny_pair):
    _, manifest, _ = packed
    assert (manifest.name, manifest.version, manifest.created) == ("assistant", 3, "2026-11-29T14:00:00Z")
    assert manifest.expires == "2027-06-01T00:00:00Z"
    target, draft = manifest.model("target"), manifest.model("draft")
    assert (target.root, draft.root) == ("models/target", "models/draft")
    assert target.source.type == "local" and target.source.path is None  # where it lay identifies nothing
    assert target.architecture == "LlamaForCausalLM"
    # Local revision = digest over sorted "path\0size\0sha256" lines of what was packed (as bundler.resolve.checkpoint does).
    lines = sorted(f"{f.path.removeprefix('models/target/')}\0{f.size}\0{f.sha256}\n"
                   for f in manifest.files if f.path.startswith("models/target/"))
    assert target.source.revision == "sha256:" + hashlib.sha256("".join(lines).encode()).hexdigest()
    assert target.source.revision != draft.source.revision
    assert [(t.id, t.backend) for t in manifest.targets] == [("jetson-thor", "tensorrt"), ("cpu", "onnxruntime")]
    assert manifest.speculative.method == "draft_model" and manifest.speculative.model == "draft"
    assert manifest.speculative.num_speculative_tokens == 3
    assert manifest.serve == {"max_model_len": 512}  # config says 512 (< the 4096 cap)
    assert manifest.builder.tool == "bundle" and manifest.builder.host is None and manifest.builder.platform


def test_both_signatures_verify_with_cryptography(packed):
    out, manifest, keys = packed
    _, _, _, envelope = read_layout(out)
    assert envelope["payloadType"] == DSSE_PAYLOAD_TYPE
    payload = unb64(envelope["payload"])
    assert payload == manifest.to_json_bytes()
    by_id = {public_key_id(k): k.public_key() for k in keys}
    assert [s["keyid"] for s in envelope["signatures"]] == [public_key_id(k) for k in keys]
    for sig in envelope["signatures"]:
        by_id[sig["keyid"]].verify(unb64(sig["sig"]), pae(DSSE_PAYLOAD_TYPE, payload))
        with pytest.raises(InvalidSignature):  # a changed manifest no longer verifies
            by_id[sig["keyid"]].verify(unb64(sig["sig"]), pae(DSSE_PAYLOAD_TYPE, payload.replace(b"3", b"4", 1)))


def test_runtime_verifier_accepts_the_bundle(packed, key_paths):
    from runtime.store import trust, verify
    out, manifest, keys = packed
    trusted = trust.trusted_keys([Path(str(key_paths[0]) + ".pub")], trust_dir=None)
    result = verify.verify_bundle(out, trusted)
    assert result.manifest.to_json_bytes() == manifest.to_json_bytes()
    assert public_key_id(keys[0]) in result.signers


def test_no_file_exceeds_max_part_size_even_incompressible(model_copy, signing_key, tmp_path):
    (model_copy / "random.bin").write_bytes(os.urandom(3 * 1024 * 1024 + 17))  # zstd output > input here
    limit = 256 * 1024
    out = tmp_path / "b"
    manifest = _create(out, model_copy, [signing_key], max_part_size=limit)
    sizes = {p: p.stat().st_size for p in out.rglob("*") if p.is_file()}
    assert max(sizes.values()) <= limit
    rnd = next(f for f in manifest.files if f.path.endswith("random.bin"))
    assert any(p.size > p.length for p in rnd.parts)  # really grew, and still under the limit
    assert all(p.length == part_length(limit) for p in rnd.parts[:-1])
    assert unpack_file(out, rnd) == (model_copy / "random.bin").read_bytes()


def test_identical_files_are_stored_once(model_copy, signing_key, tmp_path):
    shutil.copyfile(model_copy / "model.safetensors", model_copy / "copy.safetensors")
    (model_copy / "sub").mkdir()
    shutil.copyfile(model_copy / "tokenizer.json", model_copy / "sub" / "tokenizer.json")
    out = tmp_path / "b"
    manifest = _create(out, model_copy, [signing_key], max_part_size=4 * 1024 * 1024)
    by_path = {f.path: f for f in manifest.files}
    a, b = by_path["models/target/model.safetensors"], by_path["models/target/copy.safetensors"]
    assert a.sha256 == b.sha256 and a.parts == b.parts
    assert by_path["models/target/sub/tokenizer.json"].parts == by_path["models/target/tokenizer.json"].parts
    blobs = [p for p in (out / BLOBS_DIR).iterdir()]
    assert len(blobs) == len(manifest.blob_digests) + 3  # + manifest, envelope, OCI manifest
    stored = sum(p.stat().st_size for p in blobs)
    assert stored < a.size * 1.1  # one copy of the weights, not two


def test_symlinks_to_files_are_followed_hidden_files_skipped(tiny_pair, signing_key, tmp_path):
    """A Hugging Face cache snapshot is symlinks into blobs/; .git and dotfiles are not model content."""
    snap = tmp_path / "snapshot"
    store = tmp_path / "blobs"
    snap.mkdir(), store.mkdir()
    for f in tiny_pair[0].iterdir():
        shutil.copyfile(f, store / f.name)
        (snap / f.name).symlink_to(store / f.name)
    (snap / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (snap / ".cache").mkdir()
    (snap / ".cache" / "x").write_text("x")
    os.mkfifo(snap / "a-fifo")
    manifest = _create(tmp_path / "b", snap, [signing_key])
    assert sorted(f.path.split("/")[-1] for f in manifest.files) == sorted(p.name for p in tiny_pair[0].iterdir())
    (snap / "broken").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UsageError, match="broken symlink"):
        _create(tmp_path / "c", snap, [signing_key])


def test_unsigned_bundle_has_an_envelope_without_signatures(model_copy, tmp_path):
    out = tmp_path / "b"
    create_bundle(out, CreateOptions(name="x", version=1, model=local_model(model_copy, "target"), draft=None, targets=["cpu"],
                  sign_keys=[], unsigned=True, progress=False))
    _, _, manifest, envelope = read_layout(out)
    assert envelope["signatures"] == [] and manifest.speculative is None
    with pytest.raises(UsageError, match="--sign-key"):
        create_bundle(tmp_path / "c", CreateOptions(name="x", version=1, model=local_model(model_copy, "target"), draft=None,
                      targets=["cpu"], sign_keys=[], progress=False))


def test_existing_bundle_is_refused_then_replaced_with_force(model_copy, signing_key, tmp_path):
    out = tmp_path / "b"
    first = _create(out, model_copy, [signing_key])
    with pytest.raises(UsageError, match="--force"):
        _create(out, model_copy, [signing_key])
    assert (out / COMPLETE_MARKER).exists()
    (model_copy / "model.safetensors").unlink()
    second = _create(out, model_copy, [signing_key], force=True)
    assert first.blob_digests - second.blob_digests  # the weights' blobs are gone ...
    names = {p.name for p in (out / BLOBS_DIR).iterdir()}
    assert not {d.split(":")[1] for d in first.blob_digests - second.blob_digests} & names  # ... from disk too
    assert read_layout(out)[2].to_json_bytes() == second.to_json_bytes()


def test_bad_input_fails_before_writing(model_copy, signing_key, tmp_path):
    common = dict(models=[], targets=[Target("cpu", "onnxruntime")], speculative=None, serve={}, expires=None,
                  sign_keys=[signing_key], progress=False)
    src = model_copy / "config.json"
    cases = [
        ([PackFile(src, "a/config.json"), PackFile(src, "A/Config.json")], "colliding"),
        ([PackFile(src, "../config.json")], "'..'"),
        ([PackFile(src, "/etc/passwd")], "absolute"),
        ([PackFile(src, "a"), PackFile(src, "a/b")], "directory"),
        ([PackFile(model_copy / "nope", "x")], "found none"),
    ]
    for files, expected in cases:
        out = tmp_path / "out"
        with pytest.raises(UsageError, match=expected):
            pack_bundle(out, PackOptions(name="x", version=1, files=files, **common))
        assert not out.exists()
    with pytest.raises(UsageError, match="lowercase"):
        pack_bundle(tmp_path / "out", PackOptions(name="Bad Name", version=1, files=[PackFile(src, "c")], **common))
    with pytest.raises(UsageError, match="at least"):
        pack_bundle(tmp_path / "out", PackOptions(name="x", version=1, files=[PackFile(src, "c")], max_part_size=1000, **common))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="notes.txt"):
        pack_bundle(tmp_path / "busy", PackOptions(name="x", version=1, files=[PackFile(src, "c")], **common))
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_target_files_hook_adds_per_target_files(model_copy, signing_key, tmp_path):
    """How engines plug in: extra files limited to some targets, and targets with engines filled in."""
    from manifests.schema import Engine

    def hook(models, targets, work):
        graph = work / "model.onnx"
        graph.write_bytes(b"onnx graph bytes" * 1000)
        filled = [Target(t.id, t.backend, engines=(Engine("target", "onnxruntime", "onnx", "engines/cpu/model.onnx"),))
                  if t.id == "cpu" else t for t in targets]
        return [PackFile(graph, "engines/cpu/model.onnx", targets=("cpu",))], filled

    manifest = _create(tmp_path / "b", model_copy, [signing_key], target_files=hook)
    onnx = next(f for f in manifest.files if f.path == "engines/cpu/model.onnx")
    assert onnx.targets == ("cpu",) and manifest.target("cpu").engines[0].path == onnx.path
    # jetson-thor got no engine here, so the checkpoint's weights are still its only copy: every target keeps
    # them, and the default (leave out what no target installs) leaves nothing out.
    weights = next(f for f in manifest.files if f.path == "models/target/model.safetensors")
    assert weights.targets is None and "omitted_files" not in manifest.model("target").extra
    assert len(manifest.files_for("jetson-thor")) == len(manifest.files) - 1

    def hook_for_all(models, targets, work):
        files, _ = hook(models, targets, work)
        engine = Engine("target", "onnxruntime", "onnx", "engines/cpu/model.onnx")
        return files, [Target(t.id, t.backend, engines=(engine,)) for t in targets]

    # When every target's engines carry the weights, the checkpoint's copy is bundled (when asked for) but
    # installed by none; by default it is left out.
    manifest = _create(tmp_path / "b2", model_copy, [signing_key], target_files=hook_for_all, checkpoint_weights=True)
    weights = next(f for f in manifest.files if f.path == "models/target/model.safetensors")
    assert weights.targets == () and not weights.needed_by("cpu") and not weights.needed_by("jetson-thor")
    manifest = _create(tmp_path / "b3", model_copy, [signing_key], target_files=hook_for_all)
    assert "models/target/model.safetensors" not in {f.path for f in manifest.files}
    assert [o["path"] for o in manifest.model("target").extra["omitted_files"]] == ["model.safetensors"]
