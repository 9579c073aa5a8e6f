"""ONNX Runtime engine over the exported KV-cache decoder graphs (every target; the only one on `cpu`).

Slots (runtime.engines.base): each sequence has its own cache region in preallocated buffers, bound with
I/O binding, so a step allocates nothing. How they are laid out depends on the graph's layout
(metadata `bundle.kv_cache`, see bundler.onnx.export.KV_CACHE_LAYOUTS):

- "batched" (TensorScatter + Attention, what ONNX Runtime targets ship): ONE buffer per layer and
  k/v, [slots, kv_heads, capacity, head_dim], bound as both past and present. One session call
  advances a contiguous range of slots: each row's new K/V rows are scattered at its own offset
  (`write_indices`), and a boolean mask lets each row attend to its own past and, causally, to its
  new rows; attention runs over the first `window` rows only (the mask's last axis: the longest
  row's past plus the new tokens), since ONNX Runtime's Attention expands grouped K/V heads over
  every row it is given. Rows are padded to the longest row of the call; padding and the slots in
  the range that take no part write into `capacity - max_context` spare rows past the end that
  nobody attends to. Rows of very different lengths (a prefill chunk beside decodes) go in separate calls
  so that a 64-token chunk does not pad eight 1-token decodes to 64 each.
  Hybrid models (Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba-2 layers, beside attention) also
  carry a recurrent state per slot (runtime.engines.recurrent: bound in place like the cache, counted
  in kv_bytes_per_slot); a rollback into the last forward replays its captured transitions, one further back or a copy of
  part of another slot's prefix runs tokens again.
- "shared" (GroupQueryAttention graph, bundles made before "batched"): one buffer per slot, layer
  and k/v, [1, kv_heads, max_context, head_dim]. ONNX Runtime's GQA refuses a batch when a row adds
  more than one token after a past, so rows run one by one (batch 1 per call).
- "concat" (the TensorRT targets' graph, the fallback): `present = Concat(past, new)` in a
  [kv_heads, length, head_dim] layout, so two buffers per slot ping-pong; rows run one by one.

The cache takes the graph's dtype (float32, or float16 for the graphs made for fp16 GPU targets,
which this engine runs when TensorRT is absent); logits are returned as float32.

Intra-op threads do not spin-wait between runs unless asked (`allow_spinning`): speculative decoding
alternates a draft and a target session on the same cores, and a pool spinning after its run
steals the cores the other session needs (measured on 2 cores: target steps 2-5x slower).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from manifests.errors import EnvironmentProblem, ModelError
from runtime.engines.base import ContextFull, Engine, Row
from runtime.engines.recurrent import RecurrentStates
from runtime.engines.slots import SlotTable

log = logging.getLogger(__name__)

__all__ = ["ContextFull", "OnnxRuntimeEngine", "LAYOUTS"]

LAYOUTS = ("concat", "shared", "batched")
#: ONNX Runtime's type strings -> numpy dtypes this engine can hold a cache or logits in.
NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
SHARED_MIN_VERSION = (1, 20)  # CPU GroupQueryAttention with new tokens after a past
BATCHED_MIN_VERSION = (1, 30)  # opset 24 TensorScatter, opset 23 Attention on CPU (checked on 1.30 and 1.32)
MIN_VERSION = {"shared": SHARED_MIN_VERSION, "batched": BATCHED_MIN_VERSION}
#: A row at most this long may share a call with shorter rows (padded); longer rows run alone.
PAD_LIMIT_FACTOR = 2


def _version(text: str) -> tuple[int, int]:
    major, minor = (text.split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def static_capacity(meta: dict, headroom: int, graph: Path) -> int | None:
    """The cache rows per slot a batched graph fixes (bundle.kv_capacity: the graph TensorRT targets carry,
    which their ONNX Runtime fallback runs too), or None when its capacity axis is dynamic."""
    text = meta.get("bundle.kv_capacity")
    if text is None:
        return None
    if not text.isdigit() or int(text) <= headroom:
        raise ModelError(f"{graph}: expected bundle.kv_capacity a number of rows above the headroom {headroom}, "
                         f"found {text!r}")
    return int(text)


def check_capacity(fixed: int | None, max_context: int, headroom: int, graph: Path) -> None:
    """A static capacity must hold max_context rows and the spare rows padding writes into."""
    if fixed is not None and max_context + headroom > fixed:
        raise ModelError(f"max context {max_context} exceeds the static cache capacity of {graph} ({fixed} rows, "
                         f"{headroom} of them spare); expected at most {fixed - headroom}")


def bind_row_inputs(binding, token_ids: Sequence[int], past: int, *, positions: bool, mask: bool) -> None:
    """Host inputs of one batch-1 row appended after `past` cached tokens (the pre-"batched" graphs)."""
    n = len(token_ids)
    binding.bind_cpu_input("input_ids", np.asarray(token_ids, dtype=np.int64).reshape(1, n))
    if positions:
        binding.bind_cpu_input("position_ids", np.arange(past, past + n, dtype=np.int64).reshape(1, n))
    if mask:
        binding.bind_cpu_input("attention_mask", np.ones((1, past + n), np.int64))


def open_session(graph: Path, options, providers: Sequence[str], threads: int | None = None):
    """An ONNX Runtime session over `graph` (`threads` intra-op threads where given), a graph it cannot
    load a one-line ModelError: shared by the engine and the EAGLE-3 head."""
    import onnxruntime as ort

    if threads:
        options.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(str(graph), options, providers=list(providers))
    except Exception as e:  # onnxruntime raises its own untyped errors
        raise ModelError(f"ONNX Runtime cannot load {graph}: {str(e).splitlines()[0]}") from None


def tree_mask(mask: np.ndarray, positions: np.ndarray, tree, write: int) -> None:
    """One row's [width, window] mask and position ids for a Row.tree (runtime.engines.base.TreeMask)."""
    for i, anc in enumerate(tree.ancestors):
        mask[i] = False
        mask[i, :tree.base] = True
        if anc:
            mask[i, list(anc)] = True
        mask[i, write + i] = True
        positions[i] = tree.base + len(anc)


