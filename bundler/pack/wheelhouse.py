"""The floor runtime's wheelhouse: every wheel a device needs to `pip install --no-index` bundle-runtime.

On the connected host, pip resolves `bundle-runtime==<this version>` (plus any site wheels given with
--extra-wheels) for each device platform with `pip download --only-binary=:all: --platform ...`; the
wheels travel in the bundle as stored blobs listed in the signed manifest, and the bootstrap
(bundler/pack/bootstrap.sh) installs them after checking them. Downloads are cached per platform
(`--wheel-cache`, default BUNDLE_CACHE_DIR/wheels): a warm cache resolves with `--no-index`, so tests,
CI and repeated creates do not download again. The floor wheel itself is built from this source tree
when there is one (deterministically, SOURCE_DATE_EPOCH fixed), taken from --extra-wheels, or
downloaded from the configured index.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import importlib.util
import platform as host
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from manifests.errors import EnvironmentProblem, UsageError
from manifests.layout import BOOTSTRAP_MEDIA_TYPE, WHEEL_MEDIA_TYPE
from manifests.schema import BOOTSTRAP_PATH, WHEELHOUSE_PREFIX, Runtime
from runtime import settings
from runtime.fsutil import file_sha256

log = logging.getLogger(__name__)

FLOOR_PACKAGE = "bundle-runtime"
BOOTSTRAP_SOURCE = Path(__file__).with_name("bootstrap.sh")
#: Oldest glibc the wheels must run on: Ubuntu 22.04 (JetPack 6) has 2.35, Debian 12 2.36, Ubuntu 24.04
#: (JetPack 7, DGX OS 7) 2.39. pip is told every manylinux tag up to it.
GLIBC_FLOOR = (2, 35)
_PLATFORM = re.compile(r"^linux_(x86_64|aarch64)-cp3(\d{1,2})$")
#: a profile's runtime_platform meaning "the build host's own" (`cpu`: the demo, a fleet like this host)
BUILD_HOST = "build-host"
#: what prints a device's platform in this naming (the bootstrap picks the wheels the same way)
PLATFORM_COMMAND = ("python3 -c 'import platform, sys; "
                    "print(f\"linux_{platform.machine()}-cp{sys.version_info[0]}{sys.version_info[1]}\")'")
#: reproducible floor wheels: zip timestamps fixed (1980-01-01, the zip epoch)
SOURCE_DATE_EPOCH = "315532800"
PIP_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Wheelhouse:
    """What create packs: the files (stored wheels + bootstrap) and the manifest's runtime section."""

    files: tuple  # of bundler.pack.pack.PackFile
    runtime: Runtime
    sizes: dict  # platform -> bytes of its wheels


# --- platforms -------------------------------------------------------------------------------

def host_platform() -> str:
    """This interpreter's platform in the bundle's naming, e.g. linux_x86_64-cp311."""
    return f"linux_{host.machine()}-cp{sys.version_info[0]}{sys.version_info[1]}"


