"""The shape of the house: imports go bundler -> manifests <- runtime, and the floor stays offline."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NETWORK_CLIENTS = {"huggingface_hub", "requests", "httpx", "urllib3", "aiohttp", "oras"}
HEAVY = {"torch", "transformers", "onnx", "tensorrt", "safetensors", "optimum"}
PACKAGES = ("manifests", "runtime", "bundler")


def source_files(skip: str | None = None) -> list[Path]:
    """Every module of the three packages (but `skip`, a path relative to the repository), in a stable order."""
    return [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
            if p.relative_to(ROOT).as_posix() != skip]


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
    for path in source_files():
        if path.name == "settings.py" or "demo/train" in str(path):
            continue
        text = path.read_text()
        if "os.environ" in text or "os.getenv" in text:
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"environment read outside runtime/settings.py: {offenders}"


def imported_dotted(path: Path) -> set[str]:
    """Every absolute module a file imports, dotted ("runtime.serve.scheduler"), at any depth of the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def wing_imports(wing: str) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): imported_dotted(p) for p in sorted((ROOT / wing).rglob("*.py"))}


def reaching(names: set[str], prefixes: set[str]) -> list[str]:
    return sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes))


ENGINE_BACKENDS = {"runtime.engines.onnxruntime", "runtime.engines.cuda", "runtime.engines.tensorrt",
                   "runtime.engines.cudalib", "onnxruntime", "tensorrt"}


@pytest.mark.parametrize("wing,forbidden", [
    # the chain of trust needs none of the serving wings (a device can verify and install with them broken)
    ("runtime/store", {"runtime.serve", "runtime.server", "runtime.engines", "runtime.cli.floor"}),
    # the serving core knows engines, not HTTP, the store or the command line
    ("runtime/serve", {"runtime.server", "runtime.store.store", "runtime.cli.floor"}),
    # backends know nothing above them
    ("runtime/engines", {"runtime.serve", "runtime.server", "runtime.store.store", "runtime.cli.floor"}),
    # HTTP only: engines come through runtime.engines' loader, never a backend; no registry client
    ("runtime/server", ENGINE_BACKENDS | {"runtime.cli.floor", "runtime.store.registry", "runtime.store.skopeo"}),
    # the contract: stdlib only (and its own modules)
    ("manifests", {"runtime", "bundler"}),
    # build-host wings: resolution does not pack, export does not resolve or pack
    ("bundler/resolve", {"bundler.pack.pack", "bundler.cli"}),  # pre-flight checks size the graphs bundler.onnx writes
    ("bundler/onnx", {"bundler.pack.pack", "bundler.cli", "bundler.resolve.checkpoint"}),
])
def test_wings_import_only_downwards(wing, forbidden):
    bad = {f: reaching(names, forbidden) for f, names in wing_imports(wing).items() if reaching(names, forbidden)}
    assert not bad, f"{wing} must not import {sorted(forbidden)}; found {bad}"


def module_graph() -> dict[str, set[str]]:
    """Module-level imports only (function-level ones are the deliberate lazy edges) between project modules."""
    graph: dict[str, set[str]] = {}
    modules = {}
    for path in source_files():
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = path
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.parse(path.read_text(), str(path)).body:
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def test_no_import_circles():
    graph = module_graph()
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, f"import circles: {circles}"


def test_the_serving_core_has_no_circle_through_the_one_sequence_driver():
    """Generator (one sequence over the scheduler) is its own module; speculative holds only the rules."""
    spec = imported_dotted(ROOT / "runtime/serve/speculative.py")
    assert not reaching(spec, {"runtime.serve.scheduler", "runtime.serve.model_runner", "runtime.serve.generator"})


def test_byte_caps_live_in_manifests_limits():
    """Every MAX_*_BYTES cap is a field of manifests.limits.Limits: a module may name one (an alias of a LIMITS
    field) but never define its value, so no two modules bound one thing differently."""
    pattern = re.compile(r"_?MAX_\w*_BYTES")
    offenders = []
    for path in source_files(skip="manifests/limits.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
            names = [t.id for t in targets if isinstance(t, ast.Name) and pattern.fullmatch(t.id)]
            literal = not any(isinstance(n, (ast.Name, ast.Attribute, ast.Call)) for n in ast.walk(node.value)) \
                if names else False
            if literal:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {names[0]}")
    assert not offenders, f"byte caps defined outside manifests/limits.py (make them Limits fields): {offenders}"


def test_limits_are_one_frozen_value_with_a_reason_each():
    import dataclasses

    from manifests import limits

    fields = dataclasses.fields(limits.Limits)
    assert dataclasses.is_dataclass(limits.LIMITS) and limits.Limits.__dataclass_params__.frozen
    source = Path(limits.__file__).read_text()
    undocumented = [f.name for f in fields
                    if not re.search(rf"\n    {f.name}: [^\n]+\n    \"\"\"", source)]
    assert not undocumented, f"Limits fields without a docstring saying why: {undocumented}"


def test_one_family_list():
    """manifests/families.py is the only table of model families: no other module spells out a collection of
    their model types (per-family facts are Family fields), so adding a family is one edit."""
    from manifests.families import FAMILIES

    offenders = []
    for path in source_files(skip="manifests/families.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            items = node.keys if isinstance(node, ast.Dict) else \
                node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else []
            named = {i.value for i in items if isinstance(i, ast.Constant) and i.value in FAMILIES}
            if len(named) >= 2:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {sorted(named)}")
    assert not offenders, f"a second list of model families (make it a manifests.families.Family field): {offenders}"
