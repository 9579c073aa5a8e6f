"""Two wheels from one tree: bundle-runtime (the floor: runtime/ + manifests/, the `bundle` command) and
bundle (the build host: bundler/ + the demo pair, adding keygen/create/build-engines through entry points)."""

from __future__ import annotations

import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _toml(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def test_versions_agree_and_the_full_package_pins_the_floor():
    full, floor = _toml(ROOT / "pyproject.toml")["project"], _toml(ROOT / "floor" / "pyproject.toml")["project"]
    assert full["version"] == floor["version"]
    assert f"bundle-runtime=={floor['version']}" in full["dependencies"]
    assert "scripts" not in full, "the `bundle` command belongs to the floor distribution"
    assert floor["scripts"] == {"bundle": "runtime.cli.main:main"}
    assert set(full["entry-points"]["bundle.commands"]) == {"keygen", "create", "build-engines"}


def test_floor_dependencies_have_no_build_host_package():
    deps = {d.split(">")[0].split("=")[0].split("<")[0].strip().lower()
            for d in _toml(ROOT / "floor" / "pyproject.toml")["project"]["dependencies"]}
    assert not deps & {"torch", "transformers", "huggingface_hub", "huggingface-hub", "onnx", "safetensors"}
    assert {"onnxruntime", "tokenizers", "zstandard", "cryptography", "fastapi", "uvicorn"} <= deps


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([str(ROOT / "scripts" / "build-wheels"), str(out)], check=True, capture_output=True,
                   env={"PATH": "/usr/bin:/bin", "PYTHON": str(ROOT / ".venv" / "bin" / "python")}, timeout=600)
    return out


def test_floor_wheel_holds_runtime_and_manifests_only(wheels):
    (floor,) = wheels.glob("bundle_runtime-*.whl")
    names = zipfile.ZipFile(floor).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"runtime", "manifests", floor.name.split("-py3")[0] + ".dist-info"}, tops
    assert "manifests/profiles/jetson-thor.json" in names  # package data travels
    assert not [n for n in names if n.endswith((".safetensors", ".onnx"))]
    assert floor.stat().st_size < 1024 * 1024, "the floor wheel carries no demo weights"
    entry_points = zipfile.ZipFile(floor).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "bundle = runtime.cli.main:main" in entry_points


def test_full_wheel_holds_bundler_and_adds_the_build_host_commands(wheels):
    (full,) = wheels.glob("bundle-0*.whl")
    z = zipfile.ZipFile(full)
    tops = {n.split("/")[0] for n in z.namelist()}
    assert "bundler" in tops and "runtime" not in tops and "manifests" not in tops
    assert "bundler/pack/bootstrap.sh" in z.namelist()
    entry_points = z.read(next(n for n in z.namelist() if n.endswith("entry_points.txt"))).decode()
    assert "[bundle.commands]" in entry_points and "console_scripts" not in entry_points
    metadata = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: bundle-runtime==" in metadata


def test_floor_wheel_is_reproducible(wheels, tmp_path):
    from bundler.pack.wheelhouse import build_floor_wheel

    (first,) = wheels.glob("bundle_runtime-*.whl")
    again = build_floor_wheel(tmp_path)
    assert again.read_bytes() == first.read_bytes()
