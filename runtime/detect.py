"""Which target profile is this machine? (`--target auto`)

Order, most specific first: the device-tree model string (Jetson, IGX and DRIVE boards name
themselves there; it also tells a Jetson Thor from an IGX Thor, which share a GPU), then the GPU's
compute capability (cuda-python if installed, else `nvidia-smi`). A GPU no TensorRT profile names
(an x86 edge PC, a workstation) is the `cuda` target when onnxruntime-gpu's CUDA provider can run
here, else `cpu`, with the reason. The probes are parameters so tests feed a fake device-tree file,
a fixed compute capability and a fixed answer about the CUDA provider.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Callable, Sequence

from manifests.errors import EnvironmentProblem
from manifests.targets import TargetProfile
from runtime.profiles import all_profiles
from manifests.limits import LIMITS

DEVICE_TREE_MODEL = Path("/proc/device-tree/model")


def read_device_tree_model(path: Path = DEVICE_TREE_MODEL) -> str | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(LIMITS.device_model_bytes)
    except OSError:
        return None
    text = raw.split(b"\x00", 1)[0].decode("utf-8", errors="replace").strip()
    return text or None


def probe_compute_capability() -> str | None:
    """"11.0" for the first CUDA GPU, or None when there is none (or no way to ask)."""
    try:
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            from cuda import cudart
        attr = cudart.cudaDeviceAttr
        err, major = cudart.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, 0)
        err2, minor = cudart.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, 0)
        if int(err) == 0 and int(err2) == 0:
            return f"{major}.{minor}"
    except Exception:  # no cuda-python, no driver, no device: try the next probe
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
    return first or None


def probe_cuda_provider() -> str | None:
    """None when onnxruntime-gpu's CUDA provider can run here, else why not."""
    from runtime.engines.cudalib import onnxruntime_cuda

    return onnxruntime_cuda()[1]


class AmbiguousTarget(EnvironmentProblem):
    """The GPU fits several profiles and nothing tells them apart; `candidates` names them."""

    def __init__(self, message: str, candidates: tuple[str, ...]):
        super().__init__(message)
        self.candidates = candidates


def detect_target(profiles: Sequence[TargetProfile] | None = None, *, device_tree: Path = DEVICE_TREE_MODEL,
                  compute_capability: Callable[[], str | None] | str | None = probe_compute_capability,
                  cuda_provider: Callable[[], str | None] = probe_cuda_provider) -> tuple[str, str]:
    """(target id, why). EnvironmentProblem when the GPU fits several profiles and nothing tells them apart."""
    profiles = list(profiles) if profiles is not None else all_profiles()
    model = read_device_tree_model(device_tree)
    if model:
        best: tuple[int, TargetProfile] | None = None
        for p in profiles:
            for pattern in p.device_tree_models:
                if pattern.lower() in model.lower() and (best is None or len(pattern) > best[0]):
                    best = (len(pattern), p)
        if best is not None:
            return best[1].id, f"device tree model {model!r} matches profile {best[1].id}"
    cc = compute_capability() if callable(compute_capability) else compute_capability
    if cc:
        matches = [p for p in profiles if p.backend == "tensorrt" and p.matches_compute_capability(cc)]
        if len(matches) == 1:
            return matches[0].id, f"GPU compute capability {cc} matches profile {matches[0].id}"
        if len(matches) > 1:
            ids = ", ".join(p.id for p in matches)
            seen = f"device tree model {model!r}" if model else "no device tree model"
            raise AmbiguousTarget(f"GPU compute capability {cc} fits several targets ({ids}) and {seen} "
                                  f"does not tell them apart; expected one: pass --target ID",
                                  tuple(p.id for p in matches))
        unmatched = f"GPU compute capability {cc} matches no TensorRT target profile"
        cuda = next((p for p in profiles if p.backend == "onnxruntime-cuda"), None)
        if cuda is not None:
            why_not = cuda_provider()
            if why_not is None:
                return cuda.id, f"{unmatched}; ONNX Runtime's CUDA provider runs here: {cuda.id}"
            return "cpu", f"{unmatched} and {why_not}; using cpu"
        return "cpu", f"{unmatched} (add one to a profile directory); using cpu"
    where = f"device tree model {model!r} matches no profile" if model else "no device tree model"
    return "cpu", f"{where} and no NVIDIA GPU found; using cpu"


def check_target(target: str, *, force: bool = False, profiles: Sequence[TargetProfile] | None = None,
                 **probes) -> str | None:
    """An explicit `--target ID` against what this machine is: None when it fits (detection finds it, it is
    one of the profiles an ambiguous GPU fits, or it runs on the CPU, which every machine has; an id no
    profile knows is left to the bundle's own check). Otherwise EnvironmentProblem naming both, or with
    `force` the warning to print: preparing a store for another device is deliberate, a typo is not."""
    profiles = list(profiles) if profiles is not None else all_profiles()
    wanted = next((p for p in profiles if p.id == target), None)
    if wanted is None or wanted.backend == "onnxruntime":
        return None
    try:
        found, reason = detect_target(profiles, **probes)
    except AmbiguousTarget as e:
        if target in e.candidates:
            return None
        found, reason = " or ".join(e.candidates), str(e).split(";")[0]
    if found == target:
        return None
    if force:
        return f"installing for {target} although this machine is {found} ({reason}), as --force-target asks"
    raise EnvironmentProblem(f"--target {target} does not match this machine: expected a {target}, found "
                             f"{found} ({reason}); pass --force-target to install for {target} anyway")


def tensorrt_bindings() -> str:
    """One line for `bundle targets --detect`: the TensorRT Python bindings this runtime imports (version and
    folder; on a bootstrapped device, the platform's, linked in by the bootstrap), or why there are none."""
    import importlib.util

    spec = importlib.util.find_spec("tensorrt")
    if spec is None:
        from runtime.engines.tensorrt import install_hint
        return f"not importable here: TensorRT targets serve with ONNX Runtime ({install_hint()})"
    where = str(Path(list(spec.submodule_search_locations or [spec.origin or "?"])[0]).resolve().parent)
    try:
        import tensorrt
    except Exception as e:  # noqa: BLE001 - a broken install (no libnvinfer): say what it raised
        return f"found in {where} but does not import ({type(e).__name__}: {str(e)[:200]})"
    return f"{getattr(tensorrt, '__version__', 'unknown version')} from {where}"
