"""Build small, real, installable wheels (PEP 427) for tests: a module, its dist-info, a RECORD with hashes."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, name: str, version: str, *, tag: str = "py3-none-any",
               module_source: str = "VALUE = 1\n", requires: tuple[str, ...] = ()) -> Path:
    """A wheel of one module `name` (underscored) that pip installs with --no-index. Deterministic bytes."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}/__init__.py": module_source.encode(),
        f"{info}/METADATA": ("Metadata-Version: 2.1\n" f"Name: {name}\n" f"Version: {version}\n"
                             + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode(),
        f"{info}/WHEEL": (f"Wheel-Version: 1.0\nGenerator: tests.wheels\nRoot-Is-Purelib: true\nTag: {tag}\n").encode(),
    }
    record = "".join(f"{p},{_record_hash(d)},{len(d)}\n" for p, d in files.items()) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p, d in files.items():
            zi = zipfile.ZipInfo(p, date_time=(1980, 1, 1, 0, 0, 0))
            zi.external_attr = 0o644 << 16
            z.writestr(zi, d)
    return path
