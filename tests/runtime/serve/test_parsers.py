"""Tool-call and reasoning parsers (vLLM's names and formats), streamed in every chunking and whole."""

import json
import random

import pytest

from runtime.server.reasoning_parsers import make_reasoning_parser
from runtime.server.tool_parsers import (NamedToolCallParser, RequiredToolCallParser, make_tool_parser)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array"}}}}},
         {"type": "function", "function": {"name": "stop_line", "parameters": {"type": "object", "properties": {}}}}]

WEATHER = {"city": "Oslo", "days": 3}

CASES = {
    "hermes": (f'Let me check.<tool_call>\n{json.dumps({"name": "get_weather", "arguments": WEATHER})}\n</tool_call>'
               '<tool_call>{"name": "stop_line", "arguments": {}}</tool_call>', "Let me check."),
    "qwen3_coder": ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
                    "<tool_call>\n<function=stop_line>\n</function>\n</tool_call>", "Checking.\n"),
    "qwen3_xml": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call><tool_call><function=stop_line>"
                  "</function></tool_call>", None),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}; '
                    '{"name": "stop_line", "parameters": {}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}, '
                '{"name": "stop_line", "arguments": {}}]', None),
}


def _stream(parser, text, rng, max_piece=7):
    """Feed `text` in random pieces; rebuild what an OpenAI client accumulates from the deltas (and count
    each call's argument fragments under "pieces")."""
    content, calls = "", {}
    i = 0
    pieces = []
    while i < len(text):
        n = rng.randint(1, max_piece)
        pieces.append(text[i:i + n])
        i += n
    for d in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += d.content
        for c in d.tool_calls:
            entry = calls.setdefault(c.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
            if c.id:
                assert entry["id"] is None, "the id comes once, in the first delta of a call"
                assert (c.name, c.arguments) != (None, None) and c.arguments == "", "the header: name, no arguments"
                entry["id"] = c.id
            else:
                assert entry["id"] is not None and c.name is None, "arguments follow their call's header"
                entry["pieces"] += 1
            entry["name"] += c.name or ""
            entry["arguments"] += c.arguments or ""
    return content or None, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("name", list(CASES))
def test_tool_parsers_whole_and_streamed_agree(name):
    text, content = CASES[name]
    got_content, calls = make_tool_parser(name, TOOLS).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER), ("stop_line", {})]
    assert len({c.id for c in calls}) == 2
    if name == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    for seed in range(20):
        s_content, s_calls = _stream(make_tool_parser(name, TOOLS), text, random.Random(seed))
        assert s_content == content, seed
        assert [(c["name"], json.loads(c["arguments"])) for c in s_calls] == [
            ("get_weather", WEATHER), ("stop_line", {})], seed


def test_mistral_v11_format_and_qwen_types():
    _, calls = make_tool_parser("mistral", TOOLS).parse('[TOOL_CALLS]get_weather{"city": "Oslo", "days": 3}'
                                                        '[TOOL_CALLS]stop_line[ARGS]{}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER), ("stop_line", {})]
    _, calls = make_tool_parser("qwen3_coder", TOOLS).parse(
        "<tool_call><function=get_weather><parameter=metric>\nTrue\n</parameter><parameter=hours>\n[1, 2]\n"
        "</parameter><parameter=other>\n7\n</parameter></function></tool_call>")
    assert json.loads(calls[0].arguments) == {"metric": True, "hours": [1, 2], "other": "7"}


@pytest.mark.parametrize("name", list(CASES))
def test_plain_text_stays_content(name):
    text = "The line is running normally; no action needed {maybe}."
    assert make_tool_parser(name, TOOLS).parse(text) == (text, [])
    assert _stream(make_tool_parser(name, TOOLS), text, random.Random(1)) == (text, [])


@pytest.mark.parametrize("name", ["hermes", "mistral", "llama3_json"])
def test_a_broken_call_is_returned_as_text(name):
    text = {"hermes": "<tool_call>{not json</tool_call>", "mistral": "[TOOL_CALLS][{broken",
            "llama3_json": '{"city": "Oslo"}'}[name]
    content, calls = make_tool_parser(name, TOOLS).parse(text)
    assert calls == [] and content == text
    assert _stream(make_tool_parser(name, TOOLS), text, random.Random(0)) == (text, [])


@pytest.mark.parametrize("name", list(CASES))
def test_arguments_stream_in_pieces_that_join_to_the_whole_answer(name):
    """As vLLM streams calls: the header (id, name) first, then the arguments text as it is written; the
    fragments join to exactly the arguments the non-streamed answer gives."""
    text, _ = CASES[name]
    _, whole = make_tool_parser(name, TOOLS).parse(text)
    for seed in range(10):
        _, streamed = _stream(make_tool_parser(name, TOOLS), text, random.Random(seed), max_piece=2)
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in whole], seed
        assert streamed[0]["pieces"] > 1, "a long call's arguments come in more than one delta"