def parse_platforms(text: str) -> list[str]:
    """"linux_aarch64-cp312,linux_x86_64-cp311" -> validated, de-duplicated list."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if not _PLATFORM.match(item):
            raise UsageError(f"expected --with-runtime platforms like linux_aarch64-cp312 or linux_x86_64-cp311, "
                             f"found {item!r}")
        if item not in out:
            out.append(item)
    if not out:
        raise UsageError("expected at least one platform in --with-runtime, found none")
    return out


def default_platforms(target_ids: Sequence[str]) -> list[str]:
    """The platforms the targets run: each profile's `runtime_platform`.

    A device kind with one OS image names its platform (jetson-thor: linux_aarch64-cp312); `cpu` names
    BUILD_HOST, the build host's own (the demo, a fleet of machines like this one). A profile that names
    none (`cuda`: any x86_64 or aarch64 machine with any Python, so no guess is safe) is refused: a runtime
    for the wrong Python does not install, and only the user knows the devices'.
    """
    from manifests.targets import get_profile

    out = []
    for t in target_ids:
        profile = get_profile(t, settings.profile_dirs())
        plat = profile.extra.get("runtime_platform")
        if plat is None:
            raise UsageError(f"target {t} names no runtime platform (its devices' Python and architecture vary): "
                             f"expected --with-runtime PLATFORM[,PLATFORM...] for them, e.g. linux_x86_64-cp312 "
                             f"(a device prints its own: {PLATFORM_COMMAND}), or --no-runtime")
        if plat != BUILD_HOST and not (isinstance(plat, str) and _PLATFORM.match(plat)):
            raise UsageError(f"target profile {profile.source} ({t}): expected runtime_platform like "
                             f"linux_aarch64-cp312, {BUILD_HOST!r} or null, found {plat!r}")
        plat = host_platform() if plat == BUILD_HOST else plat
        if plat not in out:
            out.append(plat)
    return out


def pip_platform_args(plat: str) -> list[str]:
    m = _PLATFORM.match(plat)
    if not m:
        raise UsageError(f"expected a platform like linux_aarch64-cp312, found {plat!r}")
    arch, minor = m.group(1), m.group(2)
    tags = [f"manylinux_{GLIBC_FLOOR[0]}_{g}_{arch}" for g in range(GLIBC_FLOOR[1], 16, -1)]
    tags += [f"manylinux2014_{arch}", f"linux_{arch}"]
    args = ["--only-binary=:all:", "--implementation", "cp", "--python-version", f"3.{minor}",
            "--abi", f"cp3{minor}"]
    for t in tags:
        args += ["--platform", t]
    return args


def wheel_fits(filename: str, plat: str) -> bool:
    """Whether a wheel's tags (PEP 427 file name) can install on `plat`."""
    m = _PLATFORM.match(plat)
    parts = filename[:-len(".whl")].split("-")
    if not m or len(parts) < 5:
        return False
    arch, minor = m.group(1), int(m.group(2))
    pytags, abitags, plattags = (parts[-3].split("."), parts[-2].split("."), parts[-1].split("."))
    py_ok = any(t in ("py3", f"py3{minor}", f"cp3{minor}") or
                (t.startswith("cp3") and t[3:].isdigit() and int(t[3:]) <= minor and "abi3" in abitags)
                for t in pytags)
    plat_ok = any(t == "any" or (t.endswith(f"_{arch}") and t.startswith(("manylinux", "linux")))
                  for t in plattags)
    return py_ok and plat_ok


# --- onnxruntime-gpu, the CUDA provider fallback --------------------------------------------

#: CUDA kernels of PyPI's onnxruntime-gpu for linux aarch64, by version (cuobjdump --list-elf / --list-ptx
#: of its CUDA provider library): sm_89, sm_90a, sm_120a, sm_121a, and no PTX, so nothing runs on another
#: SM. It serves a DGX Spark (sm_121) or a GH200 (sm_90), never a Thor (sm_110) or an Orin (sm_87).
ONNXRUNTIME_GPU_AARCH64_SMS = {"1.31.1": ("8.9", "9.0", "12.0", "12.1")}


def _sm(cc: str) -> str:
    return "sm_" + cc.replace(".", "")