def batched_inputs(group, lo: int, hi: int, lengths, capacity: int, width: int = 0):
    """(input_ids, write_indices, position_ids) of one call of the batched graph over slots lo..hi-1: each row
    padded to the longest (or to `width`, a graph's), written at its slot's length; slots in the range without a
    row write into the spare rows at the end (capacity - width), which nobody attends to. Shared by the batched
    engines."""
    width = max(width, *(len(r.tokens) for r in group))
    ids = np.zeros((hi - lo, width), np.int64)
    write = np.full(hi - lo, capacity - width, np.int64)
    for r in group:
        ids[r.slot - lo, :len(r.tokens)] = r.tokens
        write[r.slot - lo] = lengths[r.slot]
    return ids, write, write[:, None] + np.arange(width, dtype=np.int64)[None, :]


def pad_groups(rows: list, headroom: int) -> list[list]:
    """Rows that go into one call each of a batched graph: similar lengths together, so padding costs at most
    about PAD_LIMIT_FACTOR times the real tokens; a row longer than the headroom goes alone (no padding).
    Shared by the batched engines and the EAGLE-3 head over slots."""
    groups: list[list] = []
    current: list = []
    for r in sorted(rows, key=lambda r: -len(r.tokens)):
        n = len(r.tokens)
        if n > headroom:
            groups.append([r])
            continue
        if current:
            width = len(current[0].tokens)
            real = sum(len(x.tokens) for x in current) + n
            if (len(current) + 1) * width > PAD_LIMIT_FACTOR * real and width > 4:
                groups.append(current)
                current = []
        current.append(r)
    if current:
        groups.append(current)
    return groups