@pytest.mark.parametrize("name", list(CASES) + ["required", "named"])
def test_output_cut_anywhere_reads_the_same_streamed_and_whole(name):
    """max_tokens can cut the output at any point: both paths then give the same content and calls (a call
    whose name was written keeps the arguments written so far)."""
    parsers = {"required": lambda: RequiredToolCallParser(TOOLS),
               "named": lambda: NamedToolCallParser("get_weather", TOOLS)}
    make = parsers.get(name) or (lambda: make_tool_parser(name, TOOLS))
    text = {"required": json.dumps([{"name": "get_weather", "parameters": WEATHER}]),
            "named": json.dumps(WEATHER)}.get(name) or CASES[name][0]
    cut_calls = 0
    for cut in range(len(text) + 1):
        content, calls = make().parse(text[:cut])
        expected = (content, [(c.name, c.arguments) for c in calls])
        s_content, s_calls = _stream(make(), text[:cut], random.Random(cut))
        assert (s_content, [(c["name"], c["arguments"]) for c in s_calls]) == expected, text[:cut]
        cut_calls += bool(calls) and calls[0].arguments not in ("", json.dumps(WEATHER))
    assert cut_calls > 5, "some cuts leave a call with partial arguments"


def test_required_and_named_forms():
    text = json.dumps([{"name": "get_weather", "parameters": WEATHER}, {"name": "stop_line", "parameters": {}}])
    content, calls = RequiredToolCallParser(TOOLS).parse(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", WEATHER), ("stop_line", {})]
    _, streamed = _stream(RequiredToolCallParser(TOOLS), text, random.Random(3))
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [("get_weather", WEATHER), ("stop_line", {})]
    content, calls = NamedToolCallParser("get_weather", TOOLS).parse(json.dumps(WEATHER))
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == WEATHER


#: what a Qwen3.5 template ends the prompt with: the thinking block is open
QWEN35_PROMPT = "<|im_start|>assistant\n<think>\n"

REASONING = [
    # (parser, kwargs, prompt, output, reasoning, content)
    ("deepseek_r1", {}, "", "<think>plan the move</think>Move arm to B.", "plan the move", "Move arm to B."),
    ("deepseek_r1", {}, "<think>\n", "plan</think>\n\nGo.", "plan", "\n\nGo."),
    ("deepseek_r1", {}, "", "still thinking about it", "still thinking about it", None),
    ("qwen3", {}, "<|im_start|>assistant\n<think>\n", "check sensor</think>Sensor OK.", "check sensor", "Sensor OK."),
    ("qwen3", {"enable_thinking": False}, "", "Sensor OK.", None, "Sensor OK."),
    ("qwen3", {}, "<think>\n\n</think>\n\n", "Sensor OK.", None, "Sensor OK."),
    ("qwen3", {}, QWEN35_PROMPT, "need data <tool_call>\n<function=get_weather></function></tool_call>",
     "need data ", "<tool_call>\n<function=get_weather></function></tool_call>"),
    ("qwen3", {}, QWEN35_PROMPT, "mention <tool_call> in text</think>done", "mention <tool_call> in text", "done"),
    # qwen3: a prompt that opens no block and an output that opens none is the answer, end marker or not
    ("qwen3", {}, "<|assistant|>\n", "Sensor OK.", None, "Sensor OK."),
    ("qwen3", {}, "", "<think>plan</think>Go.", "plan", "Go."),  # Qwen3 up to 2507 opens its own block
    ("qwen3", {}, QWEN35_PROMPT, "cut short while thinking", "cut short while thinking", None),
    ("deepseek_r1", {}, "<|assistant|>\n", "still thinking", "still thinking", None),  # R1 may omit <think>
    ("nemotron_v3", {}, "", "<think>x</think>y", "x", "y"),
    ("nemotron_v3", {"enable_thinking": False}, "", "just the answer", None, "just the answer"),
    ("deepseek_r1", {}, "", "</think>", None, None),
]


@pytest.mark.parametrize("name, kwargs, prompt, text, reasoning, content", REASONING)
def test_reasoning_split_whole_and_streamed(name, kwargs, prompt, text, reasoning, content):
    parser = make_reasoning_parser(name, prompt=prompt, chat_template_kwargs=kwargs)
    assert parser.parse(text) == (reasoning, content)
    for seed in range(20):
        rng = random.Random(seed)
        p = make_reasoning_parser(name, prompt=prompt, chat_template_kwargs=kwargs)
        r = c = ""
        i = 0
        while i <= len(text):
            n = rng.randint(1, 5)
            d = p.feed(text[i:i + n])
            r, c, i = r + d.reasoning, c + d.content, i + n
        d = p.finish()
        r, c = r + d.reasoning, c + d.content
        assert (r or None, c or None) == (reasoning, content), seed


def test_mistral_keeps_special_tokens_in_the_text(tiny_models):
    """[TOOL_CALLS] is a special token: with the mistral parser the text keeps special tokens, as vLLM does."""
    from runtime.server import protocol as P
    from runtime.server.request_plan import Features, plan_for
    from runtime.serve.tokenizer import TextStream, Tokenizer

    req = P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                  tool_choice="auto")
    common = dict(chat=True, defaults={}, vocab_size=512, eos_ids=frozenset({1}), compiler=None)
    for parser, skip in (("mistral", False), ("hermes", True)):
        plan = plan_for(req, features=Features(tool_call_parser=parser, enable_auto_tool_choice=True), **common)
        assert plan.skip_special_tokens is skip and plan.tool_mode == "auto"
    tok = Tokenizer(tiny_models["target"])
    special = next(t for t in ("<|end|>", "</s>", "<|endoftext|>", "<eos>") if tok.token_to_id(t) is not None)
    ids = [tok.token_to_id(special)] + tok.encode("ok", add_special_tokens=False)
    kept, dropped = TextStream(tok, skip_special_tokens=False), TextStream(tok)
    assert kept.push(ids).startswith(special) and not dropped.push(ids).startswith(special)


