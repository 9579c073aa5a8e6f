"""The interface the scheduler drives: many sequences at once, each in a slot with its own KV cache.

A slot is one sequence's KV cache region. One `forward` call advances several slots at once; its
rows may mix a prefill chunk, single-token decode and the k+1 tokens of a speculative
verification. Rollback (rejected drafts) and release (finished request) are per slot, and
`copy_prefix` lets a new request start from KV another slot already computed (prefix caching).

Implementations:
- `runtime.engines.onnxruntime.OnnxRuntimeEngine`: the "batched" graph (TensorScatter + Attention,
  bundler.onnx.inplace) runs all rows in one session call; the older graphs ("shared"
  GroupQueryAttention, "concat") run row by row with batch 1 (bundles made before this graph).
- `runtime.engines.tensorrt_batched.TensorRTBatchedEngine`: TensorRT plans of the batched graph (static
  cache capacity; TensorRT that parses ONNX Attention): all rows in one execution, as the ONNX Runtime one.
- `runtime.engines.tensorrt.TensorRTEngine`: batch 1 inside, row by row (plans of the concat graph:
  TensorRT 10.13, JetPack 7).
- `SequenceSlots` below: any single-sequence engine (`SequenceEngine`, the interface before
  slots) turned into a slot engine, one instance per slot, rows run one after another.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from dataclasses import dataclass
from typing import Collection, Sequence

import numpy as np

from manifests.errors import ServeError


class ContextFull(ServeError):
    """A forward() would hold more tokens in a slot than the engine's max_context."""


def check_rollback(slot: int, length: int, have: int) -> None:
    """The refusal every slot engine's rollback makes: a length outside 0..(tokens the slot holds)."""
    if not 0 <= length <= have:
        raise ValueError(f"rollback of slot {slot} to {length}: expected 0..{have}")


@dataclass(frozen=True)
class Row:
    """Tokens to append after what slot `slot` holds; logits come back for each of them.

    `fetch` says which logits the caller reads: "all", "last" (a prefill chunk whose next token is
    sampled) or "none" (a prefill chunk whose logits nobody reads). An engine may return only those
    ([1, vocab] or [0, vocab]), which saves a GPU engine a device-to-host copy of chunk x vocab floats;
    engines whose logits are host memory anyway may return all of them."""

    slot: int
    tokens: Sequence[int]
    fetch: str = "all"
    #: None: the tokens follow each other (causal). A TreeMask: they are nodes of a token tree
    #: (speculative verification of several branches in one forward); only engines with supports_tree
    tree: "TreeMask | None" = None


@dataclass(frozen=True)
class TreeMask:
    """Which cached rows each new token of a tree row sees, so a token tree runs in ONE forward.

    Token i of the row (written at cache position past + i) attends to every position < `base`, to
    the positions in `ancestors[i]` (all >= base: earlier tree nodes, in this row or in the cache
    from an earlier call) and to itself; its position id is base + len(ancestors[i]) (its depth).
    A chain of n tokens is the tree whose token i has ancestors past..past+i-1."""

    base: int
    ancestors: tuple[tuple[int, ...], ...]


#: what runs a model: a TensorRT plan, ONNX Runtime's CUDA provider, or ONNX Runtime on the CPU
RUNS = {"tensorrt": "TensorRT plan", "onnxruntime-cuda": "ONNX Runtime CUDA provider",
        "onnxruntime-cpu": "ONNX Runtime on the CPU"}


@dataclass(frozen=True)
class EngineChoice:
    """Which engine runs a model and why, set by runtime.engines.load_engine: what the serve banner and
    /health say, so an operator sees a GPU target that ended up on its CPU."""

    runs: str  # a key of RUNS
    reason: str
    wanted: str  # the target's backend: "tensorrt", "onnxruntime-cuda" or "onnxruntime"

    @property
    def degraded(self) -> bool:
        """A GPU target running on the CPU (correct, not fast)."""
        return self.wanted != "onnxruntime" and self.runs == "onnxruntime-cpu"

    @property
    def label(self) -> str:
        return RUNS.get(self.runs, self.runs)


