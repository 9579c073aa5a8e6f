"""TensorRT backend: build a plan from the shipped ONNX on the device, and run it. Thin on purpose.

Every decision around TensorRT (profile shapes, cache key, compatibility check, fallback) lives in
code that runs without it (bundler.pack.engines, runtime.engines.cache, runtime.engines). This module
only talks to the real `tensorrt` Python API and to `cuda-python` for device memory, and is imported
only on a device that asked for a TensorRT engine. It cannot run on the build machines of this
project (no GPU, no libnvinfer); the logic above it is tested with the ONNX Runtime engine standing in.

Two engines by the plan's graph (build option "kv_cache"): plans of the batched graph (TensorRT that parses
ONNX Attention: DGX OS's 10.16, TensorRT-RTX) run in runtime.engines.tensorrt_batched, many slots a call,
through TensorRTPlan and CudaMemory here; plans of the concat graph (JetPack 7's 10.13) in TensorRTEngine,
slot by slot. Neither has run on a device yet: no machine here has a GPU TensorRT supports.

TensorRT 11 removed weak typing (BuilderFlag.FP16 and friends): there the precision is the ONNX
graph's own. So fp16 targets ship an fp16 graph (build option "dtype": "float16"), which TensorRT
10 builds strongly typed too, keeping the fp32 the graph asks for (norms, softmax, logits); an
fp32 graph with precision fp16 (older bundles) still gets TensorRT 10's FP16 flag. Buffer sizes
and rollback pitches come from the engine's own tensor dtypes; logits reach the host as float32.

Two flavours, one API: TensorRT (`tensorrt`, the platform's: JetPack, DGX OS) and TensorRT-RTX
(`tensorrt_rtx`, pip wheels), whose builder also runs on a machine with no GPU for the SMs it knows
(ahead of time, bundler.pack.aot). A plan runs only under its own flavour: the engine key's
tensorrt_version names it ("10.16.1.11" is TensorRT, "rtx-1.7.1.116" TensorRT-RTX).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from manifests.errors import EnvironmentProblem, ModelError
from runtime.engines.base import Engine, Row
from runtime.engines.slots import SlotTable
from runtime.engines.cache import RTX_PREFIX, DeviceInfo, flavour_of
from runtime.fsutil import write_atomic

log = logging.getLogger(__name__)

NOT_INSTALLED = "TensorRT is not installed (libnvinfer cannot be installed on this machine)"


def install_hint(device_tree: Path | None = None) -> str:
    """Where an offline device gets TensorRT's Python bindings. Not `pip install tensorrt-cu13`: that is a
    stub that downloads the real wheels from NVIDIA's index, which a device on the floor cannot reach."""
    import platform
    import sys

    from runtime.detect import DEVICE_TREE_MODEL, read_device_tree_model

    model = read_device_tree_model(device_tree or DEVICE_TREE_MODEL) or ""
    if "jetson" in model.lower():
        return ("on a Jetson it comes with JetPack: install python3-libnvinfer with apt from the JetPack "
                "repository (a full JetPack install already has it)")
    plat = f"linux_{platform.machine()}-cp{sys.version_info[0]}{sys.version_info[1]}"
    return (f"carry TensorRT's wheels for {plat} (tensorrt_cu13_bindings, tensorrt_cu13_libs, downloaded on the "
            f"connected build host) in the bundle with `bundle create --extra-wheels DIR`, then run its bootstrap")


#: flavour -> (Python modules to try, prefix of its version in engine keys)
FLAVOURS = {"tensorrt": (("tensorrt",), ""), "rtx": (("tensorrt_rtx", "tensorrt_rtx_bindings"), RTX_PREFIX)}
RTX_NOT_INSTALLED = ("TensorRT-RTX is not installed (pip install tensorrt-rtx-cu13-bindings tensorrt-rtx-cu13-libs, "
                     "or bundle[rtx] on a build host)")


