"""Which sequences run this step: continuous batching over slots, chunked prefill, prefix cache.

Requests join and leave between steps. A step (vLLM V1's rule, decode first):
1. Cancelled requests (client gone) finish and free their slot.
2. Waiting requests take free slots while fewer than `max_num_seqs` run, one at a time from the
   `group` (the client request whose choices they are) with the fewest sequences running, earliest
   first among equals: single-choice requests go in arrival order (FIFO), and a request of many
   choices (64 prompts x n=16) takes turns with the requests that arrive after it instead of owning
   the engine until all its choices have run. With prefix caching
   a request takes the free slot whose cache shares the longest prefix with its prompt (else the
   one released longest ago), or copies a longer prefix from any other slot; freed slots keep
   their KV until a new request needs the slot: the cache is bounded by the slots the KV budget
   allows, and eviction is least recently released first.
3. Every decoding request gets one row: its pending token plus g proposals. g is the step's
   speculation length G, chosen by the model runner's cost model (runtime.serve.spec_length) from
   measured step costs and each slot's acceptance, fewer only near max_tokens or the context end.
   A request sampled with a seed always gets the configured length instead (never a length that
   depends on other requests), so it samples the same tokens alone or in a crowd.
4. What is left of `max_num_batched_tokens` goes to prompts still being prefilled, in arrival
   order, in chunks: a long prompt arriving costs running streams at most one chunk per step. A
   prompt's last chunk includes its last token and its first output token is sampled from that
   row, in the same step (as vLLM does): the first token costs one step less than a decode after
   the prefill, and requests that arrive together all prefill in the steps their prompts fill.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from manifests.errors import UsageError
from runtime.serve.model_runner import ModelRunner, step_of
from runtime.serve.sampling import SamplingParams
from runtime.serve.speculative import Step


@dataclass(eq=False)
class EngineRequest:
    """One sequence inside the engine. `on_step` is called from the engine thread with each Step;
    it may return a finish reason ("stop" for a stop string) to end the request there.
    `logits_processors`: the request's mask hook (runtime.serve.sampling), applied to plain, draft and
    verification rows alike."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    eos_ids: frozenset = frozenset()
    speculative: bool = True
    logits_processors: tuple = ()
    logprobs: int | None = None  # report raw logprobs of each token, with this many alternatives
    #: report each prompt token's logprob (and this many alternatives); such a prompt is computed in
    #: full, never taken from the prefix cache (a cached prefix has no logits), as vLLM does
    prompt_logprobs: int | None = None
    on_step: Callable[[Step], str | None] | None = None
    #: the request is over with an error: on_error(message, request_fault=False) when the engine failed,
    #: request_fault=True when the request's own logits processor did (its grammar cannot be followed)
    on_error: Callable[..., None] | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    group: str | None = None  # the client request it is a choice of (admission takes turns); None: its own
    arrival: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    # state, owned by the scheduler and runner
    tokens: list[int] = field(init=False)
    slot: int | None = None
    computed: int = 0  # tokens[:computed] are in the target slot's cache
    cached_tokens: int = 0  # how many of them came from the prefix cache
    scheduled: float | None = None  # when it got a slot (monotonic): its queue time ends there
    produced: int = 0
    finish_reason: str | None = None
    spec_hits: float = 0.0  # decayed accepted proposals, and proposals scored (runtime.serve.spec_length)
    spec_trials: float = 0.0
    spec_expected: float = 0.0  # ... and the proposals the server-wide rate at their positions expected accepted
    spec_idle: int = 0  # steps in a row this slot drafted nothing while others drafted (spec_length._per_slot)
    prompt_logprob_rows: list = field(default_factory=list)  # filled by the runner while prefilling
    #: its speculation length may follow the cost model: not for seeded sampling (reproducible). Derived from
    #: `params` once (the scheduler reads it for every decoding request every step)
    adaptive: bool = field(init=False)

    def __post_init__(self):
        self.tokens = list(self.prompt)
        self.rng: np.random.Generator = self.params.rng()
        self.adaptive = self.params.greedy or self.params.seed is None

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def prefilling(self) -> bool:
        """The prompt is not fully in the cache yet: its last chunk samples the first token."""
        return self.computed < len(self.prompt)

    def emit(self, new: list[int], drafted: int, accepted: int, logprobs: list | None = None) -> None:
        failure = self.processor_failure()
        if failure is not None:  # the step's tokens were not checked by the processor: none goes out
            self.fail(failure)
            return
        step, n = step_of(new, drafted, accepted, self.eos_ids, self.produced, self.max_tokens)
        if logprobs is not None:
            step = replace(step, logprobs=logprobs[:n])
        if self.prompt_logprobs is not None and self.produced == 0:
            step = replace(step, prompt_logprobs=list(self.prompt_logprob_rows))
        self.produced += n
        self._deliver(step)

    def processor_failure(self) -> str | None:
        """Why one of the request's logits processors cannot go on (runtime.serve.sampling), or None."""
        for processor in self.logits_processors:
            failure = getattr(processor, "failure", None)
            if failure:
                return failure
        return None

    def fail(self, message: str) -> None:
        """End with an error of the request's own; the scheduler frees its slot after the step."""
        self.finish_reason = "error"
        if self.on_error is not None:
            self.on_error(message, request_fault=True)

    def finish(self, reason: str) -> None:
        """End without new tokens (cancelled, context end)."""
        self._deliver(Step([], finish_reason=reason))

    def _deliver(self, step: Step) -> None:
        override = self.on_step(step) if self.on_step is not None else None
        self.finish_reason = step.finish_reason or override


