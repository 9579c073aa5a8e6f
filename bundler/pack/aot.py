"""Ahead-of-time TensorRT plans on the build host: TensorRT-RTX's builder needs no GPU.

TensorRT builds only for the GPU it runs on, so a Thor or Orin plan is built on the device. TensorRT-RTX
(pip: tensorrt-rtx-cu13-bindings + tensorrt-rtx-cu13-libs, the `rtx` extra) builds a serialized plan for a
compute capability it is told (its ComputeCapability list: SM75, 80, 86, 89, 120, 121 in 1.7), on a machine
with no GPU at all. `bundle create --rtx-engines` uses it for every TensorRT target whose SM is in that list
(dgx-spark, sm_121); the plan's engine key names the flavour ("rtx-1.7.1.116"), so a device loads it only
under TensorRT-RTX of that version and rebuilds otherwise (runtime.engines).
"""

from __future__ import annotations

from pathlib import Path

from manifests.errors import EnvironmentProblem
from manifests.targets import TargetProfile

INSTALL_HINT = "pip install 'bundle[rtx]' (x86_64 and aarch64 wheels from PyPI)"


class RtxBuilder:
    """TensorRT-RTX's builder for the SMs it targets ahead of time; one per `bundle create`."""

    name = "tensorrt-rtx"

    def __init__(self):
        from runtime.engines.tensorrt import TensorRTBackend, aot_targets, tensorrt_module

        try:
            module = tensorrt_module("rtx")
        except EnvironmentProblem as e:
            raise EnvironmentProblem(f"--rtx-engines needs TensorRT-RTX's builder: {e}; {INSTALL_HINT}") from None
        self.backend = TensorRTBackend("rtx")
        self.version = self.backend.version()  # as engine keys name it: "rtx-1.7.1.116"
        self.targets = tuple(aot_targets(module))

    def compute_capability_for(self, profile: TargetProfile) -> str | None:
        """The SM to build `profile`'s plan for (its own or an alias), or None when TensorRT-RTX has none of them."""
        if profile.backend != "tensorrt":
            return None
        for cc in (profile.compute_capability, *profile.compute_capability_aliases):
            if cc in self.targets:
                return cc
        return None

    def build(self, onnx_path: Path, options: dict, out_plan: Path, compute_capability: str) -> None:
        self.backend.build(onnx_path, options, out_plan, compute_capability=compute_capability)