__all__ = ["FLAVOURS", "CudaMemory", "TensorRTBackend", "TensorRTEngine", "TensorRTPlan", "aot_targets",
           "flavour_of", "install_hint", "tensorrt_module"]


def tensorrt_module(flavour: str = "tensorrt"):
    """The flavour's Python module (no GPU needed), or EnvironmentProblem saying how to get it."""
    import importlib

    for name in FLAVOURS[flavour][0]:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise EnvironmentProblem(f"{NOT_INSTALLED}; {install_hint()}" if flavour == "tensorrt" else RTX_NOT_INSTALLED)


def _modules(flavour: str = "tensorrt"):
    trt = tensorrt_module(flavour)
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python < 12.6
        except ImportError:
            raise EnvironmentProblem("cuda-python is not installed; expected it next to TensorRT "
                                     "('pip install cuda-python')") from None
    return trt, cudart


def _check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise EnvironmentProblem(f"CUDA call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class TensorRTBackend:
    """The real backend: what load_engine needs from TensorRT (device info, build, load), of one flavour."""

    def __init__(self, flavour: str = "tensorrt"):
        if flavour not in FLAVOURS:
            raise ValueError(f"expected a TensorRT flavour among {sorted(FLAVOURS)}, found {flavour!r}")
        self.flavour = flavour
        self.name = "tensorrt" if flavour == "tensorrt" else "tensorrt-rtx"

    def version(self) -> str:
        """The version as engine keys name it ("rtx-" before TensorRT-RTX's); needs no GPU."""
        return FLAVOURS[self.flavour][1] + tensorrt_module(self.flavour).__version__

    def device(self) -> DeviceInfo | None:
        """This GPU and TensorRT version, or None (with `self.unavailable` saying why)."""
        try:
            trt, cudart = _modules(self.flavour)
            major = _check(cudart.cudaDeviceGetAttribute(
                cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor, 0))
            minor = _check(cudart.cudaDeviceGetAttribute(
                cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor, 0))
            props = _check(cudart.cudaGetDeviceProperties(0))
        except EnvironmentProblem as e:
            self.unavailable = str(e)
            return None
        name = props.name.decode(errors="replace").rstrip("\x00") if isinstance(props.name, bytes) else str(props.name)
        return DeviceInfo(f"{major}.{minor}", FLAVOURS[self.flavour][1] + trt.__version__, name)

    def build(self, onnx_path: Path, options: dict, out_plan: Path, compute_capability: str | None = None) -> None:
        """Build a plan for this GPU, or (TensorRT-RTX, `compute_capability` "12.1") for that SM, ahead of
        time: then no GPU and no CUDA library is needed."""
        trt = tensorrt_module(self.flavour)
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        flags = 0
        if hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH"):
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
        typed = options.get("dtype", "float32") != "float32"  # the graph carries its precision: keep its types
        if typed and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(onnx_path)):  # reads model.onnx.data beside it
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise ModelError(f"TensorRT cannot parse {onnx_path}: {errors}")
        config = builder.create_builder_config()
        if options.get("workspace_bytes"):
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options["workspace_bytes"]))
        if hasattr(config, "builder_optimization_level"):  # TensorRT-RTX has none
            config.builder_optimization_level = int(options.get("builder_optimization_level", 3))
        if compute_capability is not None:
            sm = getattr(trt, "ComputeCapability", None)
            wanted = getattr(sm, "SM" + compute_capability.replace(".", ""), None) if sm is not None else None
            if wanted is None:
                raise EnvironmentProblem(f"TensorRT {self.version()} cannot build ahead of time for compute "
                                         f"capability {compute_capability}; expected one of {aot_targets(trt)}")
            config.num_compute_capabilities = 1
            config.set_compute_capability(wanted, 0)
        if typed:  # precision flags are refused on strongly typed networks
            log.info("building the %s graph %s strongly typed", options["dtype"], onnx_path)
        elif options.get("precision") == "fp16" and hasattr(trt.BuilderFlag, "FP16"):
            config.set_flag(trt.BuilderFlag.FP16)
        elif options.get("precision") not in (None, "fp32"):
            log.warning("TensorRT %s is strongly typed: building %s in the graph's own precision",
                        trt.__version__, options.get("precision"))
        for prof in options["profiles"]:
            p = builder.create_optimization_profile()
            for name, s in prof["shapes"].items():
                p.set_shape(name, s["min"], s["opt"], s["max"])
            config.add_optimization_profile(p)
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise EnvironmentProblem(f"TensorRT failed to build an engine from {onnx_path} (see its log above)")
        write_atomic(Path(out_plan), bytes(plan))

    def load(self, plan: Path, *, options: dict, max_context: int | None = None) -> Engine:
        """A batched plan (build option kv_cache "batched"): runtime.engines.tensorrt_batched over this module's
        TensorRTPlan and CudaMemory; a concat plan: TensorRTEngine, slot by slot. One slot; the server
        allocates more."""
        if options.get("kv_cache") == "batched":
            from runtime.engines.tensorrt_batched import TensorRTBatchedEngine

            trt_plan = TensorRTPlan(plan, self.flavour)
            return TensorRTBatchedEngine(trt_plan, CudaMemory(trt_plan.cudart), options=options,
                                         max_context=max_context,
                                         description=f"{self.name} {trt_plan.version} "
                                                     f"{options.get('precision', 'fp32')} kv-cache batched")
        return TensorRTEngine(plan, options=options, max_context=max_context, flavour=self.flavour)


