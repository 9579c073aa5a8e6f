"""EAGLE-3 drafting on the device: the head's graph with its own KV cache, and chain proposals.

The target graph (bundler.onnx.export with aux layer ids) returns `aux_hidden_states` beside the logits;
an engine that has them exposes the rows of its last forward as `last_aux_hidden` ([n, 3H]).
The head (bundler.onnx.eagle3.export_head_onnx) keeps one cache entry per position t, made from
(token t + 1, feature of t). Entries whose feature is the target's (fc of its aux states) stay
across steps; entries made while chain drafting (feature = the head's own output) are dropped
after every proposal, since after verification the target's feature for those positions exists.
The head's logits cover the target vocabulary with -inf outside the draft vocabulary (d2t applied
in the graph), so q = 0 there and acceptance is exactly runtime.serve.speculative's.

Token trees (runtime.serve.spec_tree): a level's nodes run as ONE head forward under a tree mask, each
node's entry made from (its token, its parent's hidden state) at position past + depth - 1 and seeing
the target-feature entries and its own ancestors' entries only, so every branch continues from its own
hidden state exactly as a chain along it would. Cost: one head forward per level (as a chain's one per
token), its rows the level's nodes; the head's cache holds every node drafted until the proposal ends.
Needs the "batched" head layout (the graph takes a mask and position ids); "concat" heads draft chains.

This module drafts one sequence per head run (OnnxDrafter, fork() per slot): heads whose batch carries slots
run every slot's round in one head run instead (runtime.serve.eagle3_slots, eagle3_rounds), ChainProposer
keeping each slot's features and bookkeeping in both cases.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from manifests.errors import EnvironmentProblem, ModelError
from runtime.engines.base import TreeMask
from runtime.engines.onnxruntime import open_session, tree_mask
from runtime.serve.spec_tree import Tree
from runtime.serve.speculative import common_prefix

FORMAT = "eagle3-head-v1"
#: bundle.head_batch of a batched head whose batch axis carries slots (runtime.serve.eagle3_slots);
#: heads made before it fix the batch at 1 and draft slot by slot
HEAD_BATCH = "slots"


@dataclass(frozen=True)
class HeadRow:
    """New entries for one slot's head cache in a run over slots (runtime.serve.eagle3_slots): `features`
    [n, 3H] target aux rows (from_target) or [n, H] the head's own hidden states; `tree` as Row.tree."""

    slot: int
    tokens: Sequence[int]
    features: np.ndarray
    from_target: bool
    tree: TreeMask | None = None


def open_head_graph(graph: Path, providers: Sequence[str], threads: int | None):
    """(session, metadata) of an EAGLE-3 head graph, or a one-line error naming what was expected."""
    import onnxruntime as ort

    graph = Path(graph)
    if not graph.is_file():
        raise EnvironmentProblem(f"expected the EAGLE-3 head graph at {graph}, found nothing")
    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = open_session(graph, so, providers, threads)
    meta = session.get_modelmeta().custom_metadata_map
    if meta.get("bundle.format") != FORMAT:
        raise ModelError(f"{graph}: expected an EAGLE-3 head graph (bundle.format {FORMAT}), "
                         f"found {meta.get('bundle.format')!r}")
    kv_cache = meta.get("bundle.kv_cache", "concat")
    if kv_cache not in ("batched", "concat"):
        raise ModelError(f"{graph}: expected an EAGLE-3 head KV cache 'batched' or 'concat', found {kv_cache!r}")
    return session, meta


def read_head_meta(obj, meta: dict, max_context: int | None) -> None:
    """Set the head's sizes on `obj` (a Drafter or runtime.serve.eagle3_slots.SlotsDrafter) from its metadata."""
    obj.kv_cache = meta.get("bundle.kv_cache", "concat")
    obj.vocab_size = int(meta["bundle.vocab_size"])
    obj.hidden_size = int(meta["bundle.hidden_size"])
    obj.target_hidden_size = int(meta["bundle.target_hidden_size"])
    obj.layer_ids = [int(i) for i in meta["bundle.aux_hidden_state_layer_ids"].split(",")]
    obj.max_context = min(int(max_context or meta["bundle.max_positions"]), int(meta["bundle.max_positions"]))
    obj._kv, obj._hd = int(meta["bundle.num_kv_heads"]), int(meta["bundle.head_dim"])


