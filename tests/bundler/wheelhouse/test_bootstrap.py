"""The bootstrap (`sh BUNDLE/bootstrap --trust KEY.pub`): nothing unverified is installed or executed.

A good bundle bootstraps a fresh floor-only venv inside a network namespace with only loopback, and that
venv installs and serves it; every tampered variant is refused with a one-line reason, the documented exit
code and nothing installed; the bootstrap accepts and refuses the same bundles as the runtime's verify.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bundler.pack.keys import generate_key, load_private_key
from manifests import layout as L
from runtime.store.trust import trusted_keys
from runtime.store.verify import verify_bundle
from tests.bundler.wheelhouse.conftest import run_bootstrap, system_python
from tests.conftest import unshare_problem
from tests.runtime.store.craft import envelope, flip_byte, oci_manifest, resign

REPO = Path(__file__).resolve().parents[3]

NAMESPACE_SCRIPT = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    import httpx, openai
    bundle, pub, prefix, store, port, fresh, recorder = sys.argv[1:8]
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    os.chdir(fresh)  # an empty directory: nothing of the source tree around
    run = lambda *cmd, **kw: subprocess.run(list(cmd), capture_output=True, text=True, **kw)
    out = {}
    try:
        httpx.get("https://pypi.org/simple/", timeout=3)
        out["pypi_reachable"] = True
    except httpx.TransportError:
        out["pypi_reachable"] = False
    b = run("sh", bundle + "/bootstrap", "--trust", pub, "--prefix", prefix)
    out["bootstrap"] = [b.returncode, b.stdout, b.stderr]
    exe = prefix + "/bin/bundle"
    py = prefix + "/current/bin/python"
    out["import_bundler"] = run(py, "-c", "import bundler").returncode
    out["help"] = run(exe, "--help").stdout
    c = run(exe, "create", "--targets", "cpu", "--name", "x", "--version", "1", "--unsigned")
    out["create"] = [c.returncode, c.stderr]
    i = run(exe, "install", bundle, "--store", store, "--target", "cpu", "--trust", pub, "--no-progress")
    out["install"] = [i.returncode, i.stdout, i.stderr]
    # every module the real entry point loaded, written at its exit by a sitecustomize hook
    env = dict(os.environ, PYTHONPATH=recorder, RECORD_MODULES=fresh + "/modules.txt")
    server = subprocess.Popen([exe, "serve", "tiny", "--store", store, "--port", port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    url = "http://127.0.0.1:" + port
    for _ in range(600):
        try:
            if httpx.get(url + "/health/ready", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=8)
    out["reply"] = [reply.choices[0].finish_reason, reply.usage.completion_tokens]
    server.send_signal(signal.SIGINT)
    so, se = server.communicate(timeout=60)
    out["imported"] = open(fresh + "/modules.txt").read().split()
    out["server"] = [server.returncode, so[-1500:], se[-1500:]]
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_bootstrap_then_floor_only_venv_installs_and_serves_offline(runtime_bundle, tmp_path):
    """The floor wheel alone, from the bundle, in a fresh venv with no index and no network at all."""
    problem = unshare_problem()
    if problem:
        pytest.skip(f"needs a network namespace (root): {problem}")
    script = tmp_path / "driver.py"
    script.write_text(NAMESPACE_SCRIPT)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    port = "18517"
    from tests.runtime.test_main import MODULE_RECORDER
    recorder = tmp_path / "recorder"
    recorder.mkdir()
    (recorder / "sitecustomize.py").write_text(MODULE_RECORDER)
    r = subprocess.run(["unshare", "-n", sys.executable, str(script), str(runtime_bundle.dir),
                        str(runtime_bundle.pub), str(tmp_path / "opt"), str(tmp_path / "store"), port, str(fresh),
                        str(recorder)],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHON": system_python()})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["pypi_reachable"] is False
    rc, so, se = out["bootstrap"]
    assert rc == 0, se
    assert "signature OK" in so and "sha256 as signed" in so and "next:" in so
    assert out["import_bundler"] != 0, "the floor venv must not contain the build host's code"
    for command in ("verify", "inspect", "install", "list", "rollback", "serve", "targets", "copy"):
        assert f"  {command} " in out["help"]
    for command in ("create", "keygen", "build-engines"):
        assert f"  {command} " not in out["help"]
    assert out["create"][0] == 6 and "pip install 'bundle[build]'" in out["create"][1], out["create"]
    assert out["install"][0] == 0, out["install"]
    assert out["reply"][0] in ("stop", "length") and out["reply"][1] > 0
    assert "runtime.cli.main" in out["imported"] and "runtime.server.app" in out["imported"], out["imported"][:50]
    assert not [m for m in out["imported"] if m.split(".")[0] == "bundler"], out["imported"]
    venvs = [p for p in (tmp_path / "opt").iterdir() if p.name.startswith("runtime-")]
    site = next((venvs[0] / "lib").glob("python3*/site-packages"))
    assert not (site / "bundler").exists()
    assert not list(site.glob("torch*")) and not list(site.glob("transformers*"))


def _wheel_blob(bundle: Path, name_part: str = "bundle_runtime") -> Path:
    from manifests.schema import Manifest

    m = Manifest.from_json_bytes((bundle / L.blob_path(oci_manifest(bundle)["config"]["digest"])).read_bytes())
    entry = next(f for f in m.files if f.path.startswith("wheelhouse/") and name_part in f.path)
    return bundle / L.blob_path(entry.parts[0].digest)


def _manifest(bundle: Path) -> tuple[bytes, dict]:
    data = (bundle / L.blob_path(oci_manifest(bundle)["config"]["digest"])).read_bytes()
    return data, json.loads(data)


def _canonical(d: dict) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# Each mutation -> (exit code of the bootstrap, whether the runtime's verify also refuses it)
def flipped_wheel(bundle, key, tmp):
    flip_byte(_wheel_blob(bundle), 100)


def missing_wheel(bundle, key, tmp):
    _wheel_blob(bundle, "numpy").unlink()


def truncated_wheel(bundle, key, tmp):
    blob = _wheel_blob(bundle)
    blob.write_bytes(blob.read_bytes()[:-10])


def modified_manifest(bundle, key, tmp):
    """A manifest that points a wheel at other bytes, with the old signatures: the signature must fail."""
    data, d = _manifest(bundle)
    env = json.loads((bundle / L.blob_path(next(x for x in oci_manifest(bundle)["layers"]
                                                 if x["mediaType"] == L.SIGNATURE_MEDIA_TYPE)["digest"])).read_bytes())
    d["name"] = "evil"
    new = _canonical(d)
    env["payload"] = L.b64(new)
    resign(bundle, new, envelope_bytes=json.dumps(env).encode())


def signed_by_another_key(bundle, key, tmp):
    generate_key(tmp / "other.key")
    resign(bundle, _manifest(bundle)[0], [load_private_key(tmp / "other.key")])


def unsigned(bundle, key, tmp):
    resign(bundle, _manifest(bundle)[0], [])


def config_differs_from_payload(bundle, key, tmp):
    """The signed payload is intact but the config blob (what the runtime reads) was swapped."""
    data, d = _manifest(bundle)
    d["serve"] = {"max_model_len": 64}
    good_env = envelope(data, [load_private_key(key)])
    resign(bundle, _canonical(d), envelope_bytes=good_env)


def newer_format(bundle, key, tmp):
    data, d = _manifest(bundle)
    d["format_version"] = 99
    resign(bundle, _canonical(d), [load_private_key(key)])


def signed_malformed_wheel_entry(bundle, key, tmp):
    """Validly signed by the release key, but a wheel's entry is not what any tool writes."""
    data, d = _manifest(bundle)
    entry = next(f for f in d["files"] if f["path"].startswith("wheelhouse/bundle_runtime"))
    entry["parts"] = ["not-a-part"]
    resign(bundle, _canonical(d), [load_private_key(key)])