def aot_targets(trt) -> list[str]:
    """Compute capabilities the module's builder targets without a GPU (TensorRT-RTX's ComputeCapability: SM121
    -> "12.1"); none for TensorRT, which builds for the GPU it runs on."""
    names = [n for n in dir(getattr(trt, "ComputeCapability", object)) if n.startswith("SM") and n[2:].isdigit()]
    return sorted((f"{n[2:-1]}.{n[-1]}" for n in names), key=lambda cc: tuple(int(x) for x in cc.split(".")))


class TensorRTPlan:
    """runtime.engines.tensorrt_batched.Plan over a deserialized TensorRT engine, and its ExecutionContext: the
    only part of the batched engine that touches `tensorrt` (everything else is tested without it)."""

    def __init__(self, plan: Path, flavour: str = "tensorrt"):
        from runtime.engines.tensorrt_batched import PlanTensor

        trt, cudart = _modules(flavour)
        self._trt, self.cudart, self.version = trt, cudart, trt.__version__
        serialized = Path(plan).read_bytes()
        self.plan_bytes = len(serialized)
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(serialized)
        if self.engine is None:
            raise EnvironmentProblem(f"TensorRT cannot load {plan}: built for another GPU or TensorRT version")
        self.tensors = {}
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            self.tensors[name] = PlanTensor(name, tuple(int(d) for d in self.engine.get_tensor_shape(name)),
                                            np.dtype(trt.nptype(self.engine.get_tensor_dtype(name))),
                                            self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT)
        activations = getattr(self.engine, "device_memory_size_v2", None)
        self.activation_bytes = int(activations if activations is not None
                                    else getattr(self.engine, "device_memory_size", 0) or 0)
        self.stream = _check(cudart.cudaStreamCreate())
        self._context = None

    def context(self) -> "TensorRTPlan":
        self._context = self.engine.create_execution_context()
        return self

    def set_optimization_profile(self, index: int) -> None:
        if not self._context.set_optimization_profile_async(index, self.stream):
            raise EnvironmentProblem(f"TensorRT refused optimisation profile {index}")

    def set_input_shape(self, name: str, shape) -> None:
        if not self._context.set_input_shape(name, tuple(int(d) for d in shape)):
            raise EnvironmentProblem(f"TensorRT refused the shape {tuple(shape)} of {name} (outside the profile?)")

    def set_tensor_address(self, name: str, address: int) -> None:
        if not self._context.set_tensor_address(name, int(address)):
            raise EnvironmentProblem(f"TensorRT refused the address of {name}")

    def execute(self) -> None:
        if not self._context.execute_async_v3(self.stream):
            raise EnvironmentProblem("TensorRT execution failed (see its log above)")
        _check(self.cudart.cudaStreamSynchronize(self.stream))

    def close(self) -> None:
        self._context = None
        self.cudart.cudaStreamDestroy(self.stream)


