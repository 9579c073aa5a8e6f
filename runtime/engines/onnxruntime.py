"""ONNX Runtime engine over the exported KV-cache decoder graph (every target; the only one on `cpu`).

The cache lives in preallocated buffers sized for `max_context`, bound with I/O binding, so a
step allocates nothing. How they are bound depends on the graph's layout (metadata
`bundle.kv_cache`, see bundler.export.KV_CACHE_LAYOUTS):

- "shared" (GroupQueryAttention graph): ONE buffer per layer and k/v, [1, kv_heads, max_context,
  head_dim], bound as both past and present. GQA writes only the new tokens' rows and attends
  over the first `length + n`: a decode step costs attention, not a copy of the cache. Rollback
  only changes `length` (later rows are overwritten by the next forward).
- "concat" (torch-exported graph, the fallback): `present = Concat(past, new)` in a
  [kv_heads, length, head_dim] layout, so two buffers ping-pong (written in place, present would
  overwrite the next head's rows). Each step the graph copies the whole cache into the other
  buffer; rollback compacts the kept prefix.

The cache takes the graph's dtype (past_key_values inputs: float32, or float16 for the graphs
made for fp16 GPU targets, which this engine runs when TensorRT is absent); logits are returned
as float32 whatever the graph emits.

Intra-op threads do not spin-wait between runs (`allow_spinning=False`): speculative decoding
alternates a draft and a target session on the same cores, and a pool spinning after its run
steals the cores the other session needs (measured on 2 cores: target steps 2-5x slower).
Per call only the inputs that change are rebound; the shared-layout cache buffers are bound once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from manifests.errors import EnvironmentProblem, ModelError, ServeError
from runtime.engine import Engine

log = logging.getLogger(__name__)


LAYOUTS = ("concat", "shared")
#: ONNX Runtime's type strings -> numpy dtypes this engine can hold a cache or logits in.
NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
SHARED_MIN_VERSION = (1, 20)


def _version(text: str) -> tuple[int, int]:
    major, minor = (text.split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


class ContextFull(ServeError):
    """A forward() would hold more tokens than the engine's max_context."""