MUTATIONS = {
    "signed-malformed-wheel-entry": (signed_malformed_wheel_entry, 3),
    "flipped-wheel": (flipped_wheel, 3),
    "missing-wheel": (missing_wheel, 3),
    "truncated-wheel": (truncated_wheel, 3),
    "modified-manifest": (modified_manifest, 4),
    "signed-by-another-key": (signed_by_another_key, 4),
    "unsigned": (unsigned, 4),
    "config-differs-from-payload": (config_differs_from_payload, 4),
    "newer-format-version": (newer_format, 5),
}


def _nothing_installed(prefix: Path) -> bool:
    return not prefix.exists() or not any(p.name.startswith("runtime-") for p in prefix.iterdir())


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_tampered_bundle_is_refused_with_nothing_installed(case, runtime_bundle, bundle_copy, tmp_path):
    mutate, code = MUTATIONS[case]
    mutate(bundle_copy, runtime_bundle.key, tmp_path)
    prefix = tmp_path / "opt"
    r = run_bootstrap(bundle_copy, runtime_bundle.pub, prefix, netns=unshare_problem() is None)
    assert r.returncode == code, (r.stdout, r.stderr)
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("bootstrap: error: "), r.stderr
    assert _nothing_installed(prefix)


@pytest.mark.parametrize("case", sorted(MUTATIONS) + ["intact"])
def test_bootstrap_and_runtime_verify_agree(case, runtime_bundle, bundle_copy, tmp_path):
    """Same bundles accepted and refused: the bootstrap's openssl check and runtime/store/verify.py."""
    if case != "intact":
        MUTATIONS[case][0](bundle_copy, runtime_bundle.key, tmp_path)
    r = run_bootstrap(bundle_copy, runtime_bundle.pub, tmp_path / "opt", "--verify-only")
    try:
        verify_bundle(bundle_copy, trusted_keys([runtime_bundle.pub], trust_dir=None))
        runtime_accepts = True
    except Exception as e:  # noqa: BLE001 - any refusal counts
        runtime_accepts = False
        reason = e
    assert (r.returncode == 0) == runtime_accepts, (case, r.stderr, None if runtime_accepts else reason)
    assert _nothing_installed(tmp_path / "opt")