class CudaMemory:
    """runtime.engines.cudalib.Cudart's interface (what the batched engine's buffers use) over cuda-python,
    the CUDA binding TensorRT's own Python samples use. Copies are synchronous, so they are done before the
    plan's next execution on its stream and before the host reads them."""

    def __init__(self, cudart):
        self.cudart = cudart
        self._kinds = cudart.cudaMemcpyKind
        self._kind = {1: self._kinds.cudaMemcpyHostToDevice, 2: self._kinds.cudaMemcpyDeviceToHost,
                      3: self._kinds.cudaMemcpyDeviceToDevice}

    def malloc(self, nbytes: int) -> int:
        return int(_check(self.cudart.cudaMalloc(max(int(nbytes), 1))))

    def free(self, ptr: int) -> None:
        self.cudart.cudaFree(ptr)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        _check(self.cudart.cudaMemset(ptr, value, nbytes))

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        if nbytes:
            _check(self.cudart.cudaMemcpy(dst, src, nbytes, self._kind[kind]))

    def memcpy2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                 kind: int = 3) -> None:
        if width and height:
            _check(self.cudart.cudaMemcpy2D(dst, dst_pitch, src, src_pitch, width, height, self._kind[kind]))

    def synchronize(self) -> None:
        _check(self.cudart.cudaDeviceSynchronize())


class _DeviceBuffer:
    def __init__(self, cudart, nbytes: int):
        self.cudart, self.nbytes = cudart, max(int(nbytes), 1)
        self.ptr = _check(cudart.cudaMalloc(self.nbytes))

    def free(self):
        if self.ptr:
            self.cudart.cudaFree(self.ptr)
            self.ptr = 0


class _SlotKV:
    """One slot's cache: two device buffers per layer and k/v (ping-pong, like the concat graph on
    ONNX Runtime); which one is live and how many tokens it holds are the engine's SlotTable."""

    def __init__(self, cudart, nbytes: int, tensors: int):
        self.kv = [[_DeviceBuffer(cudart, nbytes) for _ in range(tensors)] for _ in range(2)]

    def free(self) -> None:
        for buf in [*self.kv[0], *self.kv[1]]:
            buf.free()


