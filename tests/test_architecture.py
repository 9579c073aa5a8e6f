"""The shape of the house: imports go bundler -> manifests <- runtime, and the floor stays offline."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NETWORK_CLIENTS = {"huggingface_hub", "requests", "httpx", "urllib3", "aiohttp", "oras"}
HEAVY = {"torch", "transformers", "onnx", "tensorrt", "safetensors", "optimum"}


def imported_modules(package: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(ROOT))] = names
    return out


@pytest.mark.parametrize("package,forbidden", [
    ("manifests", {"bundler", "runtime"} | NETWORK_CLIENTS | HEAVY | {"zstandard", "onnxruntime", "fastapi"}),
    ("runtime", {"bundler"} | NETWORK_CLIENTS | (HEAVY - {"tensorrt"})),
])
def test_import_direction(package, forbidden):
    bad = {f: sorted(names & forbidden) for f, names in imported_modules(package).items() if names & forbidden}
    assert not bad, f"{package} must not import {sorted(forbidden)}; found {bad}"


def test_only_settings_reads_the_environment():
    offenders = []
    for package in ("manifests", "runtime", "bundler"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "settings.py" or "demo/train" in str(path):
                continue
            text = path.read_text()
            if "os.environ" in text or "os.getenv" in text:
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"environment read outside runtime/settings.py: {offenders}"
