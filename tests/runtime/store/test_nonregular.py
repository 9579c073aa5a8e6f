"""Non-regular files in a bundle: FIFOs, symlinks, devices, hard links; bounded reads; copy never
reads through a link nor writes outside DST. FIFO cases run the CLI in a child with a deadline,
because on the old code they hang for ever (holding the store lock, for install)."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat

import pytest

from bundler.cli import main
from manifests import layout as L
from manifests.errors import BadBundleError, UsageError
from manifests.limits import LIMITS
from runtime.store.copy import copy_bundle
from runtime.store.reader import open_bundle
from runtime.store.store import Store
from runtime.store.verify import CorruptBundleError, verify_bundle
from tests.runtime.store.craft import edit_index, edit_oci_manifest, tree_digests
from tests.runtime.store.helpers import assert_serving_ready, run_cli


def part_blob(bundle, path: str = "models/target/model.safetensors", index: int = 1):
    m = open_bundle(bundle).unverified_manifest()
    entry = next(f for f in m.files if f.path == path)
    return bundle / L.blob_path(entry.parts[index - 1].digest)


def to_fifo(path):
    path.unlink()
    os.mkfifo(path)


def fifo_cases(b):
    layout = open_bundle(b)
    return {"index.json": b / L.INDEX_FILE,
            "envelope": b / L.blob_path(layout.envelope.digest),
            "part": part_blob(b)}


@pytest.mark.parametrize("where", ["index.json", "envelope", "part"])
def test_fifo_does_not_hang_verify_or_install(bundle_copy, bundles, keys, tmp_path, where):
    b = bundle_copy("v1")
    fifo = fifo_cases(b)[where]
    to_fifo(fifo)
    r = run_cli(["verify", b, "--trust", keys.release_pub, "--no-progress"])
    assert r.returncode == BadBundleError.exit_code, r.stderr
    assert "FIFO" in r.stderr and fifo.name in r.stderr and "Traceback" not in r.stderr, r.stderr
    store = tmp_path / "store"
    r = run_cli(["install", b, "--store", store, "--target", "jetson-thor", "--force-target", "--trust",
                 keys.release_pub, "--no-progress"])
    assert r.returncode == BadBundleError.exit_code, r.stderr
    assert "FIFO" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # The store lock was released and nothing half-installed: a good bundle installs next.
    r = run_cli(["install", bundles["v1"], "--store", store, "--target", "jetson-thor", "--force-target", "--trust",
                 keys.release_pub, "--no-progress"])
    assert r.returncode == 0, r.stderr
    assert_serving_ready(Store(store), version=1)


def test_fifo_in_src_does_not_hang_copy(bundle_copy, tmp_path):
    b = bundle_copy("v1")
    to_fifo(part_blob(b))
    r = run_cli(["copy", b, tmp_path / "dst", "--no-progress"])
    assert r.returncode == BadBundleError.exit_code and "FIFO" in r.stderr, r.stderr
    assert not (tmp_path / "dst" / L.COMPLETE_MARKER).exists()


def test_symlinked_part_blob_is_not_followed_even_with_the_right_bytes(bundle_copy, trusted, tmp_path):
    b = bundle_copy("v1")
    blob = part_blob(b)
    outside = tmp_path / "elsewhere"
    shutil.move(blob, outside)
    blob.symlink_to(outside)
    with pytest.raises(CorruptBundleError) as e:
        verify_bundle(b, trusted)
    assert "not a regular file" in str(e.value) and "symbolic link" in str(e.value)


@pytest.mark.parametrize("link", ["index.json", "oci-layout", "blobs", "blobs/sha256"])
def test_symlinked_pointer_or_blob_dir_is_refused(bundle_copy, trusted, tmp_path, link):
    """A link to a perfect copy is still refused: no bundle file is ever reached through a link."""
    b = bundle_copy("v1")
    real = b / link
    moved = tmp_path / "moved"
    shutil.move(real, moved)
    real.symlink_to(moved)
    with pytest.raises(BadBundleError, match="symbolic link"):
        verify_bundle(b, trusted)


def test_device_node_as_blob_is_not_opened(bundle_copy, trusted):
    if os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root (CI runs as root)")
    b = bundle_copy("v1")
    blob = part_blob(b)
    blob.unlink()
    os.mknod(blob, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero: endless bytes if ever read
    with pytest.raises(CorruptBundleError, match="character device"):
        verify_bundle(b, trusted)


def test_hard_link_to_outside_bytes_is_corrupt_without_revealing_them(bundle_copy, trusted, tmp_path):
    """A hard link is a regular file: its bytes are checked like any blob's, and the message names
    the expected digest only, never the hash of what the link holds."""
    b = bundle_copy("v1")
    blob = part_blob(b)
    good = tmp_path / "good"
    shutil.copyfile(blob, good)
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(blob.stat().st_size))
    blob.unlink()
    os.link(secret, blob)
    with pytest.raises(CorruptBundleError) as e:
        verify_bundle(b, trusted)
    h = hashlib.sha256(secret.read_bytes()).hexdigest()
    assert "corrupt" in str(e.value) and h[:8] not in str(e.value)
    # A hard link to the right bytes (what `cp -al` makes) is a good blob.
    blob.unlink()
    os.link(good, blob)
    verify_bundle(b, trusted)


@pytest.mark.parametrize("what,limit", [("oci-layout", LIMITS.oci_layout_bytes), ("index.json", LIMITS.oci_index_bytes)])
def test_pointer_files_are_read_bounded(bundle_copy, trusted, what, limit):
    b = bundle_copy("v1")
    with open(b / what, "wb") as f:
        f.truncate(3 * 1024**3)  # 3 GiB sparse: reading it whole would take 3 GB of memory
    with pytest.raises(BadBundleError, match=f"larger than {limit} bytes"):
        verify_bundle(b, trusted)


@pytest.mark.parametrize("where,limit", [("oci-manifest", LIMITS.oci_manifest_bytes), ("config", LIMITS.manifest_bytes),
                                         ("envelope", LIMITS.envelope_bytes)])
def test_huge_declared_sizes_are_refused_before_reading(bundle_copy, trusted, where, limit):
    b = bundle_copy("v1")
    if where == "oci-manifest":
        edit_index(b, lambda i: i["manifests"][0].update(size=10**15))
    else:
        def grow(oci):
            desc = oci["config"] if where == "config" else next(
                d for d in oci["layers"] if d["mediaType"] == L.SIGNATURE_MEDIA_TYPE)
            desc["size"] = 10**15
        edit_oci_manifest(b, grow)
    with pytest.raises(BadBundleError, match=f"declared size {10**15} bytes, expected at most {limit}"):
        verify_bundle(b, trusted)


# --- bundle copy ------------------------------------------------------------------------------

def test_copy_writes_the_oci_layout_constant_not_src_bytes(bundle_copy, tmp_path):
    b = bundle_copy("v1")
    (b / L.OCI_LAYOUT_FILE).write_bytes(b'{ "imageLayoutVersion" : "1.0.0" , "x-extra": "' + b"A" * 3000 + b'" }')
    copy_bundle(b, tmp_path / "dst", progress=False)
    assert (tmp_path / "dst" / L.OCI_LAYOUT_FILE).read_bytes() == L.OCI_LAYOUT_CONTENT


def test_copy_does_not_follow_a_symlinked_src_oci_layout(bundle_copy, tmp_path):
    b = bundle_copy("v1")
    secret = tmp_path / "secret"
    secret.write_bytes(b"TOP-SECRET " * 100)
    (b / L.OCI_LAYOUT_FILE).unlink()
    (b / L.OCI_LAYOUT_FILE).symlink_to(secret)
    assert main(["copy", str(b), str(tmp_path / "dst"), "--no-progress"]) == BadBundleError.exit_code
    for p in (tmp_path / "dst").rglob("*"):
        assert not p.is_file() or b"TOP-SECRET" not in p.read_bytes(), p


@pytest.mark.parametrize("link", ["blobs", "blobs/sha256"])
def test_copy_never_writes_outside_dst(bundles, tmp_path, capsys, link):
    dst = tmp_path / "dst"
    outside = tmp_path / "outside"
    (outside / "sha256").mkdir(parents=True)
    (outside / ".tmp-keep").write_bytes(b"not ours")
    (outside / "sha256" / ".tmp-keep").write_bytes(b"not ours")
    before = tree_digests(outside)
    (dst / "blobs").mkdir(parents=True) if link == "blobs/sha256" else dst.mkdir()
    (dst / link).symlink_to(outside if link == "blobs" else outside / "sha256")
    assert main(["copy", str(bundles["v1"]), str(dst), "--no-progress"]) == UsageError.exit_code
    assert "symbolic link" in capsys.readouterr().err
    assert tree_digests(outside) == before
    assert not (dst / L.COMPLETE_MARKER).exists()


def test_copy_replaces_a_symlinked_blob_at_dst_without_writing_through_it(bundles, tmp_path, trusted):
    dst = tmp_path / "dst"
    copy_bundle(bundles["v1"], dst, progress=False)
    blob = part_blob(dst)
    (dst / L.COMPLETE_MARKER).unlink()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    blob.unlink()
    blob.symlink_to(victim)
    r = copy_bundle(bundles["v1"], dst, progress=False)
    assert r.blobs_copied == 1 and victim.read_bytes() == b"keep me"
    assert not blob.is_symlink()
    verify_bundle(dst, trusted)


def test_copy_does_not_copy_a_symlinked_src_blob(bundle_copy, tmp_path):
    b = bundle_copy("v1")
    blob = part_blob(b)
    moved = tmp_path / "moved"
    shutil.move(blob, moved)
    blob.symlink_to(moved)
    with pytest.raises(BadBundleError, match="symbolic link"):
        copy_bundle(b, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst" / L.COMPLETE_MARKER).exists()
    assert not (tmp_path / "dst" / L.BLOBS_DIR / blob.name).exists()


def test_inspect_does_not_hang_on_a_fifo(bundle_copy):
    b = bundle_copy("v1")
    to_fifo(b / L.INDEX_FILE)
    r = run_cli(["inspect", b])
    assert r.returncode == BadBundleError.exit_code and "FIFO" in r.stderr, r.stderr


def test_oci_layout_version_is_checked(bundle_copy, trusted):
    b = bundle_copy("v1")
    (b / L.OCI_LAYOUT_FILE).write_bytes(b'{"imageLayoutVersion":"2.0.0"}')
    with pytest.raises(BadBundleError, match="expected imageLayoutVersion '1.0.0', found '2.0.0'"):
        verify_bundle(b, trusted)


def test_trust_key_reached_through_a_link_is_fine(bundles, keys, tmp_path):
    """The trust directory is the administrator's, not the bundle's: links there are followed."""
    from runtime.store.trust import trusted_keys
    d = tmp_path / "trust.d"
    d.mkdir()
    (d / "release.pub").symlink_to(keys.release_pub)
    assert list(trusted_keys([], trust_dir=d)) == [keys.release_id]