class Drafter(ABC):
    """An EAGLE-3 head with its own KV cache for one sequence."""

    vocab_size: int
    hidden_size: int
    target_hidden_size: int
    max_context: int
    description: str = ""
    #: True when forward_tree runs a level of a token tree under a tree mask
    supports_tree: bool = False

    @property
    @abstractmethod
    def length(self) -> int:
        """Entries in the cache."""

    @abstractmethod
    def forward(self, token_ids: Sequence[int], target_hidden: np.ndarray,
                draft_hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append len(token_ids) entries: first len(target_hidden) rows with target features, then
        len(draft_hidden) with the head's own. Returns (logits [n, vocab] float32, hidden [n, H])."""

    def forward_tree(self, token_ids: Sequence[int], draft_hidden: np.ndarray,
                     tree: TreeMask) -> tuple[np.ndarray, np.ndarray]:
        """Append len(token_ids) entries made with the head's own features (draft_hidden [n, H]), entry i
        seeing the entries before tree.base and those at tree.ancestors[i] (runtime.engines.base.TreeMask),
        at position tree.base + len(tree.ancestors[i]). Returns (logits [n, vocab], hidden [n, H])."""
        raise NotImplementedError(f"{type(self).__name__} drafts no token trees")

    @abstractmethod
    def rollback(self, length: int) -> None:
        """Forget every entry at position >= length."""

    def reset(self) -> None:
        self.rollback(0)

    def fork(self) -> "Drafter":
        """Another empty cache over the same weights (one per slot)."""
        raise NotImplementedError(f"{type(self).__name__} serves one sequence")


class OnnxDrafter(Drafter):
    """The head's ONNX graph on ONNX Runtime, one sequence per instance (fork() for more).

    Layout "batched" (bundler.onnx.eagle3_graph, what bundles ship): the cache is one preallocated
    [1, kv_heads, max_context, head_dim] buffer per K and V on the session's device (an OrtValue in GPU
    memory under CUDAExecutionProvider), bound as both past and present with I/O binding, so a step writes
    only its new rows (nothing is copied or allocated) and a rollback is a length change. Host buffers under
    the CUDA provider are copied to the device and back at every step, and proposals went wrong there (10 %
    acceptance on the H200 with ONNX Runtime 1.31, against 66 % on the CPU provider). Layout "concat" (heads
    exported before it): the graph returns past + new, kept as two numpy arrays.
    """

    def __init__(self, graph: Path, *, max_context: int | None = None, threads: int | None = None,
                 providers: Sequence[str] = ("CPUExecutionProvider",), session=None):
        """`session`: one open_head_graph already opened for `graph`."""
        import onnxruntime as ort

        self.session, meta = (session, session.get_modelmeta().custom_metadata_map) if session is not None \
            else open_head_graph(graph, providers, threads)
        read_head_meta(self, meta, max_context)
        self._ort = ort
        self.supports_tree = self.kv_cache == "batched"
        self.device = "cuda" if self.session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        self._new_cache()
        self.description = (f"onnxruntime {ort.__version__} EAGLE-3 head (draft vocab {meta['bundle.draft_vocab_size']},"
                            f" kv-cache {self.kv_cache})")

    def _new_cache(self) -> None:
        self._length = 0
        if self.kv_cache == "batched":
            shape = [1, self._kv, self.max_context, self._hd]
            new = self._ort.OrtValue.ortvalue_from_shape_and_type
            self._k, self._v = new(shape, np.float32, self.device, 0), new(shape, np.float32, self.device, 0)
            self._binding = self.session.io_binding()
            for name, buf in (("key", self._k), ("value", self._v)):
                self._binding.bind_ortvalue_input(f"past_key_values.0.{name}", buf)
                self._binding.bind_ortvalue_output(f"present.0.{name}", buf)
        else:
            self._k = np.zeros((1, self._kv, 0, self._hd), np.float32)
            self._v = self._k.copy()

    @property
    def length(self) -> int:
        return self._length

    def fork(self) -> "OnnxDrafter":
        other = object.__new__(OnnxDrafter)
        other.__dict__.update(self.__dict__)  # the session is shared; ONNX Runtime's run() is thread-safe
        other._new_cache()
        return other

    def forward(self, token_ids, target_hidden, draft_hidden):
        n = len(token_ids)
        past = self._length
        if past + n > self.max_context:
            raise ModelError(f"EAGLE-3 head context full: {past} cached + {n} new > {self.max_context}")
        th = np.asarray(target_hidden, np.float32).reshape(1, -1, 3 * self.target_hidden_size)
        dh = np.asarray(draft_hidden, np.float32).reshape(1, -1, self.hidden_size)
        if th.shape[1] + dh.shape[1] != n:
            raise ValueError(f"expected {n} feature rows, found {th.shape[1]} + {dh.shape[1]}")
        ids = np.asarray(token_ids, np.int64).reshape(1, n)
        positions = np.arange(past, past + n, dtype=np.int64)[None]
        if self.kv_cache == "concat":
            logits, hidden, self._k, self._v = self.session.run(None, {
                "input_ids": ids, "target_hidden_states": th, "draft_hidden_states": dh, "position_ids": positions,
                "past_key_values.0.key": self._k, "past_key_values.0.value": self._v})
            self._length = past + n
            return logits[0], hidden[0]
        # new row i attends to every cached row and to new rows 0..i: the first past + n rows only
        mask = np.arange(past + n)[None, :] <= positions[0][:, None]
        return self._run(ids, th, dh, positions, mask)

    def forward_tree(self, token_ids, draft_hidden, tree):
        if not self.supports_tree:
            return super().forward_tree(token_ids, draft_hidden, tree)
        n, past = len(token_ids), self._length
        if past + n > self.max_context:
            raise ModelError(f"EAGLE-3 head context full: {past} cached + {n} new > {self.max_context}")
        dh = np.asarray(draft_hidden, np.float32).reshape(1, n, self.hidden_size)
        mask = np.zeros((n, past + n), bool)
        positions = np.zeros(n, np.int64)
        tree_mask(mask, positions, tree, past)
        return self._run(np.asarray(token_ids, np.int64).reshape(1, n),
                         np.zeros((1, 0, 3 * self.target_hidden_size), np.float32), dh, positions[None], mask)

    def _run(self, ids, th, dh, positions, mask):
        """One run of the batched layout: n new entries written from row `length` on; mask [n, length + n]."""
        n, past = ids.shape[1], self._length
        b = self._binding
        b.bind_cpu_input("input_ids", ids)
        b.bind_cpu_input("target_hidden_states", np.ascontiguousarray(th))
        b.bind_cpu_input("draft_hidden_states", np.ascontiguousarray(dh))
        b.bind_cpu_input("position_ids", positions)
        b.bind_cpu_input("write_indices", np.array([past], np.int64))
        b.bind_cpu_input("attention_mask", np.ascontiguousarray(mask[None, None]))
        logits = np.empty((1, n, self.vocab_size), np.float32)
        hidden = np.empty((1, n, self.hidden_size), np.float32)
        b.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        b.bind_output("hidden_states", "cpu", 0, np.float32, list(hidden.shape), hidden.ctypes.data)
        self.session.run_with_iobinding(b)
        self._length = past + n
        return logits[0], hidden[0]

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"rollback to {length}: expected 0..{self._length}")
        if self.kv_cache == "concat":
            self._k, self._v = self._k[:, :, :length], self._v[:, :, :length]
        self._length = length


