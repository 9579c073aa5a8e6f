"""push / pull / install through a real OCI registry on loopback (distribution 2.8, TLS, htpasswd)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bundler.cli import main
from manifests import layout as L
from manifests.errors import (BadBundleError, EnvironmentProblem, RegistryAuthError, RegistryError, RegistryTLSError,
                              TrustError, UsageError)
from runtime.store.copy import copy_bundle
from runtime.store.reader import open_bundle
from runtime.store.referrer import EMPTY_CONFIG, referrers_tag
from runtime.store.registry import pull, push
from runtime.cli.registry import looks_like_reference
from runtime.store.skopeo import RegistryOptions, parse_reference
from runtime.store.store import Store
from runtime.store.verify import verify_bundle
from tests.runtime.store.craft import oci_manifest, resign, tree_digests
from tests.runtime.store.helpers import assert_no_leftovers, assert_serving_ready

REPO_ROOT = Path(__file__).resolve().parents[4]
EMPTY = L.digest_of(EMPTY_CONFIG)  # the OCI empty config of the signature referrer


def blob_set(bundle: Path) -> set[str]:
    """Every blob the registry stores for a bundle: config and layers (the OCI manifest is not a blob)."""
    layout = open_bundle(bundle)
    return {layout.config.digest, *(d.digest for d in layout.layers)}


def _closed_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reg_args(registry, *extra) -> list[str]:
    return ["--ca-file", str(registry.ca), "--authfile", str(registry.authfile), "--no-progress", *extra]


# --- references (no registry) --------------------------------------------------------------------------
def test_reference_parsing_and_detection(tmp_path, monkeypatch):
    r = parse_reference("registry.factory.lan:5000/llm/assistant:3")
    assert (r.host, r.repo, r.tag, r.digest) == ("registry.factory.lan:5000", "llm/assistant", "3", None)
    d = "sha256:" + "ab" * 32
    assert parse_reference(f"docker://localhost/a@{d}").digest == d
    assert str(parse_reference("127.0.0.1:5000/x/y").pinned(d)) == f"127.0.0.1:5000/x/y@{d}"
    for bad in ("assistant:3", "llm/assistant:3", "reg.lan/UPPER:1", "reg.lan/a:b:c", "reg.lan/a@sha256:12"):
        with pytest.raises(UsageError, match="expected"):
            parse_reference(bad)
    assert looks_like_reference("registry.factory.lan/llm/assistant:3")
    assert not looks_like_reference("./assistant-3") and not looks_like_reference("/media/usb/assistant-3")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "usb.lan" / "assistant").mkdir(parents=True)
    assert not looks_like_reference("usb.lan/assistant")  # an existing directory wins


# --- round trip --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_push_pull_round_trip_is_identical_to_a_copy(registry, options, bundles, keys, trusted, tmp_path):
    ref = f"{registry.host}/fleet/demo"
    assert main(["push", str(bundles["v1"]), ref, *reg_args(registry)]) == 0
    uploads = registry.blob_uploads("fleet/demo")
    assert sorted(uploads) == sorted(blob_set(bundles["v1"]) | {EMPTY})  # each blob once, + the referrer's
    # Tagged with the bundle's version; the registry serves exactly the local manifest bytes.
    report = pull(f"{ref}:1", tmp_path / "pulled", options=options)
    assert report.digest == open_bundle(bundles["v1"]).oci_manifest.digest
    assert (report.blobs_reused, report.bytes_reused) == (0, 0)
    assert report.blobs_fetched == len(blob_set(bundles["v1"]))
    assert verify_bundle(tmp_path / "pulled", trusted).signers == [keys.release_id]
    copied = tmp_path / "copied"
    copy_bundle(bundles["v1"], copied, progress=False)
    assert bundle_files(tmp_path / "pulled") == bundle_files(copied)  # byte for byte, index.json included


def runtime_bundle(out: Path, inputs: Path, keys) -> Path:
    """A signed bundle that carries the floor runtime (a wheelhouse and the bootstrap), packed as
    `bundle create --runtime-platforms` packs it."""
    from bundler.pack.pack import PackFile, PackOptions, pack_bundle
    from bundler.pack.wheelhouse import wheelhouse_from_files
    from manifests.schema import Model, ModelSource, Target
    from tests.wheels import make_wheel
    wheel = make_wheel(out.parent / "wheels", "tiny-runtime", "1.0")
    house = wheelhouse_from_files("tiny-runtime", "1.0", {"linux_x86_64-cp312": [wheel],
                                                          "linux_aarch64-cp312": [wheel]})
    files = [PackFile(p, f"models/target/{p.name}") for p in sorted((inputs / "target").iterdir())]
    pack_bundle(out, PackOptions(name="tiny", version=1, models=[Model("target", "t", "models/target",
                                                            ModelSource("local", revision="x"))],
                files=[*files, *house.files], targets=[Target("cpu", "onnxruntime")], speculative=None,
                serve={}, expires=None, sign_keys=[keys.release], progress=False, runtime=house.runtime))
    return out


def bundle_files(root: Path) -> dict[str, str]:
    """Every file of a bundle directory and its sha256 (the pull's lock file left out)."""
    return {k: v for k, v in tree_digests(root).items() if not Path(k).name.startswith(".")}


@pytest.mark.slow
def test_a_pulled_bundle_with_the_runtime_has_its_bootstrap(registry, options, inputs, bundles, keys, tmp_path):
    """A pulled bundle holds every file `bundle create` wrote and `bundle copy` copies: the top-level
    bootstrap too, so `bundle verify` passes and `sh DIR/bootstrap` runs the signed script."""
    created = runtime_bundle(tmp_path / "created", inputs, keys)
    ref = f"{registry.host}/fleet/tiny:1"
    assert main(["push", str(created), ref, *reg_args(registry)]) == 0
    pulled = tmp_path / "pulled"
    assert main(["pull", ref, str(pulled), *reg_args(registry)]) == 0
    assert main(["verify", str(pulled), "--trust", str(keys.release_pub), "--no-progress"]) == 0
    assert (pulled / L.BOOTSTRAP_FILE).read_bytes() == (created / L.BOOTSTRAP_FILE).read_bytes()
    assert os.access(pulled / L.BOOTSTRAP_FILE, os.X_OK)
    copied = tmp_path / "copied"
    copy_bundle(created, copied, progress=False)
    assert bundle_files(pulled) == bundle_files(created) == bundle_files(copied)
    assert main(["pull", ref, str(pulled), *reg_args(registry)]) == 0  # a rerun accepts its own bootstrap
    # The next bundle in the same directory carries no runtime: no stale bootstrap stays behind.
    push(bundles["v1"], f"{registry.host}/fleet/tiny:2", options=options)
    pull(f"{registry.host}/fleet/tiny:2", pulled, options=options)
    assert bundle_files(pulled) == bundle_files(bundles["v1"])
    copy_bundle(bundles["v1"], copied, progress=False)  # copy keeps other blobs in DST, not the bootstrap
    assert not (copied / L.BOOTSTRAP_FILE).exists()


@pytest.mark.slow
def test_v2_pushes_and_pulls_only_its_new_blobs(registry, options, bundles, tmp_path):
    ref = f"{registry.host}/fleet/demo"
    v1, v2 = blob_set(bundles["v1"]), blob_set(bundles["v2"])
    new = v2 - v1
    assert new and v1 & v2  # the fixture shares most blobs and changes some
    push(bundles["v1"], ref, options=options)
    registry.mark()
    push(bundles["v2"], ref, options=options)
    assert sorted(registry.blob_uploads()) == sorted(new), "v2's push uploaded a blob the registry had"
    device = tmp_path / "device"
    pull(f"{ref}:1", device, options=options)
    registry.mark()
    report = pull(f"{ref}:2", device, options=options)
    fetched = registry.blob_gets()
    assert sorted(fetched) == sorted(new), f"fetched {len(fetched)} blobs, expected the {len(new)} new ones"
    assert (report.blobs_fetched, report.blobs_reused) == (len(new), len(v2 & v1))
    print(f"\nv2: {len(new)} of {len(v2)} blobs new; push uploaded {len(new)}, pull fetched {len(fetched)} "
          f"({report.bytes_fetched} bytes fetched, {report.bytes_reused} reused)")
    # DEST is now exactly v2: v1-only blobs are gone, one index entry.
    assert {p.name for p in (device / L.BLOBS_DIR).iterdir()} == {
        d.split(":")[1] for d in v2 | {report.digest}}
    assert open_bundle(device).unverified_manifest().version == 2


# --- interruption and resume ---------------------------------------------------------------------------
@pytest.mark.slow
def test_broken_pull_resumes_with_only_the_missing_blobs(registry, options, bundles, tmp_path):
    ref = f"{registry.host}/fleet/demo:1"
    push(bundles["v1"], ref, options=options)
    layout = open_bundle(bundles["v1"])
    victim = max(layout.parts, key=lambda d: d.size)
    data = registry.blob_data(victim.digest)
    good = data.read_bytes()
    data.write_bytes(bytes(b ^ 0xFF for b in good[:4096]) + good[4096:])  # the transfer of one blob goes bad
    dest = tmp_path / "dest"
    with pytest.raises(BadBundleError, match="does not match its digest"):
        pull(ref, dest, options=options)
    assert not (dest / L.COMPLETE_MARKER).exists()
    landed = {p.name for p in (dest / L.BLOBS_DIR).iterdir()}
    assert victim.digest.split(":")[1] not in landed and len(landed) >= len(layout.parts) - 1
    data.write_bytes(good)
    registry.mark()
    report = pull(ref, dest, options=options)
    fetched = set(registry.blob_gets())
    assert victim.digest in fetched and fetched <= {victim.digest, layout.config.digest}, fetched
    assert report.blobs_reused >= len(layout.parts) - 1
    assert (dest / L.COMPLETE_MARKER).read_text().strip() == layout.oci_manifest.digest


@pytest.mark.slow
def test_killed_pull_is_not_complete_and_a_rerun_fetches_nothing_again(registry, bundles, tmp_path):
    ref = f"{registry.host}/fleet/demo:1"
    assert main(["push", str(bundles["v1"]), ref, *reg_args(registry)]) == 0
    dest = tmp_path / "dest"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), BUNDLE_PAUSE_AT="pulled:60")
    proc = subprocess.Popen([sys.executable, "-m", "bundler.cli", "pull", ref, str(dest), *reg_args(registry)],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    for line in proc.stderr:
        if "paused at pulled" in line:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert main(["verify", str(dest), "--allow-unsigned", "--no-progress"]) == BadBundleError.exit_code
    (dest / L.INDEX_FILE).write_bytes(b'{"schemaVersion":2,"manif')  # as if killed while skopeo wrote it
    registry.mark()
    assert main(["pull", ref, str(dest), *reg_args(registry)]) == 0
    layout = open_bundle(dest)
    assert set(registry.blob_gets()) <= {layout.config.digest}  # every part came from the killed run


# --- install from the registry -----------------------------------------------------------------------
def install_args(registry, store, keys, *extra) -> list[str]:
    return ["--store", str(store), "--target", "jetson-thor", "--force-target", "--trust", str(keys.release_pub),
            *reg_args(registry), *extra]


@pytest.mark.slow
def test_install_from_registry_then_v2_fetches_only_new_blobs(registry, options, bundles, keys, tmp_path, capsys):
    ref = f"{registry.host}/fleet/demo"
    push(bundles["v1"], ref, options=options)
    push(bundles["v2"], ref, options=options)
    store = tmp_path / "store"
    assert main(["install", f"{ref}:1", *install_args(registry, store, keys)]) == 0
    cur = assert_serving_ready(Store(store), version=1)
    assert json.loads((cur.path / "install.json").read_text())["signers"] == [keys.release_id]
    registry.mark()
    assert main(["install", f"{ref}:2", *install_args(registry, store, keys)]) == 0
    gets = registry.blob_gets()
    new_parts = {d.digest for d in open_bundle(bundles["v2"]).parts} - blob_set(bundles["v1"])
    assert set(gets) - {EMPTY} == blob_set(bundles["v2"]) - blob_set(bundles["v1"])
    assert all(gets.count(d) == 1 for d in new_parts), "a part blob was fetched twice"
    assert_serving_ready(Store(store), version=2)
    assert Store(store).current("demo").previous_version == 1
    assert "reused" in capsys.readouterr().out
    assert_no_leftovers(Store(store))


@pytest.mark.slow
def test_tampered_blob_in_registry_is_refused_and_nothing_installed(registry, options, bundles, keys, tmp_path):
    ref = f"{registry.host}/fleet/demo"
    push(bundles["v1"], ref, options=options)
    store = tmp_path / "store"
    assert main(["install", f"{ref}:1", *install_args(registry, store, keys)]) == 0
    push(bundles["v2"], ref, options=options)
    changed = sorted(blob_set(bundles["v2"]) - blob_set(bundles["v1"]) - {open_bundle(bundles["v2"]).config.digest})
    registry.blob_data(changed[0]).write_bytes(b"tampered by someone with registry access")
    assert main(["install", f"{ref}:2", *install_args(registry, store, keys)]) == BadBundleError.exit_code
    assert_serving_ready(Store(store), version=1)
    assert_no_leftovers(Store(store))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["substituted manifest", "untrusted signer"])
