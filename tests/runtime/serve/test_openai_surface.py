"""The OpenAI/vLLM surface agent loops use, through the official `openai` SDK against the real server on
the demo pair: tool calls (required, named, auto with a vLLM parser), JSON schema, logprobs, n with a
seed, penalties and the other sampling controls, reasoning split, /v1/responses, /tokenize, /version,
the streaming shape, vLLM metric names and the per-request log line.

The demo bundle is made by `bundle create --serve-arg ...` (the serve defaults travel in the manifest)
and served with a hermes-style chat template passed as `--chat-template` (the demo's own template knows
no tools or think markers).
"""

from __future__ import annotations

import json
import logging
import math
import re

import httpx
import jsonschema
import openai
import pytest

from tests.runtime.serve.conftest import RunningServer

TEMPLATE = """\
{%- if tools %}<|system|>
Tools: {% for t in tools %}{{ t.function | tojson }}{% endfor %}<|end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|user|>
Result: {{ m.content }}<|end|>
{% elif m.tool_calls %}<|assistant|>
{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|end|>
{% else %}<|{{ m.role }}|>
{{ m.content }}<|end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "set_conveyor_speed", "description": "Set the conveyor belt speed of a cell.",
    "parameters": {"type": "object", "properties": {
        "cell": {"type": "string", "enum": ["A", "B", "C"]},
        "rpm": {"type": "integer", "minimum": 0, "maximum": 900}},
        "required": ["cell", "rpm"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "escalate", "description": "Call a human operator.",
        "parameters": {"type": "object", "properties": {"severity": {"enum": ["low", "high"]}},
                       "required": ["severity"], "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Cell B is jammed. Slow it down."}]
#: The template opens <think> unless told not to; a grammar applies after the thinking (as in vLLM), and the
#: demo model never closes it, so requests with a grammar turn thinking off.
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def surface(demo_installed, tmp_path_factory):
    from runtime.server.options import ServeConfig, apply_serve_config

    installed, _ = demo_installed
    template = tmp_path_factory.mktemp("template") / "hermes.jinja"
    template.write_text(TEMPLATE)
    setup = apply_serve_config(installed, ServeConfig(args={"chat_template": str(template)}))
    server = RunningServer(setup.serving)
    yield server, setup
    server.stop()


@pytest.fixture()
def sdk(surface):
    return openai.OpenAI(base_url=surface[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(name: str, arguments: str):
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# --- tools ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip_with_tool_choice_required(sdk, stream):
    kw = dict(model="demo", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_tokens=120, extra_body=NO_THINK)
    if stream:
        calls, finish, roles = {}, None, []
        for chunk in sdk.chat.completions.create(stream=True, **kw):
            c = chunk.choices[0]
            roles.append(c.delta.role)
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = c.finish_reason or finish
        assert roles[0] == "assistant" and set(roles[1:]) == {None}
        assert finish == "tool_calls" and len(calls) == 1
        call = calls[0]
        call_id, name, arguments = call["id"], call["name"], call["arguments"]
    else:
        r = sdk.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        (tc,) = r.choices[0].message.tool_calls
        call_id, name, arguments = tc.id, tc.function.name, tc.function.arguments
    assert call_id.startswith("call_") and name in SCHEMAS
    _check_call(name, arguments)  # even the tiny demo model's call parses against the tool's schema
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "speed set; belt running"}]
    final = sdk.chat.completions.create(model="demo", messages=history, tools=TOOLS, tool_choice="none",
                                        temperature=0, max_tokens=24,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    assert final.usage.prompt_tokens > 40  # the rendered history, tool result included


def test_tool_history_is_rendered_through_the_template(surface):
    server, _ = surface
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "escalate", "arguments": '{"severity": "low"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "operator paged"}]
    r = httpx.post(server.url + "/tokenize", json={"model": "demo", "messages": history, "tools": TOOLS}).json()
    text = httpx.post(server.url + "/detokenize", json={"model": "demo", "tokens": r["tokens"]}).json()["prompt"]
    assert '<tool_call>{"name": "escalate", "arguments": {"severity": "low"}}</tool_call>' in text
    assert "Result: operator paged" in text and '"name": "set_conveyor_speed"' in text
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512


@pytest.mark.parametrize("stream", [False, True])
def test_required_answer_that_stops_while_thinking_has_no_tool_calls_finish(sdk, stream):
    """The template opens <think> and a stop string ends the answer inside it: no call was made."""
    kw = dict(model="demo", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60,
              stop=["<body>"])
    if stream:
        chunks = [c.choices[0] for c in sdk.chat.completions.create(stream=True, **kw) if c.choices]
        finish = [c.finish_reason for c in chunks if c.finish_reason]
        assert finish == ["stop"] and not any(c.delta.tool_calls for c in chunks)
        return
    choice = sdk.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice


def test_named_tool_choice_returns_that_function(sdk):
    r = sdk.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
                                    tool_choice={"type": "function", "function": {"name": "escalate"}},
                                    extra_body=NO_THINK)
    (tc,) = r.choices[0].message.tool_calls
    assert tc.function.name == "escalate" and r.choices[0].finish_reason == "stop"  # vLLM: a named call stops
    _check_call("escalate", tc.function.arguments)


def test_auto_tool_choice_reads_calls_with_the_hermes_parser(sdk):
    """The model writes a hermes call when the grammar makes it (structured_outputs regex); auto mode must
    find it with the server's --tool-call-parser, stream it as indexed deltas, and finish with tool_calls."""
    call = '<tool_call>{"name": "escalate", "arguments": {"severity": "high"}}</tool_call>'
    kw = dict(model="demo", messages=ASK, tools=TOOLS, temperature=0, max_tokens=130,
              extra_body={"structured_outputs": {"regex": "Checking\\. " + re.escape(call)},
                          "chat_template_kwargs": {"enable_thinking": False}})
    r = sdk.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Checking. "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("escalate", {"severity": "high"})]
    content, names, args, finish = "", [], "", None
    for chunk in sdk.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            assert t.index == 0
            names += [t.function.name] if t.function and t.function.name else []
            args += (t.function.arguments or "") if t.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert (content, names, json.loads(args), finish) == ("Checking. ", ["escalate"], {"severity": "high"},
                                                          "tool_calls")


