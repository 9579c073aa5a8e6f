"""The EAGLE-3 head over every slot at once: one head run per draft round, whatever the number of slots.

A head graph whose batch axis carries slots (bundler.onnx.eagle3_graph, metadata bundle.head_batch
"slots") runs as the target's batched graph does (runtime.engines.onnxruntime): ONE cache buffer per K and
V, [slots, kv_heads, capacity, head_dim], on the session's device (an OrtValue in GPU memory under the CUDA
provider), bound as past and present for a contiguous range of slots; each row's new entries are written at
its slot's length (write_indices), rows are padded to the longest of the run, and padding and the slots
of the range without a row write into the capacity - max_context spare rows nobody attends to. A catch-up
longer than those spare rows runs alone. A run's rows are all of one kind: target features (catch-ups)
or the head's own (chain steps, tree levels), since the graph puts target rows before draft rows.

runtime.serve.eagle3_rounds drives the rounds (catch-ups, then one run per chain token or tree level for
every drafting slot); on the CUDA provider runtime.serve.eagle3_cuda runs the same rows from device buffers
and as CUDA graphs. `view(slot)` is one slot's runtime.serve.eagle3.Drafter over the same cache, which
ChainProposer uses for its bookkeeping (and the per-slot path, in tests, for comparison).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Sequence

import numpy as np

from manifests.errors import ModelError
from runtime.engines.onnxruntime import batched_inputs, batched_mask, pad_groups
from runtime.serve.eagle3 import (HEAD_BATCH, ChainProposer, Drafter, HeadRow, OnnxDrafter, open_head_graph,
                                  read_head_meta)

log = logging.getLogger(__name__)


class SlotsDrafter(ABC):
    """An EAGLE-3 head with one KV cache per slot; forward runs rows of many slots together."""

    vocab_size: int
    hidden_size: int
    target_hidden_size: int
    max_context: int
    num_slots: int = 0
    supports_tree: bool = True
    description: str = ""
    #: head runs so far (the model runner's draft_forwards count them)
    runs: int = 0
    #: runs that were among the first of their CUDA graph (runtime.engines.base.Engine.cold_runs)
    cold_runs: int = 0
    captures_graphs = False  # (runtime.engines.base.Engine.captures_graphs)

    @abstractmethod
    def allocate_slots(self, num_slots: int) -> None:
        """(Re)allocate the caches for `num_slots` sequences; every slot starts empty."""

    @abstractmethod
    def length(self, slot: int) -> int:
        """Entries in slot's cache."""

    @abstractmethod
    def forward(self, rows: Sequence[HeadRow]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Append each row's entries to its slot's cache (at most one row per slot); per row (logits
        [n, vocab] float32, hidden [n, H]). A tree row's entry i sees the entries before tree.base and those
        at tree.ancestors[i], at position tree.base + len(tree.ancestors[i]) (runtime.engines.base.TreeMask)."""

    @abstractmethod
    def rollback(self, slot: int, length: int) -> None:
        """Forget slot's entries at position >= length."""

    #: greedy_chains runs every round on the device (declining only chains their slots' context cannot hold)
    chains_on_device = False

    def greedy_chains(self, rows: Sequence[HeadRow], rounds: int) -> list[np.ndarray] | None:
        """Run `rounds` chain rounds for the rows (one draft token each, at most one row per slot), each next
        round's token the argmax of the last one's logits and its feature the last one's hidden state; per row
        the int64 [rounds] tokens, or None where this head runs rounds only one by one (the caller then does)."""
        return None

    def view(self, slot: int) -> "SlotHead":
        return SlotHead(self, slot)


class SlotHead(Drafter):
    """One slot of a SlotsDrafter as a single-sequence Drafter (ChainProposer's bookkeeping, the per-slot path)."""

    supports_tree = True

    def __init__(self, head: SlotsDrafter, slot: int):
        self.head, self.slot = head, slot
        self.vocab_size, self.hidden_size = head.vocab_size, head.hidden_size
        self.target_hidden_size, self.max_context = head.target_hidden_size, head.max_context
        self.supports_tree = head.supports_tree

    @property
    def length(self) -> int:
        return self.head.length(self.slot)

    def forward(self, token_ids, target_hidden, draft_hidden):
        nt = len(target_hidden)
        if nt + len(draft_hidden) != len(token_ids):
            raise ValueError(f"expected {len(token_ids)} feature rows, found {nt} + {len(draft_hidden)}")
        parts = [HeadRow(self.slot, list(token_ids[:nt]), np.asarray(target_hidden, np.float32), True),
                 HeadRow(self.slot, list(token_ids[nt:]), np.asarray(draft_hidden, np.float32), False)]
        outs = [self.head.forward([p])[0] for p in parts if len(p.tokens)]
        return np.concatenate([o[0] for o in outs]), np.concatenate([o[1] for o in outs])

    def forward_tree(self, token_ids, draft_hidden, tree):
        return self.head.forward([HeadRow(self.slot, list(token_ids), np.asarray(draft_hidden, np.float32), False,
                                          tree)])[0]

    def rollback(self, length: int) -> None:
        self.head.rollback(self.slot, length)


class OnnxSlotsDrafter(SlotsDrafter):
    """A head graph with bundle.head_batch "slots" on ONNX Runtime (the CPU or the CUDA provider)."""

    def __init__(self, graph: Path, *, max_context: int | None = None, threads: int | None = None,
                 providers: Sequence[str] = ("CPUExecutionProvider",), num_slots: int = 1, session=None):
        import onnxruntime as ort

        if session is None:
            session, meta = open_head_graph(graph, providers, threads)
        else:
            meta = session.get_modelmeta().custom_metadata_map
        self.session, self._graph = session, Path(graph)
        if meta.get("bundle.head_batch") != HEAD_BATCH or meta.get("bundle.kv_cache") != "batched":
            raise ModelError(f"{graph}: expected an EAGLE-3 head whose batch carries slots (bundle.head_batch "
                             f"{HEAD_BATCH!r}), found {meta.get('bundle.head_batch')!r}")
        read_head_meta(self, meta, max_context)
        self._headroom = int(meta.get("bundle.kv_headroom", 0))
        self.capacity = self.max_context + self._headroom
        self._ort = ort
        self.device = "cuda" if session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        self._binding = session.io_binding()
        self.description = (f"onnxruntime {ort.__version__} EAGLE-3 head (draft vocab {meta['bundle.draft_vocab_size']},"
                            f" kv-cache batched, slots in one run)")
        self.allocate_slots(num_slots)

    def allocate_slots(self, num_slots: int) -> None:
        shape = [int(num_slots), self._kv, self.capacity, self._hd]
        # zeros, not uninitialised memory: a padded run's window reaches rows no entry was written to
        # (masked off, but a NaN there would still poison the attention's weighted sum)
        self._host = [np.zeros(shape, np.float32) for _ in range(2)]
        self._cache = [self._ort.OrtValue.ortvalue_from_numpy(h, self.device, 0) for h in self._host]
        if self.device != "cpu":
            self._host = []  # copied to the device
        self.num_slots = int(num_slots)
        self._lengths = [0] * self.num_slots
        self._bound: tuple[int, int] | None = None

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def rollback(self, slot: int, length: int) -> None:
        if not 0 <= length <= self._lengths[slot]:
            raise ValueError(f"rollback of slot {slot} to {length}: expected 0..{self._lengths[slot]}")
        self._lengths[slot] = length

    def forward(self, rows):
        self._one_row_per_slot(rows)
        for r in rows:
            if self._lengths[r.slot] + len(r.tokens) > self.max_context:
                raise ModelError(f"EAGLE-3 head context full: {self._lengths[r.slot]} cached + {len(r.tokens)} "
                                 f"new > {self.max_context}")
            want = 3 * self.target_hidden_size if r.from_target else self.hidden_size
            if np.shape(r.features) != (len(r.tokens), want):
                raise ValueError(f"expected features [{len(r.tokens)}, {want}], found {list(np.shape(r.features))}")
        out = {}
        for kind in (True, False):
            for group in pad_groups([r for r in rows if r.from_target == kind and len(r.tokens)], self._headroom):
                out.update(self._run(group, kind))
        empty = (np.zeros((0, self.vocab_size), np.float32), np.zeros((0, self.hidden_size), np.float32))
        return [out.get(r.slot, empty) for r in rows]

    @staticmethod
    def _one_row_per_slot(rows) -> list[int]:
        """The rows' slots, refused (ValueError) where one appears twice."""
        slots = [r.slot for r in rows]
        if len(set(slots)) != len(slots):
            raise ValueError(f"expected at most one row per slot, found slots {slots}")
        return slots

    def _inputs(self, group: list[HeadRow], from_target: bool, lo: int, hi: int, window: int | None = None,
                width: int = 0) -> dict:
        """The graph's row inputs for one run over slots lo..hi-1 (name -> array): ids and positions padded to the
        longest row (or to `width`, a graph's), the rows' features in the input of their kind (the other one empty),
        the mask over `window` cache rows (None: every row's past and new tokens)."""
        ids, write, positions = batched_inputs(group, lo, hi, self._lengths, self.capacity, width)
        batch, width = ids.shape
        if window is None:
            window = max(self._lengths[r.slot] for r in group) + width
        wide, narrow = 3 * self.target_hidden_size, self.hidden_size
        feats = np.zeros((batch, width, wide if from_target else narrow), np.float32)
        for r in group:
            feats[r.slot - lo, :len(r.tokens)] = r.features
        none = np.zeros((batch, 0, narrow if from_target else wide), np.float32)
        return {"input_ids": ids, "target_hidden_states": feats if from_target else none,
                "draft_hidden_states": none if from_target else feats, "position_ids": positions,
                "write_indices": write, "attention_mask": batched_mask(group, lo, positions, write, window)}

    def _take(self, group: list[HeadRow], lo: int, logits: np.ndarray, hidden: np.ndarray) -> dict:
        """Each row's real entries of a run's [batch, width, ...] logits and hidden states; its slot grows by them."""
        out = {}
        for r in group:
            n = len(r.tokens)
            out[r.slot] = (logits[r.slot - lo, :n].copy(), hidden[r.slot - lo, :n].copy())
            self._lengths[r.slot] += n
        return out

    def _run(self, group: list[HeadRow], from_target: bool) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        lo, hi = min(r.slot for r in group), max(r.slot for r in group) + 1
        inputs = self._inputs(group, from_target, lo, hi)
        batch, width = inputs["input_ids"].shape
        b = self._binding
        for name, array in inputs.items():
            b.bind_cpu_input(name, array)
        if self._bound != (lo, hi):  # the slots' range of the one cache buffer, past and present alike
            shape = [hi - lo, self._kv, self.capacity, self._hd]
            offset = lo * self._kv * self.capacity * self._hd * 4
            for name, buf in zip(("key", "value"), self._cache):
                ptr = buf.data_ptr() + offset
                b.bind_input(f"past_key_values.0.{name}", self.device, 0, np.float32, shape, ptr)
                b.bind_output(f"present.0.{name}", self.device, 0, np.float32, shape, ptr)
            self._bound = (lo, hi)
        logits = np.empty((batch, width, self.vocab_size), np.float32)
        hidden = np.empty((batch, width, self.hidden_size), np.float32)
        b.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        b.bind_output("hidden_states", "cpu", 0, np.float32, list(hidden.shape), hidden.ctypes.data)
        self.session.run_with_iobinding(b)
        self.runs += 1
        return self._take(group, lo, logits, hidden)

def open_head(graph: Path, *, max_context: int | None = None, threads: int | None = None,
              providers: Sequence[str] = ("CPUExecutionProvider",), cuda_graphs: bool = True):
    """The head for serving: an OnnxSlotsDrafter when its batch axis carries slots (on the CUDA provider its
    runtime.serve.eagle3_cuda.CudaSlotsDrafter: device buffers and CUDA graphs, none where `cuda_graphs` is False),
    else (heads made before it, concat heads) the per-slot OnnxDrafter, saying so in one log line."""
    on_cuda = bool(providers) and providers[0] == "CUDAExecutionProvider"
    if on_cuda and cuda_graphs:  # with CUDA graphs where ONNX Runtime allows them (only the head over slots launches)
        from runtime.serve.eagle3_cuda import CudaSlotsDrafter, open_cuda_head_session

        session, meta, graphs = open_cuda_head_session(graph, threads)
    elif on_cuda:
        from runtime.serve.eagle3_cuda import CudaSlotsDrafter

        (session, meta), graphs = open_head_graph(graph, providers, threads), False
    else:
        session, meta = open_head_graph(graph, providers, threads)
    if meta.get("bundle.head_batch") == HEAD_BATCH and meta.get("bundle.kv_cache") == "batched":
        if on_cuda:
            return CudaSlotsDrafter(graph, max_context=max_context, session=session, cuda_graphs=graphs)
        return OnnxSlotsDrafter(graph, max_context=max_context, session=session)
    if on_cuda and graphs:  # a session with CUDA graphs on would replay graph 0 for every run of this head
        session, meta = open_head_graph(graph, providers, threads)
    log.info("EAGLE-3 head %s drafts slot by slot (one head run per slot and token): its graph runs one "
             "sequence (no bundle.head_batch %r: exported before it, or a concat head); re-create the bundle "
             "for one head run for all slots", Path(graph).name, HEAD_BATCH)
    return OnnxDrafter(graph, max_context=max_context, session=session)


def slot_proposers(head, num_slots: int) -> list[ChainProposer]:
    """One ChainProposer per slot: views of a SlotsDrafter (reallocated for num_slots), or forks of a
    single-sequence Drafter."""
    if isinstance(head, SlotsDrafter):
        head.allocate_slots(num_slots)
        return [ChainProposer(head.view(i)) for i in range(num_slots)]
    return [ChainProposer(head if i == 0 else head.fork()) for i in range(num_slots)]
