"""A TensorRT backend stand-in: the real TensorRTBackend interface (device, build, load), run by ONNX Runtime.

TensorRT cannot be installed here; everything around it (keys, cache, fallbacks, build-engines)
is driven through this object instead. Its "plan" is a JSON file naming the ONNX it was built from
and the device it was built for, so a test can see which build a loaded engine came from.
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.engines.cache import DeviceInfo
from runtime.engines.onnxruntime import OnnxRuntimeEngine


class StandInBackend:
    name = "tensorrt-standin"

    def __init__(self, compute_capability: str | None = "11.0", tensorrt_version: str = "10.13.3.9"):
        self.info = DeviceInfo(compute_capability, tensorrt_version, "stand-in GPU") if compute_capability else None
        self.unavailable = "TensorRT is not installed (stand-in)"
        self.builds: list[Path] = []
        self.loads: list[Path] = []

    def device(self) -> DeviceInfo | None:
        return self.info

    def build(self, onnx_path: Path, options: dict, out_plan: Path) -> None:
        self.builds.append(Path(out_plan))
        Path(out_plan).write_text(json.dumps({"onnx": str(onnx_path), "options": options,
                                              "built_for": [self.info.compute_capability,
                                                            self.info.tensorrt_version]}))

    def load(self, plan: Path, *, options: dict, max_context: int | None = None):
        self.loads.append(Path(plan))
        data = json.loads(Path(plan).read_text())
        engine = OnnxRuntimeEngine(Path(data["onnx"]), max_context=max_context or options["max_context"])
        engine.plan = data  # type: ignore[attr-defined]
        return engine