#: a long hermes call the grammar makes the model write, one token per step (no drafting)
LONG_CALL = ('Checking\\. <tool_call>\\{"name": "set_conveyor_speed", "arguments": \\{"cell": "B", '
             '"rpm": [1-8][0-9][0-9], "note": "[a-z]{4,8}"\\}\\}</tool_call>')


def _long_call(**kw) -> dict:
    return dict(model="demo", messages=ASK, tools=TOOLS, temperature=0, max_tokens=130,
                extra_body={"structured_outputs": {"regex": LONG_CALL}, "speculative": False, **NO_THINK}) | kw


def _streamed(sdk, kw) -> tuple[str, list[dict], str | None]:
    """content, calls (id, name, arguments, argument delta count) and finish reason, as a client joins them."""
    content, calls, finish = "", {}, None
    for chunk in sdk.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        for d in c.delta.tool_calls or []:
            if d.id:  # the header: id, type and name, with empty arguments
                assert d.index not in calls and d.type == "function" and d.function.name
                assert d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": "", "deltas": 0}
            else:
                assert d.function.name is None and d.function.arguments
                calls[d.index]["arguments"] += d.function.arguments
                calls[d.index]["deltas"] += 1
        finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_streamed_tool_call_arguments_arrive_as_they_are_generated(sdk):
    """As vLLM's hermes parser streams: the header first, then argument fragments in order; joined, they are
    the non-streamed answer's arguments on the same greedy request."""
    whole = sdk.chat.completions.create(**_long_call())
    (tc,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and tc.function.name == "set_conveyor_speed"
    content, (call,), finish = _streamed(sdk, _long_call())
    assert (content, finish) == (whole.choices[0].message.content, "tool_calls")
    assert call["deltas"] > 3 and call["arguments"] == tc.function.arguments
    assert json.loads(call["arguments"])["cell"] == "B"


def test_tool_call_cut_by_max_tokens_reads_the_same_streamed_and_not(sdk):
    """max_tokens ends the answer inside the call's arguments: both paths give the call with the arguments
    written so far (not valid JSON yet) and finish_reason "length"."""
    full = sdk.chat.completions.create(**_long_call()).usage.completion_tokens
    whole = sdk.chat.completions.create(**_long_call(max_tokens=full - 20))
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == full - 20
    (tc,) = choice.message.tool_calls
    assert tc.function.arguments.startswith('{"cell": "B"') and not tc.function.arguments.endswith("}"), tc
    content, (call,), finish = _streamed(sdk, _long_call(max_tokens=full - 20))
    assert (content, finish) == (choice.message.content, "length")
    assert (call["name"], call["arguments"]) == (tc.function.name, tc.function.arguments)


# --- structured output --------------------------------------------------------------------------------
SHIFT_REPORT = {"type": "object", "properties": {
    "status": {"enum": ["ok", "degraded", "down"]}, "line": {"type": "integer", "minimum": 1, "maximum": 12},
    "note": {"type": "string", "maxLength": 20}}, "required": ["status", "line", "note"],
    "additionalProperties": False}


@pytest.mark.parametrize("speculative", [True, False])
def test_json_schema_response_validates_and_speculation_does_not_change_it(sdk, speculative):
    r = sdk.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Report line 3."}], temperature=0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "report", "schema": SHIFT_REPORT,
                                                                "strict": True}},
        extra_body={"speculative": speculative, **NO_THINK})
    jsonschema.validate(json.loads(r.choices[0].message.content), SHIFT_REPORT)
    assert r.choices[0].finish_reason == "stop"
    baseline = sdk.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Report line 3."}], temperature=0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "report", "schema": SHIFT_REPORT}},
        extra_body={"speculative": not speculative, **NO_THINK})
    assert baseline.choices[0].message.content == r.choices[0].message.content