def test_wrong_trust_key_is_refused(runtime_bundle, tmp_path):
    generate_key(tmp_path / "stranger.key")
    r = run_bootstrap(runtime_bundle.dir, tmp_path / "stranger.key.pub", tmp_path / "opt")
    assert r.returncode == 4 and "no signature verifies" in r.stderr
    assert _nothing_installed(tmp_path / "opt")


def test_malformed_trust_key_is_a_usage_error(runtime_bundle, tmp_path):
    bad = tmp_path / "bad.pub"
    bad.write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    r = run_bootstrap(runtime_bundle.dir, bad, tmp_path / "opt")
    assert r.returncode == 2 and "expected a PEM or OpenSSH Ed25519 public key" in r.stderr


def test_openssh_trust_key_works_like_pem(runtime_bundle, tmp_path):
    from cryptography.hazmat.primitives import serialization

    from runtime.store.trust import load_public_key

    _, key = load_public_key(runtime_bundle.pub)
    ssh = tmp_path / "release.pub"
    ssh.write_bytes(key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    r = run_bootstrap(runtime_bundle.dir, ssh, tmp_path / "opt", "--verify-only")
    assert r.returncode == 0, r.stderr


def _path_without(tmp_path: Path, *missing: str, fake: dict[str, str] | None = None) -> dict:
    """A PATH of symlinks to the real tools, minus `missing`, plus `fake` scripts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(system_python())
    for tool in ("sha256sum", "openssl", "mktemp", "rm", "cat", "wc", "tr", "cut", "head", "grep",
                 "dirname", "basename", "mkdir", "ln", "mv", "sh"):
        real = shutil.which(tool)
        if real and tool not in missing:
            (bin_dir / tool).symlink_to(real)
    for name, body in (fake or {}).items():
        (bin_dir / name).unlink(missing_ok=True)
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": str(bin_dir), "PYTHON": system_python()}


def test_missing_openssl_stops_before_anything(runtime_bundle, tmp_path):
    r = run_bootstrap(runtime_bundle.dir, runtime_bundle.pub, tmp_path / "opt", env=_path_without(tmp_path, "openssl"))
    assert r.returncode == 6 and "openssl not found" in r.stderr, r.stderr
    assert _nothing_installed(tmp_path / "opt")


def test_openssl_without_ed25519_stops_before_anything(runtime_bundle, tmp_path):
    # An OpenSSL 1.1-like binary: knows its version, but `pkeyutl -rawin` (needed for Ed25519) fails.
    fake = "#!/bin/sh\n[ \"$1\" = version ] && { echo 'OpenSSL 1.1.1w  11 Sep 2023'; exit 0; }\n" \
           "echo \"pkeyutl: Unknown option: -rawin\" >&2; exit 1\n"
    env = _path_without(tmp_path, fake={"openssl": fake})
    r = run_bootstrap(runtime_bundle.dir, runtime_bundle.pub, tmp_path / "opt", env=env)
    assert r.returncode == 6 and "cannot verify Ed25519" in r.stderr and "OpenSSL 1.1.1w" in r.stderr, r.stderr
    assert _nothing_installed(tmp_path / "opt")


def test_a_modified_bootstrap_notices_it_is_not_the_signed_one(runtime_bundle, bundle_copy, tmp_path):
    script = bundle_copy / "bootstrap"
    script.write_text(script.read_text() + "\n# edited on the stick\n")
    r = run_bootstrap(bundle_copy, runtime_bundle.pub, tmp_path / "opt")
    assert r.returncode == 3 and "differs from the signed bootstrap" in r.stderr
    with pytest.raises(Exception, match="bootstrap"):  # and the runtime's verify names it too
        verify_bundle(bundle_copy, trusted_keys([runtime_bundle.pub], trust_dir=None))


@pytest.mark.slow
def test_second_run_reuses_the_installed_runtime(runtime_bundle, tmp_path):
    prefix = tmp_path / "opt"
    first = run_bootstrap(runtime_bundle.dir, runtime_bundle.pub, prefix, env={**os.environ, "PYTHON": system_python()})
    assert first.returncode == 0, first.stderr
    marker = next(prefix.glob("runtime-*/.bootstrap-complete"))
    before = marker.stat().st_mtime_ns
    again = run_bootstrap(runtime_bundle.dir, runtime_bundle.pub, prefix, env={**os.environ, "PYTHON": system_python()})
    assert again.returncode == 0, again.stderr
    assert marker.stat().st_mtime_ns == before
    assert os.readlink(prefix / "current") == marker.parent.name
    assert subprocess.run([str(prefix / "bin" / "bundle"), "--version"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_environment_cannot_inject_code_or_wheels(runtime_bundle, tmp_path):
    """PYTHONPATH/sitecustomize and PIP_* settings on the device must not reach what the bootstrap runs."""
    hook = tmp_path / "inject"
    hook.mkdir()
    marker = tmp_path / "injected"
    (hook / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'a').write('ran\\n')\n")
    evil = tmp_path / "evil-wheels"
    from tests.wheels import make_wheel
    make_wheel(evil, "evil-extra", "1.0")
    env = {**os.environ, "PYTHON": system_python(), "PYTHONPATH": str(hook), "PIP_FIND_LINKS": str(evil),
           "PIP_INDEX_URL": "http://192.0.2.1/simple", "PIP_NO_INDEX": "0"}
    prefix = tmp_path / "opt"
    r = run_bootstrap(runtime_bundle.dir, runtime_bundle.pub, prefix, env=env)
    assert r.returncode == 0, r.stderr
    assert not marker.exists(), "a sitecustomize from PYTHONPATH ran inside the bootstrap"
    site = next(prefix.glob("runtime-*/lib/python3*/site-packages"))
    assert (site / "runtime" / "cli" / "main.py").is_file() and not list(site.glob("evil_extra*"))


# --- one rule for wheel paths: the bootstrap and the runtime's verify, the same cases --------------------------
WHEEL_PATH_CASES = [
    ("wheelhouse/bundle_runtime-0.1.0-py3-none-any.whl", True),
    ("wheelhouse/Odd.Name_1+local!x-0.1-py3-none-any.whl", True),
    ("wheelhouse/..whl", True),  # a file name of dots, not a way out: both accept it
    ("wheelhouse/../x.whl", False),
    ("wheelhouse/a/../../x.whl", False),
    ("wheelhouse/a/../../..", False),
    ("wheelhouse/sub/x.whl", False),
    ("wheelhouse/./x.whl", False),
    ("wheelhouse//x.whl", False),
    ("wheelhouse/x.whl\n", False),
    ("wheelhouse/x y.whl", False),
    ("wheelhouse/x.whl/", False),
    ("models/x.whl", False),
    ("wheelhouse/" + "a" * 252 + ".whl", False),  # a name longer than 255 bytes
]


def _rename_floor_wheel(bundle: Path, key: Path, new_path: str) -> None:
    """Validly signed: the floor wheel's file entry and the runtime section name it `new_path`."""
    data, d = _manifest(bundle)
    entry = next(f for f in d["files"] if f["path"].startswith("wheelhouse/bundle_runtime"))
    old = entry["path"]
    entry["path"] = new_path
    d["runtime"]["platforms"] = {p: [new_path if w == old else w for w in ws]
                                 for p, ws in d["runtime"]["platforms"].items()}
    resign(bundle, _canonical(d), [load_private_key(key)])


@pytest.mark.parametrize("path, accepted", WHEEL_PATH_CASES, ids=[repr(p)[:40] for p, _ in WHEEL_PATH_CASES])
def test_one_wheel_path_rule_for_the_bootstrap_and_verify(path, accepted, runtime_bundle, bundle_copy, tmp_path):
    from manifests.errors import BadBundleError
    _rename_floor_wheel(bundle_copy, runtime_bundle.key, path)
    r = run_bootstrap(bundle_copy, runtime_bundle.pub, tmp_path / "opt", "--verify-only")
    if accepted:
        assert r.returncode == 0, r.stderr
        verify_bundle(bundle_copy, trusted_keys([runtime_bundle.pub], trust_dir=None))
    else:
        assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1, (r.returncode, r.stderr)
        assert "expected wheel paths like wheelhouse/NAME.whl" in r.stderr or "expected a path" in r.stderr
        with pytest.raises(BadBundleError):
            verify_bundle(bundle_copy, trusted_keys([runtime_bundle.pub], trust_dir=None))
    assert _nothing_installed(tmp_path / "opt")


def test_the_bootstrap_applies_the_schema_wheel_path_rule():
    """The bootstrap cannot import manifests/: it carries the same pattern, character for character."""
    from manifests.schema import WHEEL_PATH
    source = (REPO / "bundler" / "pack" / "bootstrap.sh").read_text()
    assert f'WHEEL_PATH = re.compile(r"{WHEEL_PATH.pattern}")' in source


# --- --trust files: what the bootstrap and the runtime accept and refuse, with the same exit code --------------
def _key_case(case: str, tmp_path: Path, runtime_bundle) -> Path:
    key = tmp_path / "keys" / "release.pub"
    key.parent.mkdir()
    if case == "symlink-to-key":
        key.symlink_to(runtime_bundle.pub)
    elif case == "symlink-to-bad-key":
        (tmp_path / "bad.pub").write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
        key.symlink_to(tmp_path / "bad.pub")
    elif case == "dangling-symlink":
        key.symlink_to(tmp_path / "nowhere.pub")
    elif case == "fifo":
        os.mkfifo(key)
    elif case == "empty":
        key.write_bytes(b"")
    elif case == "private-key":
        key.write_bytes(runtime_bundle.key.read_bytes())
    elif case == "too-large":
        key.write_bytes(b"ssh-ed25519 " + b"A" * (64 * 1024))
    return key


KEY_CASES = {"symlink-to-key": 0, "symlink-to-bad-key": 2, "dangling-symlink": 2, "fifo": 2, "empty": 2,
             "private-key": 2, "too-large": 2}


@pytest.mark.parametrize("case", sorted(KEY_CASES))
def test_trust_key_files_are_judged_alike_by_the_bootstrap_and_the_runtime(case, runtime_bundle, tmp_path, capsys):
    from runtime.cli.main import main
    key = _key_case(case, tmp_path, runtime_bundle)
    r = run_bootstrap(runtime_bundle.dir, key, tmp_path / "opt", "--verify-only")
    code = main(["verify", str(runtime_bundle.dir), "--trust", str(key), "--store", str(tmp_path / "store"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert (r.returncode, code) == (KEY_CASES[case], KEY_CASES[case]), (r.stderr, err)
    if KEY_CASES[case]:
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("bootstrap: error: "), r.stderr


# --- signals, SIGKILL and every exit path: nothing half-installed, no work folder left in TMPDIR ---------------
def _start(bundle: Path, pub: Path, prefix: Path, tmpdir: Path, stage: str, *extra: str) -> subprocess.Popen:
    tmpdir.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHON": system_python(), "TMPDIR": str(tmpdir), "BUNDLE_PAUSE_AT": f"{stage}:600"}
    return subprocess.Popen(["sh", str(bundle / "bootstrap"), "--trust", str(pub), "--prefix", str(prefix), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_paused(proc: subprocess.Popen, stage: str) -> None:
    seen = []
    for line in proc.stderr:
        if line.strip() == f"bootstrap: paused at {stage}":
            return
        seen.append(line)
    raise AssertionError(f"the bootstrap exited ({proc.wait()}) before pausing at {stage}: {''.join(seen)}")


def _in_group(pgid: int, command: str) -> int:
    """The pid of the process `command` in process group `pgid` (read from /proc), waiting for its exec: the
    bootstrap announces a pause once the child is forked, which may still be a shell for a moment."""
    deadline = time.monotonic() + 120  # a bound for a broken bootstrap, not a timing assumption
    while time.monotonic() < deadline:
        for stat_file in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat_file.read_text()
            except OSError:
                continue
            comm, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
            if comm == command and int(rest[2]) == pgid:
                return int(stat_file.parent.name)
        time.sleep(0.05)
    raise AssertionError(f"no {command} in process group {pgid}")


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _signalled(proc: subprocess.Popen, sig: int, *, group: bool) -> tuple[str, str]:
    try:
        (os.killpg if group else os.kill)(proc.pid, sig)
        out, err = proc.communicate(timeout=300)
        if sig != signal.SIGKILL:  # a trapped signal: the bootstrap stopped and reaped its child itself
            assert _group_gone(proc.pid), "the bootstrap left a child process running"
        return out, err
    finally:
        if not _group_gone(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _runtime_dirs(prefix: Path) -> list[str]:
    return sorted(p.name for p in prefix.iterdir() if p.name.startswith("runtime-")) if prefix.exists() else []


@pytest.mark.parametrize("stage, sig, group", [
    ("venv", signal.SIGINT, True),    # Ctrl-C: the whole foreground process group
    ("pip", signal.SIGTERM, False),   # `kill PID`: the shell alone, while pip's work lies in the new venv
])
def test_a_signal_stops_the_bootstrap_with_nothing_installed(stage, sig, group, runtime_bundle, tmp_path):
    prefix, tmpdir = tmp_path / "opt", tmp_path / "tmp"
    proc = _start(runtime_bundle.dir, runtime_bundle.pub, prefix, tmpdir, stage)
    _wait_paused(proc, stage)
    assert _runtime_dirs(prefix), "the new runtime should be on disk at this point"
    # every child (pip, venv, this pause) keeps its temporary files inside the work folder
    (work,) = tmpdir.iterdir()
    environ = Path(f"/proc/{_in_group(proc.pid, 'sleep')}/environ").read_bytes().split(b"\0")
    assert f"TMPDIR={work}/tmp".encode() in environ
    out, err = _signalled(proc, sig, group=group)
    assert proc.returncode == 128 + sig, (out, err)
    assert f"stopped by {signal.Signals(sig).name}" in err and "installed" not in out
    assert _runtime_dirs(prefix) == [] and not os.path.lexists(prefix / "current")
    assert list(tmpdir.iterdir()) == []


def test_a_signal_during_an_upgrade_keeps_the_installed_runtime_current(runtime_bundle, bundle_copy, tmp_path):
    prefix, tmpdir = tmp_path / "opt", tmp_path / "tmp"
    assert run_bootstrap(runtime_bundle.dir, runtime_bundle.pub, prefix,
                         env={**os.environ, "PYTHON": system_python()}).returncode == 0
    before = (_runtime_dirs(prefix), os.readlink(prefix / "current"))
    _with_runtime_version(bundle_copy, runtime_bundle.key, "99.0")
    proc = _start(bundle_copy, runtime_bundle.pub, prefix, tmpdir, "pip")
    _wait_paused(proc, "pip")
    out, err = _signalled(proc, signal.SIGTERM, group=False)
    assert proc.returncode == 143, err
    assert (_runtime_dirs(prefix), os.readlink(prefix / "current")) == before
    assert subprocess.run([str(prefix / "bin" / "bundle"), "--version"], capture_output=True).returncode == 0
    assert list(tmpdir.iterdir()) == []


def test_work_folder_is_removed_on_every_exit_path_and_after_sigkill_by_the_next_run(runtime_bundle, tmp_path):
    prefix, tmpdir = tmp_path / "opt", tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "PYTHON": system_python(), "TMPDIR": str(tmpdir)}
    generate_key(tmp_path / "stranger.key")
    assert run_bootstrap(runtime_bundle.dir, tmp_path / "stranger.key.pub", prefix, env=env).returncode == 4
    assert list(tmpdir.iterdir()) == []  # a refusal
    assert run_bootstrap(runtime_bundle.dir, runtime_bundle.pub, prefix, "--verify-only", env=env).returncode == 0
    assert list(tmpdir.iterdir()) == []  # success
    # SIGKILL cannot be trapped: the work folder stays, and the next run removes it (its process is gone) ...
    proc = _start(runtime_bundle.dir, runtime_bundle.pub, prefix, tmpdir, "verified", "--verify-only")
    _wait_paused(proc, "verified")
    _signalled(proc, signal.SIGKILL, group=True)
    (left,) = tmpdir.iterdir()
    assert left.name.startswith("bundle-bootstrap-") and (left / "wheels").is_dir()
    # ... but never the folder of a run that is still alive
    alive = tmpdir / "bundle-bootstrap-alive"
    alive.mkdir()
    (alive / ".owner-pid").write_text(f"{os.getpid()}\n")
    assert run_bootstrap(runtime_bundle.dir, runtime_bundle.pub, prefix, "--verify-only", env=env).returncode == 0
    assert [p.name for p in tmpdir.iterdir()] == ["bundle-bootstrap-alive"]


# --- anti-rollback for the runtime, as the store does for models ------------------------------------------------
def _with_runtime_version(bundle: Path, key: Path, version: str) -> None:
    """Validly signed, the same wheels, but the runtime section names another version."""
    data, d = _manifest(bundle)
    d["runtime"]["version"] = version
    resign(bundle, _canonical(d), [load_private_key(key)])


def test_an_older_runtime_is_refused_unless_allow_downgrade(runtime_bundle, bundle_copy, tmp_path):
    from bundler.pack.wheelhouse import floor_version
    prefix = tmp_path / "opt"
    env = {**os.environ, "PYTHON": system_python()}
    assert run_bootstrap(runtime_bundle.dir, runtime_bundle.pub, prefix, env=env).returncode == 0
    current = os.readlink(prefix / "current")
    _with_runtime_version(bundle_copy, runtime_bundle.key, "0.0.9")
    r = run_bootstrap(bundle_copy, runtime_bundle.pub, prefix, env=env)
    assert r.returncode == 5, r.stderr
    assert r.stderr.strip() == (f"bootstrap: error: runtime bundle-runtime 0.0.9 is older than {floor_version()} "
                                f"installed in {prefix}: expected {floor_version()} or newer (pass "
                                f"--allow-downgrade to install it anyway)")
    assert os.readlink(prefix / "current") == current and not list(prefix.glob("runtime-0.0.9-*"))
    assert run_bootstrap(bundle_copy, runtime_bundle.pub, prefix, "--verify-only", env=env).returncode == 0
    r = run_bootstrap(bundle_copy, runtime_bundle.pub, prefix, "--allow-downgrade", env=env)
    assert r.returncode == 0, r.stderr
    assert "installing it (--allow-downgrade)" in r.stderr
    assert os.readlink(prefix / "current").startswith("runtime-0.0.9-")
    # the newest ever installed still counts: the same older version again needs the flag again
    assert run_bootstrap(bundle_copy, runtime_bundle.pub, prefix, env=env).returncode == 5
    assert run_bootstrap(runtime_bundle.dir, runtime_bundle.pub, prefix, env=env).returncode == 0
    assert os.readlink(prefix / "current") == current


@pytest.mark.parametrize("older, newer", [("0.1.0", "0.1.1"), ("0.9", "0.10"), ("1.0rc1", "1.0"), ("1.0.dev1", "1.0a1"),
                                          ("1.0", "1.0.post1"), ("1.0a2", "1.0b1"), ("2", "2.0.1")])
def test_the_bootstrap_orders_versions_as_pep_440_does(older, newer, tmp_path):
    """The bootstrap's version order (it cannot import packaging) against packaging's, on the cases that matter."""
    from packaging.version import Version
    assert Version(older) < Version(newer)
    source = (REPO / "bundler" / "pack" / "bootstrap.sh").read_text()
    helper = source.split("cat > \"$HELPER\" <<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    (tmp_path / "helper.py").write_text(helper)
    for installed, candidate, refused in ((newer, older, True), (older, newer, False), (older, older, False)):
        runtime = tmp_path / f"opt-{installed}" / "runtime-x"
        runtime.mkdir(parents=True, exist_ok=True)
        (runtime / ".bootstrap-complete").write_text(f"bundle-runtime {installed} linux_x86_64-cp311 abc\n")
        r = subprocess.run([sys.executable, "-I", str(tmp_path / "helper.py"), "downgrade", str(runtime.parent),
                            "bundle-runtime", candidate], capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.strip() == (f"older {installed}" if refused else ""), (r, installed)


def _fake_platform(root: Path, init: str = '__version__ = "10.13.3.9"\n') -> Path:
    """A system python's dist-packages as JetPack's python3-libnvinfer leaves it, beside another system
    package (`othersys`) that must stay out of the runtime."""
    dist = root / "dist-packages"
    for package, text in (("tensorrt", init), ("tensorrt_lean", ""), ("othersys", "")):
        (dist / package).mkdir(parents=True, exist_ok=True)
        (dist / package / "__init__.py").write_text(text)
    meta = dist / "tensorrt-10.13.3.9.dist-info"
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorrt\nVersion: 10.13.3.9\n")
    return dist


def _system_with(dist: Path, root: Path) -> Path:
    """A python whose own path holds `dist` (a venv of the system python with a .pth), standing in for
    the device's /usr/bin/python3 with /usr/lib/python3/dist-packages."""
    subprocess.run([system_python(), "-m", "venv", "--without-pip", str(root)], check=True)
    next(root.glob("lib/python3*/site-packages")).joinpath("platform.pth").write_text(f"{dist}\n")
    return root / "bin" / "python"


def _imports(python: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True)


@pytest.mark.slow
def test_the_platform_tensorrt_alone_reaches_the_runtime(runtime_bundle, tmp_path):
    """JetPack's TensorRT bindings become importable in the isolated runtime venv; no other system package does;
    the next run follows what the platform has (opted out, or bindings that do not import)."""
    dist = _fake_platform(tmp_path)
    python = _system_with(dist, tmp_path / "system")
    prefix = tmp_path / "opt"
    r = run_bootstrap(runtime_bundle.dir, runtime_bundle.pub, prefix, "--python", str(python))
    assert r.returncode == 0, r.stderr
    source = os.path.realpath(dist)
    assert f"bootstrap: platform TensorRT 10.13.3.9 from {source} is importable in the runtime" in r.stdout
    runtime = prefix / "current" / "bin" / "python"
    seen = _imports(runtime, "import importlib.metadata as m, tensorrt, tensorrt_lean; "
                             "print(tensorrt.__version__, m.version('tensorrt'))")
    assert seen.returncode == 0 and seen.stdout.split() == ["10.13.3.9", "10.13.3.9"], seen.stderr
    other = _imports(runtime, "import othersys")
    assert other.returncode == 1 and "No module named 'othersys'" in other.stderr
    assert (prefix / "current" / ".platform-tensorrt").read_text().split() == ["tensorrt", "10.13.3.9", source]

    off = run_bootstrap(runtime_bundle.dir, runtime_bundle.pub, prefix, "--python", str(python),
                        "--no-platform-tensorrt")
    assert off.returncode == 0 and "platform TensorRT not linked (--no-platform-tensorrt)" in off.stdout
    assert _imports(runtime, "import tensorrt").returncode == 1
    assert not (prefix / "current" / ".platform-tensorrt").exists()

    _fake_platform(tmp_path, init="raise ImportError('libnvinfer.so.10: cannot open shared object file')\n")
    broken = run_bootstrap(runtime_bundle.dir, runtime_bundle.pub, prefix, "--python", str(python))
    assert broken.returncode == 0, broken.stderr
    assert "does not import in the runtime (ImportError: libnvinfer.so.10" in broken.stderr
    assert "TensorRT targets serve with ONNX Runtime" in broken.stderr
    assert _imports(runtime, "import tensorrt_lean").returncode == 1  # none of the links stay


@pytest.mark.slow
def test_a_device_without_platform_tensorrt_says_so(runtime_bundle, tmp_path):
    r = run_bootstrap(runtime_bundle.dir, runtime_bundle.pub, tmp_path / "opt", env={**os.environ,
                      "PYTHON": system_python()})
    assert r.returncode == 0, r.stderr
    assert "bootstrap: no platform TensorRT for Python 3." in r.stdout
    assert _imports(tmp_path / "opt" / "current" / "bin" / "python", "import tensorrt").returncode == 1


def _fake_onnxruntime_gpu(folder: Path) -> Path:
    """An onnxruntime-gpu wheel for this host whose `onnxruntime` says it is the GPU build (the real one is
    255 MB); it shares the package with the CPU onnxruntime the runtime requires, as the real one does."""
    import base64
    import hashlib
    import zipfile

    from bundler.pack.wheelhouse import host_platform

    tag = host_platform().split("-")[1]
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"onnxruntime_gpu-1.31.1-{tag}-{tag}-manylinux_2_28_{host_platform().split('-')[0][6:]}.whl"
    info = "onnxruntime_gpu-1.31.1.dist-info"
    files = {"onnxruntime/__init__.py": b'__version__ = "1.31.1"\nBUILD = "gpu"\n',
             f"{info}/METADATA": b"Metadata-Version: 2.1\nName: onnxruntime-gpu\nVersion: 1.31.1\n",
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}-{tag}-"
                              f"manylinux_2_28_{host_platform().split('-')[0][6:]}\n".encode()}
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},"
                     f"{len(d)}\n" for n, d in files.items()) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{info}/RECORD", record)
    return wheel


def _gpu_bundle(root: Path) -> dict:
    from bundler.pack.create import CreateOptions, create_bundle, local_model
    from bundler.pack.engines import target_files_hook
    from bundler.pack.wheelhouse import host_platform
    from tests.models import make_tiny_checkpoint

    wheels = root / "extra"
    _fake_onnxruntime_gpu(wheels)
    target = make_tiny_checkpoint(root / "target", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                  intermediate_size=64, max_positions=128, seed=0)
    generate_key(root / "release.key")
    create_bundle(root / "bundle", CreateOptions(name="tiny", version=1, model=local_model(target, "target"),
                  targets=["cpu"], sign_keys=[load_private_key(root / "release.key")],
                  target_files=target_files_hook(), progress=False, runtime_platforms=[host_platform()],
                  extra_wheels=wheels))
    return {"bundle": root / "bundle", "pub": root / "release.key.pub"}


@pytest.mark.slow
def test_a_carried_onnxruntime_gpu_is_the_onnxruntime_the_runtime_imports(tmp_path_factory, tmp_path):
    from tests.conftest import once_per_run

    made = once_per_run(tmp_path_factory, "bootstrap-onnxruntime-gpu", _gpu_bundle)
    r = run_bootstrap(made["bundle"], made["pub"], tmp_path / "opt", env={**os.environ, "PYTHON": system_python()})
    assert r.returncode == 0, r.stderr
    assert "bootstrap: onnxruntime_gpu-1.31.1-" in r.stdout and "installed over the CPU onnxruntime" in r.stdout
    seen = _imports(tmp_path / "opt" / "current" / "bin" / "python", "import onnxruntime; print(onnxruntime.BUILD)")
    assert seen.returncode == 0 and seen.stdout.strip() == "gpu", seen.stderr