class TensorRTEngine(Engine):
    """Runs a plan with each slot's KV cache in its own two device buffers (ping-pong).

    Batch 1 inside: plans are built from the concat graph with batch-1 profiles, so a forward over
    several slots runs its rows one after another (`batched = False`); slots, rollback, release
    and prefix copies follow the same interface as the batched ONNX Runtime engine.
    """

    batched = False

    def __init__(self, plan: Path, *, options: dict, max_context: int | None = None, num_slots: int = 1,
                 flavour: str = "tensorrt"):
        trt, cudart = _modules(flavour)
        self._trt, self._cudart = trt, cudart
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        serialized = Path(plan).read_bytes()
        self._plan_bytes = len(serialized)  # the plan holds the weights; TensorRT copies them to the GPU
        self.engine = runtime.deserialize_cuda_engine(serialized)
        if self.engine is None:
            raise EnvironmentProblem(f"TensorRT cannot load {plan}: built for another GPU or TensorRT version")
        self.context = self.engine.create_execution_context()
        built_max = int(options["max_context"])
        if max_context is not None and max_context > built_max:
            raise ModelError(f"max context {max_context} exceeds this engine's built maximum; "
                             f"expected at most {built_max}")
        self.max_context = max_context or built_max
        self._profiles = options["profiles"]
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self._past = [n for n in names if n.startswith("past_key_values.")]
        self._present = ["present." + n[len("past_key_values."):] for n in self._past]
        shape = self.engine.get_tensor_shape(self._past[0])  # [-1, kv, -1, hd]
        self.num_kv_heads, self.head_dim = int(shape[1]), int(shape[3])
        self.vocab_size = int(self.engine.get_tensor_shape("logits")[-1])
        self._has_mask = "attention_mask" in names
        # Element sizes from the plan itself (fp16 or fp32 graph), not from the options.
        self._itemsize = np.dtype(trt.nptype(self.engine.get_tensor_dtype(self._past[0]))).itemsize
        self._logits_dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype("logits")))
        self._slots: list[_SlotKV] = []
        self._max_new = max(p["shapes"]["input_ids"]["max"][1] for p in self._profiles)
        self._ids = _DeviceBuffer(cudart, self.max_context * 8)
        self._pos = _DeviceBuffer(cudart, self.max_context * 8)
        self._mask = _DeviceBuffer(cudart, self.max_context * 8)
        self._logits = _DeviceBuffer(cudart, self._max_new * self.vocab_size * self._logits_dtype.itemsize)
        self.stream = _check(cudart.cudaStreamCreate())
        self._profile = -1
        self.description = (f"{'tensorrt' if flavour == 'tensorrt' else 'tensorrt-rtx'} {trt.__version__} "
                            f"{options.get('precision', 'fp32')}")
        self.allocate_slots(num_slots)

    # --- slots -----------------------------------------------------------------------------------
    def _slot_bytes(self) -> int:
        """Bytes of one of a slot's buffers: [kv_heads, max_context, head_dim] of the plan's dtype."""
        return self.num_kv_heads * self.max_context * self.head_dim * self._itemsize

    def kv_bytes_per_slot(self) -> int:
        return 2 * len(self._past) * self._slot_bytes()

    def allocate_slots(self, num_slots: int) -> None:
        self.slots = SlotTable(num_slots, ping_pong=True)
        for slot in self._slots:
            slot.free()
        self._slots = [_SlotKV(self._cudart, self._slot_bytes(), len(self._past)) for _ in range(num_slots)]
        self.num_slots = num_slots

    def length(self, slot: int) -> int:
        return self.slots.lengths[slot]

    def _h2d(self, buf: _DeviceBuffer, array: np.ndarray) -> None:
        _check(self._cudart.cudaMemcpyAsync(buf.ptr, array.ctypes.data, array.nbytes,
                                            self._cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))

    def _pick_profile(self, n: int) -> int:
        for i, p in enumerate(self._profiles):
            if n <= p["shapes"]["input_ids"]["max"][1]:
                return i
        return len(self._profiles) - 1

    # --- forward ---------------------------------------------------------------------------------
    def forward(self, rows: Sequence[Row]) -> list[np.ndarray]:
        self.check_rows(rows)
        return [self._forward_slot(r.slot, list(r.tokens)) for r in rows]

    def _forward_slot(self, index: int, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        if n == 0:
            return np.zeros((0, self.vocab_size), np.float32)
        if n > self._max_new:  # longer prompts go through in chunks of the largest profile
            return np.concatenate([self._forward_slot(index, token_ids[i:i + self._max_new])
                                   for i in range(0, n, self._max_new)])
        slot = self._slots[index]
        past, total = self.slots.lengths[index], self.slots.lengths[index] + n
        ctx, kv, hd = self.context, self.num_kv_heads, self.head_dim
        profile = self._pick_profile(n)
        if profile != self._profile:
            ctx.set_optimization_profile_async(profile, self.stream)
            self._profile = profile
        ids = np.asarray(token_ids, np.int64).reshape(1, n)
        pos = np.arange(past, total, dtype=np.int64).reshape(1, n)
        mask = np.ones((1, total), np.int64)
        self._h2d(self._ids, ids)
        self._h2d(self._pos, pos)
        ctx.set_input_shape("input_ids", (1, n))
        ctx.set_tensor_address("input_ids", self._ids.ptr)
        ctx.set_input_shape("position_ids", (1, n))
        ctx.set_tensor_address("position_ids", self._pos.ptr)
        if self._has_mask:
            self._h2d(self._mask, mask)
            ctx.set_input_shape("attention_mask", (1, total))
            ctx.set_tensor_address("attention_mask", self._mask.ptr)
        live, other = self.slots.buffers(index)
        src, dst = slot.kv[live], slot.kv[other]
        for name, buf in zip(self._past, src):
            ctx.set_input_shape(name, (1, kv, past, hd))
            ctx.set_tensor_address(name, buf.ptr)
        for name, buf in zip(self._present, dst):
            ctx.set_tensor_address(name, buf.ptr)
        ctx.set_tensor_address("logits", self._logits.ptr)
        if not ctx.execute_async_v3(self.stream):
            raise EnvironmentProblem("TensorRT execution failed (see its log above)")
        host = np.empty((n, self.vocab_size), self._logits_dtype)
        _check(self._cudart.cudaMemcpyAsync(host.ctypes.data, self._logits.ptr, host.nbytes,
                                            self._cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream))
        _check(self._cudart.cudaStreamSynchronize(self.stream))
        self.slots.advance(index, n)
        return host.astype(np.float32, copy=False)

    # --- rollback and prefix copies --------------------------------------------------------------
    def _copy_rows(self, src: list, src_length: int, dst: list, length: int) -> None:
        """2D copy: every head's first `length` rows of the packed buffers `src` into `dst`, packed."""
        row = length * self.head_dim * self._itemsize
        pitch_src = src_length * self.head_dim * self._itemsize
        for s, d in zip(src, dst):
            _check(self._cudart.cudaMemcpy2DAsync(d.ptr, row, s.ptr, pitch_src, row, self.num_kv_heads,
                                                  self._cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                                                  self.stream))
        _check(self._cudart.cudaStreamSynchronize(self.stream))

    def rollback(self, slot: int, length: int) -> None:
        self.slots.rollback(slot, length, self._compact)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        self.slots.copy_prefix(src, dst, length, self._copy_prefix, self._compact)

    def _compact(self, slot: int, live: int, other: int, have: int, length: int) -> None:
        kv = self._slots[slot].kv
        self._copy_rows(kv[live], have, kv[other], length)

    def _copy_prefix(self, src: int, dst: int, have: int, length: int) -> None:
        a, b = self._slots[src].kv, self._slots[dst].kv
        self._copy_rows(a[self.slots.current[src]], have, b[self.slots.current[dst]], length)

    def memory(self) -> dict:
        """Weights: the serialized plan's size (weights plus a little kernel code; TensorRT exposes no
        per-engine weight total outside weight streaming). Activations: the scratch memory an execution
        context needs (device_memory_size_v2, TensorRT 10; device_memory_size before), which is not weights."""
        activations = getattr(self.engine, "device_memory_size_v2", None)
        if activations is None:
            activations = getattr(self.engine, "device_memory_size", 0)
        return {"weights": self._plan_bytes, "activations": int(activations or 0),
                "kv_cache": sum(b.nbytes for slot in self._slots for pair in slot.kv for b in pair),
                "buffers": sum(b.nbytes for b in (self._ids, self._pos, self._mask, self._logits))}

    def close(self) -> None:
        for slot in self._slots:
            slot.free()
        for buf in [self._ids, self._pos, self._mask, self._logits]:
            buf.free()
        self._cudart.cudaStreamDestroy(self.stream)
