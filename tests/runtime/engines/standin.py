"""A TensorRT backend stand-in: the real TensorRTBackend interface (device, build, load), run by ONNX Runtime;
and OrtPlan, the interface of a deserialized batched plan and its execution context, run the same way.

TensorRT cannot be installed here; everything around it (keys, cache, fallbacks, build-engines)
is driven through this object instead. Its "plan" is a JSON file naming the ONNX it was built from
and the device it was built for, so a test can see which build a loaded engine came from.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from runtime.engines.cache import DeviceInfo
from runtime.engines.onnxruntime import OnnxRuntimeEngine
from runtime.engines.tensorrt_batched import PlanTensor, TensorRTBatchedEngine
from tests.runtime.engines.host_memory import HostMemory


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
        """A batched plan: the batched TensorRT engine itself over OrtPlan (its host logic for real); a concat
        plan: the ONNX Runtime engine over the graph."""
        self.loads.append(Path(plan))
        data = json.loads(Path(plan).read_text())
        if options.get("kv_cache") == "batched":
            engine = TensorRTBatchedEngine(OrtPlan(Path(data["onnx"]), options), HostMemory(), options=options,
                                           max_context=max_context, description="tensorrt-standin batched")
            engine.plan_file = data  # type: ignore[attr-defined]
            return engine
        engine = OnnxRuntimeEngine(Path(data["onnx"]), max_context=max_context or options["max_context"])
        engine.plan = data  # type: ignore[attr-defined]
        return engine


#: ONNX Runtime's type strings -> numpy dtypes of the plan tensors the stand-in declares
_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
          "tensor(bool)": np.bool_, "tensor(int32)": np.int32}


class OrtPlan:
    """runtime.engines.tensorrt_batched.Plan over ONNX Runtime running the static batched ONNX graph a plan is
    built from, on host memory (tests.runtime.engines.host_memory.HostMemory pointers).

    Its context refuses what TensorRT refuses: a shape outside the selected optimisation profile (the build
    options' profiles), an input without a shape or address, an output without an address, and a cache whose
    present is not bound to its past's address (TensorRT's KV-cache update layer writes in place)."""

    def __init__(self, graph: Path, options: dict):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
        self.options = options
        self.tensors = {}
        for io, is_input in ((self.session.get_inputs(), True), (self.session.get_outputs(), False)):
            for t in io:
                shape = tuple(d if isinstance(d, int) else -1 for d in t.shape)
                self.tensors[t.name] = PlanTensor(t.name, shape, np.dtype(_NUMPY[t.type]), is_input)
        self.plan_bytes = Path(graph).stat().st_size + Path(str(graph) + ".data").stat().st_size
        self.activation_bytes = 0
        self.contexts: list[OrtContext] = []

    def context(self) -> "OrtContext":
        self.contexts.append(OrtContext(self))
        return self.contexts[-1]

    def close(self) -> None:
        self.session = None


class OrtContext:
    def __init__(self, plan: OrtPlan):
        self.plan = plan
        self.profile: int | None = None
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}
        self.calls: list[dict[str, tuple]] = []  # the input shapes of every execute
        self.profiles: list[int] = []  # the optimisation profile of every execute

    def set_optimization_profile(self, index: int) -> None:
        assert 0 <= index < len(self.plan.options["profiles"]), f"no optimisation profile {index}"
        self.profile = index

    def set_input_shape(self, name: str, shape) -> None:
        t = self.plan.tensors[name]
        assert t.is_input, f"{name} is an output: TensorRT sets no shape on it"
        assert self.profile is not None, "a shape before any optimisation profile was selected"
        limits = self.plan.options["profiles"][self.profile]["shapes"][name]
        shape = tuple(int(d) for d in shape)
        assert len(shape) == len(t.shape) and all(s == d for s, d in zip(shape, t.shape) if d != -1), (name, shape)
        assert all(lo <= s <= hi for lo, s, hi in zip(limits["min"], shape, limits["max"])), \
            f"{name} {shape} is outside profile {self.profile}: {limits['min']}..{limits['max']}"
        self.shapes[name] = shape

    def set_tensor_address(self, name: str, address: int) -> None:
        assert name in self.plan.tensors, name
        self.addresses[name] = int(address)

    def execute(self) -> None:
        tensors = self.plan.tensors
        inputs = [n for n, t in tensors.items() if t.is_input]
        assert not [n for n in inputs if n not in self.shapes], "inputs without a shape"
        assert not [n for n in tensors if n not in self.addresses], "tensors without an address"
        binding = self.plan.session.io_binding()
        for name in inputs:
            binding.bind_input(name, "cpu", 0, tensors[name].dtype, list(self.shapes[name]), self.addresses[name])
        batch, width = self.shapes["input_ids"]
        for name, t in tensors.items():
            if t.is_input:
                continue
            if name.startswith("present."):
                past = "past_key_values." + name[len("present."):]
                assert self.addresses[name] == self.addresses[past], f"{name} is not bound in place over {past}"
                shape = self.shapes[past]
            else:  # logits [batch, width, vocab], argmax [batch, width]
                shape = (batch, width, *t.shape[2:])
            binding.bind_output(name, "cpu", 0, t.dtype, list(shape), self.addresses[name])
        self.plan.session.run_with_iobinding(binding)
        self.calls.append(dict(self.shapes))
        self.profiles.append(self.profile)
