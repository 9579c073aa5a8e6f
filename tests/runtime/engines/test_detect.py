"""Target detection from a (fake) device tree and a (given) GPU compute capability, and `bundle targets`."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from manifests.errors import EnvironmentProblem
from runtime.detect import detect_target


def device_tree(tmp_path, model: str):
    path = tmp_path / "model"
    path.write_bytes(model.encode() + b"\x00")  # the kernel's file ends in NUL
    return path


@pytest.mark.parametrize("model,expected", [
    ("NVIDIA Jetson AGX Thor Developer Kit", "jetson-thor"),
    ("NVIDIA IGX Thor Developer Kit", "igx-thor"),
    ("NVIDIA DRIVE AGX Thor Developer Kit", "drive-agx-thor"),
    ("NVIDIA Jetson AGX Orin Developer Kit", "jetson-agx-orin"),
    ("NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super", "jetson-orin-nano"),
])
def test_device_tree_names_the_board(tmp_path, model, expected):
    target, reason = detect_target(device_tree=device_tree(tmp_path, model), compute_capability="11.0")
    assert target == expected
    assert model in reason and expected in reason


def test_compute_capability_when_there_is_no_device_tree(tmp_path):
    target, reason = detect_target(device_tree=tmp_path / "absent", compute_capability="12.1")
    assert (target, reason) == ("dgx-spark", "GPU compute capability 12.1 matches profile dgx-spark")


def test_ambiguous_gpu_without_a_board_name_is_refused(tmp_path):
    with pytest.raises(EnvironmentProblem, match="11.0 fits several targets .*jetson-thor.*pass --target"):
        detect_target(device_tree=tmp_path / "absent", compute_capability=lambda: "11.0")


def test_unknown_gpu_and_no_gpu_give_cpu_with_a_reason(tmp_path):
    assert detect_target(device_tree=tmp_path / "absent", compute_capability="7.5",
                         cuda_provider=lambda: "onnxruntime 1.2 has no CUDAExecutionProvider") == (
        "cpu", "GPU compute capability 7.5 matches no TensorRT target profile and onnxruntime 1.2 has no "
               "CUDAExecutionProvider; using cpu")
    target, reason = detect_target(device_tree=device_tree(tmp_path, "Raspberry Pi 5"), compute_capability=None)
    assert target == "cpu" and "'Raspberry Pi 5' matches no profile and no NVIDIA GPU" in reason


def test_gpu_no_tensorrt_profile_names_is_the_cuda_target_when_its_provider_runs(tmp_path):
    target, reason = detect_target(device_tree=tmp_path / "absent", compute_capability="9.0",
                                   cuda_provider=lambda: None)
    assert target == "cuda" and "9.0 matches no TensorRT target profile" in reason and "CUDA provider" in reason


def test_a_board_with_a_tensorrt_profile_stays_that_target_with_onnxruntime_gpu_present(tmp_path):
    """Thor/Orin keep their target: the CUDA provider is their fallback engine, not another target."""
    target, _ = detect_target(device_tree=device_tree(tmp_path, "NVIDIA Jetson AGX Thor Developer Kit"),
                              compute_capability="11.0", cuda_provider=lambda: None)
    assert target == "jetson-thor"


def test_cuda_profile_leaves_the_gpu_to_detection():
    from manifests.targets import get_profile

    cuda = get_profile("cuda")
    assert (cuda.backend, cuda.compute_capability, cuda.cpu_arch) == ("onnxruntime-cuda", None, "any")
    assert "fp16" in cuda.precisions and "bf16" in cuda.precisions


def test_targets_command_prints_the_table_and_detection():
    from bundler.cli import cli

    result = CliRunner().invoke(cli, ["targets", "--detect"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["id", "arch", "gpu", "memory", "precisions", "cuda", "tensorrt", "backend"]
    thor = next(line for line in lines if line.startswith("jetson-thor "))
    assert thor.split()[1:4] == ["aarch64", "sm_110", "128.0"] and thor.split()[-1] == "tensorrt"
    assert "detected: " in result.output


def test_targets_json_includes_user_profiles(tmp_path):
    import json

    from bundler.cli import cli
    from manifests.targets import get_profile

    (tmp_path / "p.json").write_text(json.dumps({**get_profile("cpu").to_dict(), "id": "cpu-big",
                                                 "memory_bytes": "256G"}))
    result = CliRunner().invoke(cli, ["targets", "--json", "--profile-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    by_id = {p["id"]: p for p in json.loads(result.output)}
    assert by_id["cpu-big"]["memory_bytes"] == 256 * 1024**3 and "jetson-thor" in by_id


# --- an explicit --target against what this machine is (`bundle install --target ID`) ----------------------
def test_an_explicit_target_this_machine_is_not_is_refused_unless_forced(tmp_path):
    from runtime.detect import check_target

    probes = dict(device_tree=tmp_path / "absent", compute_capability=None)
    with pytest.raises(EnvironmentProblem, match=r"--target jetson-thor does not match this machine: expected a "
                                                 r"jetson-thor, found cpu \(no device tree model and no NVIDIA "
                                                 r"GPU found; using cpu\); pass --force-target"):
        check_target("jetson-thor", **probes)
    warning = check_target("jetson-thor", force=True, **probes)
    assert "installing for jetson-thor although this machine is cpu" in warning and "--force-target" in warning
    thor = dict(device_tree=device_tree(tmp_path, "NVIDIA IGX Thor Developer Kit"), compute_capability="11.0")
    with pytest.raises(EnvironmentProblem, match="found igx-thor"):
        check_target("jetson-thor", **thor)


def test_an_explicit_target_that_fits_passes_without_a_word(tmp_path):
    from runtime.detect import check_target

    thor = dict(device_tree=device_tree(tmp_path, "NVIDIA Jetson AGX Thor Developer Kit"), compute_capability="11.0")
    assert check_target("jetson-thor", **thor) is None
    # cpu runs on every machine; an id no profile knows is left to the bundle's own check (it names its targets)
    assert check_target("cpu", **thor) is None
    assert check_target("orin-agx", **thor) is None
    # a GPU that fits several profiles: naming one of them is exactly what the detection asks for
    ambiguous = dict(device_tree=tmp_path / "absent", compute_capability="11.0")
    assert check_target("igx-thor", **ambiguous) is None
    with pytest.raises(EnvironmentProblem, match="found drive-agx-thor or igx-thor or jetson-thor"):
        check_target("dgx-spark", **ambiguous)


def test_targets_detect_names_the_tensorrt_the_runtime_imports(tmp_path, monkeypatch):
    """What the bootstrap linked in (a platform folder with a `tensorrt` package) is what --detect reports."""
    import importlib.util
    import sys

    from bundler.cli import cli

    result = CliRunner().invoke(cli, ["targets", "--detect"])
    if importlib.util.find_spec("tensorrt") is None:  # a machine with TensorRT installed has nothing to say here
        assert "tensorrt: not importable here: TensorRT targets serve with ONNX Runtime" in result.output

    (tmp_path / "tensorrt").mkdir()
    (tmp_path / "tensorrt" / "__init__.py").write_text('__version__ = "10.13.3.9"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    real = sys.modules.pop("tensorrt", None)
    try:
        result = CliRunner().invoke(cli, ["targets", "--detect"])
    finally:  # the fake must not outlive this test
        sys.modules.pop("tensorrt", None)
        if real is not None:
            sys.modules["tensorrt"] = real
    assert result.exit_code == 0, result.output
    assert f"tensorrt: 10.13.3.9 from {tmp_path.resolve()}" in result.output
