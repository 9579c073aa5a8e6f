"""`bundle copy SRC DST`: the safe way onto (or off) a USB stick.

Unsynced writes to removable media are the usual cause of corrupt transfers, so each blob is
hashed while it is copied, written under a temp name, fsynced, renamed into place, and the
directory fsynced. Blobs already complete at DST (right size and digest) are skipped, so an
interrupted copy resumes and only bad or missing blobs are copied again. The COMPLETE marker is
removed from DST first and written last: a half-copied bundle never looks finished. SRC is only read.
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
from manifests.errors import BadBundleError, EnvironmentProblem, UsageError
from runtime import settings
from runtime.hooks import pause
from runtime.reader import CHUNK, BlobReader, open_bundle, part_names
from runtime.verify import check_blob
from runtime.fsutil import fsync_dir, write_atomic

_ours = {L.OCI_LAYOUT_FILE, L.INDEX_FILE, L.COMPLETE_MARKER, L.BOOTSTRAP_FILE, "blobs"}


@dataclass(frozen=True)
class CopyReport:
    src: Path
    dst: Path
    blobs_copied: int
    blobs_skipped: int
    bytes_copied: int
    bytes_skipped: int


def _copy_blob(src: Path, dst_blobs: Path, digest: str, size: int, name: str, on_bytes) -> None:
    """Copy one blob through a temp file, hashing as it goes; the digest must match before the rename."""
    hexd = digest.split(":", 1)[1]
    tmp = dst_blobs / f".tmp-{hexd[:16]}-{secrets.token_hex(6)}"
    try:
        with BlobReader(src, digest, size, name) as reader, open(tmp, "wb") as out:
            while True:
                chunk = reader.read(CHUNK)
                if not chunk:
                    break
                out.write(chunk)
                on_bytes(len(chunk))
            reader.finish()  # BadBundleError if SRC's blob is corrupt: never land a bad blob at DST
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dst_blobs / hexd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _prepare_dst(src: Path, dst: Path) -> None:
    if dst.exists() and not dst.is_dir():
        raise UsageError(f"expected DST {dst} to be a directory, found a file")
    if dst.exists() and dst.resolve() == src.resolve():
        raise UsageError(f"expected DST to differ from SRC, found both at {src}")
    dst.mkdir(parents=True, exist_ok=True)
    foreign = sorted(p.name for p in dst.iterdir() if p.name not in _ours and not p.name.startswith("."))
    if foreign:
        raise UsageError(f"expected DST {dst} to be empty or a bundle, found other files: {', '.join(foreign[:5])}")
    # From here on DST is "not finished" until the very last step.
    marker = dst / L.COMPLETE_MARKER
    if marker.exists():
        marker.unlink()
        fsync_dir(dst)
    (dst / L.BLOBS_DIR).mkdir(parents=True, exist_ok=True)
    for p in (dst / L.BLOBS_DIR).glob(".tmp-*"):  # leftovers of an interrupted copy
        p.unlink(missing_ok=True)


def _write_bootstrap(dst: Path, manifest) -> None:
    """DST/bootstrap from DST's own (digest-checked) blob, never copied from whatever SRC has at the top."""
    rt = manifest.runtime
    entry = next((f for f in manifest.files if rt is not None and f.path == rt.bootstrap), None)
    if entry is not None:
        write_atomic(dst / L.BOOTSTRAP_FILE, (dst / L.blob_path(entry.parts[0].digest)).read_bytes()[:entry.size])


def copy_bundle(src: Path, dst: Path, *, jobs: int | None = None, progress: bool = True) -> CopyReport:
    """Copy bundle SRC to DST (resumable, verified blob by blob); needs no key: digests, not trust."""
    src, dst = Path(src), Path(dst)
    layout = open_bundle(src)  # refuses an incomplete SRC
    manifest = layout.unverified_manifest()  # for sizes and names; the signature is `verify`'s job
    names = {d: ", ".join(n) for d, n in part_names(manifest).items()}
    blobs: dict[str, int] = {layout.oci_manifest.digest: layout.oci_manifest.size,
                             layout.config.digest: layout.config.size}
    for d in layout.layers:
        blobs[d.digest] = d.size
    for f in manifest.files:
        for p in f.parts:
            if blobs.setdefault(p.digest, p.size) != p.size:
                raise BadBundleError(f"{names[p.digest]}: OCI manifest says blob {p.digest} has "
                                     f"{blobs[p.digest]} bytes, the bundle manifest says {p.size}")
    named = {layout.oci_manifest.digest: "OCI manifest", layout.config.digest: "bundle manifest"}
    if layout.envelope is not None:
        named[layout.envelope.digest] = "signature envelope"
    try:
        _prepare_dst(src, dst)
        dst_blobs = dst / L.BLOBS_DIR
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
            if check_blob(dst_blobs / digest.split(":", 1)[1], digest, size) is None:
                on_bytes(size)
                return False
            name = names.get(digest) or named.get(digest, "blob")
            _copy_blob(layout.blob_file(digest), dst_blobs, digest, size, name, on_bytes)
            pause("copying")
            return True

        order = sorted(blobs.items(), key=lambda kv: -kv[1])
        try:
            with ThreadPoolExecutor(max_workers=jobs or settings.JOBS) as pool:
                copied = list(pool.map(one, order))
        finally:
            if bar is not None:
                bar.close()
        fsync_dir(dst_blobs)
        write_atomic(dst / L.OCI_LAYOUT_FILE, (src / L.OCI_LAYOUT_FILE).read_bytes()[:4096]
                     if (src / L.OCI_LAYOUT_FILE).is_file() else L.OCI_LAYOUT_CONTENT)
        write_atomic(dst / L.INDEX_FILE, layout.index_bytes)
        _write_bootstrap(dst, manifest)
        fsync_dir(dst)
        write_atomic(dst / L.COMPLETE_MARKER, (layout.oci_manifest.digest + "\n").encode())
        fsync_dir(dst)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise EnvironmentProblem(f"no space left on {dst} while copying the bundle; free space and run "
                                     f"the same copy again to resume") from None
        raise EnvironmentProblem(f"cannot copy to {dst}: {e.strerror or e}"
                                 f"{' (' + str(e.filename) + ')' if e.filename else ''}") from None
    done = [size for (_, size), c in zip(order, copied) if c]
    return CopyReport(src, dst, len(done), len(order) - len(done), sum(done), sum(blobs.values()) - sum(done))