def test_structured_outputs_choice_and_json_object(sdk):
    r = sdk.chat.completions.create(model="demo", messages=ASK, temperature=0.8, seed=3, max_tokens=10,
                                    extra_body={"structured_outputs": {"choice": ["stop", "continue", "escalate"]},
                                                **NO_THINK})
    assert r.choices[0].message.content in ("stop", "continue", "escalate")
    r = sdk.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=130,
                                    response_format={"type": "json_object"}, extra_body=NO_THINK)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # free-form objects may run to max_tokens; what came is still a valid prefix
        assert r.choices[0].message.content.startswith("{")


# --- logprobs, n, sampling controls ---------------------------------------------------------------------
def test_chat_logprobs_match_the_sampled_tokens(sdk):
    r = sdk.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=16, logprobs=True,
                                    top_logprobs=5, extra_body={"ignore_eos": True,
                                                                "chat_template_kwargs": {"enable_thinking": False}})
    entries = r.choices[0].logprobs.content
    assert len(entries) == 16 == r.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in entries).decode() == r.choices[0].message.content
    for e in entries:
        assert len(e.top_logprobs) == 5
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-6
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
    sampled = sdk.chat.completions.create(model="demo", messages=ASK, temperature=1.0, seed=11, max_tokens=16,
                                          logprobs=True, top_logprobs=10, extra_body={"ignore_eos": True})
    for e in sampled.choices[0].logprobs.content:
        assert e.logprob <= 0 and any(t.token == e.token and t.logprob == pytest.approx(e.logprob)
                                      for t in e.top_logprobs) or e.logprob < e.top_logprobs[-1].logprob + 1e-9


def test_an_answer_with_no_text_is_empty_content_not_null(sdk):
    """vLLM's: a message whose text came out empty (a stop string at its first character) has content "", not null
    (null is for an answer that was all reasoning or a tool call); vLLM's own chat test reads it as a string."""
    plain = {"chat_template_kwargs": {"enable_thinking": False}}  # no reasoning: every token is content
    first = sdk.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=4,
                                        extra_body=plain).choices[0]
    cut = sdk.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=4,
                                      stop=[first.message.content[0]], extra_body=plain).choices[0]
    assert (cut.message.content, cut.finish_reason) == ("", "stop")