def test_substituted_manifest_is_refused_and_nothing_installed(registry, options, bundles, keys, tmp_path,
                                                               capsys, how):
    """Someone who can write to the registry pushes a bundle under the real tag: trust is the signature."""
    import shutil
    evil = tmp_path / "evil"
    shutil.copytree(bundles["v2"], evil)
    layout = open_bundle(evil)
    if how == "substituted manifest":
        doctored = layout.manifest_bytes.replace(b'"max_model_len":256', b'"max_model_len":255')
        assert doctored != layout.manifest_bytes
        resign(evil, doctored, envelope_bytes=layout.envelope_bytes)  # the real v2 signature, other bytes
    else:
        resign(evil, layout.manifest_bytes, [keys.other])
    assert oci_manifest(evil) != oci_manifest(bundles["v2"])
    ref = f"{registry.host}/fleet/demo"
    push(bundles["v1"], ref, options=options)
    store = tmp_path / "store"
    assert main(["install", f"{ref}:1", *install_args(registry, store, keys)]) == 0
    push(evil, f"{ref}:2", options=options)
    capsys.readouterr()
    registry.mark()
    assert main(["install", f"{ref}:2", *install_args(registry, store, keys)]) == TrustError.exit_code
    assert "untrusted bundle" in capsys.readouterr().err
    # Refused from the manifest and the envelope alone: not one of v2's new part blobs was downloaded.
    new_parts = {d.digest for d in open_bundle(evil).parts} - blob_set(bundles["v1"])
    assert new_parts and not new_parts & set(registry.blob_gets())
    assert_serving_ready(Store(store), version=1)
    assert_no_leftovers(Store(store))


