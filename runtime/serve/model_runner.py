"""One scheduled step on the engines: draft proposals for every speculating slot, ONE target forward
for every slot (prefill chunks and [pending + drafts] rows together), exact acceptance per slot.

Cache bookkeeping per slot: the target slot holds every token of the sequence except the last
("pending", whose logits are not computed yet) once its first token is out (sampled from the
prompt's last prefill row, in the step that prefills it); a verification
appends pending + drafts and rolls back to the accepted prefix. `target_cache[slot]` /
`draft_cache[slot]` mirror what each slot holds (token ids): the draft catches up from the common
prefix, and a new request reuses the longest prefix any slot holds (prefix caching).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Collection, Sequence

import numpy as np

from manifests.errors import UsageError
from runtime.serve.eagle3_rounds import ChainJob, TreeJob, propose_all
from runtime.serve.eagle3_slots import SlotsDrafter, slot_proposers
from runtime.engines.base import Engine, Row, SequenceEngine, SequenceSlots, TreeMask
from runtime.serve.logits_process import token_logprobs
from runtime.serve.spec_length import SpeculationLength
from runtime.serve.spec_tree_shape import TreeShape
from runtime.serve.spec_tree import (Tree, TreeOptions, accept_tree, accept_tree_greedy, grow_level, level_quota,
                                     ngram_tree)
from runtime.serve.speculative import (METHODS, SpecStats, Step, accept, accept_greedy, common_prefix, ngram_lookup,
                                      propose_token)

log = logging.getLogger(__name__)

TREE_METHODS = ("draft_model", "eagle3", "ngram")  # the methods that propose token trees
IDLE_GAP = 0.5  # seconds between two steps beyond which the engine waited (no work, a stop) rather than worked
SEEDED_BRANCHING = 2  # auto trees: the fixed branching of seeded sampled requests (reproducible shapes)


def as_slots(engine):
    """A slot engine; a single-sequence engine (the interface before slots) becomes one slot."""
    if engine is None or isinstance(engine, Engine):
        return engine
    if isinstance(engine, SequenceEngine) or hasattr(engine, "forward"):
        return SequenceSlots([engine])
    raise TypeError(f"expected an Engine, found {type(engine).__name__}")


#: How sampled requests draft: "draw" from the drafter's q; "argmax", the drafter's argmax (a one-hot q: accepted with
#: probability p(d), else a draw from p without d, so the output is the target's distribution either way), which is
#: accepted less often where p is flat but chains on the device (one call for every round); "auto": argmax where the
#: drafter chains on the device, else draw.
SAMPLED_DRAFTS = ("auto", "argmax", "draw")


class ModelRunner:
    def __init__(self, target: Engine, draft: Engine | None = None, method: str = "none",
                 num_speculative_tokens: int = 3, *, prompt_lookup_min: int = 2, prompt_lookup_max: int = 4,
                 clock=time.perf_counter, greedy_argmax: bool = True, adaptive: bool = True,
                 disable_by_batch_size: int | None = None, tree: TreeOptions | None = None,
                 sampled_drafts: str = "auto"):
        """`greedy_argmax`: a step whose decoding rows are all greedy asks the target for the argmax
        only (Engine.forward_greedy); False always fetches logits (the reference in tests).
        `adaptive`: pick each step's number of proposals from measured costs (runtime.serve.spec_length);
        False verifies num_speculative_tokens every step. `disable_by_batch_size`: vLLM's key.
        `tree`: draft_model, eagle3 and ngram propose token trees (runtime.serve.spec_tree) of depth up to
        num_speculative_tokens, where the engines (and the EAGLE-3 head) run them; None: chains.
        `sampled_drafts`: one of SAMPLED_DRAFTS."""
        if method not in METHODS:
            raise UsageError(f"speculative method must be one of {', '.join(METHODS)}, found {method!r}")
        if method == "draft_model" and draft is None:
            raise UsageError("speculative method 'draft_model' needs a draft engine; the bundle has no draft model")
        if method != "none" and not (1 <= num_speculative_tokens <= 16):
            raise UsageError(f"num_speculative_tokens must be in 1..16, found {num_speculative_tokens}")
        if not (1 <= prompt_lookup_min <= prompt_lookup_max):
            raise UsageError(f"expected 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"found {prompt_lookup_min} and {prompt_lookup_max}")
        if method == "eagle3" and draft is None:
            raise UsageError("speculative method 'eagle3' needs an EAGLE-3 head; the bundle has none")
        if draft is not None and method in ("draft_model", "eagle3") and draft.vocab_size != target.vocab_size:
            # Logit rows must index the same tokens; a smaller draft vocabulary would need padding.
            raise UsageError(f"draft vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size})")
        if sampled_drafts not in SAMPLED_DRAFTS:
            raise UsageError(f"sampled_drafts must be one of {', '.join(SAMPLED_DRAFTS)}, found {sampled_drafts!r}")
        if tree is not None and method not in TREE_METHODS:
            raise UsageError(f'speculative "tree" needs method {", ".join(TREE_METHODS)}, found {method!r}')
        if tree is not None and not (target.supports_tree and (draft is None or draft.supports_tree)):
            log.warning("token trees are off: the %s cannot run them (they need a batched KV-cache graph: ONNX "
                        "Runtime's, the CUDA engine's, an EAGLE-3 head's); speculation proposes chains",
                        "target engine" if not target.supports_tree else "draft engine" if method == "draft_model"
                        else "EAGLE-3 head")
            tree = None
        self.tree = tree
        #: "tree": "auto": nodes per level from measured acceptance (runtime.serve.spec_tree_shape)
        self.shape = TreeShape(num_speculative_tokens, tree.max_nodes) if tree is not None and tree.auto else None
        self._shapes: dict[int, tuple[int, ...]] = {}  # this step's shape per depth (auto trees)
        self._batch = 1  # the latest step's decoding sequences (what a shape's row cost is measured against)
        self.target = target
        self.draft = draft if method == "draft_model" else None
        self.head = draft if method == "eagle3" else None  # runtime.serve.eagle3.Drafter
        #: sampled requests draft the drafter's argmax (SAMPLED_DRAFTS; "auto": where it chains its rounds on the
        #: device, so they too draft without a host round trip per token, as vLLM's and SGLang's EAGLE drafts do)
        self.argmax_sampled = sampled_drafts == "argmax" or (
            sampled_drafts == "auto" and bool(getattr(self.draft or self.head, "chains_on_device", False)))
        self.method = method
        self.num_speculative_tokens = num_speculative_tokens if method != "none" else 0
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.stats = SpecStats()
        self.speculation = SpeculationLength(self.num_speculative_tokens, adaptive=adaptive,
                                             disable_by_batch_size=disable_by_batch_size)
        self._clock = clock
        self._catch_up = False  # this step's draft caught up on many tokens (set by _propose)
        self._lookups: dict[tuple[int, int], list[int]] = {}  # this step's n-gram lookups: (slot, length) -> tokens
        self._pending = None  # the latest decode step's costs, observed when the next step starts (_observe_pending)
        self.greedy_argmax = greedy_argmax
        #: called before every target forward (the engine client hands the previous step's tokens to
        #: the event loop there, while the target is about to release the GIL for its run). Not before the
        #: draft's: its short single-threaded forwards would then wait for the loop's whole streaming turn
        #: to get the GIL back, which made every drafted step pay that turn several times over
        self.before_forward = None
        self._mirrors()

    def _mirrors(self) -> None:
        """Empty slots on both sides: the mirrors start empty, so the engines' slots are emptied too (an
        engine an earlier runner filled would otherwise answer from caches the mirrors do not know)."""
        for engine in (self.target, self.draft):
            if engine is not None:
                for slot in range(engine.num_slots):
                    engine.release(slot)
        self.target_cache: list[list[int]] = [[] for _ in range(self.num_slots)]
        self.draft_cache: list[list[int]] = [[] for _ in range(self.num_slots)]
        # EAGLE-3: per slot, the target's features and a head cache of its own (one buffer for all slots
        # when the head runs them together)
        self.eagle = slot_proposers(self.head, self.num_slots) if self.head is not None else None

    @property
    def rows_per_decode(self) -> int:
        """The most target rows one decoding sequence takes in a step (pending + proposals)."""
        return 1 + (max(self.tree.max_nodes, self.num_speculative_tokens) if self.tree else self.num_speculative_tokens)

    def proposal_rows(self, g: int) -> int:
        """Target rows the proposals of a step with speculation length g take (a tree: its nodes)."""
        if self.tree is None or g == 0:
            return g
        k = self.tree.branching or SEEDED_BRANCHING  # auto: seeded requests' fixed trees may be the larger
        fixed = min(self.tree.max_nodes, sum(k ** d for d in range(1, g + 1)))
        return max(fixed, sum(self.tree_shape(g))) if self.shape is not None else fixed

    def tree_shape(self, g: int) -> tuple[int, ...]:
        """Auto trees: nodes per level for depth g this step (the same for every slot, chosen once a step)."""
        if g not in self._shapes:
            self._shapes[g] = self.shape.choose(g, self.speculation.row_cost_share(self._batch, g))
        return self._shapes[g]

    def drafts_tree(self, g: int, r) -> bool:
        """Whether request r's proposal of depth g is a tree: fixed trees always; auto ones when a level holds
        more than one node (an all-ones shape is the chain, proposed as one) or r is seeded (_level)."""
        if self.tree is None or g <= 0:
            return False
        return self.shape is None or not r.adaptive or max(self.tree_shape(g)) > 1

    def shape_snapshot(self) -> dict[int, int]:
        """Auto trees: {depth: nodes} of the latest shape chosen (/metrics, the periodic log line)."""
        last = self.shape.last if self.shape is not None else ()
        return {d + 1: w for d, w in enumerate(last)}

    @property
    def num_slots(self) -> int:
        n = self.target.num_slots
        return min(n, self.draft.num_slots) if self.draft is not None else n

    @property
    def max_context(self) -> int:
        m = self.target.max_context
        if self.head is not None:
            m = min(m, self.head.max_context + 1)
        return min(m, self.draft.max_context) if self.draft is not None else m

    def kv_bytes_per_slot(self) -> int:
        return self.target.kv_bytes_per_slot() + (self.draft.kv_bytes_per_slot() if self.draft else 0)

    def allocate_slots(self, num_slots: int) -> None:
        """Give both engines `num_slots` caches (only engines that can: ONNX Runtime, TensorRT)."""
        for engine in (self.target, self.draft):
            if engine is not None and engine.num_slots != num_slots:
                engine.allocate_slots(num_slots)
        self._mirrors()

    def check(self, request) -> None:
        if not request.prompt:
            raise UsageError("prompt must hold at least one token")
        if request.max_tokens < 1:
            raise UsageError(f"max_tokens must be >= 1, found {request.max_tokens}")
        if len(request.prompt) >= self.max_context:
            raise UsageError(f"prompt has {len(request.prompt)} tokens, the context holds {self.max_context}")

    def proposal_caps(self, requests):
        """n-gram chains: a function giving, per request, how many proposals its lookup has this step (the tokens
        after its match, up to num_speculative_tokens; none without one), for the speculation length; the lookups
        are kept for this step's proposals. None for the other methods (and trees): every slot proposes G."""
        if self.method != "ngram" or self.tree is not None:
            return None
        return lambda: [len(self._ngram(r)) for r in requests]

    def _ngram(self, r) -> list[int]:
        """r's n-gram proposal of num_speculative_tokens tokens, looked up once a step (a shorter one is its prefix)."""
        key = (r.slot, len(r.tokens))
        if key not in self._lookups:
            self._lookups[key] = ngram_lookup(r.tokens, self.num_speculative_tokens, self.prompt_lookup_min,
                                              self.prompt_lookup_max)
        return self._lookups[key]

    def catch_up_tokens(self, requests) -> int:
        """Tokens the draft model would read before proposing for these requests (what its caches lack): a
        probe's price after plain steps. 0 for n-gram and EAGLE-3 (whose head catches up on the target's
        features, one cheap layer)."""
        if self.draft is None:
            return 0
        return sum(len(r.tokens) - self._draft_holds(r) for r in requests if r.slot is not None and self.uses_draft(r))

    def _draft_holds(self, r) -> int:
        """Tokens of r the draft's cache holds and keeps (all but the last at most: the draft reads it now)."""
        return min(common_prefix(self.draft_cache[r.slot], r.tokens), len(r.tokens) - 1)

    def drafts_argmax(self, r) -> bool:
        """r's proposals are the drafter's argmax (q one-hot): greedy requests, and sampled ones where the
        drafter chains on the device (argmax_sampled); never under a logits processor, which masks the draft."""
        return not r.logits_processors and (r.params.greedy or self.argmax_sampled)

    def uses_draft(self, request) -> bool:
        return self.draft is not None and request.speculative

    # --- slots and the prefix cache -------------------------------------------------------------
    def prefix_length(self, slot: int, tokens: Sequence[int]) -> int:
        """Tokens of `tokens` that slot's target cache already holds (at most all but the last)."""
        return min(common_prefix(self.target_cache[slot], tokens), len(tokens) - 1)

    def place(self, request, slot: int, *, reuse: bool) -> int:
        """Make `slot` hold the longest cached prefix of the request's tokens; return its length.

        reuse=False (prefix caching off): the slot starts empty. Otherwise the slot keeps what it
        shares with the request, or takes a longer prefix from another slot (a copy of its KV rows).
        """
        tokens = request.tokens
        best, source = 0, slot
        if reuse:
            best = self.prefix_length(slot, tokens)
            for other in range(self.num_slots):
                n = self.prefix_length(other, tokens) if other != slot else 0
                if n > best:
                    best, source = n, other
        self._reuse(self.target, self.target_cache, source, slot, best)
        if self.draft is not None:
            own = min(common_prefix(self.draft_cache[slot], tokens), len(tokens) - 1) if reuse else 0
            there = min(common_prefix(self.draft_cache[source], tokens), best) if reuse else 0
            if there > own:
                self._reuse(self.draft, self.draft_cache, source, slot, there)
            else:
                self._reuse(self.draft, self.draft_cache, slot, slot, own)
        request.slot, request.computed, request.cached_tokens = slot, best, best
        return best

    def _reuse(self, engine: Engine, mirror: list[list[int]], source: int, slot: int, n: int) -> None:
        eagle = self.eagle if engine is self.target else None
        if source == slot:
            if n < len(mirror[slot]):
                engine.rollback(slot, n)
                del mirror[slot][n:]
                if eagle is not None:
                    eagle[slot].on_target_rollback(n)
            return
        engine.copy_prefix(source, slot, n)
        mirror[slot] = mirror[source][:n]
        if eagle is not None:
            eagle[slot].reset()
            eagle[slot].copy_from(eagle[source], n)

    def release(self, slot: int) -> None:
        for engine, mirror in ((self.target, self.target_cache), (self.draft, self.draft_cache)):
            if engine is not None and mirror[slot]:
                engine.release(slot)
                mirror[slot].clear()
        if self.eagle is not None:
            self.eagle[slot].reset()

    def reset(self) -> None:
        """Empty every slot (after an engine error the mirrors may be wrong)."""
        for engine, mirror in ((self.target, self.target_cache), (self.draft, self.draft_cache)):
            if engine is not None:
                for slot in range(self.num_slots):
                    engine.release(slot)
                    mirror[slot].clear()
        for proposer in self.eagle or ():
            proposer.reset()

    def forget_measurements(self) -> None:
        """Start measuring afresh (after runtime.serve.warmup's throwaway steps): the length chooser's costs and
        acceptance, the tree shape's, the counters /metrics reports."""
        s = self.speculation
        self.speculation = SpeculationLength(s.k, adaptive=s.adaptive, disable_by_batch_size=s.disable_by_batch_size)
        self.stats = SpecStats()
        if self.shape is not None:
            self.shape = TreeShape(self.shape.depth, self.shape.max_nodes)
        self._pending = None

    # --- one step ---------------------------------------------------------------------------------
    def step(self, decodes: Sequence[tuple], prefills: Sequence[tuple]) -> None:
        """`decodes`: (request, g) with g proposals wanted (0: plain); `prefills`: (request, n prompt tokens).

        Each decoding request gets one Step through `request.emit`, and so does each request whose
        prompt's last chunk runs now (its first token, sampled from that chunk's last row).
        """
        t0, target0 = self._clock(), self.stats.target_seconds
        self._observe_pending(t0)
        cold0 = self.cold_runs()
        self._catch_up = False
        if decodes:
            self._batch = len(decodes)
        drafted = max((g for _, g in decodes), default=0)
        # nothing to propose (G = 0, or plain decoding), and no prefill for the draft: the proposer is not asked
        drafting = drafted > 0 or (prefills and self.draft is not None and self.speculation.last > 0)
        proposals = self._propose(decodes, prefills) if drafting else {}
        propose_s = self._clock() - t0  # the proposer's whole time (its forwards and the Python around them)
        rows, firsts = [], []  # firsts: the prefills whose last chunk this is
        for r, n in prefills:
            last = r.computed + n == len(r.prompt)
            fetch = "all" if r.prompt_logprobs is not None else "last" if last else "none"
            rows.append(Row(r.slot, r.tokens[r.computed:r.computed + n], fetch=fetch))
            if last:
                firsts.append(r)
        for r, _ in decodes:
            drafts, _ = proposals.get(r.slot, ([], []))
            if isinstance(drafts, Tree):
                rows.append(Row(r.slot, [r.tokens[-1], *drafts.tokens], tree=target_mask(drafts, len(r.tokens) - 1)))
            else:
                rows.append(Row(r.slot, [r.tokens[-1], *drafts]))
        # Sampling rows (decodes, and prompts whose last chunk runs now) that are greedy with nothing
        # reading the full distribution get only the argmax back; rows that read it (sampling, logprobs,
        # a logits processor) their logits, in the same call.
        sampling = [r for r, _ in decodes] + firsts
        sampled = {r.slot for r in sampling if not argmax_suffices(r)}
        greedy = self.greedy_argmax and len(sampled) < len(sampling) and offers_greedy(self.target)
        wanted = sampled | {r.slot for r, _ in prefills if r.prompt_logprobs is not None}
        logits = self._forward(self.target, self.target_cache, rows, "target", greedy=greedy, logits_for=wanted)
        for (r, n), row_logits in zip(prefills, logits):
            if r.prompt_logprobs is not None:  # row i is the distribution of prompt token computed + i + 1
                rows_np = np.asarray(row_logits)
                for i in range(n):
                    if r.computed + i + 1 < len(r.prompt):
                        r.prompt_logprob_rows.append(token_logprobs(rows_np[i], r.prompt[r.computed + i + 1],
                                                                    r.prompt_logprobs))
            r.computed += n
            if r.computed == len(r.prompt):  # the first token, from the prompt's last row
                self._finish_row(r, np.asarray(row_logits)[-1:], [], [], greedy and r.slot not in wanted)
        emitted = 0  # the tokens the decoding rows produce now (the referee's tokens per second)
        for (r, _), row_logits in zip(decodes, logits[len(prefills):]):
            drafts, qs = proposals.get(r.slot, ([], []))
            had = len(r.tokens)
            self._finish_row(r, row_logits, drafts, qs, greedy and r.slot not in sampled)
            emitted += len(r.tokens) - had
        target_s = self.stats.target_seconds - target0
        rounds = max((depth(d) for d, _ in proposals.values()), default=0)
        # the cost model sees decode-only steps: a prefill chunk runs as a call of its own, with another
        # cost per token than verification rows (and a draft catching up on many tokens is prefilling), and a
        # step that ran some CUDA graph for one of its first times measured ONNX Runtime's capture, not the step
        cold = self.cold_runs() != cold0
        decoded = 0 if prefills or self._catch_up or cold else sum(len(row.tokens) for row in rows)
        end = self._clock()
        if decoded:  # observed when the next step starts: its "other" seconds take the time until then too
            observe = functools.partial(self.speculation.observe_step, decoded, target_s, rounds,
                                        sum(1 for d, _ in proposals.values() if d), propose_s,
                                        batch=len(decodes), drafted=drafted, emitted=emitted)
            self._pending = (observe, end - t0 - target_s - propose_s, end)
        self._shapes.clear()  # the next step chooses again, with what this one measured
        self._lookups.clear()

    def _observe_pending(self, now: float, gap: bool = True) -> None:
        """Feed the latest decode step's costs to the length chooser, its "other" seconds including the time from its
        end until `now` (the next step's start): the scheduler, the engine thread's hand-off of the step's tokens and
        its wait for the GIL the event loop holds while it streams them. That time is per step, whatever the step
        verified, so drafting spreads it over its accepted tokens; on the H200 it was more than the runner's own
        step time at 32 streams, and a cost model without it predicted drafting at 0.87x of plain where a fixed
        length ran 2.3x. A wait longer than IDLE_GAP (the engine had no work, or the process was stopped) is not."""
        if self._pending is None:
            return
        observe, other, end = self._pending
        self._pending = None
        observe(other + (now - end if gap and 0 <= now - end <= IDLE_GAP else 0.0))

    def idle(self) -> None:
        """The scheduler has no work left: the latest step's costs are observed without the wait that follows."""
        self._observe_pending(self._clock(), gap=False)

    def cold_runs(self) -> int:
        """The engines' cold runs so far (runtime.engines.base.Engine.cold_runs): target, draft and EAGLE-3 head."""
        return sum(getattr(e, "cold_runs", 0) for e in (self.target, self.draft, self.head) if e is not None)

    def _finish_row(self, r, row_logits, drafts: list[int], qs: list, greedy: bool) -> None:
        """Accept from a row's target output (argmax or logits after [pending, *drafts]); emit the Step."""
        if isinstance(drafts, Tree):
            self._finish_tree(r, row_logits, drafts, greedy)
            return
        if greedy:  # row_logits: the argmax after [pending, *drafts]
            new = accept_greedy(np.asarray(row_logits).tolist()[-(len(drafts) + 1):], drafts)
        else:
            new = accept(row_logits, drafts, qs, r.params, r.rng, r.logits_processors, r.output_ids)
        accepted = len(new) - 1
        if drafts:  # without proposals there is nothing to score, and neither cache holds more than it keeps
            self.stats.record(len(drafts), accepted)
            self.speculation.record(r, len(drafts), accepted)
            if self.shape is not None:  # a chain: one node per level, each rank 0
                self.shape.record([1] * len(drafts), [0] * accepted)
            keep = len(r.tokens) + accepted  # target now holds tokens + drafts; keep tokens + accepted
            self._rollback(self.target, self.target_cache, r.slot, keep)
            if self.draft is not None and self.uses_draft(r):
                self._rollback(self.draft, self.draft_cache, r.slot, min(len(self.draft_cache[r.slot]), keep))
        r.tokens.extend(new)
        r.computed = len(r.tokens) - 1
        # row i of the raw target logits is the distribution new[i] was chosen from
        logprobs = None if r.logprobs is None else [token_logprobs(row_logits[i], t, r.logprobs)
                                                     for i, t in enumerate(new)]
        r.emit(new, len(drafts), accepted, logprobs)

    def _finish_tree(self, r, row_logits, tree: Tree, greedy: bool) -> None:
        """As _finish_row for a token tree: keep the accepted path's cache rows, in both engines."""
        if greedy:
            new, path = accept_tree_greedy(np.asarray(row_logits).tolist(), tree)
        else:
            new, path = accept_tree(row_logits, tree, r.params, r.rng, r.logits_processors, r.output_ids)
        accepted = len(path)
        self.stats.record(len(tree), accepted)
        self.speculation.record(r, max(tree.depths, default=0), accepted)
        if self.shape is not None:
            levels: dict[int, list[int]] = {}
            for j, d in enumerate(tree.depths):
                levels.setdefault(d, []).append(j)
            self.shape.record([len(levels[d]) for d in sorted(levels)],
                              [levels[i + 1].index(j) for i, j in enumerate(path)])
        past = len(r.tokens) - 1  # the target holds past + [pending, *nodes]; keep pending and the path
        self._keep(self.target, self.target_cache, r.slot, past, [0] + [1 + j for j in path])
        if self.uses_draft(r):  # the draft holds tokens + the nodes it ran (all but the deepest level's)
            ran = len(self.draft_cache[r.slot]) - len(r.tokens)
            self._keep(self.draft, self.draft_cache, r.slot, len(r.tokens), [j for j in path if j < ran])
        rows = [0] + [1 + j for j in path]  # row of the target output each new token was chosen from
        r.tokens.extend(new)
        r.computed = len(r.tokens) - 1
        logprobs = None if r.logprobs is None else [token_logprobs(row_logits[rows[i]], t, r.logprobs)
                                                     for i, t in enumerate(new)]
        r.emit(new, len(tree), accepted, logprobs)

    def _keep(self, engine: Engine, mirror: list[list[int]], slot: int, past: int, rows: list[int]) -> None:
        engine.keep_rows(slot, past, rows)
        mirror[slot][past:] = [mirror[slot][past + i] for i in rows]
        if self.eagle is not None and engine is self.target:  # the target's features follow its cache rows
            self.eagle[slot].keep_rows(past, rows)

    def _tree_budget(self, r) -> int:
        """Nodes a tree may have for request r: the configured budget, less what the context cannot hold
        (the target holds past + pending + nodes)."""
        return max(min(self.tree.max_nodes, self.max_context - len(r.tokens)), 0)

    def _level(self, r, g: int, level: int, tree: Tree) -> tuple[int, int]:
        """(children per frontier node, nodes) for the level of depth level + 1 of r's tree of depth g:
        the configured branching with the budget spread evenly, or the auto shape's nodes."""
        left = self._tree_budget(r) - len(tree)
        if self.shape is not None and r.adaptive:
            shape = self.tree_shape(g)  # shallower than g when max_nodes < g: no nodes below it
            w = shape[level] if level < len(shape) else 0
            return max(w, 1), max(min(w, left), 0)
        # a seeded request keeps a shape that no other request changes, so it draws the same tokens alone
        # or in a crowd (as it keeps the fixed K): auto trees give it SEEDED_BRANCHING, spread evenly
        return self.tree.branching or SEEDED_BRANCHING, level_quota(left, g - level)

    def _grower(self, r, g: int):
        """grow(tree, frontier, logits_of, level) for an EAGLE-3 head's tree (grow_level with r's sampling)."""
        def grow(tree, frontier, logits_of, level):
            k, quota = self._level(r, g, level, tree)
            return grow_level(tree, frontier, logits_of, r.params, r.rng, k, quota, r.logits_processors,
                              r.output_ids)
        return grow

    def _propose_eagle(self, wanting) -> dict:
        """EAGLE-3 chains and trees for the wanting (request, g): a head over slots drafts them all in one
        head run per round (runtime.serve.eagle3_rounds); a single-sequence head (made before it) slot by slot."""
        # a head that has not run since plain steps first reads the target's features of every token they decoded:
        # a prefill's cost, as a draft model's catch-up, which the step fits leave out (else a drafted step looks dear)
        if any(len(r.tokens) - 1 - self.eagle[r.slot].drafter.length > g + 2 for r, g in wanting):
            self._catch_up = True
        if isinstance(self.head, SlotsDrafter):
            jobs = {r.slot: TreeJob(self.eagle[r.slot], r.tokens, g, self._grower(r, g)) if self.drafts_tree(g, r)
                    else ChainJob(self.eagle[r.slot], r.tokens, g, self._picker(r), greedy=self.drafts_argmax(r))
                    for r, g in wanting}
            runs = self.head.runs
            propose_all(self.head, list(jobs.values()))
            self.stats.draft_forwards += self.head.runs - runs
            return {slot: (job.result(), []) if isinstance(job, TreeJob) else job.result()
                    for slot, job in jobs.items()}
        out = {}
        for r, g in wanting:
            if self.drafts_tree(g, r):
                out[r.slot] = (self.eagle[r.slot].propose_tree(r.tokens, g, self._grower(r, g)), [])
            else:
                out[r.slot] = self.eagle[r.slot].propose(r.tokens, g, self._picker(r))
            self.stats.draft_forwards += g
        return out

    def _picker(self, r):
        """pick(logits, drafts) for an EAGLE-3 chain: the argmax (drafts_argmax), else r's sampling, its logits
        processors seeing the drafts."""
        if self.drafts_argmax(r):
            return lambda logits, drafts: (int(np.argmax(logits)), None)

        def pick(logits, drafts):
            return propose_token(logits, r.params, r.rng, r.logits_processors, r.output_ids + drafts)
        return pick

    def _propose_tree(self, wanting, last) -> dict[int, tuple[Tree, list]]:
        """Grow each wanting slot's tree level by level; one draft forward per level for every slot,
        each node seeing the past and its ancestors (the deepest level is not run)."""
        trees = {r.slot: Tree() for r, _ in wanting}
        frontier = {r.slot: [-1] for r, _ in wanting}
        logits = {r.slot: {-1: last[r.slot]} for r, _ in wanting}
        for level in range(max((g for _, g in wanting), default=0)):
            rows, grown = [], {}
            for r, g in wanting:
                if level >= g:
                    continue
                tree = trees[r.slot]
                k, quota = self._level(r, g, level, tree)  # within what the target and the draft can hold
                new = grow_level(tree, frontier[r.slot], logits[r.slot], r.params, r.rng, k, quota,
                                 r.logits_processors, r.output_ids)
                frontier[r.slot] = new
                if new and level < g - 1:
                    base = len(r.tokens)  # the draft holds every token, pending included; node j is at base + j
                    rows.append(Row(r.slot, [tree.tokens[j] for j in new],
                                    tree=TreeMask(base, tuple(tuple(base + a for a in tree.ancestors(j)) for j in new))))
                    grown[r.slot] = new
            if rows:
                for row, lg in zip(rows, self._forward(self.draft, self.draft_cache, rows, "draft")):
                    logits[row.slot].update(zip(grown[row.slot], lg))
        return {slot: (tree, []) for slot, tree in trees.items()}

    def _propose(self, decodes, prefills) -> dict[int, tuple[list[int], list]]:
        out: dict[int, tuple[list[int], list]] = {}
        if self.method == "ngram":
            for r, g in decodes:
                if self.drafts_tree(g, r):
                    k, budget = self.tree.branching or SEEDED_BRANCHING, self._tree_budget(r)
                    if self.shape is not None and r.adaptive:  # the shape's widest level and its nodes
                        k, budget = max(self.tree_shape(g)), min(sum(self.tree_shape(g)), budget)
                    tree = ngram_tree(r.tokens, g, self.prompt_lookup_min, self.prompt_lookup_max, k, budget)
                    out[r.slot] = (tree if len(tree) else [], [])
                elif g > 0:
                    out[r.slot] = (self._ngram(r)[:g], [])
            return out
        if self.eagle is not None:
            t0 = self._clock()
            out = self._propose_eagle([(r, g) for r, g in decodes if g > 0 and r.speculative and len(r.tokens) >= 2])
            self.stats.draft_seconds += self._clock() - t0
            return out
        if self.draft is None:
            return out
        # First call: every speculating slot's catch-up (what its draft cache lacks: at least the
        # pending token) plus the draft's share of this step's prefill chunks; then one token per call.
        rows, wanting = [], []
        # While the cost model drafts nothing, the draft does not prefill either: a slot catches up from
        # the common prefix when it next drafts (a probe, or once drafting pays again).
        draft_prefills = self.speculation.last > 0
        for r, n in prefills:
            if self.uses_draft(r) and draft_prefills:
                end = r.computed + n
                have = min(common_prefix(self.draft_cache[r.slot], r.tokens[:end]), end)
                self._rollback(self.draft, self.draft_cache, r.slot, have)
                if end > have:
                    rows.append(Row(r.slot, r.tokens[have:end], fetch="none"))
        for r, g in decodes:
            if g <= 0 or not self.uses_draft(r):
                continue
            have = self._draft_holds(r)
            self._rollback(self.draft, self.draft_cache, r.slot, have)
            rows.append(Row(r.slot, r.tokens[have:], fetch="last"))
            if len(r.tokens) - have > g + 2:  # a catch-up of more than the last step's tokens: a prefill's cost
                self._catch_up = True
            wanting.append((r, g))
            out[r.slot] = ([], [])
        if not rows:
            return out
        # Argmax proposals (drafts_argmax) need only the draft's argmax: only that comes back.
        # Trees read the draft's logits (top-k children, or draws from q).
        sampled = {r.slot for r, _ in wanting if not self.drafts_argmax(r)}
        trees = any(self.drafts_tree(g, r) for r, g in wanting)  # the step drafts trees for every slot, or chains
        if trees:
            sampled = {r.slot for r, _ in wanting}
        greedy = self.greedy_argmax and len(sampled) < len(wanting) and offers_greedy(self.draft)
        t0, cold = self._clock(), getattr(self.draft, "cold_runs", 0)
        logits = dict(zip((row.slot for row in rows), self._forward(self.draft, self.draft_cache, rows, "draft",
                                                                    greedy=greedy, logits_for=sampled)))
        # what reading the tokens decoded plainly cost (a probe's price), unless the draft ran a CUDA graph cold there
        if self._catch_up and not prefills and getattr(self.draft, "cold_runs", 0) == cold:
            self.speculation.observe_catch_up(sum(len(row.tokens) for row in rows), self._clock() - t0)
        last = {r.slot: logits[r.slot][-1] for r, _ in wanting}
        if trees:
            out.update(self._propose_tree(wanting, last))
            return out
        if greedy and not sampled and self._chain_draft(wanting, last, out):
            return out
        for i in range(max((g for _, g in wanting), default=0)):
            rows = []
            for r, g in wanting:
                if i >= g:
                    continue
                drafts, qs = out[r.slot]
                if r.slot not in sampled:  # last[r.slot]: the draft's argmax token (greedy), else its logits
                    d, q = int(last[r.slot] if greedy else np.argmax(last[r.slot])), None
                else:
                    d, q = propose_token(last[r.slot], r.params, r.rng, r.logits_processors, r.output_ids + drafts)
                drafts.append(d)
                if q is not None:
                    qs.append(q)
                if i < g - 1:  # the last proposal is fed to the draft next step, only if it is accepted
                    rows.append(Row(r.slot, [d]))
            if rows:
                for row, lg in zip(rows, self._forward(self.draft, self.draft_cache, rows, "draft", greedy=greedy,
                                                       logits_for=sampled)):
                    last[row.slot] = lg[-1]
        return out

    def _chain_draft(self, wanting, last: dict, out: dict) -> bool:
        """Greedy chains of the draft model after its catch-up (`last`: each slot's argmax token, the first
        draft): the rest in one engine call for every slot (Engine.greedy_chain, each round's argmax fed to the
        next on the device), a chain of g taking g - 1 of its rounds. False, nothing drafted, where the engine
        declines (the caller then drafts call by call)."""
        rows = [Row(r.slot, [int(last[r.slot])]) for r, g in wanting if g >= 2]
        chained = {}
        if rows:
            rounds = max(g for _, g in wanting) - 1
            t0 = self._clock()
            got = self.draft.greedy_chain(rows, rounds)
            if got is None:
                return False
            self.stats.draft_forwards += rounds
            self.stats.draft_seconds += self._clock() - t0
            for row, ids in zip(rows, got):  # what the draft now holds: every round's input token
                self.draft_cache[row.slot].extend([row.tokens[0], *map(int, ids[:-1])])
                chained[row.slot] = [int(t) for t in ids]
        for r, g in wanting:
            out[r.slot][0].extend([int(last[r.slot]), *chained.get(r.slot, [])[:g - 1]])
        return True

    # --- cache helpers ---------------------------------------------------------------------------
    def _forward(self, engine: Engine, mirror: list[list[int]], rows: list[Row], role: str, *,
                 greedy: bool = False, logits_for: Collection[int] = ()) -> list[np.ndarray]:
        """greedy: argmax only (Engine.forward_greedy), except logits for the slots in logits_for."""
        if self.before_forward is not None and role == "target":
            self.before_forward()
        t0 = self._clock()
        logits = engine.forward_greedy(rows, logits_for=logits_for) if greedy else engine.forward(rows)
        for row in rows:
            mirror[row.slot].extend(map(int, row.tokens))
        if self.eagle is not None and engine is self.target:
            aux = aux_source(engine)  # looked up once a forward, not once a row
            for row in rows:
                if len(row.tokens):
                    self.eagle[row.slot].on_target_forward(aux(row.slot), len(row.tokens))
        dt = self._clock() - t0
        if role == "target":
            self.stats.target_forwards += 1
            self.stats.target_seconds += dt
        else:
            self.stats.draft_forwards += 1
            self.stats.draft_seconds += dt
        return logits

    def _rollback(self, engine: Engine, mirror: list[list[int]], slot: int, length: int) -> None:
        if length < len(mirror[slot]):
            engine.rollback(slot, length)
            del mirror[slot][length:]
            if self.eagle is not None and engine is self.target:
                self.eagle[slot].on_target_rollback(length)