class OnnxRuntimeEngine(Engine):
    def __init__(self, graph: Path, *, max_context: int | None = None, threads: int | None = None,
                 providers: Sequence[str] = ("CPUExecutionProvider",), session_options=None,
                 kv_cache: str | None = None, allow_spinning: bool = False):
        """`kv_cache`: the layout the bundle's engine record promises; refused if the graph says otherwise.
        `allow_spinning`: let intra-op threads busy-wait for the next run (only pays off when this is
        the only session on otherwise idle cores)."""
        import onnxruntime as ort

        graph = Path(graph)
        if not graph.is_file():
            raise EnvironmentProblem(f"expected the ONNX graph at {graph}, found nothing")
        so = session_options or ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:  # caller-supplied session options that already decide spinning win
            so.get_session_config_entry("session.intra_op.allow_spinning")
        except RuntimeError:
            so.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
        if threads:
            so.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(graph), so, providers=list(providers))
        except Exception as e:  # onnxruntime raises its own untyped errors
            raise ModelError(f"ONNX Runtime cannot load {graph}: {str(e).splitlines()[0]}") from None
        self._graph = graph
        self._read_signature()
        meta = self.session.get_modelmeta().custom_metadata_map
        graph_max = int(meta.get("bundle.max_positions", 0)) or None
        limit = max_context or graph_max
        if limit is None:
            raise ModelError(f"{graph}: no bundle.max_positions in the graph metadata; pass max_context")
        if graph_max is not None and limit > graph_max:
            raise ModelError(f"max context {limit} exceeds what the model supports; expected at most {graph_max}")
        self.max_context = int(limit)
        self.kv_cache = meta.get("bundle.kv_cache", "concat")
        if self.kv_cache not in LAYOUTS:
            raise ModelError(f"{graph}: expected bundle.kv_cache concat or shared, found {self.kv_cache!r}")
        if kv_cache is not None and kv_cache != self.kv_cache:
            raise ModelError(f"{graph}: the engine record expects a {kv_cache!r} KV-cache graph, "
                             f"the graph is {self.kv_cache!r}")
        if self.kv_cache == "shared" and _version(ort.__version__) < SHARED_MIN_VERSION:
            raise EnvironmentProblem(f"{graph} needs onnxruntime >= 1.20 (GroupQueryAttention with a past), "
                                     f"found {ort.__version__}")
        # [buffer][layer*2 + (0 key | 1 value)] flat arrays (graph's KV dtype) of capacity max_context tokens.
        per = self.num_kv_heads * self.max_context * self.head_dim
        copies = 1 if self.kv_cache == "shared" else 2
        self._buffers = [[np.zeros(per, self.kv_dtype) for _ in self._past] for _ in range(copies)]
        self._current = 0  # which buffer holds the live cache
        self._length = 0
        self._logits = np.zeros(0, self._logits_dtype)
        self._positions = np.arange(self.max_context, dtype=np.int64).reshape(1, -1)
        self._mask = np.ones((1, self.max_context), np.int64)
        self._binding = self.session.io_binding()
        self._bound_logits = (0, 0)  # (address, rows) of the bound logits output
        if self.kv_cache == "shared":  # same memory in and out, fixed shape: bound once, GQA appends in place
            shape = [1, self.num_kv_heads, self.max_context, self.head_dim]
            for past_name, present_name, buf in zip(self._past, self._present, self._buffers[0]):
                self._binding.bind_input(past_name, "cpu", 0, self.kv_dtype, shape, buf.ctypes.data)
                self._binding.bind_output(present_name, "cpu", 0, self.kv_dtype, shape, buf.ctypes.data)
        precision = "fp16" if self.kv_dtype == np.float16 else "fp32"
        self.description = (f"onnxruntime {ort.__version__} {self.session.get_providers()[0]} {precision} "
                            f"kv-cache {self.kv_cache}")

    # --- graph signature -----------------------------------------------------------------------
    def _read_signature(self) -> None:
        ins = {i.name: i for i in self.session.get_inputs()}
        outs = {o.name: o for o in self.session.get_outputs()}
        for name in ("input_ids", "past_key_values.0.key"):
            if name not in ins:
                raise ModelError(f"{self._graph}: expected a KV-cache decoder graph with input {name!r}, "
                                 f"found inputs {sorted(ins)[:6]}")
        layers = sum(1 for n in ins if n.startswith("past_key_values.") and n.endswith(".key"))
        self._past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
        self._present = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
        missing = [n for n in self._past if n not in ins] + [n for n in ["logits", *self._present] if n not in outs]
        if missing:
            raise ModelError(f"{self._graph}: expected KV-cache inputs/outputs, missing {missing[:4]}")
        shape = ins["past_key_values.0.key"].shape  # [batch, kv_heads, past, head_dim]
        vocab = outs["logits"].shape[-1]
        if not (isinstance(shape[1], int) and isinstance(shape[3], int) and isinstance(vocab, int)):
            raise ModelError(f"{self._graph}: expected static kv_heads, head_dim and vocab, found "
                             f"past {shape}, logits {outs['logits'].shape}")
        self.num_layers, self.num_kv_heads, self.head_dim, self.vocab_size = layers, shape[1], shape[3], vocab
        types = {ins[n].type for n in self._past} | {outs[n].type for n in self._present}
        if len(types) != 1 or next(iter(types)) not in NUMPY_TYPES or outs["logits"].type not in NUMPY_TYPES:
            raise ModelError(f"{self._graph}: expected one float32 or float16 type for the KV cache and "
                             f"float32/float16 logits, found cache {sorted(types)}, logits {outs['logits'].type}")
        self.kv_dtype = np.dtype(NUMPY_TYPES[next(iter(types))])
        self._logits_dtype = np.dtype(NUMPY_TYPES[outs["logits"].type])
        self._has_mask = "attention_mask" in ins
        self._has_positions = "position_ids" in ins

    # --- Engine --------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self._length

    def forward(self, token_ids: Sequence[int]) -> np.ndarray:
        n = len(token_ids)
        if n == 0:
            return np.zeros((0, self.vocab_size), np.float32)
        past, total = self._length, self._length + n
        if total > self.max_context:
            raise ContextFull(f"context full: expected at most {self.max_context} tokens, "
                              f"found {past} cached + {n} new")
        b = self._binding
        # Rebinding a name replaces its previous binding, so only what changes is bound here.
        b.bind_cpu_input("input_ids", np.asarray(token_ids, dtype=np.int64).reshape(1, n))
        if self._has_positions:
            b.bind_cpu_input("position_ids", self._positions[:, past:total])
        if self._has_mask:
            b.bind_cpu_input("attention_mask", self._mask[:, :total])
        if self.kv_cache == "concat":
            kv, hd = self.num_kv_heads, self.head_dim
            src, dst = self._buffers[self._current], self._buffers[1 - self._current]
            for name, buf in zip(self._past, src):
                b.bind_input(name, "cpu", 0, self.kv_dtype, [1, kv, past, hd], buf.ctypes.data)
            for name, buf in zip(self._present, dst):
                b.bind_output(name, "cpu", 0, self.kv_dtype, [1, kv, total, hd], buf.ctypes.data)
        if self._logits.size < n * self.vocab_size:
            self._logits = np.zeros(max(n, 8) * self.vocab_size, self._logits_dtype)
        if self._bound_logits != (self._logits.ctypes.data, n):
            b.bind_output("logits", "cpu", 0, self._logits_dtype, [1, n, self.vocab_size], self._logits.ctypes.data)
            self._bound_logits = (self._logits.ctypes.data, n)
        self.session.run_with_iobinding(b)
        if self.kv_cache == "concat":
            self._current = 1 - self._current
        self._length = total
        return self._logits[: n * self.vocab_size].reshape(n, self.vocab_size).astype(np.float32)  # a copy

    def _view(self, which: int, layer_slot: int, length: int) -> np.ndarray:
        flat = self._buffers[which][layer_slot]
        return flat[: self.num_kv_heads * length * self.head_dim].reshape(self.num_kv_heads, length, self.head_dim)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"rollback to {length}: expected 0..{self._length}")
        if length == self._length:
            return
        # shared: rows at >= length are simply overwritten by the next forward. concat: compact the
        # kept prefix of every head into the other buffer, then swap.
        if length > 0 and self.kv_cache == "concat":
            other = 1 - self._current
            for slot in range(len(self._past)):
                self._view(other, slot, length)[:] = self._view(self._current, slot, self._length)[:, :length]
            self._current = other
        self._length = length

    def memory(self) -> dict:
        data = self._graph.with_name(self._graph.name + ".data")
        weights = self._graph.stat().st_size + (data.stat().st_size if data.exists() else 0)
        return {"weights": weights, "kv_cache": sum(b.nbytes for pair in self._buffers for b in pair)}

    def close(self) -> None:
        self._buffers = [[], []]
        self.session = None  # type: ignore[assignment]