@pytest.mark.slow
def test_a_digest_reference_refuses_any_other_manifest(registry, options, bundles, tmp_path):
    ref = f"{registry.host}/fleet/demo"
    push(bundles["v1"], ref, options=options)
    push(bundles["v2"], ref, options=options)
    v1 = open_bundle(bundles["v1"]).oci_manifest.digest
    assert pull(f"{ref}@{v1}", tmp_path / "a", options=options).version == 1
    # The tag now names v2's manifest; asking for v1's digest can never yield it.
    registry.tag_link("fleet/demo", "1").write_text(open_bundle(bundles["v2"]).oci_manifest.digest)
    assert pull(f"{ref}@{v1}", tmp_path / "b", options=options).version == 1


# --- credentials and TLS -----------------------------------------------------------------------------
@pytest.mark.slow
def test_credentials_certificates_and_missing_tags_have_their_own_exit_codes(registry, options, bundles, tmp_path,
                                                                            capsys):
    ref = f"{registry.host}/fleet/demo:1"
    push(bundles["v1"], ref, options=options)
    wrong = tmp_path / "wrong-auth.json"
    wrong.write_text(json.dumps({"auths": {registry.host: {"auth": "ZmxlZXQ6d3Jvbmc="}}}))  # fleet:wrong
    cases = [
        (["--ca-file", str(registry.ca), "--authfile", str(wrong)], RegistryAuthError, "refused the credentials"),
        (["--authfile", str(registry.authfile)], RegistryTLSError, "TLS certificate not trusted"),
    ]
    for args, error, text in cases:
        capsys.readouterr()
        assert main(["pull", ref, str(tmp_path / "x"), "--no-progress", *args]) == error.exit_code
        err = capsys.readouterr().err
        assert text in err and registry.host in err and len(err.strip().splitlines()) == 1, err
    other_ca = tmp_path / "other-ca"
    from tests.runtime.store.registry.server import make_ca
    ca2, _, _ = make_ca(other_ca, "another-ca")
    with pytest.raises(RegistryTLSError):
        pull(ref, tmp_path / "y", options=RegistryOptions(ca_file=ca2, authfile=registry.authfile))
    with pytest.raises(RegistryError, match="has no") as e:
        pull(f"{registry.host}/fleet/demo:9", tmp_path / "z", options=options)
    assert e.value.exit_code == RegistryError.exit_code
    with pytest.raises(RegistryError, match="could not be used") as e:  # nothing listens there
        pull(f"127.0.0.1:{_closed_port()}/fleet/demo:1", tmp_path / "z", options=options)
    assert "connection refused" in str(e.value)
    with pytest.raises(UsageError, match="PEM"):
        pull(ref, tmp_path / "z", options=RegistryOptions(ca_file=registry.authfile))
    assert not (tmp_path / "x" / L.COMPLETE_MARKER).exists()


