"""One sequence at a time over the batched scheduler: the driver tests, tools and benchmarks use.

The server does not go through it: runtime.serve.engine_client drives the same ModelRunner with many
sequences at once. It lives apart from runtime.serve.speculative (the acceptance rules), which the
runner and the scheduler import, so no import circle runs through it.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator, Sequence

from runtime.serve.model_runner import ModelRunner, as_slots
from runtime.serve.sampling import LogitsProcessor, SamplingParams
from runtime.serve.scheduler import EngineRequest, Scheduler
from runtime.serve.speculative import Step, ngram_lookup


class Generator:
    """One sequence at a time over the batched scheduler: what tests, tools and benchmarks drive.

    Holds the model runner (engines, speculative method); the server's runtime.serve.engine_client
    drives the same runner with many sequences at once.
    """

    def __init__(self, target, draft=None, method: str = "none", num_speculative_tokens: int = 3, *,
                 prompt_lookup_min: int = 2, prompt_lookup_max: int = 4, clock=time.perf_counter,
                 adaptive: bool = False, disable_by_batch_size: int | None = None, tree=None):
        """`adaptive`: the runner picks each step's speculation length from measured costs
        (runtime.serve.spec_length; what the server runs); False, the default here, always verifies
        `num_speculative_tokens`, so tools and tests see the fixed call pattern."""
        draft = draft if method == "eagle3" else as_slots(draft)  # an EAGLE-3 head is a runtime.serve.eagle3.Drafter
        self.runner = ModelRunner(as_slots(target), draft, method, num_speculative_tokens,
                                  prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max,
                                  clock=clock, adaptive=adaptive, disable_by_batch_size=disable_by_batch_size,
                                  tree=tree)
        self._busy = threading.Lock()

    @classmethod
    def over(cls, runner: ModelRunner) -> "Generator":
        """A Generator driving an existing runner (the one a ServingModel holds)."""
        self = cls.__new__(cls)
        self.runner, self._busy = runner, threading.Lock()
        return self

    target = property(lambda self: self.runner.target)
    draft = property(lambda self: self.runner.draft)
    method = property(lambda self: self.runner.method)
    num_speculative_tokens = property(lambda self: self.runner.num_speculative_tokens)
    stats = property(lambda self: self.runner.stats)
    max_context = property(lambda self: self.runner.max_context)

    def _lookup(self, tokens: list[int], g: int) -> list[int]:
        return ngram_lookup(tokens, g, self.runner.prompt_lookup_min, self.runner.prompt_lookup_max)

    def generate(self, prompt: Sequence[int], params: SamplingParams, *, max_tokens: int,
                 eos_ids: Sequence[int] = (), speculative: bool = True, cancel: threading.Event | None = None,
                 logits_processors: Sequence[LogitsProcessor] = (), logprobs: int | None = None) -> Iterator[Step]:
        """Yield Steps of new tokens until eos (not included), `max_tokens`, the context end, or `cancel`.

        `logprobs`: each token's raw log-probability and this many top alternatives (0: the token's only).
        """
        request = EngineRequest(list(prompt), params, max_tokens, eos_ids=frozenset(eos_ids),
                                speculative=speculative, logits_processors=tuple(logits_processors),
                                logprobs=logprobs)
        self.runner.check(request)
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("Generator.generate is already running; it serves one sequence at a time")
        try:
            steps: list[Step] = []
            request.on_step = lambda step: steps.append(step)
            scheduler = Scheduler(self.runner, max_num_seqs=1, max_num_batched_tokens=self.runner.max_context + 16)
            scheduler.add(request)
            while request.finish_reason is None:
                if cancel is not None and cancel.is_set():
                    request.cancel.set()
                scheduler.step()
                yield from steps
                steps.clear()
        finally:
            self._busy.release()

    def reset(self) -> None:
        self.runner.reset()
