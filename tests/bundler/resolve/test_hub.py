"""resolve_model against a real HF API on loopback (olah), through the real huggingface_hub."""

from __future__ import annotations

import hashlib

import pytest

from bundler.resolve.checkpoint import resolve_model
from bundler.resolve.errors import (DigestMismatch, GatedRepo, HubAuthFailed, HubUnreachable, RepoNotFound,
                                    RevisionNotFound)
from manifests.errors import ResolveError, UsageError
from tests.bundler.resolve.hub_server import Fault, free_port

SERVING = ["LICENSE", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
           "tokenizer_config.json"]


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_branch_resolves_to_commit_sha(hub, hf_cache):
    m = resolve_model("acme/tiny-llama", role="target", cache_dir=hf_cache, endpoint=hub.url)
    assert m.revision == hub.shas["main"] and m.requested_revision is None
    assert m.source.type == "huggingface" and m.source.revision == hub.shas["main"]
    assert m.local_dir.name == hub.shas["main"]
    assert (m.local_dir / "config.json").read_text().count("second commit on main") == 1


def test_tag_and_sha_pin_the_older_commit(hub, hf_cache):
    by_tag = resolve_model("acme/tiny-llama@v1", role="target", cache_dir=hf_cache, endpoint=hub.url)
    assert by_tag.revision == hub.shas["v1"] != hub.shas["main"]
    assert by_tag.source.requested_revision == "v1" and by_tag.source.revision == hub.shas["v1"]
    by_sha = resolve_model(f"acme/tiny-llama@{hub.shas['v1']}", role="target", cache_dir=hf_cache,
                           endpoint=hub.url)
    assert by_sha.files == by_tag.files
    # The cache records the tag, as `hf download` does, so an offline rebuild can find it.
    assert (hf_cache / "models--acme--tiny-llama" / "refs" / "v1").read_text() == hub.shas["v1"]


def test_default_filter_keeps_what_serving_needs_and_one_copy_of_weights(hub, hf_cache, checkpoints):
    m = resolve_model("acme/tiny-llama@v1", role="target", cache_dir=hf_cache, endpoint=hub.url)
    assert [f.path for f in m.files] == SERVING
    for f in m.files:
        assert f.sha256 == _sha256(m.local_dir / f.path) and f.size == (m.local_dir / f.path).stat().st_size
    assert {f.path: f.sha256 for f in m.files}["model.safetensors"] == _sha256(checkpoints.target /
                                                                                "model.safetensors")
    # Nothing else crossed the wire: no .bin copy, no original/, no GGUF, no images.
    fetched = {e.path.rsplit("/", 1)[-1] for e in hub.proxy.log if "/resolve/" in e.path and e.method == "GET"}
    assert fetched == set(SERVING)


def test_include_and_exclude_patterns(hub, hf_cache):
    m = resolve_model("acme/tiny-llama@v1", role="target", include=["original/*", "README.md"],
                      exclude=["LICENSE", "generation_config.json"], cache_dir=hf_cache, endpoint=hub.url)
    paths = [f.path for f in m.files]
    assert "original/consolidated.00.pth" in paths and "README.md" in paths
    assert "LICENSE" not in paths and "generation_config.json" not in paths
    assert (m.local_dir / "original" / "consolidated.00.pth").read_bytes() == b"original-weights" * 300


def test_patterns_that_bundle_two_copies_of_the_weights_are_refused(hub, hf_cache):
    with pytest.raises(UsageError, match=r"both \.safetensors and \.bin"):
        resolve_model("acme/tiny-llama@v1", role="target", include=["*.bin"], cache_dir=hf_cache, endpoint=hub.url)
    m = resolve_model("acme/tiny-llama@v1", role="target", include=["*.bin"], exclude=["*.safetensors"],
                      cache_dir=hf_cache, endpoint=hub.url)
    assert [f.path for f in m.files if f.path.endswith((".bin", ".safetensors"))] == ["pytorch_model.bin"]