def onnxruntime_gpu_lines(target_ids: Sequence[str], platforms: Sequence[str],
                          extra_wheels: Path | None) -> list[str]:
    """One line per aarch64 TensorRT target about the CUDA provider fallback its bundle carries, or why none.

    An onnxruntime-gpu for aarch64 given with --extra-wheels goes to every aarch64 device of the bundle, so a
    target whose SM it has no kernels for (a Thor, an Orin) is refused: there its CUDA provider would load and
    then fail at the first kernel, instead of serving on the CPU."""
    from manifests.targets import get_profile

    if not any(p.startswith("linux_aarch64") for p in platforms):
        return []
    wheels = sorted(Path(extra_wheels).glob("onnxruntime_gpu-*.whl")) if extra_wheels else []
    gpu = next((w for w in wheels if any(wheel_fits(w.name, p) for p in platforms if "aarch64" in p)), None)
    version = gpu.name.split("-")[1] if gpu is not None else None
    lines, refused = [], []
    for t in target_ids:
        profile = get_profile(t, settings.profile_dirs())
        if profile.backend != "tensorrt" or profile.cpu_arch != "aarch64" or not profile.compute_capability:
            continue
        sms = ONNXRUNTIME_GPU_AARCH64_SMS.get(version or "1.31.1")
        fits = sms is not None and profile.compute_capability in sms
        if gpu is None:
            lines.append(f"fallback: {t}: " + (
                f"onnxruntime-gpu 1.31.1 (PyPI, aarch64) has {_sm(profile.compute_capability)} kernels: carry it "
                f"with --extra-wheels for a CUDA provider fallback (else the CPU serves without TensorRT)" if fits
                else f"no onnxruntime-gpu: PyPI's aarch64 build has kernels for "
                     f"{', '.join(_sm(c) for c in ONNXRUNTIME_GPU_AARCH64_SMS['1.31.1'])} only, no PTX, not "
                     f"{_sm(profile.compute_capability)}: without TensorRT it serves on the CPU"))
        elif sms is None:
            lines.append(f"fallback: {t}: carries onnxruntime-gpu {version} (its kernels for "
                         f"{_sm(profile.compute_capability)} are not verified here)")
        elif fits:
            lines.append(f"fallback: {t}: carries onnxruntime-gpu {version}, whose CUDA provider has "
                         f"{_sm(profile.compute_capability)} kernels")
        else:
            refused.append(f"{t} ({_sm(profile.compute_capability)})")
    if refused:
        raise UsageError(f"--extra-wheels {gpu.name} has CUDA kernels for "
                         f"{', '.join(_sm(c) for c in ONNXRUNTIME_GPU_AARCH64_SMS[version])} only and would reach "
                         f"{', '.join(refused)}, where its CUDA provider fails: expected a bundle of its own for "
                         f"those targets, without onnxruntime-gpu")
    return lines


# --- the floor wheel -------------------------------------------------------------------------

def floor_version() -> str:
    return importlib.metadata.version(FLOOR_PACKAGE)


def _source_tree() -> Path | None:
    """The repository this runtime was imported from, when it is a source checkout (floor/pyproject.toml)."""
    import runtime

    root = Path(runtime.__file__).resolve().parent.parent
    return root if (root / "floor" / "pyproject.toml").is_file() else None


def _pip(args: list[str], what: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                           env=settings.subprocess_env(SOURCE_DATE_EPOCH=SOURCE_DATE_EPOCH))
    except subprocess.TimeoutExpired:
        raise EnvironmentProblem(f"{what}: pip did not finish within {PIP_TIMEOUT_S} s") from None
    if r.returncode != 0:
        lines = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
        raise EnvironmentProblem(f"{what}: pip failed: {lines[-1] if lines else 'no output'}")


