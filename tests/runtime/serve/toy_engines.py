"""Engines for decoder tests that are about the decoding rule itself, not about a runtime.

`MarkovEngine` is a complete Engine whose next-token distribution depends only on the last token,
so the exact distribution of any generated sequence is known in closed form: the chi-square test
compares speculative sampling against it. `TorchEngine` runs a real Hugging Face checkpoint with a
transformers KV cache; it lets the greedy-equivalence tests run before or beside the ONNX Runtime
engine (tests may import torch; the runtime never does).
"""

from __future__ import annotations

import numpy as np

from runtime.engine import Engine


class MarkovEngine(Engine):
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


class TorchEngine(Engine):
    """A transformers causal LM behind the Engine interface (KV cache cropped on rollback)."""

    description = "torch (tests)"

    def __init__(self, model_dir, max_context: int | None = None):
        import torch
        import transformers

        torch.set_num_threads(1)
        self._torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.vocab_size = self.model.config.vocab_size
        self.max_context = max_context or self.model.config.max_position_embeddings
        self.reset()

    def reset(self):
        from transformers import DynamicCache

        self._cache = DynamicCache(config=self.model.config)
        self._len = 0

    @property
    def length(self) -> int:
        return self._len

    def forward(self, token_ids):
        torch = self._torch
        assert self._len + len(token_ids) <= self.max_context
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([list(token_ids)]), cache=self._cache, use_cache=True)
        self._len += len(token_ids)
        return out.logits[0].float().numpy()

    def rollback(self, length):
        assert 0 <= length <= self._len
        if length == 0:
            self.reset()
        elif length < self._len:
            self._cache.crop(length - self._len)
            self._len = length
