"""An engine for decoder tests that are about the decoding rule itself, not about a runtime.

`MarkovEngine` is a complete Engine whose next-token distribution depends only on the last token,
so the exact distribution of any generated sequence is known in closed form: the chi-square test
compares speculative sampling against it. Everything else runs the real ONNX Runtime engine.
"""

from __future__ import annotations

import numpy as np

from runtime.engines.base import Engine, SequenceEngine, check_rollback


class MarkovEngine(SequenceEngine):
    description = "numpy first-order Markov chain"

    def __init__(self, table: np.ndarray, max_context: int = 4096):
        self.table = np.asarray(table, dtype=np.float32)  # [vocab, vocab] logits after each token
        self.vocab_size = self.table.shape[1]
        self.max_context = max_context
        self._tokens: list[int] = []
        self.forward_calls = 0

    @property
    def length(self) -> int:
        return len(self._tokens)

    def forward(self, token_ids):
        assert len(self._tokens) + len(token_ids) <= self.max_context, "cache overflow"
        self.forward_calls += 1
        self._tokens.extend(int(t) for t in token_ids)
        return self.table[np.asarray(token_ids, dtype=np.int64)]

    def rollback(self, length):
        assert 0 <= length <= len(self._tokens), f"rollback to {length} with {len(self._tokens)} cached"
        del self._tokens[length:]


class MarkovSlots(Engine):
    """The Markov chain as a slot Engine that runs token trees: a node's logits depend on its own token
    only, so any tree mask gives them exactly; keep_rows keeps the chosen tokens as the real engine does."""

    description = "numpy first-order Markov chain, token trees"
    supports_tree = True

    def __init__(self, table: np.ndarray, max_context: int = 4096, num_slots: int = 1):
        self.table = np.asarray(table, dtype=np.float32)
        self.vocab_size = self.table.shape[1]
        self.max_context = max_context
        self.num_slots = num_slots
        self._tokens: list[list[int]] = [[] for _ in range(num_slots)]

    def length(self, slot):
        return len(self._tokens[slot])

    def forward(self, rows):
        self.check_rows(rows)
        out = []
        for r in rows:
            self._tokens[r.slot].extend(int(t) for t in r.tokens)
            out.append(self.table[np.asarray(r.tokens, dtype=np.int64)].reshape(len(r.tokens), -1))
        return out

    def rollback(self, slot, length):
        check_rollback(slot, length, len(self._tokens[slot]))
        del self._tokens[slot][length:]

    def keep_rows(self, slot, past, rows):
        t = self._tokens[slot]
        assert list(rows) == sorted(set(rows)) and all(past + i < len(t) for i in rows), (past, rows, len(t))
        self._tokens[slot] = t[:past] + [t[past + i] for i in rows]

    def copy_prefix(self, src, dst, length):
        self._tokens[dst] = self._tokens[src][:length]


class MarkovChainSlots(MarkovSlots):
    """MarkovSlots with greedy chains in one call, as the CUDA engine runs them on its device (Engine.greedy_chain):
    what the model runner does for requests where a drafter chains on the device, without a GPU."""

    description = "numpy first-order Markov chain, greedy chains in one call"
    chains_on_device = True

    def __init__(self, table: np.ndarray, max_context: int = 4096, num_slots: int = 1):
        super().__init__(table, max_context, num_slots)
        self.chain_calls = 0

    def greedy_chain(self, rows, rounds):
        self.check_rows(rows)
        assert all(len(r.tokens) == 1 for r in rows)
        if any(len(self._tokens[r.slot]) + rounds > self.max_context for r in rows):
            return None
        self.chain_calls += 1
        out = []
        for r in rows:
            token, ids = int(r.tokens[0]), []
            for _ in range(rounds):
                self._tokens[r.slot].append(token)
                token = int(self.table[token].argmax())
                ids.append(token)
            out.append(np.array(ids, np.int64))
        return out



class ShapeCountingSlots(MarkovChainSlots):
    """MarkovChainSlots that counts its calls by the CUDA engine's graph shapes (runtime.engines.cuda): a step's
    single-token rows are one call and its longer rows calls of similar lengths (the dual engine, pad_groups), each of
    shape (batch bucket of its highest slot, tokens a row rounded up to a power of two, attention window), a chain's
    round r (bucket, window, r); a shape's first GRAPH_WARMUP calls are cold (Engine.cold_runs), as a capture is.
    Calls of more than GRAPH_MAX_WIDTH tokens a row are ordinary runs, never cold (`_ordinary`)."""

    captures_graphs = True
    HEADROOM = 64  # the cache's spare rows (a `cuda` bundle's): a longer row is a call of its own

    def __init__(self, table: np.ndarray, max_context: int = 4096, num_slots: int = 1):
        from runtime.engines.cuda import batch_buckets

        super().__init__(table, max_context, num_slots)
        self.buckets = batch_buckets(num_slots)
        self.shape_runs: dict[tuple, int] = {}
        self.cold_runs = 0

    def _count(self, shape: tuple) -> None:
        from runtime.engines.cuda import GRAPH_WARMUP

        runs = self.shape_runs[shape] = self.shape_runs.get(shape, 0) + 1
        self.cold_runs += runs <= GRAPH_WARMUP

    def _bucket(self, slots) -> int:
        return next(b for b in self.buckets if b > max(slots))

    def _window(self, rows: int) -> int:
        from runtime.engines.cuda import graph_window

        return graph_window(rows, self.max_context)

    def forward(self, rows):
        from runtime.engines.cuda import GRAPH_MAX_WIDTH, graph_width

        from runtime.engines.onnxruntime import pad_groups

        single = [r for r in rows if len(r.tokens) == 1]
        groups = ([single] if single else []) + pad_groups([r for r in rows if len(r.tokens) > 1], self.HEADROOM)
        for group in groups:
            width = max(len(r.tokens) for r in group)
            if width <= GRAPH_MAX_WIDTH:
                reach = max(len(self._tokens[r.slot]) for r in group) + width
                self._count((self._bucket([r.slot for r in group]), graph_width(width), self._window(reach)))
            else:
                self._ordinary(len(group), width)
        return super().forward(rows)

    def _ordinary(self, rows: int, width: int) -> None:
        """A call of `rows` rows of up to `width` tokens, more than a graph's: an ordinary run (nothing counted)."""

    def greedy_chain(self, rows, rounds):
        reach = max(len(self._tokens[r.slot]) for r in rows) + rounds
        out = super().greedy_chain(rows, rounds)
        if out is not None:
            for r in range(rounds):
                self._count(("chain", self._bucket([row.slot for row in rows]), self._window(reach), r))
        return out