class Engine(ABC):
    """A causal LM with `num_slots` KV caches of `max_context` tokens each."""

    #: size of the logits' last axis
    vocab_size: int
    #: the most tokens one slot can hold (prompt + generated)
    max_context: int
    #: how many sequences the engine holds at once
    num_slots: int = 1
    #: short description for logs and /v1/models, e.g. "onnxruntime CPUExecutionProvider fp32"
    description: str = ""
    #: what runs it and why (runtime.engines.load_engine sets it; None for an engine made directly)
    choice: EngineChoice | None = None
    #: True when one forward computes all rows together; False when rows run one after another
    batched: bool = False
    #: True when slots also hold a recurrent state (Gated DeltaNet or Mamba-2 layers): it cannot be shortened by a
    #: length, so a rollback or a partial prefix copy runs tokens again; prefix caching buys nothing
    recurrent: bool = False
    #: True when forward takes Row.tree (a tree attention mask) and keep_rows compacts chosen rows
    supports_tree: bool = False
    #: calls so far that ran a CUDA graph's shape for one of its first runs (ONNX Runtime runs a new graph id
    #: ordinarily, then captures it: many times a replay's cost), which a cost measurement must leave out
    cold_runs: int = 0
    #: True when the engine captures a CUDA graph per call shape on its first runs (runtime.serve.warmup runs every
    #: shape serving can meet once at startup, so that no request pays a capture)
    captures_graphs: bool = False

    @abstractmethod
    def length(self, slot: int) -> int:
        """Tokens currently held in `slot`'s cache."""

    def check_rows(self, rows: Sequence[Row]) -> None:
        """Refuse a forward before it touches a cache: each slot in range and at most once, and every
        row fitting its slot (ContextFull otherwise)."""
        seen = set()
        for r in rows:
            if r.slot in seen or not 0 <= r.slot < self.num_slots:
                raise ValueError(f"expected each slot in 0..{self.num_slots - 1} at most once, found slot {r.slot}")
            seen.add(r.slot)
            if r.tree is not None:
                if not self.supports_tree:
                    raise NotImplementedError(f"{type(self).__name__} runs no token trees (Row.tree)")
                if len(r.tree.ancestors) != len(r.tokens):
                    raise ValueError(f"expected one ancestor list per tree token ({len(r.tokens)}), "
                                     f"found {len(r.tree.ancestors)}")
            if self.length(r.slot) + len(r.tokens) > self.max_context:
                raise ContextFull(f"context full: expected at most {self.max_context} tokens, found "
                                  f"{self.length(r.slot)} cached + {len(r.tokens)} new in slot {r.slot}")

    @abstractmethod
    def forward(self, rows: Sequence[Row]) -> list[np.ndarray]:
        """Append each row's tokens to its slot; return float32 logits [len(row.tokens), vocab] per row.

        Row i's logits j are the next-token distribution after row i's token j. A slot appears at
        most once per call. Prefill, decode and verification are all this one call.
        """

    def forward_greedy(self, rows: Sequence[Row], logits_for: Collection[int] = ()) -> list[np.ndarray]:
        """As forward, but only the argmax token of each logits row comes back (int64 [k] per row).

        Greedy decoding and greedy verification read nothing else. Row i's entry j is the argmax of
        forward's logits i, j, ties to the lowest id (numpy's argmax): the same tokens either way. This
        default takes it from `forward`; an engine whose graph computes the argmax itself (CUDA)
        overrides it so a vocab-sized row never crosses to the host. The rows of the slots in
        `logits_for` come back as forward returns them (logits): a sampled row beside greedy ones
        keeps the step one call with the others still on the argmax path.
        """
        return [lg if row.slot in logits_for else np.asarray(lg).argmax(-1)
                for row, lg in zip(rows, self.forward(rows))]

    #: greedy_chain runs every round on the device (declining only a chain its slots' context cannot hold)
    chains_on_device = False

    def greedy_chain(self, rows: Sequence[Row], rounds: int) -> list[np.ndarray] | None:
        """Greedy decoding of `rounds` tokens for each row (one token each, at most one row per slot) in one call:
        each round appends a token to every row's slot and the next round's token is the argmax of its logits
        (forward_greedy's, ties to the lowest id). Per row the int64 [rounds] argmax tokens; the slots grow by
        `rounds`. None where the engine cannot do better than a call per round (this default; the CUDA engine
        feeds each round's argmax to the next on the device): the caller then makes those calls."""
        return None

    @abstractmethod
    def rollback(self, slot: int, length: int) -> None:
        """Forget every token of `slot` at position >= length (rejected drafts, a shorter prefix)."""

    def keep_rows(self, slot: int, past: int, rows: Sequence[int]) -> None:
        """Keep the first `past` cached tokens of `slot` and, after them, the rows past + i for i in
        `rows` (increasing), moved to be contiguous; forget the rest. After a token tree's
        verification only the accepted path stays. Engines without supports_tree refuse."""
        raise NotImplementedError(f"{type(self).__name__} cannot keep selected cache rows (token trees)")

    def release(self, slot: int) -> None:
        """Empty `slot` (its cached tokens are forgotten)."""
        self.rollback(slot, 0)

    @abstractmethod
    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make `dst` hold the first `length` tokens of `src` (prefix caching across slots)."""

    def kv_bytes_per_slot(self) -> int:
        """KV memory one slot takes, for the slot budget, /health and the banner."""
        return 0

    def allocate_slots(self, num_slots: int) -> None:
        """(Re)allocate the caches for `num_slots` empty slots. Engines with a fixed count refuse."""
        raise NotImplementedError(f"{type(self).__name__} has a fixed number of slots ({self.num_slots})")

    def memory(self) -> dict:
        """Bytes used, for /metrics and logs: {"weights", "kv_cache"} and, where known, "activations"
        (scratch the runtime allocates per execution) and "buffers" (inputs and logits)."""
        return {}

    def close(self) -> None:
        """Release resources."""

    # --- one-sequence convenience (tests, tools): slot 0 ------------------------------------------
    def forward_one(self, token_ids: Sequence[int], slot: int = 0) -> np.ndarray:
        return self.forward([Row(slot, list(token_ids))])[0]


class SequenceEngine(ABC):
    """One sequence, batch 1: the engine interface before slots. Turned into slots by SequenceSlots."""

    vocab_size: int
    max_context: int
    description: str = ""

    @property
    @abstractmethod
    def length(self) -> int:
        """Tokens currently held in the cache."""

    @abstractmethod
    def forward(self, token_ids: Sequence[int]) -> np.ndarray:
        """Append `token_ids`; float32 logits [len(token_ids), vocab]."""

    @abstractmethod
    def rollback(self, length: int) -> None:
        """Forget every cached token at position >= length."""

    def memory(self) -> dict:
        """Bytes used, for /metrics and logs: {"weights", "kv_cache"} and, where known, "activations"
        (scratch the runtime allocates per execution) and "buffers" (inputs and logits)."""
        return {}

    def close(self) -> None:
        """Release resources."""


class SequenceSlots(Engine):
    """Slots over single-sequence engines, one per slot; rows run one by one.

    copy_prefix replays the tokens (`tokens_of(src)` is kept here), since a single-sequence engine
    exposes no cache memory: correct for any engine, and only as fast as a prefill.
    """

    batched = False

    def __init__(self, engines: Sequence[SequenceEngine]):
        if not engines:
            raise ValueError("expected at least one engine (one per slot), found none")
        self._slots = list(engines)
        first = self._slots[0]
        num_slots = len(self._slots)
        self.vocab_size = first.vocab_size
        self.max_context = min(e.max_context for e in self._slots)
        self.num_slots = num_slots
        self.description = first.description
        self._tokens: list[list[int]] = [[] for _ in range(num_slots)]

    @property
    def sequences(self) -> list[SequenceEngine]:
        return self._slots

    def length(self, slot: int) -> int:
        return self._slots[slot].length

    def forward(self, rows: Sequence[Row]) -> list[np.ndarray]:
        if any(row.tree is not None for row in rows):  # a single-sequence engine has no tree mask
            raise NotImplementedError(f"{type(self).__name__} runs no token trees (Row.tree)")
        out = []
        for row in rows:
            out.append(self._slots[row.slot].forward(row.tokens))
            self._tokens[row.slot].extend(int(t) for t in row.tokens)
        return out

    def rollback(self, slot: int, length: int) -> None:
        self._slots[slot].rollback(length)
        del self._tokens[slot][length:]

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        if src == dst:
            self.rollback(dst, length)
            return
        self.rollback(dst, 0)
        if length:
            self.forward([Row(dst, self._tokens[src][:length])])

    def memory(self) -> dict:
        total: dict = {}
        for s in self._slots:
            for k, v in s.memory().items():
                total[k] = total.get(k, 0) + v
        return total

    def close(self) -> None:
        for s in self._slots:
            s.close()