def test_interrupted_download_resumes_with_a_range_request(hub, hf_cache):
    obj = hub.repos.lfs_object("acme/large", "model.safetensors")
    size, cut = obj.stat().st_size, 15 * 1024 * 1024
    hub.proxy.faults.append(Fault(r"/resolve/.*/model\.safetensors$", cut_after=cut, times=1, method="GET"))
    m = resolve_model("acme/large", role="target", cache_dir=hf_cache, endpoint=hub.url)
    assert _sha256(m.local_dir / "model.safetensors") == _sha256(obj)
    first, second = hub.gets("model.safetensors")
    assert first.range is None and first.body_bytes == cut
    # huggingface_hub keeps what it wrote (whole 10 MB chunks) and asks only for the rest.
    start = int(second.range.removeprefix("bytes=").rstrip("-"))
    assert 0 < start <= cut
    assert second.status == 206 and second.body_bytes == size - start


def test_digest_mismatch_stops_and_evicts_the_bad_blob(hub, hf_cache):
    with pytest.raises(DigestMismatch, match=r"model\.safetensors does not match the hub's metadata: expected "
                                             r"sha256 [0-9a-f]{64}, found [0-9a-f]{64}") as e:
        resolve_model("acme/corrupt", role="target", cache_dir=hf_cache, endpoint=hub.url)
    assert e.value.exit_code == 7
    snap = hf_cache / "models--acme--corrupt" / "snapshots" / hub.shas["corrupt"]
    assert not (snap / "model.safetensors").exists()
    assert (snap / "config.json").exists()  # the good files stay cached


def test_missing_repo(hub, hf_cache):
    with pytest.raises(RepoNotFound, match=r"expected a model repository 'acme/nope' at http://127\.0\.0\.1"):
        resolve_model("acme/nope", role="target", cache_dir=hf_cache, endpoint=hub.url)


def test_unknown_revision(hub, hf_cache):
    with pytest.raises(RevisionNotFound, match=r"acme/tiny-llama has no branch, tag or commit 'v9'"):
        resolve_model("acme/tiny-llama@v9", role="target", cache_dir=hf_cache, endpoint=hub.url)


def test_gated_repo_without_access(hub, hf_cache, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    hub.proxy.faults.append(Fault(r"acme/gated", status=403, unless_token="hf_granted",
                                  headers={"X-Error-Code": "GatedRepo",
                                           "X-Error-Message": "Access to model acme/gated is restricted."}))
    with pytest.raises(GatedRepo, match=r"acme/gated is gated: accept its license .* set HF_TOKEN"):
        resolve_model("acme/gated", role="target", cache_dir=hf_cache, endpoint=hub.url)
    # HF_TOKEN of an account with access: the same request goes through.
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    m = resolve_model("acme/gated", role="target", cache_dir=hf_cache, endpoint=hub.url)
    assert m.revision == hub.shas["gated"]
    assert all(e.authorization == "Bearer hf_granted" for e in hub.proxy.log if e.status != 403)


def test_refused_token(hub, hf_cache, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_expired")
    hub.proxy.faults.append(Fault(r"acme/tiny-draft", status=401,
                                  headers={"X-Error-Message": "Invalid credentials in Authorization header"}))
    with pytest.raises(HubAuthFailed, match=r"refused HF_TOKEN for acme/tiny-draft with 401"):
        resolve_model("acme/tiny-draft", role="draft", cache_dir=hf_cache, endpoint=hub.url)


def test_no_network(hf_cache):
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(HubUnreachable, match=r"cannot reach http://127\.0\.0\.1:\d+ for acme/tiny-llama@main "
                                             r"\(ConnectError"):
        resolve_model("acme/tiny-llama", role="target", cache_dir=hf_cache, endpoint=dead)


def test_server_error_is_a_resolve_error_with_the_status(hub, hf_cache):
    hub.proxy.faults.append(Fault(r"/api/models/acme/tiny-draft", status=500, times=50))
    with pytest.raises(ResolveError, match=r"answered 500 for acme/tiny-draft@main"):
        resolve_model("acme/tiny-draft", role="draft", cache_dir=hf_cache, endpoint=hub.url)


def test_file_missing_on_the_mirror(hub, hf_cache):
    hub.proxy.faults.append(Fault(r"/resolve/.*/tokenizer\.json$", status=404,
                                  headers={"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"}))
    with pytest.raises(ResolveError, match=r"acme/tiny-draft@main: a file the repository lists is missing at "
                                           r"http://127\.0\.0\.1:\d+"):
        resolve_model("acme/tiny-draft", role="draft", cache_dir=hf_cache, endpoint=hub.url)