DEFAULT_BATCHED_TOKENS = 256  # rows a step may run when --max-num-batched-tokens is not given (at least)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # None: DEFAULT_BATCHED_TOKENS, or twice one decode step's rows
    enable_prefix_caching: bool = True


class Scheduler:
    def __init__(self, runner: ModelRunner, *, max_num_seqs: int = 8, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True):
        """`max_num_batched_tokens` None (not given): DEFAULT_BATCHED_TOKENS, or twice the rows of one decode step
        of every slot where that is more (32 sequences verifying 3 proposals each take 128), so that no
        combination of --max-num-seqs and a speculative config is refused for the default; given, it must hold
        one such step."""
        self.runner = runner
        self.num_slots = min(runner.num_slots, max_num_seqs)
        per_step = self.num_slots * runner.rows_per_decode
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(DEFAULT_BATCHED_TOKENS, 2 * per_step)
        if max_num_batched_tokens < per_step:
            raise UsageError(f"--max-num-batched-tokens {max_num_batched_tokens} is less than one step of "
                             f"{self.num_slots} sequences with {runner.num_speculative_tokens} speculative "
                             f"tokens each ({per_step}); expected at least {per_step}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: collections.deque[EngineRequest] = collections.deque()
        self.running: dict[int, EngineRequest] = {}
        self._free = list(range(self.num_slots))  # least recently released first
        #: metrics, read by the engine thread's step hook: tokens computed in the last step, and prompt
        #: tokens looked up in / found in the prefix cache since start. Nothing is ever preempted here.
        self.last_step_tokens = 0
        self.prefix_queries = self.prefix_hits = 0
        self._lock = threading.Lock()

    # --- called from any thread ----------------------------------------------------------------
    def add(self, request: EngineRequest) -> None:
        self.runner.check(request)
        with self._lock:
            self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- the engine thread ------------------------------------------------------------------------
    def step(self) -> list[EngineRequest]:
        """Run one step; return the requests that finished in it."""
        finished: list[EngineRequest] = []
        for r in [r for r in self.running.values() if r.cancel.is_set()]:
            r.finish("cancelled")
            finished.append(self._free_slot(r))
        with self._lock:
            for r in [r for r in self.waiting if r.cancel.is_set()]:
                self.waiting.remove(r)
                r.finish("cancelled")
                finished.append(r)
            admitted = self._take_waiting(len(self._free))
        for r in admitted:
            r.scheduled = time.monotonic()
            self.runner.place(r, self._pick_slot(r), reuse=self.enable_prefix_caching and r.prompt_logprobs is None)
            self.running[r.slot] = r
            if self.enable_prefix_caching:  # vLLM's prefix_cache_queries / _hits, in tokens
                self.prefix_queries += len(r.prompt)
                self.prefix_hits += r.cached_tokens
        decodes, prefills = [], []
        budget = self.max_num_batched_tokens
        k = self.runner.num_speculative_tokens
        context = self.runner.max_context
        decoding, waiting_prefill = [], []
        for r in sorted(self.running.values(), key=lambda r: r.arrival):
            if r.prefilling:
                waiting_prefill.append(r)
                continue
            if context - len(r.tokens) < 0:
                r.finish("length")
                finished.append(self._free_slot(r))
                continue
            decoding.append(r)
        speculating = [r for r in decoding if r.speculative] if k else []
        adaptive = [r for r in speculating if r.adaptive]
        seeded = [r for r in speculating if not r.adaptive] if len(adaptive) < len(speculating) else []  # fixed K
        speculation = self.runner.speculation
        length = speculation.choose(adaptive, len(seeded),
                                    free_draft=self.runner.method == "ngram",
                                    plain=len(decoding) - len(speculating),
                                    rows=self.runner.proposal_rows if self.runner.tree else None,
                                    catch_up=lambda: self.runner.catch_up_tokens(speculating),
                                    caps=self.runner.proposal_caps(adaptive))
        decode_rows = 0
        if length == 0 and not seeded and not speculation.per_slot:  # nothing drafts (plain, or G = 0): g = 0 for all
            decodes = [(r, 0) for r in decoding]
            decode_rows = len(decodes)
        else:
            own, per_slot = set(map(id, seeded)), speculation.per_slot
            for r in decoding:
                if not (r.speculative and k):
                    want = 0
                elif id(r) in own:
                    want = k
                else:
                    want = speculation.length_of(r, length) if per_slot else length
                g = max(min(want, context - len(r.tokens), r.max_tokens - r.produced - 1), 0)
                decodes.append((r, g))
                decode_rows += 1 + self.runner.proposal_rows(g)
        budget -= decode_rows
        for r in waiting_prefill:
            if budget > 0:
                n = min(len(r.prompt) - r.computed, budget)
                prefills.append((r, n))
                budget -= n
        self.last_step_tokens = decode_rows + sum(n for _, n in prefills)
        if decodes or prefills:
            self.runner.step(decodes, prefills)
        for r, _ in [*decodes, *prefills]:
            if r.finish_reason is not None:
                finished.append(self._free_slot(r))
        if not self.running and not self.waiting:  # the engine waits for work now: not a cost of the last step
            self.runner.idle()
        return finished

    def _take_waiting(self, n: int) -> list[EngineRequest]:
        """Up to `n` waiting requests, each from the group with the fewest sequences running (those taken
        before it included), the earliest waiting among equals."""
        def group(r: EngineRequest) -> str:
            return r.group or r.id

        running = collections.Counter(group(r) for r in self.running.values())
        taken = []
        for _ in range(min(n, len(self.waiting))):
            best = min(range(len(self.waiting)), key=lambda i: (running[group(self.waiting[i])], i))
            r = self.waiting[best]
            del self.waiting[best]
            running[group(r)] += 1
            taken.append(r)
        return taken

    def _pick_slot(self, request: EngineRequest) -> int:
        if self.enable_prefix_caching:
            slot = max(self._free, key=lambda s: self.runner.prefix_length(s, request.tokens))
            if self.runner.prefix_length(slot, request.tokens) == 0:
                slot = self._free[0]
        else:
            slot = self._free[0]
        self._free.remove(slot)
        return slot

    def _free_slot(self, request: EngineRequest) -> EngineRequest:
        slot = request.slot
        if slot is not None and self.running.get(slot) is request:
            del self.running[slot]
            if not self.enable_prefix_caching:
                self.runner.release(slot)
            self._free.append(slot)
        return request

    def fail_all(self, reason: str) -> list[EngineRequest]:
        """After an engine error: every request ends (the caller tells its client why), slots empty."""
        with self._lock:
            victims = list(self.running.values()) + list(self.waiting)
            self.waiting.clear()
        for r in list(self.running.values()):
            self._free_slot(r)
        self.runner.reset()
        for r in victims:
            r.finish_reason = reason
        return victims
