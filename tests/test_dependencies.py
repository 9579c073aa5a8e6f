"""The two pyproject.toml files declare every third-party module the code imports, with lower bounds the code
needs: floor/pyproject.toml (bundle-runtime) for runtime/ and manifests/, pyproject.toml (bundle, which pins
bundle-runtime, so the floor's dependencies are there too) for bundler/."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"bundler", "runtime", "manifests"}
#: Provided by the device's JetPack / CUDA install, never pip-installed by us (runtime.engines.tensorrt);
#: `nvidia`: the namespace of the nvidia-* CUDA library wheels, looked for (ImportError is fine) by runtime.engines.cudalib.
DEVICE_PROVIDED = {"tensorrt", "cuda", "nvidia"}
#: What the code needs, and why (the bound in pyproject.toml may be higher, never lower).
NEEDS = {
    "transformers": ((4, 56), "from_pretrained(dtype=...) in bundler/onnx/export.py"),
    "huggingface-hub": ((1, 2, 1), "huggingface_hub.constants.is_offline_mode() in bundler/resolve/hub.py"),
}

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")


def _project(floor: bool = False) -> dict:
    return tomllib.loads((ROOT / ("floor/pyproject.toml" if floor else "pyproject.toml")).read_text())["project"]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")


def _lower_bound(req: str) -> tuple[int, ...] | None:
    m = re.search(r">=\s*([0-9][0-9.]*)", req)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def _declared(group: str | None = None, floor: bool = False) -> dict[str, str]:
    project = _project(floor)
    reqs = project["dependencies"] if group is None else project["optional-dependencies"][group]
    return {_name(r): r for r in reqs}


def _floor() -> dict[str, str]:
    return _declared(floor=True)


def _build_host() -> dict[str, str]:
    return {**_floor(), **_declared(), **_declared("build")}


def _imports(package: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module.split(".")[0]]
            for n in names:
                if n not in sys.stdlib_module_names and n not in FIRST_PARTY | DEVICE_PROVIDED:
                    out.setdefault(n, set()).add(str(path.relative_to(ROOT)))
    return out


def _distribution(module: str) -> str:
    dists = importlib.metadata.packages_distributions().get(module)
    assert dists, f"{module} is imported but not installed: declare it in pyproject.toml"
    return dists[0].lower().replace("_", "-")


def test_every_imported_module_is_declared():
    declared = _build_host()
    missing = {m: sorted(files)[:3] for m, files in _imports("bundler").items() if _distribution(m) not in declared}
    assert not missing, f"bundler/ imports modules pyproject.toml does not declare: {missing}"


def test_the_floor_needs_only_the_floor_distribution():
    """bundle-runtime is what a device gets: runtime/ and manifests/ import only what floor/pyproject.toml declares."""
    floor = _floor()
    extra = {m: sorted(files)[:3] for pkg in ("runtime", "manifests") for m, files in _imports(pkg).items()
             if _distribution(m) not in floor}
    assert not extra, f"the floor imports modules bundle-runtime does not declare: {extra}"


def test_lower_bounds_cover_what_the_code_needs():
    from bundler.pack.engines import ONNXRUNTIME_MIN_BATCHED
    from runtime.engines.onnxruntime import BATCHED_MIN_VERSION

    declared = _build_host()
    needs = dict(NEEDS)
    ort = max(tuple(int(x) for x in ONNXRUNTIME_MIN_BATCHED.split(".")), BATCHED_MIN_VERSION)
    needs["onnxruntime"] = (ort, "the default cpu graph (TensorScatter + Attention, opset 24)")
    too_low = {name: f"{declared[name]!r}, needs >= {'.'.join(map(str, v))}: {why}"
               for name, (v, why) in needs.items()
               if _lower_bound(declared[name]) is None or _lower_bound(declared[name]) < v}
    assert not too_low, too_low
