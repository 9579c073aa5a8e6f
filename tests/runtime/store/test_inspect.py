"""bundle inspect: readable with no key; signer ids shown and labelled unverified."""

from __future__ import annotations

import json

from bundler.cli import main


def test_inspect_json_needs_no_key(bundles, keys, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("BUNDLE_TRUST_DIR", str(tmp_path / "none"))
    assert main(["inspect", str(bundles["v3-expiring"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["name"], info["version"], info["expires"]) == ("demo", 3, "2026-12-01T00:00:00Z")
    assert [t["id"] for t in info["targets"]] == ["jetson-thor", "igx-thor"]
    jetson = info["targets"][0]
    assert jetson["size"] < info["size"]  # the igx engine is not needed by jetson
    assert info["models"][0]["role"] == "target" and info["models"][0]["architecture"] == "LlamaForCausalLM"
    assert info["speculative"]["method"] == "ngram"
    assert info["signatures"] == {"key_ids": [keys.release_id], "verified": False, "envelope": "matches manifest"}
    assert info["compressed_size"] > 0 and info["complete"] is True


def test_inspect_text(bundles, keys, capsys):
    assert main(["inspect", str(bundles["unsigned"])]) == 0
    out = capsys.readouterr().out
    assert out.startswith("demo v1") and "signed by none" in out and "UNVERIFIED" in out
    assert main(["inspect", str(bundles["v1"])]) == 0
    out = capsys.readouterr().out
    assert keys.release_id in out and "jetson-thor" in out and "expires   never" in out
