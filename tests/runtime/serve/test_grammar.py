"""runtime.serve.grammar (llguidance masks over the demo tokenizer) and runtime.serve.logits_process."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from runtime.serve.grammar import GrammarCompiler, GrammarError, GrammarSpec, spec_from_request, tool_call_schema, \
    tool_parameters_schema
from runtime.serve.logits_process import LogitsProcessor, Penalties, parse_logit_bias, token_logprobs
from runtime.serve.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[3] / "bundler" / "demo" / "models" / "target"
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Bergen"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEMO)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler.for_tokenizer(tok, vocab_size=tok.vocab_size + 8)  # engines may pad the vocabulary


def _walk(constraint, tok, rng, steps=200):
    """Sample uniformly among allowed tokens until only end-of-sequence is allowed."""
    out = []
    for _ in range(steps):
        allowed = constraint.allowed(out)
        assert not allowed[tok.vocab_size:].any(), "padding ids past the tokenizer are never allowed"
        ids = np.flatnonzero(allowed)
        non_eos = [i for i in ids if i not in tok.eos_token_ids]
        if not non_eos:
            assert constraint.is_complete(out)
            return out
        out.append(int(rng.choice(non_eos)))
    raise AssertionError("grammar never completed")


@pytest.mark.parametrize("spec, check", [
    (GrammarSpec("json_schema", SCHEMA), lambda s: json.loads(s)["city"] in ("Oslo", "Bergen")
     and 1 <= json.loads(s)["days"] <= 9 and set(json.loads(s)) == {"city", "days"}),
    (GrammarSpec("regex", r"(PASS|FAIL)-[0-9]{2}"), lambda s: re.fullmatch(r"(PASS|FAIL)-[0-9]{2}", s)),
    (GrammarSpec("choice", ["stop", "continue", "escalate"]), lambda s: s in ("stop", "continue", "escalate")),
    (GrammarSpec("grammar", 'root ::= "arm " ("up" | "down")'), lambda s: s in ("arm up", "arm down")),
])
def test_every_masked_walk_matches(compiler, tok, spec, check):
    rng = np.random.default_rng(0)
    for _ in range(10):
        out = _walk(compiler.compile(spec).constraint(), tok, rng)
        assert check(tok.decode(out)), tok.decode(out)


def test_rollback_to_any_prefix_gives_the_same_mask(compiler, tok):
    """What speculative verification does: ask for masks at prefixes in any order."""
    c = compiler.compile(GrammarSpec("json_schema", SCHEMA)).constraint()
    text = '{"city":"Bergen","days":4}'
    ids = tok.encode(text, add_special_tokens=False)
    grammar = compiler.compile(GrammarSpec("json_schema", SCHEMA))
    fresh = [grammar.constraint().allowed(ids[:i]) for i in range(len(ids) + 1)]
    order = list(range(len(ids) + 1))
    np.random.default_rng(1).shuffle(order)
    for i in order:
        assert (c.allowed(ids[:i]) == fresh[i]).all(), i
    assert c.is_complete(ids)
    # a prefix outside the grammar (forced by ignore_eos, say) allows everything rather than nothing
    assert c.allowed(ids + ids[:1]).all()
    assert (c.allowed(ids[:3]) == fresh[3]).all()  # and it recovers


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("regex", "(unclosed"), ["regex", "unclosed"]),
    (GrammarSpec("json_schema", {"type": "nonsense"}), ["json schema", "nonsense"]),
    (GrammarSpec("json_schema", "{not json"), ["JSON schema: expected JSON"]),
    (GrammarSpec("choice", []), ["non-empty list"]),
])
def test_bad_grammars_are_one_line_errors(compiler, spec, words):
    with pytest.raises(GrammarError) as e:
        compiler.compile(spec)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "\n" not in str(e.value)



@pytest.mark.parametrize("spec, reason", [
    (GrammarSpec("regex", "a{1000}{1000}"), "too many expressions"),
    (GrammarSpec("regex", "((a{100}){100}){100}"), "too many expressions"),
    (GrammarSpec("grammar", 'start: x\nx: "a" x\n'), "Too many items"),  # a rule with no base case
    (GrammarSpec("choice", ["x"] * 1025), "at most 1024 entries"),
    (GrammarSpec("regex", "x" * (64 * 1024 + 1)), "at most 65536"),
])
def test_grammars_llguidance_cannot_follow_are_refused_when_compiled(compiler, spec, reason):
    with pytest.raises(GrammarError) as e:
        compiler.compile(spec)
    assert reason in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_matcher_that_fails_later_allows_nothing_and_says_why(compiler, tok, caplog):
    """The grammar is fine until the regex's huge repetition starts, after the first character: from there
    the constraint allows nothing and reports the failure, rather than letting any token through."""
    constraint = compiler.compile(GrammarSpec("regex", "(b|c)a{1000}{1000}")).constraint()
    processor = LogitsProcessor(grammar=constraint)
    out = []
    for _ in range(5):
        allowed = constraint.allowed(out)
        if processor.failure is not None:
            break
        out.append(int(np.flatnonzero(allowed)[0]))
    assert processor.failure.startswith(f"structured output failed after {len(out)} tokens: the regex cannot be "
                                        f"followed within the server's grammar limits (lexer error: too many")
    assert not allowed.any() and not constraint.allowed(out[:1]).any()  # and it stays failed
    assert tok.decode(out)[0] in "bc" and "structured output failed" in caplog.text

def test_request_fields_to_specs():
    assert spec_from_request({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}) == \
        GrammarSpec("json_schema", SCHEMA)
    assert spec_from_request({"type": "json_object"}) == GrammarSpec("json_object")
    assert spec_from_request({"type": "text"}) is None
    assert spec_from_request(None, {"regex": "a+"}) == GrammarSpec("regex", "a+")
    assert spec_from_request(None, {"json": SCHEMA}) == GrammarSpec("json_schema", SCHEMA)
    with pytest.raises(GrammarError, match="one of json, regex"):
        spec_from_request(None, {"regex": "a", "choice": ["b"]})
    with pytest.raises(GrammarError, match="both"):
        spec_from_request({"type": "json_object"}, {"regex": "a"})


def test_required_tool_schema_parses_calls(compiler, tok):
    tools = [{"type": "function", "function": {"name": "set_speed", "parameters": {
        "type": "object", "properties": {"rpm": {"type": "integer", "minimum": 0, "maximum": 3000}},
        "required": ["rpm"], "additionalProperties": False}}}]
    c = compiler.compile(GrammarSpec("json_schema", tool_call_schema(tools, parallel=False))).constraint()
    out = json.loads(tok.decode(_walk(c, tok, np.random.default_rng(2), steps=400)))
    assert len(out) == 1 and out[0]["name"] == "set_speed" and 0 <= out[0]["parameters"]["rpm"] <= 3000


def _accepts(compiler, tok, schema, text: str, kind: str = "json_schema") -> bool:
    """Whether the grammar lets the whole of `text` through and may end there."""
    m = compiler.compile(GrammarSpec(kind, schema)).matcher()
    ids = tok.encode(text)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


# --- a regex's \d \w \s are ASCII, as vLLM's default backend reads them ----------------------------
IP = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"


@pytest.mark.parametrize("regex, yes, no", [
    (r"\d+", "0123456789", "\uabf2"),              # MEETEI MAYEK DIGIT TWO: a Unicode digit, not [0-9]
    (r"[\d.]+", "1.2", "\u0662"),                  # ARABIC-INDIC DIGIT TWO
    (r"\w+", "ab_9", "\u00e9"),
    (r"a\sb", "a\tb", "a\u00a0b"),                 # NO-BREAK SPACE is Unicode space, not \s here
    (r"[x\D]+", "x\u00e9", "x1"),
    (r"\p{L}+", "\u00e9t\u00e9", "1"),             # an explicit Unicode class keeps its meaning
])
def test_the_served_grammar_takes_ascii_and_refuses_the_rest(compiler, tok, regex, yes, no):
    assert _accepts(compiler, tok, regex, yes, "regex")
    assert not _accepts(compiler, tok, regex, no, "regex")


def test_every_masked_walk_of_an_ip_regex_is_a_short_ascii_address(compiler, tok):
    """What an evaluation harness asks of a random model: an IP address within 20 tokens."""
    rng = np.random.default_rng(0)
    grammar = compiler.compile(GrammarSpec("regex", IP))
    for _ in range(20):
        out = _walk(grammar.constraint(), tok, rng)
        text = tok.decode(out)
        assert re.fullmatch(IP, text, re.ASCII), text
        assert len(out) <= 16, (len(out), text)  # 15 characters at most, then the end


OPEN = {"type": "object", "properties": {"city": {"type": "string"},
                                         "stop": {"type": "object", "properties": {"at": {"type": "integer"}}}},
        "required": ["city"]}


def test_tool_arguments_allow_only_declared_properties(compiler, tok):
    fn = {"name": "weather", "parameters": OPEN}
    named = tool_parameters_schema(fn)
    assert _accepts(compiler, tok, named, '{"city":"Oslo"}')
    assert not _accepts(compiler, tok, named, '{"city":"Oslo","unit":"C"}')
    assert not _accepts(compiler, tok, named, '{"city":"Oslo","stop":{"at":1,"x":2}}')  # nested objects too
    required = tool_call_schema([{"type": "function", "function": fn}])
    assert _accepts(compiler, tok, required, '[{"name":"weather","parameters":{"city":"Oslo"}}]')
    assert not _accepts(compiler, tok, required, '[{"name":"weather","parameters":{"city":"Oslo","unit":"C"}}]')
    assert OPEN.get("additionalProperties") is None  # the caller's tool is left as it was


def test_a_schema_that_sets_additional_properties_keeps_its_choice(compiler, tok):
    schema = tool_parameters_schema({"name": "f", "parameters": {**OPEN, "additionalProperties": True}})
    assert _accepts(compiler, tok, schema, '{"city":"Oslo","unit":"C"}')
    typed = tool_parameters_schema({"name": "f", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": {"type": "integer"}}})
    assert _accepts(compiler, tok, typed, '{"n":1}') and not _accepts(compiler, tok, typed, '{"n":"x"}')


# --- logits processing ------------------------------------------------------------------------------
def test_penalties_match_their_definitions():
    logits = np.array([2.0, -1.0, 0.5, 1.0])
    proc = LogitsProcessor(prompt=[3], penalties=Penalties(presence=0.5, frequency=0.25, repetition=2.0))
    got = proc.apply(logits, generated=[0, 0, 1])
    # token 0: seen twice in output: 2/2 - 0.25*2 - 0.5; token 1: once: -1*2 - 0.25 - 0.5;
    # token 2: unseen; token 3: prompt only: repetition only
    assert np.allclose(got, [1.0 - 0.5 - 0.5, -2.0 - 0.75, 0.5, 0.5])


def test_min_tokens_bars_the_end_and_logit_bias_adds():
    proc = LogitsProcessor(min_tokens=2, end_ids=frozenset({1}), logit_bias={2: 5.0})
    assert proc.apply(np.zeros(4), [7])[1] == -np.inf
    assert proc.apply(np.zeros(4), [7, 7]).tolist() == [0, 0, 5, 0]
    assert parse_logit_bias({"3": -100}, 4) == {3: -100.0}
    for bad in ({"x": 1}, {"9": 1}, {"1": 101}):
        with pytest.raises(Exception, match="logit_bias"):
            parse_logit_bias(bad, 4)


def test_token_logprobs_are_normalised_and_sorted():
    logits = np.array([1.0, 3.0, 2.0, 3.0])
    lp = token_logprobs(logits, 2, top_n=3)
    assert np.isclose(np.exp([v for _, v in token_logprobs(logits, 0, top_n=4).top]).sum(), 1.0)
    assert [t for t, _ in lp.top] == [1, 3, 2]  # ties: lower id first
    assert lp.logprob == dict(lp.top)[2]


# --- with the generator: the demo pair, speculation on and off ------------------------------------
@pytest.fixture(scope="module")
def demo_engines(tmp_path_factory):
    from bundler.demo import DEMO_DRAFT_DIR
    from bundler.onnx.export import export_onnx
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    root = tmp_path_factory.mktemp("demo-onnx")
    models = {"target": DEMO, "draft": DEMO_DRAFT_DIR}
    graphs = {n: export_onnx(d, root / n).files[0] for n, d in models.items()}

    def make(n, batched=False):  # batched: the in-place graph the cpu target ships (token trees need it)
        if batched and f"{n}-batched" not in graphs:
            graphs[f"{n}-batched"] = export_onnx(models[n], root / f"{n}-batched", kv_cache="batched").graph
        return OnnxRuntimeEngine(graphs[f"{n}-batched" if batched else n], max_context=512, threads=1)
    return make


@pytest.mark.parametrize("spec", [GrammarSpec("json_schema", {
    "type": "object", "properties": {"function": {"type": "string", "maxLength": 24},
                                     "returns": {"enum": ["int", "str", "None"]}},
    "required": ["function", "returns"], "additionalProperties": False}),
    GrammarSpec("regex", r"It returns (an int|a string|None)\.")])
def test_constrained_greedy_output_is_the_same_with_and_without_speculation(demo_engines, tok, spec):
    from runtime.serve.sampling import SamplingParams
    from runtime.serve.generator import Generator

    prompt = tok.encode("<|user|>\nWhat does `os.path.join(a, *p)` do?<|end|>\n<|assistant|>\n",
                        add_special_tokens=False)
    outputs = {}
    from runtime.serve.spec_tree import TreeOptions

    for name, method, draft in (("none", "none", None), ("draft_model", "draft_model", "draft"),
                                ("ngram", "ngram", None), ("tree", "draft_model", "draft")):
        target = demo_engines("target", batched=name == "tree")
        gen = Generator(target, demo_engines(draft, batched=name == "tree") if draft else None, method, 3,
                        tree=TreeOptions(branching=2, max_nodes=6) if name == "tree" else None)
        assert (gen.runner.tree is not None) == (name == "tree")
        compiler = GrammarCompiler.for_tokenizer(tok, target.vocab_size)
        proc = LogitsProcessor(grammar=compiler.compile(spec).constraint(), penalties=Penalties(frequency=0.3))
        steps = list(gen.generate(prompt, SamplingParams(temperature=0.0), max_tokens=80,
                                  eos_ids=tok.eos_token_ids, logits_processors=(proc,), logprobs=2))
        outputs[name] = ([t for s in steps for t in s.tokens], steps[-1].finish_reason,
                         [lp.logprob for s in steps for lp in s.logprobs])
        if method == "draft_model":
            assert gen.stats.num_drafts > 0
    for method in ("draft_model", "ngram", "tree"):  # same tokens; logprobs equal up to batched-forward rounding
        assert outputs[method][:2] == outputs["none"][:2], method
        assert np.allclose(outputs[method][2], outputs["none"][2], atol=1e-4), method
    text = tok.decode(outputs["none"][0])
    assert outputs["none"][1] == "stop"
    if spec.kind == "regex":
        assert re.fullmatch(spec.value, text), text
    else:
        assert set(json.loads(text)) == {"function", "returns"}


def test_with_a_reasoning_parser_the_grammar_starts_after_the_thinking(compiler, tok):
    """vLLM's rule: the model thinks freely, the grammar applies from the first token after </think>."""
    from runtime.serve.logits_process import ReasoningGate
    from runtime.server.reasoning_parsers import make_reasoning_parser

    spec = GrammarSpec("choice", ["stop", "go"])
    gate = ReasoningGate(tok, make_reasoning_parser("qwen3", prompt="<|assistant|>\n<think>\n"))
    proc = LogitsProcessor(grammar=compiler.compile(spec).constraint(), grammar_start=gate)
    thinking = tok.encode("the belt is jammed so", add_special_tokens=False)
    closed = tok.encode("the belt is jammed so</think>", add_special_tokens=False)
    logits = np.zeros(compiler.vocab_size)
    assert np.isfinite(proc.apply(logits, thinking)).all()  # still thinking: nothing masked
    masked = proc.apply(logits, closed)
    allowed = {tok.decode([int(i)]) for i in np.flatnonzero(np.isfinite(masked))}
    assert allowed and all("stop".startswith(a) or "go".startswith(a) for a in allowed), allowed
    assert gate(closed) == len(closed) and gate(closed + [5, 6]) == len(closed)  # cached for longer prefixes
    # a prompt that already closed the thinking (enable_thinking false): the grammar applies from the start
    off = ReasoningGate(tok, make_reasoning_parser("qwen3", prompt="<think>\n\n</think>\n\n"))
    assert off([]) == 0
