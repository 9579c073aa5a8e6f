"""The one interface the server drives: feed tokens into a KV cache, get logits, roll back.

One sequence at a time (batch 1). Implementations: ONNX Runtime (`runtime.engines.onnxruntime`,
every target) and TensorRT (`runtime.engines.tensorrt`, GPU targets). Speculative decoding needs
exactly three operations: score k new tokens in one pass, drop rejected tokens from the cache,
and start over for the next request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np


class Engine(ABC):
    """A causal LM with its own KV cache for one sequence."""

    #: size of the logits' last axis
    vocab_size: int
    #: the most tokens the cache can hold (prompt + generated)
    max_context: int
    #: short description for logs and /v1/models, e.g. "onnxruntime CPUExecutionProvider fp32"
    description: str = ""

    @property
    @abstractmethod
    def length(self) -> int:
        """Tokens currently held in the cache."""

    @abstractmethod
    def forward(self, token_ids: Sequence[int]) -> np.ndarray:
        """Append `token_ids` after the cached tokens; return float32 logits of shape [len(token_ids), vocab].

        Row i is the next-token distribution after token_ids[i]. Prefill, single-token decode and
        verification of k draft tokens are all this one call.
        """

    @abstractmethod
    def rollback(self, length: int) -> None:
        """Forget every cached token at position >= length (rejected draft tokens)."""

    def reset(self) -> None:
        """Empty the cache for a new request."""
        self.rollback(0)

    def memory(self) -> dict:
        """Bytes used, for /metrics and logs: {"weights", "kv_cache"} and, where known, "activations"
        (scratch the runtime allocates per execution) and "buffers" (inputs and logits)."""
        return {}

    def close(self) -> None:
        """Release resources."""