def build_floor_wheel(dest: Path, source: Path | None = None) -> Path:
    """Build bundle-runtime's wheel from a source tree into `dest` (a staged copy: the tree is not written)."""
    source = source or _source_tree()
    if source is None:
        raise EnvironmentProblem("expected a source checkout (floor/pyproject.toml) to build bundle-runtime from")
    stage = dest / ".stage"
    shutil.rmtree(stage, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for pkg in ("runtime", "manifests"):
        shutil.copytree(source / pkg, stage / pkg, ignore=ignore)
    (stage / "floor").mkdir()
    shutil.copy2(source / "floor" / "pyproject.toml", stage / "floor" / "pyproject.toml")
    # The installed setuptools when it is new enough (no index needed); else pip's isolated build (needs one).
    flags = ["--no-build-isolation", "--no-index"] if _setuptools_at_least(77) else ["--use-pep517"]
    _pip(["wheel", "--no-deps", *flags, "-w", str(dest), str(stage / "floor")], "building the bundle-runtime wheel")
    shutil.rmtree(stage, ignore_errors=True)
    return _one_floor_wheel(dest)


def _setuptools_at_least(major: int) -> bool:
    if importlib.util.find_spec("setuptools") is None:
        return False
    head = importlib.metadata.version("setuptools").split(".")[0]
    return head.isdigit() and int(head) >= major


def _one_floor_wheel(folder: Path) -> Path:
    version = floor_version()
    found = sorted(folder.glob(f"bundle_runtime-{version}-*.whl"))
    if not found:
        raise EnvironmentProblem(f"expected bundle_runtime-{version}-*.whl in {folder}, found none")
    return found[-1]


def floor_wheel(work: Path, extra_wheels: Path | None) -> Path:
    """The floor wheel of exactly this version: from --extra-wheels, built from source, or from the index."""
    version = floor_version()
    if extra_wheels is not None:
        given = sorted(Path(extra_wheels).glob(f"bundle_runtime-{version}-*.whl"))
        if given:
            return given[-1]
    out = work / "floor-wheel"
    out.mkdir(parents=True, exist_ok=True)
    if _source_tree() is not None:
        return build_floor_wheel(out)
    try:
        _pip(["download", "--no-deps", "-d", str(out), f"{FLOOR_PACKAGE}=={version}"],
             f"downloading {FLOOR_PACKAGE}=={version}")
    except EnvironmentProblem as e:
        raise EnvironmentProblem(f"{e}; put bundle_runtime-{version}-*.whl in a folder given with --extra-wheels "
                                 f"(scripts/build-wheels makes it)") from None
    return _one_floor_wheel(out)


# --- per-platform resolution -----------------------------------------------------------------

def download_platform(plat: str, requirements: list[str], find_links: list[Path], cache: Path,
                      work: Path) -> list[Path]:
    """Resolve and fetch every wheel for `plat` into a fresh folder; the cache is tried offline first."""
    cached = cache / plat
    cached.mkdir(parents=True, exist_ok=True)
    dest = work / "wheels" / plat
    links = [a for d in [*find_links, cached] for a in ("--find-links", str(d))]
    base = ["download", *pip_platform_args(plat), *links, *requirements]
    dest.mkdir(parents=True)
    try:
        _pip([*base[:1], "--no-index", "-d", str(dest), *base[1:]], f"wheels for {plat} from the cache")
    except EnvironmentProblem:
        shutil.rmtree(dest)
        dest.mkdir(parents=True)
        _pip([*base[:1], "-d", str(dest), *base[1:]], f"downloading the wheels for {plat}")
    local = {p.name for d in find_links for p in Path(d).glob("*.whl")}
    wheels = sorted(dest.glob("*.whl"))
    for w in wheels:  # keep what came from the index; site and floor wheels are never cached
        if w.name not in local and not (cached / w.name).exists():
            tmp = cached / f".{w.name}.{os.getpid()}.{threading.get_ident()}.tmp"  # two creates may share the cache
            shutil.copy2(w, tmp)
            tmp.replace(cached / w.name)
    if not wheels:
        raise EnvironmentProblem(f"pip found no wheels for {plat}")
    return wheels


def tensorrt_requirements(target_ids: Sequence[str], platforms: Sequence[str]) -> dict[str, list[str]]:
    """What a platform's wheelhouse adds for its TensorRT targets: cuda-python (`cuda-bindings`, 7 MB for
    aarch64), which the TensorRT engine allocates device memory with, of the target's CUDA major (JetPack 7:
    13, JetPack 6: 12). TensorRT itself is the platform's (the bootstrap links it in). A target runs on its
    profile's runtime_platform, or on every platform of its architecture when the profile names none."""
    from manifests.targets import get_profile

    wanted: dict[str, set[str]] = {}
    for plat in platforms:
        m = _PLATFORM.match(plat)
        for t in target_ids:
            profile = get_profile(t, settings.profile_dirs())
            own = profile.extra.get("runtime_platform")
            if profile.backend != "tensorrt" or not profile.cuda_version or m is None or \
                    profile.cpu_arch != m.group(1) or (own not in (None, BUILD_HOST) and own != plat):
                continue
            major, minor = (int(x) for x in profile.cuda_version.split(".")[:2])
            wanted.setdefault(plat, set()).add(f"cuda-bindings>={major}.{minor if major == 12 else 0},<{major + 1}")
    out = {}
    for plat, reqs in wanted.items():
        if len(reqs) == 1:
            out[plat] = sorted(reqs)
        else:  # one venv per platform holds one cuda-python
            log.warning("wheelhouse: targets for %s need different CUDA majors (%s): no cuda-python carried; the "
                        "TensorRT engine needs one installed on the device", plat, ", ".join(sorted(reqs)))
    return out


def build_wheelhouse(platforms: Sequence[str], work: Path, *, extra_wheels: Path | None = None,
                     cache: Path | None = None, requirements: dict[str, list[str]] | None = None) -> Wheelhouse:
    """Every platform's wheels plus the bootstrap, as stored files for the packer. `requirements`: more for
    some platforms (tensorrt_requirements)."""
    if extra_wheels is not None and not Path(extra_wheels).is_dir():
        raise UsageError(f"expected --extra-wheels {extra_wheels} to be a folder of .whl files, found "
                         f"{'nothing' if not Path(extra_wheels).exists() else 'a file'}")
    cache = Path(cache) if cache is not None else settings.cache_dir() / "wheels"
    floor = floor_wheel(work, extra_wheels)
    extras = sorted(p for p in Path(extra_wheels).glob("*.whl") if p.resolve() != floor.resolve()) \
        if extra_wheels else []
    links = [floor.parent] + ([Path(extra_wheels)] if extra_wheels else [])
    per_platform = {}
    for plat in platforms:
        reqs = [f"{FLOOR_PACKAGE}=={floor_version()}"] + [str(e) for e in extras if wheel_fits(e.name, plat)] \
            + list((requirements or {}).get(plat, ()))
        per_platform[plat] = download_platform(plat, reqs, links, cache, work)
    return wheelhouse_from_files(FLOOR_PACKAGE, floor_version(), per_platform)


def wheelhouse_from_files(package: str, version: str, per_platform: dict[str, list[Path]],
                          bootstrap: Path = BOOTSTRAP_SOURCE) -> Wheelhouse:
    """Wheel files per platform -> stored PackFiles (a wheel shared by platforms once) and the runtime section."""
    from bundler.pack.pack import PackFile

    by_name: dict[str, tuple[Path, str]] = {}
    paths: dict[str, tuple[str, ...]] = {}
    sizes: dict[str, int] = {}
    for plat, wheels in per_platform.items():
        for w in wheels:
            sha = file_sha256(w)
            if by_name.setdefault(w.name, (w, sha))[1] != sha:
                raise EnvironmentProblem(f"two different files named {w.name} for two platforms; expected one")
        paths[plat] = tuple(sorted(f"{WHEELHOUSE_PREFIX}{w.name}" for w in wheels))
        sizes[plat] = sum(w.stat().st_size for w in wheels)
    files = [PackFile(src=src, path=f"{WHEELHOUSE_PREFIX}{name}", targets=(), media_type=WHEEL_MEDIA_TYPE)
             for name, (src, _) in sorted(by_name.items())]
    files.append(PackFile(src=bootstrap, path=BOOTSTRAP_PATH, targets=(), media_type=BOOTSTRAP_MEDIA_TYPE))
    runtime = Runtime(package=package, version=version, platforms=paths, bootstrap=BOOTSTRAP_PATH)
    return Wheelhouse(tuple(files), runtime, sizes)