@pytest.mark.slow
def test_docker_config_json_in_home_is_found_without_authfile(registry, options, bundles, tmp_path, monkeypatch):
    push(bundles["v1"], f"{registry.host}/fleet/demo:1", options=options)
    home = tmp_path / "home"
    (home / ".docker").mkdir(parents=True)
    (home / ".docker" / "config.json").write_bytes(registry.authfile.read_bytes())
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)
    r = pull(f"{registry.host}/fleet/demo:1", tmp_path / "d", options=RegistryOptions(ca_file=registry.ca))
    assert r.version == 1
    # Podman's auth.json (REGISTRY_AUTH_FILE) is read before Docker's file: its wrong password is used.
    podman = tmp_path / "podman-auth.json"
    podman.write_text(json.dumps({"auths": {registry.host: {"auth": "ZmxlZXQ6d3Jvbmc="}}}))  # fleet:wrong
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(podman))
    with pytest.raises(RegistryAuthError):
        pull(f"{registry.host}/fleet/demo:1", tmp_path / "e", options=RegistryOptions(ca_file=registry.ca))


def test_push_refuses_a_damaged_bundle_before_contacting_any_registry(bundles, tmp_path):
    import shutil
    from tests.runtime.store.craft import flip_byte
    b = tmp_path / "b"
    shutil.copytree(bundles["v1"], b)
    flip_byte(b / L.blob_path(open_bundle(b).parts[0].digest))
    with pytest.raises(BadBundleError, match="nothing pushed"):
        push(b, "127.0.0.1:1/fleet/demo", options=RegistryOptions())