def test_completion_logprobs_echo_and_prompt_lists(sdk):
    r = sdk.completions.create(model="demo", prompt=["import os\n", "def read(path):"], max_tokens=6,
                               temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 12
    for c in r.choices:
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text and len(lp.token_logprobs) == 6
        assert all(len(top) == 3 and max(top.values()) == pytest.approx(v) for top, v in
                   zip(lp.top_logprobs, lp.token_logprobs))
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    e = sdk.completions.create(model="demo", prompt="import os\n", max_tokens=4, temperature=0, echo=True)
    assert e.choices[0].text.startswith("import os\n")
    assert e.choices[0].text[len("import os\n"):] == r.choices[0].text[:len(e.choices[0].text) - len("import os\n")]


def test_n_choices_with_a_seed_are_reproducible(sdk):
    kw = dict(model="demo", messages=ASK, temperature=1.0, seed=1234, n=3, max_tokens=12,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    a, b = sdk.chat.completions.create(**kw), sdk.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1, "each choice draws its own sample"
    assert a.usage.completion_tokens == 36
    streamed = {}
    for chunk in sdk.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts


def test_sampling_controls_change_output_as_defined(sdk):
    base = dict(model="demo", messages=ASK, temperature=0, max_tokens=24,
                extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    plain = sdk.chat.completions.create(**base).choices[0].message.content
    tok = httpx.post(str(sdk.base_url).replace("/v1/", "/tokenize"), json={"prompt": plain[:1],
                                                                            "add_special_tokens": False}).json()
    first = tok["tokens"][0]
    banned = sdk.chat.completions.create(**base, logit_bias={str(first): -100}).choices[0].message.content
    assert not banned.startswith(plain[:1]) and banned != plain
    forced = sdk.chat.completions.create(**{**base, "max_tokens": 3}, logit_bias={str(first): 100})
    assert forced.choices[0].message.content == plain[:1] * 3
    penalised = sdk.chat.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.choices[0].message.content != plain
    rep = sdk.chat.completions.create(**{**base, "extra_body": {**base["extra_body"], "repetition_penalty": 3.0}})
    assert rep.choices[0].message.content != plain
    # min_tokens bars the end token; stop_token_ids ends on a token; max_completion_tokens caps
    short = sdk.chat.completions.create(model="demo", messages=ASK, temperature=0, max_completion_tokens=5,
                                        extra_body={"stop_token_ids": [first],
                                                    "chat_template_kwargs": {"enable_thinking": False}})
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens == 0
    assert sdk.chat.completions.create(model="demo", messages=ASK, temperature=0, max_completion_tokens=5,
                                       extra_body={"min_p": 0.5}).usage.completion_tokens <= 5
    long = sdk.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=20,
                                       extra_body={"min_tokens": 20})
    assert long.usage.completion_tokens == 20


def test_explicit_nulls_and_unknown_fields(surface, caplog):
    server, _ = surface
    body = {"model": "demo", "messages": ASK, "max_tokens": 3, "temperature": None, "top_p": None, "n": None,
            "stop": None, "seed": None, "stream": None, "logprobs": None, "top_logprobs": None, "tools": None,
            "tool_choice": None, "response_format": None, "presence_penalty": None, "max_tokenz": 5}
    with caplog.at_level(logging.WARNING, logger="bundle.serve"):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert any("max_tokenz" in rec.getMessage() and rec.levelno == logging.WARNING for rec in caplog.records)


# --- reasoning ------------------------------------------------------------------------------------------
def test_reasoning_split_by_the_templates_think_markers(sdk):
    """The template opens <think> in the prompt: what the model writes is reasoning (it never closes it);
    with enable_thinking false the template closes it, and the output is the answer."""
    r = sdk.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=12,
                                    extra_body={"ignore_eos": True})
    m = r.choices[0].message
    assert m.content is None and m.reasoning and m.model_extra["reasoning_content"] == m.reasoning
    streamed = [c.choices[0].delta for c in sdk.chat.completions.create(
        model="demo", messages=ASK, temperature=0, max_tokens=12, stream=True, extra_body={"ignore_eos": True})]
    assert "".join(getattr(d, "reasoning", None) or "" for d in streamed) == m.reasoning
    assert all(d.content in (None, "") for d in streamed)
    off = sdk.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=12,
                                      extra_body={"ignore_eos": True,
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content and getattr(off.choices[0].message, "reasoning", None) is None
    hidden = sdk.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=12,
                                         extra_body={"ignore_eos": True, "include_reasoning": False})
    assert getattr(hidden.choices[0].message, "reasoning", None) is None
    # earlier reasoning in the history is accepted under both names
    sdk.chat.completions.create(model="demo", max_tokens=2, messages=[
        *ASK, {"role": "assistant", "content": "ok", "reasoning_content": "think"},
        {"role": "assistant", "content": "ok", "reasoning": "think"}, *ASK])


# --- responses, tokenize, version, stream shape, metrics, logs ----------------------------------------------
def test_responses_api_text_tools_and_streaming(sdk):
    r = sdk.responses.create(model="plant-assistant", input="Cell B is jammed.", instructions="Be brief.",
                             max_output_tokens=10, temperature=0,
                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.output_tokens <= 10 and r.usage.input_tokens > 0
    call = sdk.responses.create(model="demo", input="Cell B is jammed.", temperature=0, max_output_tokens=80,
                                tool_choice="required", parallel_tool_calls=False,
                                tools=[{"type": "function", **t["function"]} for t in TOOLS], extra_body=NO_THINK)
    (fc,) = [o for o in call.output if o.type == "function_call"]
    _check_call(fc.name, fc.arguments)
    follow = sdk.responses.create(model="demo", temperature=0, max_output_tokens=8, input=[
        {"role": "user", "content": "Cell B is jammed."},
        {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": "done"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert follow.output_text
    events = list(sdk.responses.create(model="demo", input="hi", max_output_tokens=6, temperature=0, stream=True,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text
    streamed = list(sdk.responses.create(model="demo", input="Cell B is jammed.", temperature=0, stream=True,
                                         max_output_tokens=80, tool_choice="required", parallel_tool_calls=False,
                                         tools=[{"type": "function", **t["function"]} for t in TOOLS],
                                         extra_body=NO_THINK))
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done.arguments == args == fc.arguments  # greedy: the same call as the non-streamed request
    (item,) = [o for o in streamed[-1].response.output if o.type == "function_call"]
    assert item.name == fc.name and item.call_id.startswith("call_")
    # thinking on: the reasoning is its own output item; text.format json_schema constrains the answer
    thought = sdk.responses.create(model="demo", input="Cell B?", max_output_tokens=6, temperature=0)
    assert [o.type for o in thought.output] == ["reasoning"] and thought.status == "incomplete"
    thinking = list(sdk.responses.create(model="demo", input="Cell B?", max_output_tokens=6, temperature=0,
                                         stream=True))
    deltas = "".join(e.delta for e in thinking if e.type == "response.reasoning_text.delta")
    assert deltas == thought.output[0].content[0].text
    assert [o.type for o in thinking[-1].response.output] == ["reasoning"]
    report = sdk.responses.create(model="demo", input="Report line 3.", temperature=0, max_output_tokens=80,
                                  text={"format": {"type": "json_schema", "name": "report", "schema": SHIFT_REPORT}},
                                  extra_body=NO_THINK)
    jsonschema.validate(json.loads(report.output_text), SHIFT_REPORT)
    with pytest.raises(openai.BadRequestError, match="no conversation state"):
        sdk.responses.create(model="demo", input="x", previous_response_id="resp_1")


def test_responses_logprobs_whole_and_streamed(sdk):
    """vLLM's Responses logprobs: with include=["message.output_text.logprobs"], one entry per generated token
    on the output text, each with top_logprobs alternatives; streamed on the text deltas, the same entries."""
    kw = dict(model="demo", input="Cell B is jammed.", max_output_tokens=8, temperature=0, top_logprobs=3,
              include=["message.output_text.logprobs"], extra_body={**NO_THINK, "speculative": False})
    r = sdk.responses.create(**kw)
    (msg,) = [o for o in r.output if o.type == "message"]
    lps = msg.content[0].logprobs
    assert len(lps) == r.usage.output_tokens and all(len(lp.top_logprobs) == 3 for lp in lps)
    assert all(lp.logprob <= max(t.logprob for t in lp.top_logprobs) + 1e-6 for lp in lps)  # top 3 are the best
    events = list(sdk.responses.create(stream=True, **kw))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    streamed = [(lp.token, lp.logprob) for lp in done.logprobs]
    assert [(lp.token, lp.logprob) for lp in deltas] == streamed
    assert [t for t, _ in streamed] == [lp.token for lp in lps]
    assert [lp for _, lp in streamed] == pytest.approx([lp.logprob for lp in lps], abs=1e-4)
    plain = sdk.responses.create(**{**kw, "include": None})  # top_logprobs alone asks for none, as in vLLM
    assert [o for o in plain.output if o.type == "message"][0].content[0].logprobs == []


def test_usage_counts_the_prompt_once_per_prompt(sdk):
    kw = dict(model="demo", prompt=["import os\n", "def read(path):"], max_tokens=3, n=2, temperature=0.7, seed=1)
    whole = sdk.completions.create(**kw)
    chunks = list(sdk.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert len(whole.choices) == 4 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    chat = sdk.chat.completions.create(model="demo", messages=ASK, n=2, max_tokens=2, stream=True,
                                       stream_options={"include_usage": True})
    single = sdk.chat.completions.create(model="demo", messages=ASK, max_tokens=2)
    assert list(chat)[-1].usage.prompt_tokens == single.usage.prompt_tokens


def test_tokenize_detokenize_version_and_models(surface, sdk):
    server, _ = surface
    t = httpx.post(server.url + "/tokenize", json={"model": "demo", "prompt": "import os",
                                                   "return_token_strs": True}).json()
    # vocabulary strings, as vLLM's convert_ids_to_tokens gives them (byte-level BPE: "Ġ" for a space)
    assert "".join(t["token_strs"]).replace("\u0120", " ") == "import os" and t["count"] == len(t["tokens"])
    assert httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "import os"}
    assert re.match(r"\d+\.\d+", httpx.get(server.url + "/version").json()["version"])
    assert [m.id for m in sdk.models.list().data] == ["demo", "plant-assistant"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10 ** 6]}).status_code == 400


def test_continue_final_message_ends_the_prompt_inside_the_assistant_turn(surface, sdk):
    """vLLM's continue_final_message: the prompt stops right after the last (assistant) message's text, so the
    model goes on with it; chat and /tokenize render the same prompt; with add_generation_prompt too: a 400."""
    server, _ = surface
    messages = ASK + [{"role": "assistant", "content": "Slowing cell B to"}]
    body = {"model": "demo", "messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    t = httpx.post(server.url + "/tokenize", json=body).json()
    text = httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}).json()["prompt"]
    assert text.endswith("\n\nSlowing cell B to")  # no end-of-turn markup after it
    r = sdk.chat.completions.create(model="demo", messages=messages, max_tokens=3, temperature=0,
                                    extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert r.usage.prompt_tokens == t["count"]
    closed = httpx.post(server.url + "/tokenize", json={**body, "continue_final_message": False}).json()
    assert closed["count"] > t["count"]  # the usual render closes the turn
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt and continue_final_message"):
        sdk.chat.completions.create(model="demo", messages=messages, max_tokens=3,
                                    extra_body={"continue_final_message": True})


def test_return_token_ids_and_prompt_truncation(surface, sdk):
    """vLLM's return_token_ids: the prompt's ids and each choice's generated ids, whole and streamed (the
    first chunk names the prompt's, each chunk the ids since the one before); truncate_prompt_tokens keeps
    that many prompt tokens, the last ones unless truncation_side is right."""
    server, _ = surface
    ids = {"return_token_ids": True, "speculative": False}
    kw = dict(model="demo", prompt="import os\ndef read(path):", max_tokens=6, temperature=0, extra_body=ids)
    prompt = httpx.post(server.url + "/tokenize", json={"model": "demo", "prompt": kw["prompt"]}).json()["tokens"]
    c = sdk.completions.create(**kw).choices[0]
    assert c.prompt_token_ids == prompt and len(c.token_ids) == 6
    assert httpx.post(server.url + "/detokenize", json={"tokens": c.token_ids}).json()["prompt"] == c.text
    chunks = [ch.choices[0] for ch in sdk.completions.create(stream=True, **kw)]
    assert [getattr(ch, "prompt_token_ids", None) for ch in chunks] == [prompt] + [None] * (len(chunks) - 1)
    assert [t for ch in chunks for t in ch.token_ids] == c.token_ids
    chat = dict(model="demo", messages=ASK, max_tokens=5, temperature=0, extra_body={**ids, **NO_THINK})
    rendered = httpx.post(server.url + "/tokenize", json={"model": "demo", "messages": ASK, **NO_THINK}).json()
    whole = sdk.chat.completions.create(**chat)
    assert whole.prompt_token_ids == rendered["tokens"] and len(whole.choices[0].token_ids) == 5
    stream = list(sdk.chat.completions.create(stream=True, **chat))
    assert stream[0].prompt_token_ids == rendered["tokens"]
    assert [t for ch in stream for c in ch.choices for t in c.token_ids] == whole.choices[0].token_ids
    for side, kept in (("left", rendered["tokens"][-7:]), ("right", rendered["tokens"][:7])):
        cut = sdk.chat.completions.create(**{**chat, "extra_body": {**chat["extra_body"], "truncate_prompt_tokens": 7,
                                                                    "truncation_side": side}})
        assert cut.prompt_token_ids == kept and cut.usage.prompt_tokens == 7
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        sdk.completions.create(**{**kw, "extra_body": {"truncate_prompt_tokens": 10 ** 6}})


def test_streaming_shape_on_the_wire(surface):
    server, _ = surface
    body = {"model": "demo", "messages": ASK, "max_tokens": 5, "temperature": 0, "stream": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all("role" not in d for d in deltas[1:]), "role is omitted after the first chunk, not null"
    assert deltas[-1]["content"] and chunks[-1]["choices"][0]["finish_reason"] == "length"  # vLLM's shape
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all(None not in d.values() for d in deltas)


def test_vllm_metric_names_and_one_log_line_per_request(surface, sdk, caplog):
    server, _ = surface
    with caplog.at_level(logging.INFO, logger="bundle.serve"):
        sdk.chat.completions.create(model="demo", messages=ASK, temperature=0, max_tokens=6,
                                    extra_body={"ignore_eos": True})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request chatcmpl-")]
    assert len(lines) == 1
    assert re.search(r"prompt \d+ tokens, completion 6 tokens, ttft [0-9.]+s, [0-9.]+ tokens/s, "
                     r"(acceptance \d+%, )?finish length", lines[0]), lines[0]  # acceptance: when it drafted (the
    # adaptive speculation length may draft nothing, by measured step costs)
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                 "vllm:num_requests_running", "vllm:generation_tokens_total", "vllm:request_prompt_tokens_sum"):
        assert re.search(rf'^{name}{{[^}}]*model_name="demo"', text, re.M), name
    assert re.search(r'^vllm:request_success_total\{[^}]*finished_reason="length"[^}]*\} [1-9]', text, re.M)


def test_startup_notes_name_every_flag_without_effect(surface):
    _, setup = surface
    notes = [line for line in setup.features_lines if line.startswith("note:")]
    assert any("--trust-remote-code:" in n and "no model code" in n for n in notes)
    assert "tools:       auto tool choice, hermes parser" in setup.features_lines
    assert "reasoning:   qwen3 parser" in setup.features_lines


def test_disable_log_requests_turns_the_line_off(demo_installed, caplog):
    from runtime.server.options import ServeConfig, apply_serve_config

    installed, _ = demo_installed
    setup = apply_serve_config(installed, ServeConfig(args={"disable_log_requests": True, "max_model_len": 256}))
    server = RunningServer(setup.serving)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with caplog.at_level(logging.INFO, logger="bundle.serve"):
            client.chat.completions.create(model="demo", messages=ASK, max_tokens=2)
        assert not [r for r in caplog.records if r.getMessage().startswith("request ")]
        assert setup.serving.model.max_model_len == 256
    finally:
        server.stop()


def test_the_demo_bundles_own_template_cannot_think_so_answers_are_content(demo_installed):
    """The demo's signed defaults name --reasoning-parser qwen3, but its tokenizer has no think tokens and
    its own template opens no block: the parser is off with a note, answers and structured output are
    content from the first token (before, every answer was reasoning and content was null)."""
    from runtime.server.options import ServeConfig, apply_serve_config

    installed, _ = demo_installed
    setup = apply_serve_config(installed, ServeConfig(args={"max_model_len": 256}))
    assert not [line for line in setup.features_lines if line.startswith("reasoning:")]
    assert any("--reasoning-parser qwen3 is off" in line for line in setup.features_lines)
    server = RunningServer(setup.serving)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        plain = client.chat.completions.create(model="demo", messages=ASK, max_tokens=8, temperature=0)
        assert plain.choices[0].message.content
        assert getattr(plain.choices[0].message, "reasoning", None) is None
        r = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Report line 3."}], temperature=0, max_tokens=80,
            response_format={"type": "json_schema", "json_schema": {"name": "report", "schema": SHIFT_REPORT}})
        jsonschema.validate(json.loads(r.choices[0].message.content), SHIFT_REPORT)
    finally:
        server.stop()
