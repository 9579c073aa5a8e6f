"""The EAGLE-3 head over slots on the CUDA provider: inputs and outputs in device memory, CUDA graphs for the
fixed shapes of a step's head runs.

A head run is one decoder layer and an lm_head over a draft vocabulary: a few dozen small kernels whose launches,
not their arithmetic, are its time on a GPU (measured on an H200: about 0.6 ms a run for the demo head, three
times the target's replayed decode step). So, as runtime.engines.cuda does for the target:

- every small input (ids, features, positions, write offsets, mask) is packed into one host buffer and copied
  with ONE host-to-device copy into a fixed device buffer, logits and hidden states come back from fixed device
  buffers, and the head cache stays where it is (one [slots, kv, capacity, hd] buffer per K and V);
- runs of at most GRAPH_MAX_WIDTH tokens a row (chain rounds: one token per slot; tree levels; the catch-up
  after a verification) run as CUDA graphs (ONNX Runtime's `enable_cuda_graph`), one per (kind of rows, batch
  bucket, width, window): slots 0..bucket-1 always, a slot without a row writing into the spare rows, the
  attention window rounded up to a power of two (at least 256, at most the capacity), captured on first use;
- longer runs (a new request's catch-up over its prompt) are ordinary runs over the same buffers;
- greedy chains (greedy_chains) run all their rounds in one call: every round's small inputs go over in one
  copy before the first, round r + 1 reads round r's `argmax` output (the head graph's ArgMax of its logits)
  as its token ids and its hidden states as its features, where they are, and the rounds are launched back
  to back (ONNX Runtime told not to wait for the GPU after each); only the tokens come back, after the last.
  One graph per (bucket, window, round), as the round's buffers are its own.

Rows, padding and the cache's bookkeeping are runtime.serve.eagle3_slots.OnnxSlotsDrafter's; only where the bytes
live and how a run is launched differ, so proposals are the same (tests run this class on host memory through the
CPU provider against OnnxSlotsDrafter).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from manifests.errors import EnvironmentProblem
from runtime.engines.cuda import (GRAPH_MAX_WIDTH, GRAPH_WARMUP, MAX_CHAIN_ROUNDS, batch_buckets, graph_width,
                                  graph_window)
from runtime.engines.cudalib import D2H, H2D, Cudart, DeviceBuffer, grow_buffer, onnxruntime_cuda, pack_aligned
from runtime.serve.eagle3 import HeadRow, open_head_graph
from runtime.serve.eagle3_slots import OnnxSlotsDrafter

log = logging.getLogger(__name__)



def cuda_graph_providers(device_id: int = 0) -> list:
    """The CUDA provider with CUDA graphs on (ONNX Runtime refuses the session when a node would run elsewhere)."""
    return [("CUDAExecutionProvider", {"device_id": str(device_id), "enable_cuda_graph": "1"}), "CPUExecutionProvider"]


def open_cuda_head_session(graph: Path, threads: int | None = None):
    """(session, metadata, CUDA graphs on) for a head on the CUDA provider: with CUDA graphs where ONNX Runtime
    allows them for this graph, else without (the reason in one log line)."""
    try:
        session, meta = open_head_graph(graph, cuda_graph_providers(), threads)
        return session, meta, True
    except Exception as e:  # ModelError from open_session: a node not on the CUDA provider
        log.warning("EAGLE-3 head %s runs without CUDA graphs: %s", Path(graph).name, str(e).splitlines()[0])
    session, meta = open_head_graph(graph, ["CUDAExecutionProvider", "CPUExecutionProvider"], threads)
    return session, meta, False


class CudaSlotsDrafter(OnnxSlotsDrafter):
    """OnnxSlotsDrafter with device-memory inputs and outputs and CUDA graphs (see the module docstring)."""

    def __init__(self, graph: Path, *, max_context: int | None = None, num_slots: int = 1, session=None,
                 cuda_graphs: bool = True, memory=None, fixed_shapes: bool | None = None):
        """`session`: a head session on the CUDA provider (open_cuda_head_session; None: opened here), created
        with CUDA graphs when `cuda_graphs`. `memory`: None for the GPU; tests pass a host-memory object with
        runtime.engines.cudalib.Cudart's methods and the head then runs this class's bookkeeping on host buffers
        through the CPU provider (no graphs). `fixed_shapes`: runs of at most GRAPH_MAX_WIDTH tokens a row take
        a graph's shapes and buffers (bucket, window) whether or not they launch as graphs (default: as
        cuda_graphs; tests on host memory turn it on to check those shapes)."""
        if memory is None:
            ort, why = onnxruntime_cuda()
            if ort is None:
                raise EnvironmentProblem(f"the EAGLE-3 head cannot run on the CUDA provider here: {why}")
            if session is None:
                session, _, cuda_graphs = open_cuda_head_session(graph)
            self.cudart, self._where = Cudart.load(), "cuda"
        else:
            if session is None:
                session, _ = open_head_graph(graph, ["CPUExecutionProvider"], None)
            self.cudart, self._where, cuda_graphs = memory, "cpu", False
        self.cuda_graphs = self._graph_session = bool(cuda_graphs)  # the session was made with CUDA graphs on
        self.fixed_shapes = self.cuda_graphs if fixed_shapes is None else bool(fixed_shapes)
        self._graph_ids = 0
        self._graph_runs: dict[int, int] = {}  # graph id -> runs so far
        self.cold_runs = 0  # runs that were among the first GRAPH_WARMUP of their graph (as Engine.cold_runs)
        self._scratch: dict[tuple, DeviceBuffer] = {}
        self._argmax = "argmax" in {o.name for o in session.get_outputs()}  # heads made before it chain on the host
        super().__init__(graph, max_context=max_context, num_slots=num_slots, session=session)
        self.description += " on device buffers" + (", CUDA graphs" if self.cuda_graphs else "")

    def allocate_slots(self, num_slots: int) -> None:
        super().allocate_slots(num_slots)
        self.buckets = batch_buckets(self.num_slots)
        # new cache buffers: bindings and graphs over the old ones are never used again (graph ids keep counting)
        self._runs: dict[tuple, tuple] = {}  # shape key -> (binding, input buffer, logits, hidden, graph id)
        self._chains: dict[tuple, tuple] = {}  # (bucket, window, round) -> (binding, input buffer, graph id)

    def _run(self, group: list[HeadRow], from_target: bool) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        width = max(len(r.tokens) for r in group)
        padded, hi = graph_width(width), max(r.slot for r in group) + 1
        # a graph's padding rows write into the spare rows: at most the headroom wide
        graph = self.fixed_shapes and padded <= min(GRAPH_MAX_WIDTH, self._headroom)
        lo, window = 0 if graph else min(r.slot for r in group), None
        if graph:  # slots 0..bucket-1 at the same addresses every time, a power of two tokens a row and window rows
            hi, width = next(b for b in self.buckets if b >= hi), padded
            window = graph_window(max(self._lengths[r.slot] for r in group) + width, self.capacity)
        inputs = self._inputs(group, from_target, lo, hi, window, width)
        batch, window = hi - lo, inputs["attention_mask"].shape[-1]
        parts = list(inputs.items())
        host, offsets = pack_aligned([a for _, a in parts])
        key = (from_target, lo, batch, width, window)
        run = self._runs.get(key) if graph else None
        if run is None:
            run = self._bind(key, parts, offsets, host.nbytes, graph)
        binding, inputs, logits, hidden, graph_id = run
        self.cudart.memcpy(inputs.ptr, host.ctypes.data, host.nbytes, H2D)
        self.cudart.synchronize()  # a pageable copy may still be in flight; ONNX Runtime's stream does not wait
        self._launch(binding, graph_id)
        self.runs += 1
        out_logits = np.empty((batch, width, self.vocab_size), np.float32)
        out_hidden = np.empty((batch, width, self.hidden_size), np.float32)
        self.cudart.memcpy(out_logits.ctypes.data, logits.ptr, out_logits.nbytes, D2H)
        self.cudart.memcpy(out_hidden.ctypes.data, hidden.ptr, out_hidden.nbytes, D2H)
        return self._take(group, lo, out_logits, out_hidden)

    def _launch(self, binding, graph_id: int, wait: bool = True) -> None:
        """One run: graph_id > 0 captures (first use) or replays that CUDA graph, -1 an ordinary run. A capture ONNX
        Runtime cannot make turns graphs off for this head, in one log line, and the run is made again ordinarily
        (it writes the same cache entries at the same positions). `wait`: return once the GPU has finished it
        (else once it is queued: a chain's next round reads its outputs in the same stream)."""
        if graph_id > 0:  # its first runs: an ordinary run, then the capture (what cost measurements leave out)
            self._graph_runs[graph_id] = self._graph_runs.get(graph_id, 0) + 1
            self.cold_runs += self._graph_runs[graph_id] <= GRAPH_WARMUP
        if not self._graph_session and wait:
            self.session.run_with_iobinding(binding)
            return
        try:  # a session with CUDA graphs on needs the id on every run: without one it would capture graph 0
            self.session.run_with_iobinding(binding, self._run_options(graph_id if self.cuda_graphs else -1, wait))
        except Exception as e:  # onnxruntime raises its own untyped errors
            if graph_id < 0 or not self.cuda_graphs:
                raise
            log.warning("EAGLE-3 head: CUDA graphs off after a failed capture: %s", str(e).splitlines()[0])
            self.cuda_graphs = False
            self.session.run_with_iobinding(binding, self._run_options(-1, wait))

    def _run_options(self, graph_id: int, wait: bool = True):
        options = self._ort.RunOptions()
        if self._graph_session:
            options.add_run_config_entry("gpu_graph_id", str(graph_id))
        if not wait:
            options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        return options

    @property
    def captures_graphs(self) -> bool:
        return bool(self.fixed_shapes and self.cuda_graphs)

    @property
    def chains_on_device(self) -> bool:
        return self._argmax and self._headroom >= 1

    def greedy_chains(self, rows, rounds):
        """All rounds in one call (the module docstring): slots 0..bucket-1 as a graph run's, one attention window
        for every round; None for a head without the argmax output, more than MAX_CHAIN_ROUNDS rounds, or a
        slot whose context cannot hold them (the caller runs those round by round)."""
        if not (self.chains_on_device and 1 <= rounds <= MAX_CHAIN_ROUNDS):
            return None
        if any(len(r.tokens) != 1 or r.from_target or r.tree is not None for r in rows):
            raise ValueError("expected chain rows: one token each, the head's own features, no tree")
        slots = self._one_row_per_slot(rows)
        if any(self._lengths[s] + rounds > self.max_context for s in slots):
            return None
        hi = next(b for b in self.buckets if b > max(slots))
        window = graph_window(max(self._lengths[s] for s in slots) + rounds, self.capacity)
        tokens = grow_buffer(self._scratch, ("chain-tokens", hi), self.cudart, MAX_CHAIN_ROUNDS * hi * 8)
        placeholders = [HeadRow(s, [0], np.zeros((1, self.hidden_size), np.float32), False) for s in slots]
        launches = []
        for r in range(rounds):  # round r's inputs at the lengths it writes at: ids and features only in round 0
            inputs = self._inputs(rows if r == 0 else placeholders, False, 0, hi, window)
            if r:
                del inputs["input_ids"], inputs["draft_hidden_states"]
            parts = list(inputs.items())
            host, offsets = pack_aligned([a for _, a in parts])
            key = (hi, window, r)
            if key not in self._chains:
                self._chains[key] = self._bind_chain(key, parts, offsets, host.nbytes, tokens)
            binding, buffer, graph_id = self._chains[key]
            self.cudart.memcpy(buffer.ptr, host.ctypes.data, host.nbytes, H2D)
            launches.append((binding, graph_id))
            for s in slots:
                self._lengths[s] += 1
        self.cudart.synchronize()  # the pageable copies may still be in flight; ONNX Runtime's stream does not wait
        for r, (binding, graph_id) in enumerate(launches):
            self._launch(binding, graph_id, wait=r == rounds - 1)
        self.runs += rounds
        out = np.empty((rounds, hi), np.int64)
        self.cudart.memcpy(out.ctypes.data, tokens.ptr, out.nbytes, D2H)
        return [out[:, s].copy() for s in slots]

    def _bind_chain(self, key: tuple, parts, offsets, nbytes: int, tokens: DeviceBuffer) -> tuple:
        """Round r's binding over its own input buffer: from round 1 on, token ids from round r - 1's argmax and
        features from its hidden states (two buffers taking turns); the tokens of round r go to row r of
        `tokens`; logits to one buffer every round overwrites (nobody reads them)."""
        hi, window, r = key
        where = self._where
        buffer = grow_buffer(self._scratch, ("chain-inputs", *key), self.cudart, nbytes)
        logits = grow_buffer(self._scratch, ("chain-logits", hi), self.cudart, hi * self.vocab_size * 4)
        hidden = [grow_buffer(self._scratch, ("chain-hidden", hi, i), self.cudart, hi * self.hidden_size * 4)
                  for i in (r % 2, (r - 1) % 2)]  # written this round, read from the last
        binding = self.session.io_binding()
        for (name, array), off in zip(parts, offsets):
            binding.bind_input(name, where, 0, array.dtype.type, list(array.shape), buffer.ptr + off)
        if r:
            binding.bind_input("input_ids", where, 0, np.int64, [hi, 1], tokens.ptr + (r - 1) * hi * 8)
            binding.bind_input("draft_hidden_states", where, 0, np.float32, [hi, 1, self.hidden_size], hidden[1].ptr)
        shape = [hi, self._kv, self.capacity, self._hd]
        for name, buf in zip(("key", "value"), self._cache):
            binding.bind_input(f"past_key_values.0.{name}", where, 0, np.float32, shape, buf.data_ptr())
            binding.bind_output(f"present.0.{name}", where, 0, np.float32, shape, buf.data_ptr())
        binding.bind_output("logits", where, 0, np.float32, [hi, 1, self.vocab_size], logits.ptr)
        binding.bind_output("hidden_states", where, 0, np.float32, [hi, 1, self.hidden_size], hidden[0].ptr)
        binding.bind_output("argmax", where, 0, np.int64, [hi, 1], tokens.ptr + r * hi * 8)
        if self.fixed_shapes:
            self._graph_ids += 1
        graph_id = self._graph_ids if self.fixed_shapes and self.cuda_graphs else -1
        return binding, buffer, graph_id

    def _bind(self, key: tuple, parts, offsets, nbytes: int, graph: bool) -> tuple:
        """A binding over this shape's device buffers: kept per key for graph runs (what a captured graph replays),
        made afresh over grow-only buffers otherwise."""
        from_target, lo, batch, width, window = key
        tag = key if graph else ("any",)
        inputs = grow_buffer(self._scratch, ("inputs", *tag), self.cudart, nbytes)
        logits = grow_buffer(self._scratch, ("logits", *tag), self.cudart,
                             batch * width * self.vocab_size * 4)
        hidden = grow_buffer(self._scratch, ("hidden", *tag), self.cudart,
                             batch * width * self.hidden_size * 4)
        where = self._where
        binding = self.session.io_binding()
        for (name, array), off in zip(parts, offsets):
            binding.bind_input(name, where, 0, array.dtype.type, list(array.shape), inputs.ptr + off)
        shape = [batch, self._kv, self.capacity, self._hd]
        offset = lo * self._kv * self.capacity * self._hd * 4
        for name, buf in zip(("key", "value"), self._cache):
            ptr = buf.data_ptr() + offset
            binding.bind_input(f"past_key_values.0.{name}", where, 0, np.float32, shape, ptr)
            binding.bind_output(f"present.0.{name}", where, 0, np.float32, shape, ptr)
        binding.bind_output("logits", where, 0, np.float32, [batch, width, self.vocab_size], logits.ptr)
        binding.bind_output("hidden_states", where, 0, np.float32, [batch, width, self.hidden_size], hidden.ptr)
        if self._argmax:  # read by nobody here, bound anyway: a captured graph writes every output where it was bound
            argmax = grow_buffer(self._scratch, ("argmax", *tag), self.cudart, batch * width * 8)
            binding.bind_output("argmax", where, 0, np.int64, [batch, width], argmax.ptr)
        if graph:
            self._graph_ids += 1
        graph_id = self._graph_ids if graph and self.cuda_graphs else -1
        run = (binding, inputs, logits, hidden, graph_id)
        if graph:
            self._runs[key] = run
        return run

    def close(self) -> None:
        for buf in self._scratch.values():
            buf.free()
        self._scratch.clear()