@pytest.mark.slow
def test_without_a_signature_referrer_the_signature_is_checked_after_the_download(registry, options, bundles,
                                                                                  keys, trusted, tmp_path):
    """A mirror made with `skopeo copy` carries the bundle (envelope layer included) but not its referrer."""
    ref = f"{registry.host}/fleet/demo:1"
    push(bundles["v1"], ref, options=options)
    digest = open_bundle(bundles["v1"]).oci_manifest.digest
    tag = registry.storage / f"docker/registry/v2/repositories/fleet/demo/_manifests/tags/{referrers_tag(digest)}"
    assert tag.is_dir()  # push wrote the referrers tag
    early = pull(ref, tmp_path / "a", options=options, trusted=trusted)
    assert early.signature == "checked before download"
    import shutil
    shutil.rmtree(tag)
    late = pull(ref, tmp_path / "b", options=options, trusted=trusted)
    assert late.signature == "checked after download"
    from runtime.store.trust import trusted_keys
    with pytest.raises(TrustError):
        pull(ref, tmp_path / "c", options=options, trusted=trusted_keys([keys.other_pub], trust_dir=None))
    store = tmp_path / "store"
    assert main(["install", ref, *install_args(registry, store, keys)]) == 0
    assert_serving_ready(Store(store), version=1)


@pytest.mark.slow
def test_push_keeps_other_referrers_at_the_referrers_tag(registry, options, bundles, trusted, tmp_path,
                                                         monkeypatch):
    """Another tool (cosign, notation, a second signing run) may list its own referrer at the same tag."""
    import runtime.store.referrer as referrer
    from runtime.store.skopeo import skopeo as skopeo_client
    ref = f"{registry.host}/fleet/demo:1"
    push(bundles["v1"], ref, options=options)
    original = referrer.signature_manifest

    def annotated(layout):
        m = json.loads(original(layout))
        m["annotations"] = {"org.example.other": "yes"}
        return json.dumps(m, sort_keys=True, separators=(",", ":")).encode()
    monkeypatch.setattr(referrer, "signature_manifest", annotated)
    push(bundles["v1"], ref, options=options)
    monkeypatch.setattr(referrer, "signature_manifest", original)
    push(bundles["v1"], ref, options=options)  # ours again: not listed twice
    digest = open_bundle(bundles["v1"]).oci_manifest.digest
    tag_ref = parse_reference(f"{registry.host}/fleet/demo:{referrers_tag(digest)}")
    with skopeo_client(options, tag_ref) as sk:
        entries = referrer._entries(sk, tag_ref)
    assert len(entries) == 2
    assert pull(ref, tmp_path / "d", options=options, trusted=trusted).signature == "checked before download"