@pytest.mark.parametrize("name", list(CASES))
def test_deeply_nested_model_output_is_read_without_recursion(name):
    """A model can write nesting deep enough to exhaust json's recursion: never a 500."""
    text = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "", "qwen3_coder": "<tool_call>",
            "qwen3_xml": "<tool_call>"}[name] + '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    content, calls = make_tool_parser(name, TOOLS).parse(text)
    if name in ("qwen3_coder", "qwen3_xml", "mistral"):  # no <function=, no name before the {: not a call
        assert (content, calls) == (text, [])
    else:  # a call to f whose arguments are the model's text, read without recursion
        assert content is None and [(c.name, c.arguments) for c in calls] == [("f", "[" * 5000 + "]" * 5000)]


def test_a_model_that_cannot_think_gets_no_reasoning_parser(tiny_models):
    """vLLM refuses a parser whose think tokens the tokenizer lacks; a model whose template never writes
    <think> either cannot think, so the parser is off (with the reason) and every answer is content."""
    from runtime.serve.tokenizer import Tokenizer
    from runtime.server.reasoning_parsers import reasoning_unavailable

    tok = Tokenizer(tiny_models["target"])
    assert tok.token_to_id("<think>") is None
    why = reasoning_unavailable("qwen3", tok, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert why and "--reasoning-parser qwen3 is off" in why and "<think>" in why
    assert reasoning_unavailable("qwen3", tok, "{{ '<think>\\n' }}") is None  # the template opens a block