class ChainProposer:
    """Chain drafting of g tokens from the target's features, for one slot.

    `features` holds the target's aux rows for every token its cache holds (row t: after token t);
    the model runner appends and truncates it alongside the target cache. They are kept as the target
    handed them out, one array per forward (a chunk): a step appends one object whatever its rows (no
    Python object per row, no copy while nothing drafts), a rollback trims the newest chunks, and a
    catch-up joins only the chunks it reads.
    """

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self._chunks: list[np.ndarray] = []  # [n_i, 3H] each, in cache order; never written in place
        self._n = 0  # rows in all chunks
        self._covered: list[int] = []  # tokens[:length + 1]: what the cached target-feature entries read

    @property
    def features(self) -> np.ndarray:
        """[positions, 3H]: one row per target cache position."""
        return self._tail(0)

    def __len__(self) -> int:
        return self._n

    def on_target_forward(self, rows, n: int) -> None:
        """The target appended n tokens; `rows` are their aux hidden states."""
        if rows is None or len(rows) != n:
            raise ModelError("EAGLE-3 needs a target graph with aux_hidden_states (export with the head's "
                             "layer ids); this target engine returned none")
        rows = np.asarray(rows, np.float32)
        self._chunks.append(rows if rows.ndim == 2 else rows.reshape(n, -1))
        self._n += n

    def on_target_rollback(self, length: int) -> None:
        drop = self._n - max(length, 0)
        while drop > 0:
            last = self._chunks[-1]
            if len(last) <= drop:
                self._chunks.pop()
                drop -= len(last)
            else:
                self._chunks[-1] = last[:len(last) - drop]
                drop = 0
        self._n = min(self._n, max(length, 0))

    def _tail(self, start: int) -> np.ndarray:
        """Feature rows [start, n) as one array, read from the newest chunk back (a view where one chunk holds
        them, else a joined copy: a probe after many plain steps joins their rows, as stacking rows did)."""
        start = max(start, 0)
        chunks, parts, end, i = self._chunks, [], self._n, len(self._chunks)
        while end > start:
            i -= 1
            end -= len(chunks[i])
            parts.append(chunks[i])
        if not parts:
            return np.zeros((0, chunks[-1].shape[1] if chunks else 0), np.float32)
        if end < start:  # the oldest chunk read begins before start
            parts[-1] = parts[-1][start - end:]
        return parts[0] if len(parts) == 1 else np.concatenate(parts[::-1])

    def keep_rows(self, past: int, rows: Sequence[int]) -> None:
        """The target kept cache rows past + i for i in `rows` (a token tree's accepted path) at past..."""
        tail = self._tail(past)
        self.on_target_rollback(past)
        if len(rows):
            self._chunks.append(tail[list(rows)])  # a copy: the rows picked out of the tail
            self._n += len(rows)

    def copy_from(self, other: "ChainProposer", n: int) -> None:
        """Take the first n feature rows of another slot's proposer (a prefix copied between slots)."""
        self._chunks, self._n, end = [], 0, 0
        for chunk in other._chunks:
            if end >= n:
                break
            part = chunk[:n - end]
            self._chunks.append(part)
            end += len(part)
        self._n = end

    def reset(self) -> None:
        self._chunks.clear()
        self._n = 0
        self._covered.clear()
        self.drafter.reset()

    def _catch_up(self, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Feed the head the target-feature entries it lacks for `tokens`: (logits row, hidden [1, H]) of
        the last one, the head's view of the token after the pending one."""
        ids, feats = self.catch_up_rows(tokens)
        logits, hidden = self.drafter.forward(ids, feats, np.zeros((0, self.drafter.hidden_size), np.float32))
        return logits[-1], hidden[-1:]

    def catch_up_rows(self, tokens: Sequence[int]) -> tuple[list[int], np.ndarray]:
        """Roll the head back to the target-feature entries it keeps for `tokens`; return the (token ids,
        target features [n, 3H]) of the entries it lacks (n >= 1), to run next."""
        L = len(tokens)
        if self._n < L - 1:
            raise ModelError(f"EAGLE-3: the target's features cover {self._n} positions, "
                             f"expected {L - 1}")
        same = common_prefix(self._covered, tokens)
        keep = min(self.drafter.length, max(0, same - 1), L - 2)
        self.drafter.rollback(keep)
        feats = self._tail(keep)[:L - 1 - keep]  # keep <= L - 2: at least one row
        self._covered = list(tokens[:L])
        return list(tokens[keep + 1:L]), feats

    def propose(self, tokens: Sequence[int], g: int, pick) -> tuple[list[int], list]:
        """`pick(logits row, drafts so far)` -> (token, q or None). Returns (drafts, qs)."""
        L = len(tokens)
        row, h = self._catch_up(tokens)
        drafts, qs = [], []
        for i in range(g):
            d, q = pick(row, drafts)
            drafts.append(d)
            if q is not None:
                qs.append(q)
            if i < g - 1:
                lg, hd = self.drafter.forward([d], np.zeros((0, 3 * self.drafter.target_hidden_size), np.float32), h)
                row, h = lg[-1], hd[-1:]
        self.drafter.rollback(L - 1)  # chain entries read the head's own features: never kept
        return drafts, qs

    def propose_tree(self, tokens: Sequence[int], g: int, grow) -> Tree:
        """A token tree of depth up to g. `grow(tree, frontier, logits_of, level)` -> the level's new nodes
        (runtime.serve.spec_tree.grow_level); each level but the deepest runs as one head forward under a
        tree mask, a node's entry made from its token and its parent's hidden state."""
        L = len(tokens)
        row, h = self._catch_up(tokens)
        base = self.drafter.length  # node j's entry goes to base + j (levels are written in order)
        tree, frontier = Tree(), [-1]
        logits_of, hidden_of = {-1: row}, {-1: h[0]}
        for level in range(g):
            new = grow(tree, frontier, logits_of, level)
            if not new:
                break
            frontier = new
            if level < g - 1:
                mask = TreeMask(base, tuple(tuple(base + a for a in tree.ancestors(j)) for j in new))
                lg, hd = self.drafter.forward_tree([tree.tokens[j] for j in new],
                                                   np.stack([hidden_of[tree.parents[j]] for j in new]), mask)
                logits_of.update(zip(new, lg))
                hidden_of.update(zip(new, hd))
        self.drafter.rollback(L - 1)  # tree entries read the head's own features: never kept
        return tree
