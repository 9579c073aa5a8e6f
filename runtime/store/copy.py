"""`bundle copy SRC DST`: the safe way onto (or off) a USB stick.

Unsynced writes to removable media are the usual cause of corrupt transfers, so each blob is
hashed while it is copied, written under a temp name, fsynced, renamed into place, and the
directory fsynced. Blobs already complete at DST (right size and digest) are skipped, so an
interrupted copy resumes and only bad or missing blobs are copied again. The COMPLETE marker is
removed from DST first and written last: a half-copied bundle never looks finished. SRC is only read,
never through a link (runtime.bundle_files); DST's blob directory is reached without following links
and written through its fd, so nothing (no blob, no deletion of a `.tmp-*`) lands outside DST.
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from manifests import layout as L
from manifests.errors import EnvironmentProblem, UsageError
from runtime import settings
from runtime.bundle_files import NotRegularFile, open_dir
from runtime.fsutil import fsync_dir, write_atomic
from runtime.store.hooks import pause
from runtime.store.reader import CHUNK, BlobReader, open_bundle, part_names
from runtime.store.validate import check_bundle
from runtime.store.verify import check_blob

_ours = {L.OCI_LAYOUT_FILE, L.INDEX_FILE, L.COMPLETE_MARKER, L.BOOTSTRAP_FILE, "blobs"}


@dataclass(frozen=True)
class CopyReport:
    src: Path
    dst: Path
    blobs_copied: int
    blobs_skipped: int
    bytes_copied: int
    bytes_skipped: int


def _copy_blob(layout_root: Path, blobs_fd: int, digest: str, size: int, name: str, on_bytes) -> None:
    """Copy one blob through a temp file in DST's blob directory (an fd: nothing is written through a
    link), hashing as it goes; the digest must match before the rename."""
    hexd = digest[7:]
    tmp = f".tmp-{hexd[:16]}-{secrets.token_hex(6)}"
    out_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=blobs_fd)
    try:
        with BlobReader(layout_root, digest, size, name) as reader, os.fdopen(out_fd, "wb") as out:
            while True:
                chunk = reader.read(CHUNK)
                if not chunk:
                    break
                out.write(chunk)
                on_bytes(len(chunk))
            reader.finish()  # BadBundleError if SRC's blob is corrupt: never land a bad blob at DST
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, hexd, src_dir_fd=blobs_fd, dst_dir_fd=blobs_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=blobs_fd)
        except FileNotFoundError:
            pass
        raise


def _prepare_dst(src: Path, dst: Path) -> int:
    """Make DST ready and return an fd of DST/blobs/sha256, reached without following any link."""
    if dst.exists() and not dst.is_dir():
        raise UsageError(f"expected DST {dst} to be a directory, found a file")
    if dst.exists() and dst.resolve() == src.resolve():
        raise UsageError(f"expected DST to differ from SRC, found both at {src}")
    dst.mkdir(parents=True, exist_ok=True)
    foreign = sorted(p.name for p in dst.iterdir() if p.name not in _ours and not p.name.startswith("."))
    if foreign:
        raise UsageError(f"expected DST {dst} to be empty or a bundle, found other files: {', '.join(foreign[:5])}")
    try:
        blobs_fd = open_dir(dst, L.BLOBS_DIR, create=True)
    except NotRegularFile as e:  # a symlinked DST/blobs would send every blob (and our deletions) elsewhere
        raise UsageError(f"refusing to copy into {dst}: {e}") from None
    try:
        # From here on DST is "not finished" until the very last step.
        marker = dst / L.COMPLETE_MARKER
        if os.path.lexists(marker):
            marker.unlink()
            fsync_dir(dst)
        for name in os.listdir(blobs_fd):  # leftovers of an interrupted copy, inside DST only
            if name.startswith(".tmp-"):
                try:
                    os.unlink(name, dir_fd=blobs_fd)
                except (FileNotFoundError, IsADirectoryError, PermissionError):
                    pass
    except BaseException:
        os.close(blobs_fd)
        raise
    return blobs_fd


def write_top_level_bootstrap(dst: Path, blobs_fd: int, manifest) -> None:
    """DST/bootstrap (what `sh DST/bootstrap` runs) from DST's own digest-checked blob, as `bundle create`
    writes it, never taken from whatever a source has at its top; removed when the bundle carries none
    (left by an earlier version in DST). Shared by copy and pull, so each leaves the files create does."""
    rt = manifest.runtime
    entry = next((f for f in manifest.files if rt is not None and f.path == rt.bootstrap), None)
    if entry is None:
        (dst / L.BOOTSTRAP_FILE).unlink(missing_ok=True)
        return
    fd = os.open(entry.parts[0].hex, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=blobs_fd)
    with os.fdopen(fd, "rb") as f:
        write_atomic(dst / L.BOOTSTRAP_FILE, f.read(entry.size), mode=0o755)


def copy_bundle(src: Path, dst: Path, *, jobs: int | None = None, progress: bool = True) -> CopyReport:
    """Copy bundle SRC to DST (resumable, verified blob by blob); needs no key: digests, not trust."""
    src, dst = Path(src), Path(dst)
    layout = open_bundle(src)  # refuses an incomplete SRC
    manifest = layout.unverified_manifest()  # for sizes and names; the signature is `verify`'s job
    check_bundle(layout, manifest)  # the rules verify and install apply: DST gets a valid bundle or nothing
    names = {d: ", ".join(n) for d, n in part_names(manifest).items()}
    blobs: dict[str, int] = {layout.oci_manifest.digest: layout.oci_manifest.size,
                             layout.config.digest: layout.config.size}
    for d in layout.layers:
        blobs[d.digest] = d.size
    named = {layout.oci_manifest.digest: "OCI manifest", layout.config.digest: "bundle manifest"}
    if layout.envelope is not None:
        named[layout.envelope.digest] = "signature envelope"
    blobs_fd = None
    try:
        blobs_fd = _prepare_dst(src, dst)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=sum(blobs.values()), unit="B", unit_scale=True, unit_divisor=1024,
                       desc=f"copy {manifest.name} v{manifest.version}", dynamic_ncols=True)
        lock = threading.Lock()

        def on_bytes(n: int) -> None:
            if bar is not None:
                with lock:
                    bar.update(n)

        def one(item) -> bool:
            """Copy one blob unless DST already holds it complete; True if copied."""
            digest, size = item
            if check_blob(blobs_fd, digest, size) is None:
                on_bytes(size)
                return False
            name = names.get(digest) or named.get(digest, "blob")
            _copy_blob(layout.path, blobs_fd, digest, size, name, on_bytes)
            pause("copying")
            return True

        order = sorted(blobs.items(), key=lambda kv: -kv[1])
        try:
            with ThreadPoolExecutor(max_workers=jobs or settings.jobs()) as pool:
                copied = list(pool.map(one, order))
        finally:
            if bar is not None:
                bar.close()
        fsync_dir(dst / L.BLOBS_DIR)
        # oci-layout is the spec's constant, never SRC's bytes (which could be a link to anything).
        write_atomic(dst / L.OCI_LAYOUT_FILE, L.OCI_LAYOUT_CONTENT)
        write_atomic(dst / L.INDEX_FILE, layout.index_bytes)  # read bounded, validated above
        write_top_level_bootstrap(dst, blobs_fd, manifest)
        fsync_dir(dst)
        write_atomic(dst / L.COMPLETE_MARKER, (layout.oci_manifest.digest + "\n").encode())
        fsync_dir(dst)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise EnvironmentProblem(f"no space left on {dst} while copying the bundle; free space and run "
                                     f"the same copy again to resume") from None
        raise EnvironmentProblem(f"cannot copy to {dst}: {e.strerror or e}"
                                 f"{' (' + str(e.filename) + ')' if e.filename else ''}") from None
    finally:
        if blobs_fd is not None:
            os.close(blobs_fd)
    done = [size for (_, size), c in zip(order, copied) if c]
    return CopyReport(src, dst, len(done), len(order) - len(done), sum(done), sum(blobs.values()) - sum(done))
