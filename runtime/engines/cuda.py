"""ONNX Runtime's CUDA provider over the shipped graph: the `cuda` target, and TensorRT targets without TensorRT.

Slots (runtime.engines.base) as in runtime.engines.onnxruntime, their lengths and live buffers in the one
SlotTable (runtime.engines.slots; the engine supplies only the device-to-device row copies), with nothing on
the host that need not be:

- the KV cache lives in device memory (cudaMalloc, then zeroed: attention reads rows nobody wrote yet
  under its mask, and recycled memory may hold NaN), bound to the graph's past and present with
  I/O binding, so a step writes only the new tokens' keys and values, on the device;
- logits are computed into a device buffer and only the rows asked for come back: what each Row's
  `fetch` names (all, the last, none: a prefill chunk's logits nobody reads never leave the GPU),
  the last of every row (`forward(rows, last_only=True)`), or just the argmax of every position
  (`forward_greedy`, from the graph's `argmax` output: 8 bytes a token instead of a vocab-sized row);
- steps whose rows hold at most GRAPH_MAX_WIDTH tokens (decode, verification of k+1 draft tokens)
  run as CUDA graphs (ONNX Runtime's `enable_cuda_graph`), one graph per (batch bucket, width rounded up
  to a power of two, and for graphs that attend over a window, the window rounded up to a power of two):
  buckets of 1, 2, 4, 8, ... slots, slots 0..bucket-1, always at the same device addresses (inputs
  are copied into fixed device buffers, a slot without a row writes into the spare rows), captured
  on first use. Prefill chunks run without a graph. Measured on an H200 (benchmarks/bench_cuda.py):
  a Llama-3.2-1B-shaped decode step 1.8 ms with graphs, 4.8 ms without (launch-bound).

EAGLE-3 targets (graphs with `aux_hidden_states`, float32 [batch, width, aux_width]): the output is bound
to a device buffer per call shape like the logits (so a captured CUDA graph writes the same address), in
both graphs of the dual engine (each must have it, same width), and after every call each slot's real rows
(not the padding) come back as float32 in `last_aux_hidden[slot]`, as runtime.engines.onnxruntime does,
whether or not logits are fetched (forward_greedy too). Not yet run on a GPU (tests/runtime/engines/
test_cuda_engine.py has the device tests; test_cuda_eagle3_host.py runs the same code on host memory).

Layouts: "batched" (TensorScatter + Attention; the `cuda` target's graph, written in fp16 or bf16 by
bundler.onnx.inplace): one call for every row of a step. Its GroupQueryAttention variant
(bundler.onnx.inplace.GQA_FUSIONS: inputs seqlens_k and total_sequence_length instead of positions,
write offsets and a mask; fused rotary, packed QKV, one flash-decoding kernel that reads only each
row's own length) uses the same cache layout; ONNX Runtime's GroupQueryAttention takes a batch of
single-token rows but refuses a batch of longer rows after a past ("batch_size must be 1 when
sequence_length > 1"), so there the decode rows of a step are one call and each longer row
(prefill chunk, verification) is a call of its own, without a CUDA graph. "concat" (the fp16 graph TensorRT targets
carry, run here when TensorRT is absent): rows one by one, batch 1, two device buffers per slot that
take turns. The "shared" GroupQueryAttention graph is a cpu-target graph and is refused.

Token trees (Row.tree, runtime.engines.base.TreeMask; `supports_tree` on the Attention graph, batched):
a tree row's mask and position ids are written as the CPU batched engine writes them
(runtime.engines.onnxruntime.tree_mask) into the same input buffers, so tree rows share calls and CUDA
graphs with chains; under the dual engine every tree row, a one-token one included, runs on the Attention
graph. keep_rows moves the accepted path's K/V rows into place with device-to-device copies.

Both graphs at once (`decode_graph`, what `cuda` bundles carry: bundler.onnx.dual): the Attention
graph and the GroupQueryAttention graph share the cache buffers and the weights. A step's
single-token rows are one call of the GroupQueryAttention graph (a CUDA graph), its multi-token rows
(verification, prefill chunks) calls of the Attention graph (verification as CUDA graphs); a row is in
exactly one call, and each call writes only its own rows' positions of their slots (a slot without a
row writes its spare rows past max_context), so the order of the calls does not matter. Both write
the same cache contents (rotary applied to K before the write, same dtype). The weights are read once
into device memory and given to both ONNX Runtime sessions as shared initializers
(SessionOptions.add_initializer, DLPack OrtValues over the engine's own allocations: ONNX Runtime refuses
initializers in memory it allocated; runtime.engines.shared_weights, runtime.engines.dlpack): neither session holds a copy of its own. Where onnxruntime cannot
import DLPack memory the engine runs the Attention graph alone (decode_graph_error says why).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Collection, Sequence

import numpy as np

from manifests.errors import EnvironmentProblem, ModelError
from manifests.limits import LIMITS
from runtime.engines.base import Engine, Row
from runtime.engines.cudalib import (D2D, D2H, H2D, Cudart, DeviceBuffer, fetch_group, fetch_rows, grow_buffer,
                                     onnxruntime_cuda, pack_aligned)
from runtime.engines.device_states import DeviceStates
from runtime.engines.onnxruntime import (OnnxRuntimeEngine, batched_inputs, batched_mask, bind_row_inputs,
                                         check_capacity, static_capacity)
from runtime.engines.shared_weights import SHARED_WEIGHTS_INDEX, read_shared_weights
from runtime.engines.slots import SlotTable

log = logging.getLogger(__name__)

__all__ = ["CudaEngine", "batch_buckets"]

#: ONNX type strings -> (numpy dtype for host copies, element type for binding). bf16 has no numpy type.
TYPES = {"tensor(float)": (np.float32, np.float32), "tensor(float16)": (np.float16, np.float16),
         "tensor(bfloat16)": (np.uint16, 16)}
PRECISION = {"tensor(float)": "fp32", "tensor(float16)": "fp16", "tensor(bfloat16)": "bf16"}
#: Steps whose rows are at most this many tokens run as CUDA graphs (decode; verification of k+1 drafts).
GRAPH_MAX_WIDTH = 8
#: A graph run's attention window is a power of two at least this long (fewer captures), at most the capacity.
MIN_WINDOW = 256
#: A greedy chain's rounds in one call at most (the size of its tokens' buffer); longer chains run call by call.
MAX_CHAIN_ROUNDS = 16
#: The first runs of a graph id are not replays: ONNX Runtime runs it once ordinarily (its memory planned), then
#: captures it (onnxruntime's min_num_runs_before_cuda_graph_capture_ is 1); Engine.cold_runs counts them.
GRAPH_WARMUP = 2


def graph_window(rows: int, capacity: int) -> int:
    """The attention window of a graph run whose rows reach cache row `rows`: rounded up to a power of two (at least
    MIN_WINDOW, at most `capacity`), so one captured graph serves every length up to it."""
    return min(capacity, max(MIN_WINDOW, 1 << (rows - 1).bit_length()))


def graph_width(tokens: int) -> int:
    """The tokens a row of a graph run holds: its longest row's, rounded up to a power of two, so one captured graph
    serves verifications of k + 1 and k tokens alike and the adaptive length's other choices capture few graphs
    more (padding tokens write past their slot's length, into rows the next tokens overwrite)."""
    return 1 << (tokens - 1).bit_length()


def batch_buckets(num_slots: int) -> list[int]:
    """Batch sizes a decode step is padded to (one CUDA graph each): powers of two, and num_slots."""
    out, b = [], 1
    while b < num_slots:
        out.append(b)
        b *= 2
    return out + [num_slots]


class _Lane:
    """One ONNX Runtime session over the engine's cache, with its own I/O binding and CUDA graphs."""

    def __init__(self, session, name: str):
        self.session, self.name = session, name
        ins = {i.name for i in session.get_inputs()}
        self.gqa = "seqlens_k" in ins  # the GroupQueryAttention decode graph
        meta = session.get_modelmeta().custom_metadata_map
        self.windowed = meta.get("bundle.attention_window") == "1"  # else the mask spans the capacity
        self.graphs: dict[tuple, int] = {}  # (bucket, width, window, allocation) -> gpu_graph_id
        self.runs: dict[int, int] = {}  # gpu_graph_id -> runs so far (its first GRAPH_WARMUP are cold)
        self.io = None
        self.bound_inputs = self.bound_outputs = self.bound = None
        self.chains: dict[tuple, tuple] = {}  # greedy_chain's rounds: key -> (binding, input buffer, graph id)

    @property
    def binding(self):
        if self.io is None:
            self.io = self.session.io_binding()
            self.bound_inputs = self.bound_outputs = self.bound = None
        return self.io


class CudaEngine(Engine):
    def __init__(self, graph: Path, *, max_context: int | None = None, num_slots: int = 1,
                 kv_cache: str | None = None, cuda_graphs: bool = True, device_id: int = 0, memory=None,
                 profile: bool = False, decode_graph: Path | None = None, fixed_shapes: bool | None = None):
        """`memory`: None for the GPU; tests pass a host-memory object with Cudart's methods, and the
        engine then binds host buffers and runs on ONNX Runtime's CPU provider (its bookkeeping, no GPU).
        `fixed_shapes`: steps of at most GRAPH_MAX_WIDTH tokens a row take a CUDA graph's shapes (a bucket of slots,
        a power of two tokens a row and window rows) even without CUDA graphs (tests on host memory: the shapes
        graphs replay, through the CPU provider); None: where CUDA graphs replay.
        `profile`: ONNX Runtime's profiler on, for `node_providers` (which provider ran each node).
        `decode_graph`: the GroupQueryAttention graph over `graph`'s weights (bundler.onnx.dual), for
        the single-token rows of a step; `graph` (the Attention graph) then runs the multi-token rows."""
        if memory is None:
            ort, why = onnxruntime_cuda()
            if ort is None:
                raise EnvironmentProblem(f"the CUDA engine cannot run here: {why}")
            self.cudart, self._device, self._provider = Cudart.load(), "cuda", "CUDAExecutionProvider"
        else:
            import onnxruntime as ort

            self.cudart, self._device, self._provider, cuda_graphs = memory, "cpu", "CPUExecutionProvider", False
        graph = Path(graph)
        if not graph.is_file():
            raise EnvironmentProblem(f"expected the ONNX graph at {graph}, found nothing")
        self._ort, self._graph, self.device_id, self._profile = ort, graph, device_id, profile
        self._decode_graph = None if decode_graph is None else Path(decode_graph)
        if self._decode_graph is not None and not self._decode_graph.is_file():
            raise EnvironmentProblem(f"expected the decode graph at {self._decode_graph}, found nothing")
        self.shared_weights, self._weight_buffers, self.decode_graph_error = {}, [], None
        if self._decode_graph is not None:
            try:
                self.shared_weights, self._weight_buffers = read_shared_weights(
                    self._decode_graph.with_name(SHARED_WEIGHTS_INDEX), graph, ort, self.cudart,
                    self._device == "cuda", device_id)
            except (AttributeError, TypeError, RuntimeError, ValueError) as e:
                # this onnxruntime cannot take device memory of ours as an initializer: two sessions
                # would hold two copies of the weights, so the Attention graph runs every row instead
                self.decode_graph_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning("running %s alone, without its decode graph %s: %s", graph, self._decode_graph,
                            self.decode_graph_error)
                self._decode_graph = None
        self.cuda_graphs, self.cuda_graph_error = cuda_graphs, None
        self.session = self._load(graph)
        self._lane = self._decode = _Lane(self.session, "main")
        if self._decode_graph is not None:
            self._decode = _Lane(self._load(self._decode_graph), "decode")
            if self._lane.gqa or not self._decode.gqa:
                raise ModelError(f"expected {graph} to be an Attention graph and {self._decode_graph} a "
                                 f"GroupQueryAttention graph (input seqlens_k), found otherwise")
        meta = self.session.get_modelmeta().custom_metadata_map
        self.kv_cache = meta.get("bundle.kv_cache", "concat")
        if self.kv_cache not in ("batched", "concat"):
            raise ModelError(f"{graph}: the CUDA engine runs the batched or concat KV-cache graphs, "
                             f"found {self.kv_cache!r}")
        if kv_cache is not None and kv_cache != self.kv_cache:
            raise ModelError(f"{graph}: the engine record expects a {kv_cache!r} KV-cache graph, the graph is "
                             f"{self.kv_cache!r}")
        self._read_signature()
        if self._decode is not self._lane:
            self._check_same_cache(self._decode.session)
        graph_max = int(meta.get("bundle.max_positions", 0)) or None
        limit = int(max_context or graph_max or 0)
        if not limit:
            raise ModelError(f"{graph}: no bundle.max_positions in the graph metadata; pass max_context")
        if graph_max is not None and limit > graph_max:
            raise ModelError(f"max context {limit} exceeds what the model supports; expected at most {graph_max}")
        self.batched = self.kv_cache == "batched"
        # token trees: the Attention graph takes any mask and position ids (GroupQueryAttention takes neither);
        # a recurrent state cannot branch
        self.supports_tree = self.batched and not self._lane.gqa and self._states is None
        self._headroom = int(meta.get("bundle.kv_headroom", 0)) if self.batched else 0
        self._fixed_capacity = static_capacity(meta, self._headroom, graph)  # the graph TensorRT targets carry
        if self._fixed_capacity and not max_context:
            limit = self._fixed_capacity - self._headroom
        self._generation = 0
        self._buffers: list = []
        self._scratch: dict[str, DeviceBuffer] = {}
        # Recurrent hybrids run without CUDA graph replay: measured on an H200 (onnxruntime-gpu 1.31.1), their
        # captured graphs left the states after a mixed batch or a rollback off the uncaptured run's (parity with
        # transformers held only without replay); every call is then an ordinary run (gpu_graph_id -1)
        self._replay = (self.cuda_graphs if fixed_shapes is None else fixed_shapes) and self._states is None
        if self.cuda_graphs and self._states is not None:
            self.cuda_graph_error = "recurrent states: CUDA graph replay is off for hybrid graphs"
        self.description = (f"onnxruntime {ort.__version__} {self._provider} {self.precision} "
                            f"kv-cache {self.kv_cache}{' gqa' if self._lane.gqa else ''}"
                            f"{' + gqa decode' if self.dual else ''}"
                            f"{' cuda-graphs' if self._replay and self.cuda_graphs else ''}")
        self.allocate_slots(num_slots, max_context=limit)

    @property
    def captures_graphs(self) -> bool:
        return bool(self._replay and self.cuda_graphs)

    @property
    def dual(self) -> bool:
        """Whether single-token rows run through the GroupQueryAttention decode graph."""
        return self._decode is not self._lane

    def _load(self, graph: Path):
        """A session over `graph`, with CUDA graphs if self.cuda_graphs and ONNX Runtime allows them
        (else self.cuda_graphs becomes False, with the reason in cuda_graph_error)."""
        session = None
        if self.cuda_graphs:
            try:
                session = self._session(graph, True)
            except Exception as e:  # ONNX Runtime refuses graphs when some node is not on the CUDA provider
                self.cuda_graph_error = str(e).splitlines()[0]
                log.warning("CUDA graphs are off for %s: %s", graph, self.cuda_graph_error)
                self.cuda_graphs = False
        if session is None:
            try:
                session = self._session(graph, False)
            except Exception as e:
                raise ModelError(f"ONNX Runtime's CUDA provider cannot load {graph}: {str(e).splitlines()[0]}") from None
        if session.get_providers()[0] != self._provider:
            raise EnvironmentProblem(f"expected ONNX Runtime to run {graph} on {self._provider}, "
                                     f"found {session.get_providers()}")
        return session

    def _session(self, graph: Path, cuda_graphs: bool):
        ort = self._ort
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self._profile:
            so.enable_profiling = True
        for name, value in self.shared_weights.items():
            so.add_initializer(name, value)
        if self.shared_weights and self._device == "cpu":  # the CPU MatMul would copy its weights to prepack them
            so.add_session_config_entry("session.disable_prepacking", "1")
        if self._device == "cpu":
            return ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
        options = {"device_id": str(self.device_id), "enable_cuda_graph": "1" if cuda_graphs else "0"}
        return ort.InferenceSession(str(graph), so, providers=[("CUDAExecutionProvider", options)])

    def _check_same_cache(self, session) -> None:
        """The decode graph must read and write the cache exactly as the main graph does."""
        ins = {i.name: i for i in session.get_inputs()}
        main = {i.name: i for i in self.session.get_inputs()}
        outs = {o.name for o in session.get_outputs()}
        for name in self._past:
            if name not in ins or ins[name].type != main[name].type or ins[name].shape[1:2] + ins[name].shape[3:] \
                    != main[name].shape[1:2] + main[name].shape[3:]:
                raise ModelError(f"{self._decode_graph}: expected the cache input {name} as in {self._graph} "
                                 f"({main[name].type} {main[name].shape}), found "
                                 f"{ins[name].type + ' ' + str(ins[name].shape) if name in ins else 'none'}")
        missing = [n for n in (*self._present, "logits") if n not in outs]
        if missing or self._has_argmax and "argmax" not in outs:
            raise ModelError(f"{self._decode_graph}: expected the outputs of {self._graph}, found "
                             f"{sorted(outs)[:6]}")
        aux = self._aux_width_of(session, self._decode_graph)
        if aux != self.aux_width:  # EAGLE-3 reads the aux rows of every step, whichever graph ran it
            raise ModelError(f"{self._decode_graph}: expected aux_hidden_states of width {self.aux_width} as in "
                             f"{self._graph} (0: none), found {aux}")
        meta = session.get_modelmeta().custom_metadata_map
        mine = self.session.get_modelmeta().custom_metadata_map
        for key in ("bundle.kv_headroom", "bundle.max_positions", "bundle.dtype", "bundle.kv_cache"):
            if meta.get(key) != mine.get(key):
                raise ModelError(f"{self._decode_graph}: expected {key} {mine.get(key)!r} as in {self._graph}, "
                                 f"found {meta.get(key)!r}")

    def _read_signature(self) -> None:
        ins = {i.name: i for i in self.session.get_inputs()}
        outs = {o.name: o for o in self.session.get_outputs()}
        layers = sum(1 for n in ins if n.startswith("past_key_values.") and n.endswith(".key"))
        if not layers or "input_ids" not in ins or "logits" not in outs:
            raise ModelError(f"{self._graph}: expected a KV-cache decoder graph, found inputs {sorted(ins)[:6]}")
        self._past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
        self._present = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
        shape = ins[self._past[0]].shape
        self.num_layers, self.num_kv_heads, self.head_dim = layers, int(shape[1]), int(shape[3])
        self.vocab_size = int(outs["logits"].shape[-1])
        kv_type = ins[self._past[0]].type
        if kv_type not in TYPES or outs["logits"].type != "tensor(float)":
            raise ModelError(f"{self._graph}: expected a float32/float16/bfloat16 KV cache and float32 logits, "
                             f"found {kv_type} and {outs['logits'].type}")
        self.kv_dtype = np.dtype(TYPES[kv_type][0])
        self._kv_element = TYPES[kv_type][1]
        self.precision = PRECISION[kv_type]
        self._itemsize = self.kv_dtype.itemsize
        self._has_argmax = "argmax" in outs
        # EAGLE-3 targets: aux_hidden_states [batch, width, aux_width] float32 beside the logits; each
        # forward leaves the real rows of every slot it advanced in last_aux_hidden (as the CPU engine)
        self.aux_width = self._aux_width_of(self.session, self._graph)
        self.last_aux_hidden: dict[int, np.ndarray] = {}
        self._has_mask = "attention_mask" in ins
        self._has_positions = "position_ids" in ins
        # hybrid graphs (Gated DeltaNet, Mamba-2): recurrent states per slot on the device (runtime.engines.device_states)
        states = DeviceStates.of(ins, outs, self.session.get_modelmeta().custom_metadata_map, self._graph)
        if states is not None and self.kv_cache != "batched":
            raise ModelError(f"{self._graph}: expected recurrent states in a batched graph, found {self.kv_cache!r}")
        self._states = states.attach(self.cudart, self._device, self.device_id, self._scratch_buffer) \
            if states is not None else None
        self.recurrent = self._states is not None
        self._total = np.zeros((), np.int32)  # its total_sequence_length: host memory, read by the kernel's host code

    @staticmethod
    def _aux_width_of(session, graph: Path) -> int:
        """The width of `session`'s aux_hidden_states output (0 without one); it must be float32."""
        aux = {o.name: o for o in session.get_outputs()}.get("aux_hidden_states")
        if aux is None:
            return 0
        if aux.type != "tensor(float)" or len(aux.shape) != 3 or not isinstance(aux.shape[-1], int):
            raise ModelError(f"{graph}: expected aux_hidden_states float32 [batch, width, static aux width], "
                             f"found {aux.type} {aux.shape}")
        return int(aux.shape[-1])

    # --- memory --------------------------------------------------------------------------------
    def _rows_per_slot(self) -> int:
        return self.capacity if self.batched else 2 * self.max_context

    def kv_bytes_per_slot(self) -> int:
        kv = len(self._past) * self.num_kv_heads * self._rows_per_slot() * self.head_dim * self._itemsize
        return kv + (self._states.bytes_per_slot() if self._states else 0)

    def allocate_slots(self, num_slots: int, max_context: int | None = None) -> None:
        """(Re)allocate the device caches for `num_slots` empty slots (and a new max_context, if given)."""
        slots = SlotTable(num_slots, ping_pong=not self.batched)  # concat: two buffers per slot take turns
        for buf in self._flat_buffers():
            buf.free()
        self.max_context = int(max_context or self.max_context)
        check_capacity(self._fixed_capacity, self.max_context, self._headroom, self._graph)
        self.capacity = self._fixed_capacity or self.max_context + self._headroom
        self.num_slots = int(num_slots)
        per_head = self.num_kv_heads * self.head_dim * self._itemsize
        if self.batched:  # [layer*2 + kv] -> [slots, kv_heads, capacity, head_dim]
            self._buffers = [DeviceBuffer(self.cudart, num_slots * per_head * self.capacity) for _ in self._past]
        else:  # [slot][copy][layer*2 + kv] -> [kv_heads, length, head_dim], packed
            self._buffers = [[[DeviceBuffer(self.cudart, per_head * self.max_context) for _ in self._past]
                              for _ in range(2)] for _ in range(num_slots)]
        # cudaMalloc does not clear: memory this process freed earlier (an earlier engine's, ONNX Runtime's
        # arenas) comes back with its old bytes, NaN and inf among them. Attention reads cache rows no row
        # has written yet (a window rounded up for a CUDA graph, the rows beyond a shorter slot's length in
        # a shared call) under its mask, and a masked NaN still poisons the sum (0 * NaN), so the cache
        # starts as zeros, as the CPU engine's does. The memset runs on the legacy stream and ONNX Runtime's
        # stream does not wait for it.
        for buf in self._flat_buffers():
            self.cudart.memset(buf.ptr, 0, buf.nbytes)
        self.cudart.synchronize()
        if self._states:
            self._states.allocate(num_slots)
        self.slots = slots
        self._generation += 1
        self.buckets = batch_buckets(num_slots)

    def _flat_buffers(self) -> list[DeviceBuffer]:
        if self.batched:
            return list(self._buffers)
        return [b for slot in self._buffers for copy in slot for b in copy]

    def _scratch_buffer(self, name: str, nbytes: int) -> DeviceBuffer:
        """A device buffer that only grows (its address changes only when it grows)."""
        return grow_buffer(self._scratch, name, self.cudart, nbytes)

    def memory(self) -> dict:
        data = self._graph.with_name(self._graph.name + ".data")
        weights = self._graph.stat().st_size + (data.stat().st_size if data.exists() else 0)
        if self._decode_graph is not None:  # its weights are the main graph's (one copy)
            weights += self._decode_graph.stat().st_size
        return {"weights": weights, "kv_cache": self.kv_bytes_per_slot() * self.num_slots}

    def close(self) -> None:
        if self._states:
            self._states.close()
        for buf in self._flat_buffers() + list(self._scratch.values()):
            buf.free()
        self._buffers, self._scratch, self.session = [], {}, None
        self._lane = self._decode = None
        self.shared_weights = {}  # after the sessions: what they read from
        for buf in self._weight_buffers:
            buf.free()
        self._weight_buffers = []

    # --- slots ---------------------------------------------------------------------------------
    def length(self, slot: int) -> int:
        return self.slots.lengths[slot]

    def forward(self, rows: Sequence[Row], *, last_only: bool = False) -> list[np.ndarray]:
        """float32 logits per row: [len(tokens), vocab], or [1, vocab] of its last token with last_only."""
        return self._forward(rows, "last" if last_only else "all")

    def forward_greedy(self, rows: Sequence[Row], logits_for: Collection[int] = ()) -> list[np.ndarray]:
        """The argmax token after each of a row's tokens (int64 [len(tokens)]): greedy decoding and
        greedy verification without copying logits to the host. Rows of the slots in `logits_for`
        get the logits their `fetch` names instead, from the same call."""
        if not self._has_argmax:
            return [lg if r.slot in logits_for else lg.argmax(-1) for r, lg in zip(rows, self._forward(rows, "all"))]
        return self._forward(rows, "argmax", logits_for)

    def _forward(self, rows: Sequence[Row], want: str, logits_for: Collection[int] = ()) -> list[np.ndarray]:
        """`want`: "all" (each row's fetch), "last" or "argmax" (but each row's fetch for logits_for)."""
        self.check_rows(rows)
        wants = {r.slot: r.fetch if want == "all" or (want == "argmax" and r.slot in logits_for) else want
                 for r in rows}
        out: dict[int, np.ndarray] = {}
        live = [r for r in rows if len(r.tokens)]
        for r in rows:
            if not len(r.tokens):
                out[r.slot] = (np.zeros(0, np.int64) if wants[r.slot] == "argmax"
                               else np.zeros((0, self.vocab_size), np.float32))
        if self.batched:
            lane = self._lane
            if self.dual:  # single-token rows: one GroupQueryAttention call; the others: the Attention graph
                # (a tree row of one token too: its node sees its ancestors only, not every cached row)
                decode = [r for r in live if len(r.tokens) == 1 and r.tree is None]
                if decode:
                    out.update(self._run_batched(self._decode, decode, wants))
                groups = self._groups([r for r in live if len(r.tokens) > 1 or r.tree is not None])
            elif lane.gqa:  # GroupQueryAttention alone: a multi-token row after a past is a call of its own
                groups = [[r for r in live if len(r.tokens) == 1]] + [[r] for r in live if len(r.tokens) > 1]
            else:
                groups = self._groups(live)
            for group in groups:
                if group:
                    out.update(self._run_batched(lane, group, wants))
        else:
            for r in live:
                out[r.slot] = self._run_one(r.slot, r.tokens, wants[r.slot])
        return [out[r.slot] for r in rows]

    @property
    def chains_on_device(self) -> bool:
        return bool(self.batched and self._has_argmax and self._states is None and not self.aux_width
                    and self._headroom >= 1)

    def greedy_chain(self, rows: Sequence[Row], rounds: int) -> list[np.ndarray] | None:
        """`rounds` single-token decode calls for the rows in one go: round r + 1's input ids are round r's `argmax`
        output where it lies, on the device; every round's small inputs go over in one copy before the first, the
        rounds are launched back to back (ONNX Runtime told not to wait for the GPU after each), and only the
        tokens come back, after the last. Each round a CUDA graph of its own (its buffers are its own), as a
        decode step is: slots 0..bucket-1, the same window every round. None (the caller decodes call by call)
        for a graph without the argmax output, hybrids and EAGLE-3 targets, more than MAX_CHAIN_ROUNDS rounds, or
        a slot whose context cannot hold them."""
        lane = self._decode
        if not (self.chains_on_device and 1 <= rounds <= MAX_CHAIN_ROUNDS):
            return None
        if any(len(r.tokens) != 1 or r.tree is not None for r in rows):
            raise ValueError("expected decode rows: one token each, no tree")
        self.check_rows(rows)
        slots = [r.slot for r in rows]
        lengths = list(self.slots.lengths)
        if any(lengths[s] + rounds > self.max_context for s in slots):
            return None
        hi, cap = next(b for b in self.buckets if b > max(slots)), self.capacity
        window = graph_window(max(lengths[s] for s in slots) + rounds, cap) if lane.windowed else cap
        tokens = self._scratch_buffer(f"chain-tokens-{hi}", MAX_CHAIN_ROUNDS * hi * 8)
        launches = []
        for r in range(rounds):  # round r's inputs at the lengths it writes at; its ids from the last round's argmax
            group = rows if r == 0 else [Row(s, [0]) for s in slots]
            ids, write, positions = batched_inputs(group, 0, hi, lengths, cap)
            parts = [("input_ids", ids, np.int64)] if r == 0 else []
            if lane.gqa:
                parts.append(("seqlens_k", write.astype(np.int32), np.int32))
            else:
                parts += [("position_ids", positions, np.int64), ("write_indices", write, np.int64),
                          ("attention_mask", batched_mask(group, 0, positions, write, window), np.bool_)]
            host, offsets = pack_aligned([array for _, array, _ in parts])
            key = (hi, window, r, self._generation)
            if key not in lane.chains:
                lane.chains[key] = self._bind_chain(lane, key, parts, offsets, host.nbytes, tokens)
            binding, buffer, graph_id = lane.chains[key]
            self.cudart.memcpy(buffer.ptr, host.ctypes.data, host.nbytes, H2D)
            launches.append((binding, graph_id))
            for s in slots:
                lengths[s] += 1
        self._total[()] = cap
        self.cudart.synchronize()  # the pageable copies may still be in flight; ONNX Runtime's stream does not wait
        for r, (binding, graph_id) in enumerate(launches):
            lane.session.run_with_iobinding(binding, self._run_options(lane, graph_id, wait=r == rounds - 1))
        out = np.empty((rounds, hi), np.int64)
        self.cudart.memcpy(out.ctypes.data, tokens.ptr, out.nbytes, D2H)
        for s in slots:
            self.slots.advance(s, rounds)
        return [out[:, s].copy() for s in slots]

    def _bind_chain(self, lane: _Lane, key: tuple, parts, offsets, nbytes: int, tokens: DeviceBuffer) -> tuple:
        """Round r's own binding (buffers fixed for its CUDA graph): its inputs, from round 1 on the ids at row r - 1
        of `tokens`, the cache of slots 0..hi-1, logits into one buffer every round overwrites (nobody reads them),
        the argmax into row r of `tokens`."""
        hi, window, r, _ = key
        dev, did = self._device, self.device_id
        buffer = self._scratch_buffer(f"chain-inputs-{lane.name}-{hi}x{window}-{r}", nbytes)
        logits = self._scratch_buffer(f"chain-logits-{hi}", hi * self.vocab_size * 4)
        binding = lane.session.io_binding()
        for (name, array, dtype), off in zip(parts, offsets):
            binding.bind_input(name, dev, did, dtype, list(array.shape), buffer.ptr + off)
        if r:
            binding.bind_input("input_ids", dev, did, np.int64, [hi, 1], tokens.ptr + (r - 1) * hi * 8)
        if lane.gqa:
            binding.bind_input("total_sequence_length", "cpu", 0, np.int32, [], self._total.ctypes.data)
        shape = [hi, self.num_kv_heads, self.capacity, self.head_dim]
        for past, present, buf in zip(self._past, self._present, self._buffers):
            binding.bind_input(past, dev, did, self._kv_element, shape, buf.ptr)
            binding.bind_output(present, dev, did, self._kv_element, shape, buf.ptr)
        binding.bind_output("logits", dev, did, np.float32, [hi, 1, self.vocab_size], logits.ptr)
        binding.bind_output("argmax", dev, did, np.int64, [hi, 1], tokens.ptr + r * hi * 8)
        graph_id = lane.graphs.setdefault(("chain", *key), len(lane.graphs) + 1) if self._replay else None
        return binding, buffer, graph_id

    def _run_options(self, lane: _Lane, graph_id: int | None, wait: bool = True):
        """RunOptions of one run of `lane`: its CUDA graph's id where graphs are on (-1, None here: an ordinary run),
        the graph's runs counted (its first GRAPH_WARMUP are cold, Engine.cold_runs). `wait` False: ONNX Runtime
        returns once the run is queued (a chain's next round reads its outputs in the same stream)."""
        options = self._ort.RunOptions()
        if self.cuda_graphs:
            options.add_run_config_entry("gpu_graph_id", str(graph_id if graph_id is not None else -1))
        if graph_id is not None:
            lane.runs[graph_id] = lane.runs.get(graph_id, 0) + 1
            self.cold_runs += lane.runs[graph_id] <= GRAPH_WARMUP
        if not wait:
            options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        return options

    #: Similar lengths share a call, a row longer than the headroom goes alone: the CPU engine's rule.
    _groups = OnnxRuntimeEngine._groups

    # --- batched -------------------------------------------------------------------------------
    def _run_batched(self, lane: _Lane, group: list[Row], wants: dict[int, str]) -> dict[int, np.ndarray]:
        width = max(len(r.tokens) for r in group)
        hi = max(r.slot for r in group) + 1
        use_graph = self._replay and (width == 1 if lane.gqa else width <= GRAPH_MAX_WIDTH)
        if use_graph:  # decode, verify: a bucket of slots 0..bucket-1, a power of two tokens a row
            lo, hi, width = 0, next(b for b in self.buckets if b >= hi), graph_width(width)
        else:
            lo = min(r.slot for r in group)
        batch, cap = hi - lo, self.capacity
        ids, write, positions = batched_inputs(group, lo, hi, self.slots.lengths, cap, width)
        # Attention runs over the first `window` cache rows (windowed graphs): every real row's past and
        # new tokens. A graph's shapes are fixed, so graph steps round it up to a power of two (>= 256).
        window = cap
        if lane.windowed:
            window = max(self.slots.lengths[r.slot] for r in group) + width
            if use_graph:
                window = graph_window(window, cap)
        graph_id = lane.graphs.setdefault((hi, width, window, self._generation), len(lane.graphs) + 1) \
            if use_graph else None
        mask = None if lane.gqa else batched_mask(group, lo, positions, write, window)
        counts = {r.slot: len(r.tokens) for r in group}
        self._bind_inputs(lane, batch, width, window, ids, positions, write, mask,
                          self._states.inputs(lo, hi, counts) if self._states else ())
        self._bind_cache(lane, lo, hi)
        logits, argmax, aux = self._bind_outputs(batch, width, lane)
        captures = self._states.before_run(lane.binding, lo, hi, counts, self.slots.lengths, width) \
            if self._states else None
        lane.session.run_with_iobinding(lane.binding, self._run_options(lane, graph_id))
        out = dict(zip((r.slot for r in group), fetch_group(
            self.cudart, logits.ptr, argmax.ptr, self.vocab_size, batch, width,
            [(r.slot - lo, len(r.tokens), wants[r.slot]) for r in group])))
        if aux is not None:  # one copy of the call's aux rows for every slot in it
            block = self._fetch_aux(aux, batch * width, 0, batch * width).reshape(batch, width, self.aux_width) \
                if len(group) > 1 else None
            for r in group:
                n, row = len(r.tokens), r.slot - lo
                self.last_aux_hidden[r.slot] = block[row, :n].copy() if block is not None \
                    else self._fetch_aux(aux, width, row, n)
        for r in group:
            self.slots.advance(r.slot, len(r.tokens))
        if self._states:
            self._states.after_run(lo, {r.slot: r.tokens for r in group}, captures, width)
        return out

    def _bind_inputs(self, lane, batch, width, window, ids, positions, write, mask, extra=()) -> None:
        """One host-to-device copy of every small input into a fixed device buffer (what graphs replay);
        `extra`: more (name, array, dtype) inputs (the hybrids' new_tokens and capture_count)."""
        if lane.gqa:  # seqlens_k: each row's length after this step - 1 (the spare rows: the capacity's end)
            parts = [("input_ids", ids, np.int64), ("seqlens_k", (write + width - 1).astype(np.int32), np.int32)]
            self._total[()] = self.capacity  # rows attend by seqlens_k; this only bounds the cache
        else:
            parts = [("input_ids", ids, np.int64), ("position_ids", positions, np.int64),
                     ("write_indices", write, np.int64), ("attention_mask", mask, np.bool_)]
        parts += list(extra)
        host, offsets = pack_aligned([array for _, array, _ in parts])
        total = host.nbytes
        buf = self._scratch_buffer(f"inputs-{lane.name}-{batch}x{width}x{window}", total)
        self.cudart.memcpy(buf.ptr, host.ctypes.data, total, H2D)
        self.cudart.synchronize()  # a pageable copy may still be in flight; ONNX Runtime's stream does not wait
        key = ("inputs", batch, width, window, buf.ptr)
        binding = lane.binding
        if lane.bound_inputs != key:
            for (name, array, dtype), off in zip(parts, offsets):
                binding.bind_input(name, self._device, self.device_id, dtype, list(array.shape), buf.ptr + off)
            if lane.gqa:
                binding.bind_input("total_sequence_length", "cpu", 0, np.int32, [], self._total.ctypes.data)
            lane.bound_inputs = key

    def _bind_cache(self, lane: _Lane, lo: int, hi: int) -> None:
        key = ("batched", lo, hi, self._generation)
        binding = lane.binding
        if lane.bound != key:
            per = self.num_kv_heads * self.capacity * self.head_dim * self._itemsize
            shape = [hi - lo, self.num_kv_heads, self.capacity, self.head_dim]
            for past, present, buf in zip(self._past, self._present, self._buffers):
                binding.bind_input(past, self._device, self.device_id, self._kv_element, shape, buf.ptr + lo * per)
                binding.bind_output(present, self._device, self.device_id, self._kv_element, shape,
                                    buf.ptr + lo * per)
            if self._states:
                self._states.bind_states(binding, lo, hi)
            lane.bound = key

    def _bind_outputs(self, batch: int, width: int, lane: _Lane | None = None):
        """Device buffers for logits, argmax and (EAGLE-3 targets) aux_hidden_states of a [batch, width]
        call: one per shape, so a CUDA graph captured for the shape always writes the same addresses."""
        lane = lane or self._lane
        binding = lane.binding
        logits = self._scratch_buffer(f"logits-{batch}x{width}", batch * width * self.vocab_size * 4)
        argmax = self._scratch_buffer(f"argmax-{batch}x{width}", batch * width * 8)
        aux = self._scratch_buffer(f"aux-{batch}x{width}", batch * width * self.aux_width * 4) \
            if self.aux_width else None
        key = (batch, width, logits.ptr, argmax.ptr, aux.ptr if aux is not None else None)
        if lane.bound_outputs != key:
            binding.bind_output("logits", self._device, self.device_id, np.float32,
                                [batch, width, self.vocab_size], logits.ptr)
            if self._has_argmax:
                binding.bind_output("argmax", self._device, self.device_id, np.int64, [batch, width], argmax.ptr)
            if aux is not None:
                binding.bind_output("aux_hidden_states", self._device, self.device_id, np.float32,
                                    [batch, width, self.aux_width], aux.ptr)
            lane.bound_outputs = key
        return logits, argmax, aux

    def _fetch_aux(self, aux: DeviceBuffer, width: int, row: int, n: int) -> np.ndarray:
        """Row `row`'s first n aux rows (its real tokens, not the padding) as float32 [n, aux_width]."""
        host = np.empty((n, self.aux_width), np.float32)
        self.cudart.memcpy(host.ctypes.data, aux.ptr + row * width * self.aux_width * 4, host.nbytes, D2H)
        return host

    def _fetch(self, logits: DeviceBuffer, argmax: DeviceBuffer, batch: int, width: int, row: int, n: int,
               want: str) -> np.ndarray:
        """Copy back only what was asked for: row `row`'s first n positions (or its last, or its argmax)."""
        return fetch_rows(self.cudart, logits.ptr, argmax.ptr, self.vocab_size, width, row, n, want)

    # --- concat (batch 1, two buffers per slot) ------------------------------------------------
    def _run_one(self, slot: int, token_ids: Sequence[int], want: str) -> np.ndarray:
        n = len(token_ids)
        past, total = self.slots.lengths[slot], self.slots.lengths[slot] + n
        b = self._binding
        bind_row_inputs(b, token_ids, past, positions=self._has_positions, mask=self._has_mask)
        kv, hd = self.num_kv_heads, self.head_dim
        live, other = self.slots.buffers(slot)
        src, dst = self._buffers[slot][live], self._buffers[slot][other]
        for name, buf in zip(self._past, src):
            b.bind_input(name, self._device, self.device_id, self._kv_element, [1, kv, past, hd], buf.ptr)
        for name, buf in zip(self._present, dst):
            b.bind_output(name, self._device, self.device_id, self._kv_element, [1, kv, total, hd], buf.ptr)
        self._lane.bound = None
        logits, argmax, aux = self._bind_outputs(1, n)
        self.session.run_with_iobinding(b, self._plain_run())
        if aux is not None:
            self.last_aux_hidden[slot] = self._fetch_aux(aux, n, 0, n)
        self.slots.advance(slot, n)
        return self._fetch(logits, argmax, 1, n, 0, n, want)

    def _plain_run(self):
        ro = self._ort.RunOptions()
        if self.cuda_graphs:
            ro.add_run_config_entry("gpu_graph_id", "-1")
        return ro

    # --- rollback, prefix copies (device to device) --------------------------------------------
    def _copy_rows(self, dst: int, dst_pitch_rows: int, src: int, src_pitch_rows: int, rows: int) -> None:
        """Copy the first `rows` positions of every head: [kv_heads, pitch, head_dim] -> same, other pitch."""
        row = self.head_dim * self._itemsize
        self.cudart.memcpy2d(dst, dst_pitch_rows * row, src, src_pitch_rows * row, rows * row, self.num_kv_heads,
                             D2D)
        self.cudart.synchronize()  # device-to-device copies are asynchronous: done before the next run

    def rollback(self, slot: int, length: int) -> None:
        if self._states:  # the state after `length` tokens: replayed, or run again
            self._states.roll_back_slot(self.slots, slot, length, self._compact, self._run_again)
        else:
            self.slots.rollback(slot, length, self._compact)

    def keep_rows(self, slot: int, past: int, rows: Sequence[int]) -> None:
        """Token trees: the rows past + rows[i] move to past + i on the device (one 2-D copy per layer, K or V
        and row that moves; rows already in place stay), then the slot is past + len(rows) long."""
        if not self.supports_tree:
            return super().keep_rows(slot, past, rows)
        have = self.slots.lengths[slot]
        idx = past + np.asarray(rows, dtype=np.int64)
        if not (0 <= past <= have and (len(idx) == 0 or (idx.max() < have and np.all(np.diff(idx) > 0)))):
            raise ValueError(f"keep rows {list(rows)[:8]} after {past} of slot {slot}: it holds {have}")
        row = self.head_dim * self._itemsize
        per = self.num_kv_heads * self.capacity * row
        moves = [(past + i, int(j)) for i, j in enumerate(idx) if j != past + i]
        for buf in self._buffers:  # in order: a row's destination is never a later row's source (idx increases)
            base = buf.ptr + slot * per
            for dst, src in moves:
                self.cudart.memcpy2d(base + dst * row, self.capacity * row, base + src * row, self.capacity * row,
                                     row, self.num_kv_heads, D2D)
        if moves:
            self.cudart.synchronize()  # device-to-device copies are asynchronous: done before the next run
        self.slots.lengths[slot] = past + len(idx)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        if self._states:
            self._states.copy_slot_prefix(self.slots, src, dst, length, self._copy_prefix, self._compact,
                                          self._run_again)
        else:
            self.slots.copy_prefix(src, dst, length, self._copy_prefix, self._compact)

    def _run_again(self, slot: int, tokens: list[int]) -> None:
        self.forward([Row(slot, tokens, fetch="none")])

    def _compact(self, slot: int, live: int, other: int, have: int, length: int) -> None:
        """concat: the kept prefix of every head into the slot's other buffer, packed."""
        for s, d in zip(self._buffers[slot][live], self._buffers[slot][other]):
            self._copy_rows(d.ptr, length, s.ptr, have, length)

    def _copy_prefix(self, src: int, dst: int, have: int, length: int) -> None:
        """src's first `length` rows into dst's live cache: same pitch (batched), or packed (concat)."""
        if self.batched:
            per = self.num_kv_heads * self.capacity * self.head_dim * self._itemsize
            for buf in self._buffers:
                self._copy_rows(buf.ptr + dst * per, self.capacity, buf.ptr + src * per, self.capacity, length)
            return
        pairs = zip(self._buffers[src][self.slots.current[src]], self._buffers[dst][self.slots.current[dst]])
        for s, d in pairs:
            self._copy_rows(d.ptr, length, s.ptr, have, length)

    def node_providers(self) -> dict[str, dict[str, dict]]:
        """{provider: {op type: {"nodes": distinct nodes, "us": kernel time}}} over the runs so far (needs
        profile=True). A node on CPUExecutionProvider in a CUDA session means host round trips (ONNX
        Runtime's "Memcpy nodes are added to the graph")."""
        import json

        if not self._profile:
            raise ValueError("expected an engine made with profile=True")
        path = Path(self.session.end_profiling())
        seen: dict[str, dict[str, dict]] = {}
        for event in json.loads(path.read_text()):
            args = event.get("args", {})
            if event.get("cat") == "Node" and "provider" in args and event.get("name", "").endswith("_kernel_time"):
                op = seen.setdefault(args["provider"], {}).setdefault(args.get("op_name", "?"),
                                                                       {"names": set(), "us": 0})
                op["names"].add(event["name"])
                op["us"] += int(event.get("dur", 0))
        path.unlink(missing_ok=True)
        return {p: {op: {"nodes": len(v["names"]), "us": v["us"]} for op, v in ops.items()} for p, ops in seen.items()}

    # --- I/O binding state ---------------------------------------------------------------------
    @property
    def _binding(self):
        return self._lane.binding

    @property
    def _gqa(self) -> bool:
        return self._lane.gqa
