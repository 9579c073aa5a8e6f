"""The default bundle is the smallest that serves every target: checkpoint files no target installs (the
engines carry their own weights) stay home, listed in the signed manifest; files a target installs travel."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

from click.testing import CliRunner

from bundler.pack.create import CreateOptions, create_bundle, local_model
from bundler.pack.engines import target_files_hook
from runtime.store.store import Store
from runtime.store.trust import load_public_key

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def _create(tiny_pair, out, signing_key, **kw):
    target, draft = tiny_pair
    return create_bundle(out, CreateOptions(name="lean", version=1, model=local_model(target, "target"),
                         draft=local_model(draft, "draft"), targets=["cpu"], sign_keys=[signing_key], now=NOW,
                         progress=False, **kw))


def test_by_default_weights_no_target_installs_are_left_out_listed_and_the_bundle_serves(
        tiny_pair, signing_key, key_paths, tmp_path):
    target, _ = tiny_pair
    out = tmp_path / "lean"
    manifest = _create(tiny_pair, out, signing_key, target_files=target_files_hook())
    assert not [f.path for f in manifest.files if f.path.endswith(".safetensors")]
    omitted = manifest.model("target").extra["omitted_files"]
    data = (target / "model.safetensors").read_bytes()
    assert omitted == [{"path": "model.safetensors", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    assert manifest.model("draft").extra["omitted_files"][0]["path"] == "model.safetensors"

    trusted = dict([load_public_key(key_paths[0].with_name(key_paths[0].name + ".pub"))])
    installed = Store(tmp_path / "store").install(out, target="cpu", trusted=trusted)
    assert installed.manifest.model("target").extra["omitted_files"] == omitted  # signed, survives the trip
    from runtime.serve.sampling import SamplingParams
    from runtime.server.loader import load_serving_model

    model = load_serving_model(installed)
    from runtime.serve.generator import Generator

    steps = Generator.over(model.runner).generate([5, 6, 7], SamplingParams(temperature=0.0), max_tokens=4)
    assert sum(len(s.tokens) for s in steps) >= 1


def test_with_checkpoint_weights_carries_them_installed_by_no_target_and_keeps_the_revision(
        tiny_pair, signing_key, tmp_path):
    lean = _create(tiny_pair, tmp_path / "lean", signing_key, target_files=target_files_hook())
    full = _create(tiny_pair, tmp_path / "full", signing_key, target_files=target_files_hook(),
                   checkpoint_weights=True)
    weights = [f for f in full.files if f.path.endswith(".safetensors")]
    assert {f.path for f in weights} == {"models/target/model.safetensors", "models/draft/model.safetensors"}
    assert all(f.targets == () for f in weights) and "omitted_files" not in full.model("target").extra
    assert {f.path for f in full.files_for("cpu")} == {f.path for f in lean.files_for("cpu")}
    # A local folder is pinned by its content, left-out files included: one revision either way.
    assert lean.model("target").source.revision == full.model("target").source.revision
    assert lean.model("draft").source.revision == full.model("draft").source.revision

    # inspect: bytes per target, what was left out (sizes), what travels that no target installs.
    from runtime.store.inspect import format_inspect, inspect_bundle

    weights_size = sum(f.size for f in weights)
    info = inspect_bundle(tmp_path / "lean")
    assert sorted((o["model"], o["path"], o["size"]) for o in info["left_out"]) == \
        sorted((f.path.split("/")[1], "model.safetensors", f.size) for f in weights)
    assert info["installed_by_no_target"] == 0 and info["targets"][0]["size"] == info["size"]
    assert "left out  target: model.safetensors" in format_inspect(info)
    info = inspect_bundle(tmp_path / "full")
    assert info["left_out"] == [] and info["installed_by_no_target"] == weights_size
    assert info["targets"][0]["size"] == info["size"] - weights_size
    assert 0 < info["targets"][0]["compressed_size"] < info["compressed_size"]
    assert "that no target installs" in format_inspect(info)


def test_weights_a_target_installs_are_never_left_out(tiny_pair, signing_key, key_paths, tmp_path):
    """No engines (no export hook): the checkpoint's weights are the target's only copy, so they travel
    and are installed, whichever way checkpoint_weights is set."""
    out = tmp_path / "b"
    manifest = _create(tiny_pair, out, signing_key, checkpoint_weights=False)
    weights = next(f for f in manifest.files if f.path == "models/target/model.safetensors")
    assert weights.targets is None and weights.needed_by("cpu")
    assert "omitted_files" not in manifest.model("target").extra
    trusted = dict([load_public_key(key_paths[0].with_name(key_paths[0].name + ".pub"))])
    installed = Store(tmp_path / "store").install(out, target="cpu", trusted=trusted)
    assert (installed.path / "models" / "target" / "model.safetensors").read_bytes() == \
        (tiny_pair[0] / "model.safetensors").read_bytes()


def test_cli_flags_both_spellings(monkeypatch, tmp_path):
    """--with-checkpoint-weights carries them; --no-checkpoint-weights (the default) is still accepted."""
    import bundler.pack.create
    from bundler.cli.pack import create

    seen = []

    class Stop(Exception):
        pass

    def fake_create_bundle(out, options):
        seen.append(options.checkpoint_weights)
        raise Stop

    monkeypatch.setattr(bundler.pack.create, "create_bundle", fake_create_bundle)
    for flags, expected in (([], False), (["--no-checkpoint-weights"], False), (["--with-checkpoint-weights"], True)):
        result = CliRunner().invoke(create, ["--targets", "cpu", "--name", "d", "--version", "1", "--unsigned",
                                             "--out", str(tmp_path / "o"), "--no-progress", *flags])
        assert isinstance(result.exception, Stop), result.output
        assert seen[-1] is expected