def test_skopeo_answers_are_read_bounded_and_its_errors_classified(tmp_path):
    """skopeo's stdout is the registry's untrusted answer: read at most to the limit, then killed."""
    from runtime.store.skopeo import Skopeo, classify
    chatty = tmp_path / "skopeo"
    chatty.write_text("#!/bin/sh\nyes '{\"padding\": \"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"}'\n")
    chatty.chmod(0o755)
    ref = parse_reference("registry.lan/fleet/demo:1")
    with pytest.raises(BadBundleError, match="answered more than 65536 bytes"):
        Skopeo(RegistryOptions(skopeo=str(chatty)), None).inspect_raw(ref, limit=65536)
    fatal = 'time="2026-12-01T08:47:08Z" level=fatal msg="reading manifest 1 in {}: {}"'
    cases = {"unauthorized: authentication required": RegistryAuthError,
             'Get \\"https://r/v2/\\": x509: certificate signed by unknown authority': RegistryTLSError,
             "manifest unknown: manifest unknown": RegistryError,
             "Digest did not match, expected sha256:ab, got sha256:cd": BadBundleError,
             "dial tcp 127.0.0.1:1: connect: connection refused": RegistryError}
    for why, cls in cases.items():
        err = classify(fatal.format(ref, why), ref)
        assert type(err) is cls or (cls is RegistryError and isinstance(err, RegistryError)
                                    and err.exit_code == RegistryError.exit_code), (why, err)
        assert "registry.lan" in str(err)
    with pytest.raises(EnvironmentProblem, match="skopeo tool"):
        Skopeo(RegistryOptions(skopeo=str(tmp_path / "no-such-skopeo")), None)


@pytest.mark.slow
def test_bearer_token_auth_as_harbor_does_it(bundles, keys, tmp_path):
    """The registry sends the client to a token realm; the client gets a token with the same credentials."""
    from tests.runtime.store.registry.server import PASSWORD, USER, start_registry
    from tests.runtime.store.registry.token_server import TokenServer
    tokens = TokenServer(tmp_path / "token", USER, PASSWORD)
    registry = start_registry(tmp_path / "registry", token_server=tokens)
    try:
        options = RegistryOptions(ca_file=registry.ca, authfile=registry.authfile)
        ref = f"{registry.host}/fleet/demo:1"
        push(bundles["v1"], ref, options=options)
        store = tmp_path / "store"
        assert main(["install", ref, *install_args(registry, store, keys)]) == 0
        assert_serving_ready(Store(store), version=1)
        granted = [scope for status, scope in tokens.requests if status == 200]
        assert any("repository:fleet/demo:" in s and "push" in s for s in granted)
        assert any("repository:fleet/demo:pull" in s for s in granted)
        wrong = tmp_path / "wrong.json"
        wrong.write_text(json.dumps({"auths": {registry.host: {"auth": "ZmxlZXQ6d3Jvbmc="}}}))
        with pytest.raises(RegistryAuthError):
            pull(ref, tmp_path / "x", options=RegistryOptions(ca_file=registry.ca, authfile=wrong))
        assert any(status == 401 for status, _ in tokens.requests)
    finally:
        registry.stop()
        tokens.stop()


def test_a_directory_install_loads_no_registry_code(bundles, keys, tmp_path):
    code = ("import json, sys\nfrom bundler.cli import main\n"
            f"rc = main(['install', {str(bundles['v1'])!r}, '--store', {str(tmp_path / 's')!r}, '--target', "
            f"'jetson-thor', '--force-target', '--trust', {str(keys.release_pub)!r}, '--no-progress'])\n"
            "print(json.dumps([rc, sorted(sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                         env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), timeout=120)
    rc, modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert rc == 0 and "runtime.store.store" in modules, out.stderr
    assert not {"runtime.store.registry", "runtime.store.skopeo", "runtime.store.referrer", "runtime.store.registry_ping"} & set(modules)