def target_mask(tree: Tree, past: int) -> TreeMask:
    """The target row [pending, *nodes] after `past` tokens: pending at past, node j at past + 1 + j."""
    anc = [()] + [(past,) + tuple(past + 1 + a for a in tree.ancestors(j)) for j in range(len(tree))]
    return TreeMask(past, tuple(anc))


def depth(drafts) -> int:
    """Draft forwards' worth of a proposal: a chain's length, a tree's depth."""
    return max(drafts.depths, default=0) if isinstance(drafts, Tree) else len(drafts)


def argmax_suffices(request) -> bool:
    """True when the request's next tokens are the argmax of the raw logits: greedy, no logits
    processor (grammar mask, penalties, bias, min_tokens change the argmax) and no logprobs."""
    return request.params.greedy and not request.logits_processors and request.logprobs is None


def offers_greedy(engine) -> bool:
    """The engine's own class has forward_greedy (every runtime.engines.base.Engine does). Looked up on the
    class: a wrapper that forwards unknown attributes to an inner engine would otherwise skip its
    own `forward`."""
    return callable(getattr(type(engine), "forward_greedy", None))


def aux_source(engine):
    """slot -> the aux hidden rows of that slot's last forward of `engine` (EAGLE-3 target graphs), or None."""
    sequences = getattr(engine, "sequences", None)
    if sequences is not None:  # runtime.engines.base.SequenceSlots: one single-sequence engine per slot
        return lambda slot: getattr(sequences[slot], "last_aux_hidden", None)
    rows = getattr(engine, "last_aux_hidden", None)
    if isinstance(rows, dict):
        return rows.get
    return lambda slot: rows


def step_of(tokens: list[int], drafted: int, accepted: int, eos, produced: int, max_tokens: int) -> tuple[Step, int]:
    """Cut a verification's tokens at eos (not included) and max_tokens: (the Step, tokens produced now)."""
    out, finish = [], None
    for t in tokens:
        if t in eos:
            finish = "stop"
            break
        out.append(t)
        if produced + len(out) >= max_tokens:
            finish = "length"
            break
    return Step(out, drafted=drafted, accepted=accepted, finish_reason=finish), len(out)