def batched_mask(group, lo: int, positions: np.ndarray, write: np.ndarray, window: int) -> np.ndarray:
    """The boolean mask [batch, 1, width, window]: new token i of a row attends to every cached row before it
    and to new tokens 0..i; a token tree's nodes to the past and their ancestors only (tree_mask, which
    also sets their positions to their depth)."""
    mask = np.arange(window)[None, None, None, :] <= positions[:, None, :, None]
    for r in group:
        if r.tree is not None:
            tree_mask(mask[r.slot - lo, 0], positions[r.slot - lo], r.tree, int(write[r.slot - lo]))
    return mask


class OnnxRuntimeEngine(Engine):
    def __init__(self, graph: Path, *, max_context: int | None = None, num_slots: int = 1,
                 threads: int | None = None, providers: Sequence[str] = ("CPUExecutionProvider",),
                 session_options=None, kv_cache: str | None = None, allow_spinning: bool = False):
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
        self.session = open_session(graph, so, providers, threads)
        self._graph = graph
        meta = self.session.get_modelmeta().custom_metadata_map
        self.kv_cache = meta.get("bundle.kv_cache", "concat")
        if self.kv_cache not in LAYOUTS:
            raise ModelError(f"{graph}: expected bundle.kv_cache {', '.join(LAYOUTS)}, found {self.kv_cache!r}")
        if kv_cache is not None and kv_cache != self.kv_cache:
            raise ModelError(f"{graph}: the engine record expects a {kv_cache!r} KV-cache graph, "
                             f"the graph is {self.kv_cache!r}")
        need = MIN_VERSION.get(self.kv_cache)
        if need and _version(ort.__version__) < need:
            raise EnvironmentProblem(f"{graph} ({self.kv_cache} KV cache) needs onnxruntime >= "
                                     f"{need[0]}.{need[1]}, found {ort.__version__}")
        self._read_signature()
        self.batched = self.kv_cache == "batched"
        self._headroom = int(meta.get("bundle.kv_headroom", 0)) if self.batched else 0
        graph_max = int(meta.get("bundle.max_positions", 0)) or None
        fixed = static_capacity(meta, self._headroom, graph)
        limit = max_context or (fixed - self._headroom if fixed else graph_max)
        if limit is None:
            raise ModelError(f"{graph}: no bundle.max_positions in the graph metadata; pass max_context")
        if graph_max is not None and limit > graph_max:
            raise ModelError(f"max context {limit} exceeds what the model supports; expected at most {graph_max}")
        check_capacity(fixed, int(limit), self._headroom, graph)
        self.max_context = int(limit)
        # token trees: the batched graph takes any mask and position ids; a recurrent state cannot branch
        self.supports_tree = self.batched and self._states is None
        self._windowed = meta.get("bundle.attention_window") == "1"  # else the mask spans the capacity
        #: rows one slot's region holds: max_context, plus the spare rows padding writes into (a graph made
        #: for TensorRT fixes them: bundle.kv_capacity)
        self.capacity = fixed or self.max_context + self._headroom
        self._binding = self.session.io_binding()
        self._logits = np.zeros(0, self._logits_dtype)
        self._bound_logits = (0, ())
        self._bound_cache: tuple | None = None  # what the cache inputs are bound to now
        precision = "fp16" if self.kv_dtype == np.float16 else "fp32"
        self.description = (f"onnxruntime {ort.__version__} {self.session.get_providers()[0]} {precision} "
                            f"kv-cache {self.kv_cache}")
        self.allocate_slots(num_slots)

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
        wanted_in = self._past + (["position_ids", "write_indices", "attention_mask"]
                                  if self.kv_cache == "batched" else [])
        missing = [n for n in wanted_in if n not in ins] + [n for n in ["logits", *self._present] if n not in outs]
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
        meta = self.session.get_modelmeta().custom_metadata_map
        self._states = RecurrentStates.of(ins, outs, meta, self._graph)  # hybrid graphs only
        if self._states is not None and self.kv_cache != "batched":
            raise ModelError(f"{self._graph}: expected recurrent states in a batched graph, found {self.kv_cache!r}")
        self.recurrent = self._states is not None
        self._has_positions = "position_ids" in ins
        # EAGLE-3 targets (every layout) also return the aux layers' hidden states: per slot, the rows
        # of its last forward, in last_aux_hidden
        aux = outs.get("aux_hidden_states")
        self.aux_width = aux.shape[-1] if aux is not None and isinstance(aux.shape[-1], int) else 0
        self._aux_dtype = np.dtype(NUMPY_TYPES.get(aux.type, "float32")) if aux is not None else None
        self.last_aux_hidden: dict[int, np.ndarray] = {}

    # --- slots ---------------------------------------------------------------------------------
    def _rows_per_slot(self) -> int:
        """Cache rows (token positions) per head that one slot's buffers hold, all copies together."""
        return {"batched": self.capacity, "shared": self.max_context, "concat": 2 * self.max_context}[self.kv_cache]

    def kv_bytes_per_slot(self) -> int:
        kv = len(self._past) * self.num_kv_heads * self._rows_per_slot() * self.head_dim * self.kv_dtype.itemsize
        return kv + (self._states.bytes_per_slot() if self._states else 0)

    def allocate_slots(self, num_slots: int) -> None:
        """(Re)allocate the caches for `num_slots` sequences; every slot starts empty."""
        self.slots = SlotTable(num_slots, ping_pong=self.kv_cache == "concat")
        self.num_slots = int(num_slots)
        per = self.num_kv_heads * self.head_dim
        if self.batched:  # [layer*2 + kv] -> flat [slots, kv_heads, capacity, head_dim]
            self._buffers = [np.zeros(num_slots * per * self.capacity, self.kv_dtype) for _ in self._past]
        else:  # [slot][copy][layer*2 + kv] -> flat [kv_heads, max_context, head_dim]
            copies = 1 if self.kv_cache == "shared" else 2
            self._buffers = [[[np.zeros(per * self.max_context, self.kv_dtype) for _ in self._past]
                              for _ in range(copies)] for _ in range(num_slots)]
        if self._states:
            self._states.allocate(num_slots)
        self._bound_cache = None

    def length(self, slot: int) -> int:
        return self.slots.lengths[slot]

    # --- forward -------------------------------------------------------------------------------
    def forward(self, rows: Sequence[Row]) -> list[np.ndarray]:
        self.check_rows(rows)
        out: dict[int, np.ndarray] = {}
        live = [r for r in rows if len(r.tokens)]
        for r in rows:
            if not len(r.tokens):
                out[r.slot] = np.zeros((0, self.vocab_size), np.float32)
        if self.batched:
            for group in self._groups(live):
                out.update(self._run_batched(group))
        else:
            for r in live:
                out[r.slot] = self._run_one(r.slot, r.tokens)
        return [out[r.slot] for r in rows]

    def _groups(self, rows: list[Row]) -> list[list[Row]]:
        return pad_groups(rows, self._headroom)

    def _logits_buffer(self, shape: tuple) -> np.ndarray:
        size = int(np.prod(shape))
        if self._logits.size < size:
            self._logits = np.zeros(max(size, 8 * self.vocab_size), self._logits_dtype)
        if self._bound_logits != (self._logits.ctypes.data, shape):
            self._binding.bind_output("logits", "cpu", 0, self._logits_dtype, list(shape), self._logits.ctypes.data)
            self._bound_logits = (self._logits.ctypes.data, shape)
        return self._logits[:size].reshape(shape)

    def _run_batched(self, group: list[Row]) -> dict[int, np.ndarray]:
        lo, hi = min(r.slot for r in group), max(r.slot for r in group) + 1
        width = max(len(r.tokens) for r in group)
        batch, cap = hi - lo, self.capacity
        by_slot = {r.slot: r for r in group}
        ids, write, positions = batched_inputs(group, lo, hi, self.slots.lengths, cap)
        # Attention runs over the first `window` rows: every real row's past and new (padded) tokens.
        # Slots without a row write past max_context, outside it: their rows attend to nothing
        # (their outputs are thrown away).
        window = max(self.slots.lengths[r.slot] for r in group) + width if self._windowed else cap
        mask = batched_mask(group, lo, positions, write, window)
        b = self._binding
        b.bind_cpu_input("input_ids", ids)
        b.bind_cpu_input("position_ids", positions)
        b.bind_cpu_input("write_indices", write)
        b.bind_cpu_input("attention_mask", mask)
        if self._states:
            captures = self._states.before_run(b, lo, hi, {s: len(r.tokens) for s, r in by_slot.items()},
                                               self.slots.lengths, width)
        if self._bound_cache != ("batched", lo, hi):
            per = self.num_kv_heads * cap * self.head_dim
            shape = [batch, self.num_kv_heads, cap, self.head_dim]
            offset = lo * per * self.kv_dtype.itemsize
            for past, present, buf in zip(self._past, self._present, self._buffers):
                b.bind_input(past, "cpu", 0, self.kv_dtype, shape, buf.ctypes.data + offset)
                b.bind_output(present, "cpu", 0, self.kv_dtype, shape, buf.ctypes.data + offset)
            if self._states:
                self._states.bind_states(b, lo, hi)
            self._bound_cache = ("batched", lo, hi)
        logits = self._logits_buffer((batch, width, self.vocab_size))
        aux = self._bind_aux((batch, width))
        self.session.run_with_iobinding(b)
        out = {}
        for slot, r in by_slot.items():
            n = len(r.tokens)
            out[slot] = logits[slot - lo, :n].astype(np.float32)  # a copy
            if aux is not None:  # the row's real tokens only, not its padding
                self.last_aux_hidden[slot] = aux[slot - lo, :n].astype(np.float32, copy=False)
            self.slots.advance(slot, n)
        if self._states:
            self._states.after_run(lo, {s: r.tokens for s, r in by_slot.items()}, captures)
        return out

    def _bind_aux(self, rows: tuple[int, int]) -> np.ndarray | None:
        """EAGLE-3 targets: a fresh [batch, width, 3H] buffer for aux_hidden_states (kept per slot)."""
        if not self.aux_width:
            return None
        aux = np.zeros((*rows, self.aux_width), self._aux_dtype)
        self._binding.bind_output("aux_hidden_states", "cpu", 0, self._aux_dtype, list(aux.shape), aux.ctypes.data)
        return aux

    def _run_one(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        """Batch 1: the graphs made before "batched"."""
        n = len(token_ids)
        past, total = self.slots.lengths[slot], self.slots.lengths[slot] + n
        b = self._binding
        bind_row_inputs(b, token_ids, past, positions=self._has_positions, mask=self._has_mask)
        kv, hd = self.num_kv_heads, self.head_dim
        if self.kv_cache == "shared":  # same memory in and out, fixed shape: GQA appends in place
            if self._bound_cache != ("shared", slot):
                shape = [1, kv, self.max_context, hd]
                for past_name, present_name, buf in zip(self._past, self._present, self._buffers[slot][0]):
                    b.bind_input(past_name, "cpu", 0, self.kv_dtype, shape, buf.ctypes.data)
                    b.bind_output(present_name, "cpu", 0, self.kv_dtype, shape, buf.ctypes.data)
                self._bound_cache = ("shared", slot)
        else:
            live, other = self.slots.buffers(slot)
            src, dst = self._buffers[slot][live], self._buffers[slot][other]
            for name, buf in zip(self._past, src):
                b.bind_input(name, "cpu", 0, self.kv_dtype, [1, kv, past, hd], buf.ctypes.data)
            for name, buf in zip(self._present, dst):
                b.bind_output(name, "cpu", 0, self.kv_dtype, [1, kv, total, hd], buf.ctypes.data)
        logits = self._logits_buffer((1, n, self.vocab_size))
        aux = self._bind_aux((1, n))
        self.session.run_with_iobinding(b)
        if aux is not None:
            self.last_aux_hidden[slot] = aux[0].astype(np.float32, copy=False)
        self.slots.advance(slot, n)
        return logits[0].astype(np.float32)  # a copy

    # --- rollback, prefix copies ---------------------------------------------------------------
    def _view(self, slot: int, layer_slot: int, length: int, which: int | None = None) -> np.ndarray:
        """[kv_heads, length, head_dim] view of one slot's cache for one layer's key or value."""
        kv, hd = self.num_kv_heads, self.head_dim
        if self.batched:
            flat = self._buffers[layer_slot]
            per = kv * self.capacity * hd
            return flat[slot * per:(slot + 1) * per].reshape(kv, self.capacity, hd)[:, :length]
        if self.kv_cache == "shared":
            return self._buffers[slot][0][layer_slot].reshape(kv, self.max_context, hd)[:, :length]
        which = self.slots.current[slot] if which is None else which
        return self._buffers[slot][which][layer_slot][: kv * length * hd].reshape(kv, length, hd)

    def rollback(self, slot: int, length: int) -> None:
        if self._states:  # the state after `length` tokens: replayed, or run again
            self._states.roll_back_slot(self.slots, slot, length, self._compact, self._run_again)
        else:
            self.slots.rollback(slot, length, self._compact)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        if self._states:
            self._states.copy_slot_prefix(self.slots, src, dst, length, self._copy_rows, self._compact,
                                          self._run_again)
        else:
            self.slots.copy_prefix(src, dst, length, self._copy_rows, self._compact)

    def _run_again(self, slot: int, tokens: list[int]) -> None:
        self.forward([Row(slot, tokens, fetch="none")])

    def keep_rows(self, slot: int, past: int, rows: Sequence[int]) -> None:
        if not self.supports_tree:
            super().keep_rows(slot, past, rows)
        have = self.slots.lengths[slot]
        idx = past + np.asarray(rows, dtype=np.int64)
        if not (0 <= past <= have and (len(idx) == 0 or (idx.max() < have and np.all(np.diff(idx) > 0)))):
            raise ValueError(f"keep rows {list(rows)[:8]} after {past} of slot {slot}: it holds {have}")
        n = len(idx)
        if n and not np.array_equal(idx, np.arange(past, past + n)):
            for i in range(len(self._past)):  # a gather (fancy indexing copies) into the rows after past
                view = self._view(slot, i, have)
                view[:, past:past + n] = view[:, idx]
        self.slots.lengths[slot] = past + n

    def _compact(self, slot: int, live: int, other: int, have: int, length: int) -> None:
        """concat: the kept prefix of every head into the slot's other buffer."""
        for i in range(len(self._past)):
            self._view(slot, i, length, which=other)[:] = self._view(slot, i, have, which=live)[:, :length]

    def _copy_rows(self, src: int, dst: int, have: int, length: int) -> None:
        for i in range(len(self._past)):  # concat rows are packed per head: take the first `length` of each
            self._view(dst, i, length)[:] = self._view(src, i, have)[:, :length]

    def memory(self) -> dict:
        data = self._graph.with_name(self._graph.name + ".data")
        weights = self._graph.stat().st_size + (data.stat().st_size if data.exists() else 0)
        return {"weights": weights, "kv_cache": self.kv_bytes_per_slot() * self.num_slots}

    def close(self) -> None:
        self._buffers = []
        if self._states:
            self._states.close()
        self.session = None  # type: ignore[assignment]
