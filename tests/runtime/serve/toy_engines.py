"""An engine for decoder tests that are about the decoding rule itself, not about a runtime.

`MarkovEngine` is a complete Engine whose next-token distribution depends only on the last token,
so the exact distribution of any generated sequence is known in closed form: the chi-square test
compares speculative sampling against it. Everything else runs the real ONNX Runtime engine.
"""

from __future__ import annotations

import numpy as np

from runtime.engines.base import SequenceEngine


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
