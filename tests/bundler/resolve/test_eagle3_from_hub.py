"""An EAGLE-3 head from the hub (the olah loopback mirror): `bundle create --speculative-config
'{"method": "eagle3", "model": "org/head"}'` pins it to a commit, records it in the lock file like any draft,
checks it against the target before its weights are fetched, and the bundle installs and serves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bundler.pack.keys import generate_key
from manifests.errors import ModelError
from runtime.store.trust import load_public_key
from runtime.store.verify import verify_bundle
from tests.bundler.resolve.test_create_from_hub import bundle


def _create(hub, tmp_path, head_ref, out, *extra):
    spec = json.dumps({"method": "eagle3", "model": head_ref, "num_speculative_tokens": 3})
    return bundle(["create", "--model", "acme/tiny-llama@v1", "--speculative-config", spec, "--targets", "cpu",
                   "--name", "e3", "--version", "1", *extra, "--out", str(out), "--no-progress", "--no-runtime"],
                  hub.url, tmp_path / "hf")


@pytest.mark.slow
def test_hub_head_pinned_locked_packed_installed_served(hub, tmp_path):
    from runtime.serve.sampling import SamplingParams
    from runtime.server.loader import load_serving_model
    from runtime.store.store import Store
    from runtime.store.trust import trusted_keys

    key = tmp_path / "k"
    generate_key(key)
    out = tmp_path / "b"
    done = _create(hub, tmp_path, "acme/tiny-eagle3", out, "--sign-key", str(key))
    assert done.returncode == 0, done.stderr
    manifest = verify_bundle(out, dict([load_public_key(Path(f"{key}.pub"))])).manifest
    head = manifest.model("draft")
    assert head.architecture == "LlamaForCausalLMEagle3"
    assert (head.source.type, head.source.repo, head.source.revision) == ("huggingface", "acme/tiny-eagle3",
                                                                          hub.shas["eagle3"])
    assert manifest.speculative.method == "eagle3"
    lock = json.loads((tmp_path / "b.lock.json").read_text())["models"]
    assert lock["draft"]["repo"] == "acme/tiny-eagle3" and lock["draft"]["revision"] == hub.shas["eagle3"]
    assert lock["target"]["revision"] == hub.shas["v1"]
    assert lock["draft"]["speculative_method"] == "eagle3" and "speculative_method" not in lock["target"]
    # rebuilt from the lock alone (no --speculative-config): the same head at the same commit, as a head
    again = bundle(["create", "--lock", str(tmp_path / "b.lock.json"),
                    "--targets", "cpu", "--name", "e3", "--version", "2", "--sign-key", str(key), "--out",
                    str(tmp_path / "b2"), "--no-progress", "--no-runtime"], hub.url, tmp_path / "hf")
    assert again.returncode == 0, again.stderr
    m2 = verify_bundle(tmp_path / "b2", dict([load_public_key(Path(f"{key}.pub"))])).manifest
    assert m2.model("draft").source.revision == hub.shas["eagle3"] and m2.speculative.method == "eagle3"
    heads = lambda m: {(f.path, f.sha256) for f in m.files if f.path.startswith("models/draft/")}  # noqa: E731
    assert heads(m2) == heads(manifest) and heads(manifest)
    Store(tmp_path / "store").install(out, target="cpu", trusted=trusted_keys([Path(f"{key}.pub")], trust_dir=None))
    installed = Store(tmp_path / "store").current("e3")
    served = load_serving_model(installed)
    plain = load_serving_model(installed, no_speculation=True)
    assert served.runner.method == "eagle3" and served.runner.head.kv_cache == "batched"

    def greedy(model):
        from runtime.serve.generator import Generator

        return [t for s in Generator.over(model.runner).generate(list(range(3, 30, 2)),
                                                                 SamplingParams(temperature=0.0), max_tokens=20)
                for t in s.tokens]
    assert greedy(served) == greedy(plain)
    assert served.runner.stats.num_drafts > 0


def test_hub_head_for_another_target_refused_before_its_weights(hub, tmp_path):
    out = tmp_path / "b"
    done = _create(hub, tmp_path, "acme/eagle3-for-another", out, "--unsigned")
    assert done.returncode == ModelError.exit_code, done.stderr
    # huggingface_hub's own progress bars aside, the error is one line
    err = [line for line in done.stderr.strip().splitlines() if line.strip() and not line.startswith("Fetching")]
    assert len(err) == 1 and "acme/eagle3-for-another" in err[0] and "expected target hidden size 64" in err[0] \
        and "found 32" in err[0], err
    assert not out.exists()
    assert not [e for e in hub.gets("model.safetensors") if "eagle3-for-another" in e.path]  # checked first
