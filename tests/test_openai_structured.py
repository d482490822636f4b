"""Structured output and tool calls on the OpenAI HTTP API.

First the gateway's pure translation (no server): response_format, structured_outputs and tools -> the
Constraint of the GenerateRequest, clashes and bounds, tool-call parsing and the response and SSE shapes.
Then the same over HTTP with the official `openai` client against the session's stack (the default model):
outputs fit their constraint, and constraints the grammar compiler refuses are a 400 naming the client's field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from baton.api.params import MAX_CHOICE_CHARS, MAX_CONSTRAINT_CHARS
from baton.bench.schemas import SCHEMAS
from baton.services.gateway import translate as tr
from baton.services.gateway.translate import BadRequest
from baton.v1 import generation_pb2 as pb

MSGS = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": ADD}}]
PARAMETERS = {"get_weather": WEATHER, "add": ADD}


def chat(body: dict, tool_models=()) -> tuple[pb.GenerateRequest, tr.Options]:
    reqs, opts = tr.to_generate({"messages": MSGS, **body}, True, ["m"], tool_models)
    assert len(reqs) == 1
    return reqs[0], opts


def refused(body: dict, chat_api: bool = True, tool_models=()) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        tr.to_generate({"messages": MSGS, "prompt": "x", **body}, chat_api, ["m"], tool_models)
    assert e.value.status == 400 and str(e.value)
    return e.value


def kind(req: pb.GenerateRequest) -> str | None:
    return req.sampling.constraint.WhichOneof("kind") if req.sampling.HasField("constraint") else None


# ---- request -> Constraint ----------------------------------------------------------------------------


def test_response_format_maps_to_a_constraint():
    req, opts = chat({"response_format": {"type": "text"}})
    assert kind(req) is None and opts.constraint_param is None and opts.tools is None
    req, opts = chat({"response_format": {"type": "json_object"}})
    assert req.sampling.constraint.json_object and opts.constraint_param == "response_format"
    schema = SCHEMAS["person"]
    req, opts = chat({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                                                 "strict": True}}})
    assert json.loads(req.sampling.constraint.json_schema) == schema
    assert opts.constraint_param == "response_format.json_schema.schema"
    reqs, _ = tr.to_generate({"prompt": ["a", "b"], "response_format": {"type": "json_object"}}, False, ["m"])
    assert all(r.sampling.constraint.json_object for r in reqs)  # completions too, every prompt
    for rf, param in (({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
                      ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
                      ({"type": "json_schema", "json_schema": {"schema": "{}"}}, "response_format.json_schema.schema"),
                      ({"type": "json_schema"}, "response_format.json_schema"),
                      ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
                       "response_format.json_schema.name"),
                      ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
                       "response_format.json_schema.strict"),
                      ({"type": "xml"}, "response_format.type"), ({}, "response_format.type"),
                      ("json", "response_format")):
        assert refused({"response_format": rf}).param == param, rf


def test_structured_outputs_map_to_constraints():
    req, opts = chat({"structured_outputs": {"json": SCHEMAS["tags"]}})
    assert json.loads(req.sampling.constraint.json_schema) == SCHEMAS["tags"]
    assert opts.constraint_param == "structured_outputs.json"
    req, _ = chat({"structured_outputs": {"json": json.dumps(SCHEMAS["enums"])}})  # a schema as JSON text
    assert json.loads(req.sampling.constraint.json_schema) == SCHEMAS["enums"]
    req, opts = chat({"structured_outputs": {"regex": "[a-z]+", "json": None, "json_object": False}})
    assert req.sampling.constraint.regex == "[a-z]+" and opts.constraint_param == "structured_outputs.regex"
    req, _ = chat({"structured_outputs": {"choice": ["yes", "no"]}})
    assert list(req.sampling.constraint.choice.choices) == ["yes", "no"]
    req, _ = chat({"structured_outputs": {"grammar": 'start: "a"+'}})
    assert req.sampling.constraint.grammar == 'start: "a"+'
    req, _ = chat({"structured_outputs": {"json_object": True, "disable_fallback": True}})
    assert req.sampling.constraint.json_object
    req, opts = chat({"structured_outputs": {}})
    assert kind(req) is None and opts.constraint_param is None


def test_structured_outputs_bounds_and_types():
    cases = [({"json": "{not json"}, "structured_outputs.json"), ({"json": "[1]"}, "structured_outputs.json"),
             ({"json": 3}, "structured_outputs.json"), ({"json": {"a": float("nan")}}, "structured_outputs.json"),
             ({"json": {"d": "x" * MAX_CONSTRAINT_CHARS}}, "structured_outputs.json"),
             ({"json": "x" * (MAX_CONSTRAINT_CHARS + 1)}, "structured_outputs.json"),
             ({"regex": ""}, "structured_outputs.regex"), ({"regex": ["a"]}, "structured_outputs.regex"),
             ({"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}, "structured_outputs.regex"),
             ({"grammar": 5}, "structured_outputs.grammar"),
             ({"grammar": "a" * (MAX_CONSTRAINT_CHARS + 1)}, "structured_outputs.grammar"),
             ({"choice": []}, "structured_outputs.choice"), ({"choice": "yes"}, "structured_outputs.choice"),
             ({"choice": ["a", ""]}, "structured_outputs.choice"), ({"choice": ["a", 1]}, "structured_outputs.choice"),
             ({"choice": [str(i) for i in range(257)]}, "structured_outputs.choice"),
             ({"choice": ["x" * (MAX_CHOICE_CHARS + 1)]}, "structured_outputs.choice"),
             ({"json_object": "yes"}, "structured_outputs.json_object"),
             ({"structural_tag": "{}"}, "structured_outputs"), ({"x" * 10_000: 1}, "structured_outputs")]
    for so, param in cases:
        e = refused({"structured_outputs": so})
        assert e.param == param and len(str(e)) < 400, (so, e)
    assert refused({"structured_outputs": "regex"}).param == "structured_outputs"
    chat({"structured_outputs": {"choice": [str(i) for i in range(256)]}})  # the bounds themselves pass
    chat({"structured_outputs": {"regex": "a" * MAX_CONSTRAINT_CHARS}})
    assert refused({"guided_json": {"type": "object"}}).param == "guided_json"  # vLLM's old name: never ignored


def test_one_constraint_per_request():
    rf = {"type": "json_object"}
    e = refused({"response_format": rf, "structured_outputs": {"regex": "a+"}})
    assert "response_format and structured_outputs.regex" in str(e) and e.param == "structured_outputs.regex"
    e = refused({"structured_outputs": {"regex": "a+", "choice": ["a"]}})
    assert "structured_outputs.regex and structured_outputs.choice" in str(e)
    e = refused({"response_format": rf, "tools": TOOLS, "tool_choice": "required"})
    assert e.param == "tool_choice" and "response_format" in str(e)
    # tools that are not used constrain nothing
    req, opts = chat({"response_format": rf, "tools": TOOLS, "tool_choice": "none"})
    assert req.sampling.constraint.json_object and opts.tools is None and not req.messages.tools
    e = refused({"response_format": rf, "tools": TOOLS}, tool_models=("m",))  # auto cannot be constrained
    assert e.param == "tool_choice"


def test_tools_with_tool_choice():
    req, opts = chat({"tools": TOOLS, "tool_choice": "none"})
    assert kind(req) is None and opts.tools is None and req.messages.tools == ""
    req, opts = chat({"tools": TOOLS, "tool_choice": "required"})
    schema = json.loads(req.sampling.constraint.json_schema)
    assert opts.tools.mode == "required" and opts.constraint_param == "tools" and req.messages.tools == ""
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather",
                                                            "arguments": {"city": "Oslo", "unit": "celsius"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "add", "arguments": {"a": 1}}], [{"name": "sub", "arguments": {"a": 1, "b": 2}}],
                [{"name": "add", "arguments": {"a": 1, "b": 2}, "x": 1}], [good[0]] * 17):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    req, _ = chat({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert json.loads(req.sampling.constraint.json_schema)["maxItems"] == 1
    req, opts = chat({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert json.loads(req.sampling.constraint.json_schema) == ADD
    assert opts.tools == tr.ToolPlan("named", frozenset(PARAMETERS), "add")
    assert opts.constraint_param == "tools[1].function.parameters"
    bare = [{"type": "function", "function": {"name": "now"}}]  # no parameters: the arguments are {}
    req, _ = chat({"tools": bare, "tool_choice": {"type": "function", "function": {"name": "now"}}})
    no_args = json.loads(req.sampling.constraint.json_schema)
    jsonschema.validate({}, no_args)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"x": 1}, no_args)
    # auto, a model whose template takes tools: rendered, unconstrained, parsed
    req, opts = chat({"tools": TOOLS}, tool_models=("m",))
    assert kind(req) is None and opts.tools.mode == "auto" and json.loads(req.messages.tools) == TOOLS
    req, _ = chat({"tools": TOOLS, "tool_choice": "required"}, tool_models=("m",))
    assert json.loads(req.messages.tools) == TOOLS  # rendered too where the template can show them
    # auto, a template without tools: refused, naming the field the client set, saying what to do instead
    e = refused({"tools": TOOLS, "tool_choice": "auto"})
    assert e.param == "tool_choice" and "required" in str(e) and "template" in str(e)
    assert refused({"tools": TOOLS}).param == "tools"
    chat({"tool_choice": "auto"})  # auto without tools: nothing to do
    chat({"tool_choice": "none"})


def test_tool_refs_still_resolve_inside_the_required_schema():
    params = {"type": "object", "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                    "required": ["x"]}},
              "properties": {"p": {"$ref": "#/$defs/point"}}, "required": ["p"]}
    tools = [{"type": "function", "function": {"name": "plot", "parameters": params}}, TOOLS[1]]
    req, _ = chat({"tools": tools, "tool_choice": "required"})
    schema = json.loads(req.sampling.constraint.json_schema)
    jsonschema.validate([{"name": "plot", "arguments": {"p": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "plot", "arguments": {"p": {"x": "one"}}}], schema)


def test_tools_bounds():
    fn = TOOLS[0]["function"]
    cases = [("weather", "tools"), ([TOOLS[0]] * 129, "tools"), ([1], "tools[0].type"),
             ([{"type": "custom", "custom": {"name": "x"}}], "tools[0].type"),
             ([{"type": "function"}], "tools[0].function"),
             ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
             ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
             ([{"type": "function", "function": {}}], "tools[0].function.name"),
             ([TOOLS[0], TOOLS[0]], "tools[1].function.name"),
             ([{"type": "function", "function": {**fn, "parameters": []}}], "tools[0].function.parameters"),
             ([{"type": "function", "function": {**fn, "description": 5}}], "tools[0].function.description"),
             ([{"type": "function", "function": {**fn, "description": "d" * MAX_CONSTRAINT_CHARS}}], "tools")]
    for tools, param in cases:
        e = refused({"tools": tools, "tool_choice": "required"})
        assert e.param == param and len(str(e)) < 400, (param, e)
    for choice in ("any", 3, {"type": "function"}, {"type": "function", "function": {"name": 3}},
                   {"type": "allowed_tools", "function": {"name": "add"}},
                   {"type": "function", "function": {"name": "nope"}}):
        assert refused({"tools": TOOLS, "tool_choice": choice}).param == "tool_choice", choice
    assert refused({"tool_choice": "required"}).param == "tool_choice"  # no tools to call
    assert refused({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"}).param == \
        "parallel_tool_calls"
    assert refused({"tools": TOOLS, "tool_choice": "required"}, chat_api=False).param == "tools"
    assert refused({"functions": [{"name": "f"}]}).param == "functions"  # the legacy API stays refused
    # 128 tools within the bound whose calls' schema is not: bounded like any constraint
    many = [{"type": "function", "function": {"name": f"t{i}", "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(16)}}}} for i in range(128)]
    assert len(json.dumps(many, separators=(",", ":"))) < MAX_CONSTRAINT_CHARS
    e = refused({"tools": many, "tool_choice": "required"})
    assert e.param == "tools" and "schema" in str(e)
    chat({"tools": many[:40], "tool_choice": "required"})


def test_messages_with_tool_calls_and_results():
    msgs = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"},
            {"role": "assistant", "content": "Let me add.", "tool_calls": [
                {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": "not json"}}]}]
    req, _ = chat({"messages": msgs})
    got = [(m.role, m.content) for m in req.messages.messages]
    assert got[0] == ("user", "Weather in Oslo?")
    assert got[1][0] == "assistant" and got[1][1].startswith("<tool_call>") and got[1][1].endswith("</tool_call>")
    assert json.loads(got[1][1].removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
        "name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}
    assert got[2] == ("tool", "4 degrees")
    assert got[3][1].startswith("Let me add.\n<tool_call>") and '"arguments": "not json"' in got[3][1]
    tokenized = tr.to_tokenize({"messages": msgs}, ["m"])
    assert [m.content for m in tokenized.messages.messages] == [m[1] for m in got]
    call = msgs[1]["tool_calls"][0]
    for bad, param in (({"tool_calls": "x"}, "messages[1].tool_calls"),
                       ({"tool_calls": [call] * 129}, "messages[1].tool_calls"),
                       ({"tool_calls": [{"type": "function"}]}, "messages[1].tool_calls[0]"),
                       ({"tool_calls": [{"function": {"name": "a b"}}]}, "messages[1].tool_calls[0].function.name"),
                       ({"tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                        "messages[1].tool_calls[0].function.arguments"),
                       ({"tool_calls": [{**call, "id": "x" * 257}]}, "messages[1].tool_calls[0].id"),
                       ({"tool_calls": [call], "content": 5}, "messages[1].content")):
        e = refused({"messages": [msgs[0], {"role": "assistant", **bad}]})
        assert e.param == param, (bad, e)
    assert refused({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}).param == \
        "messages[0].tool_call_id"
    assert refused({"messages": [{"role": "user", "content": None}]}).param == "messages[0].content"


# ---- answers -> tool calls ----------------------------------------------------------------------------

REQUIRED = tr.ToolPlan("required", frozenset(PARAMETERS))
NAMED = tr.ToolPlan("named", frozenset(PARAMETERS), "add")
AUTO = tr.ToolPlan("auto", frozenset(PARAMETERS))


def _calls(answer: tr.Answer) -> list[tuple[str, dict]]:
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) and c["type"] == "function" for c in answer.tool_calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer.tool_calls]


def test_parse_tool_calls():
    a = REQUIRED.parse('[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": '
                       '{"city": "Oslo", "unit": "celsius"}}]', "stop")
    assert a.content is None and a.finish_reason == "tool_calls"
    assert _calls(a) == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    a = NAMED.parse(' {"a": 1, "b": 2}', "stop")
    assert _calls(a) == [("add", {"a": 1, "b": 2})] and a.content is None and a.finish_reason == "tool_calls"
    a = AUTO.parse('Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
                   '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}', "stop")
    assert a.content == "Checking." and a.finish_reason == "tool_calls"
    assert _calls(a) == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]
    assert AUTO.parse("Just text.", "stop") == tr.Answer("Just text.", None, "stop")
    # the end inside a call, or a call that does not parse: the text as it is
    for plan, text in ((REQUIRED, '[{"name": "add", "argu'), (NAMED, '{"a": 1'), (AUTO, '<tool_call>{"name": "add"')):
        assert plan.parse(text, "length") == tr.Answer(text, None, "length")
    for plan, text in ((REQUIRED, "[]"), (REQUIRED, '[{"name": "sub", "arguments": {}}]'), (NAMED, "[1]"),
                       (REQUIRED, "{"), (AUTO, "<tool_call>{oops}</tool_call>"),
                       (AUTO, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')):
        assert plan.parse(text, "stop") == tr.Answer(text, None, "stop"), text


def _opts(plan=None, **kw) -> tr.Options:
    return tr.Options(model=None, stream=kw.pop("stream", False), include_usage=kw.pop("include_usage", False),
                      tools=plan, **kw)


def _collected(text: str, finish: str) -> tr.Collected:
    out = tr.Collected()
    out.add(pb.GenerateResponse(text=text, token_ids=[1, 2], finish_reason=finish,
                                usage=pb.Usage(prompt_tokens=5, completion_tokens=2)))
    return out


def test_whole_response_with_tool_calls():
    outs = [_collected('[{"name": "add", "arguments": {"a": 1, "b": 2}}]', "stop"),
            _collected('[{"name": "add", "arg', "length")]
    r = tr.whole_response(outs, "chatcmpl-1", 0, "m", True, _opts(REQUIRED, n=2))
    first, second = r["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
    assert first["message"]["role"] == "assistant" and _calls(tr.Answer(None, first["message"]["tool_calls"], None)) \
        == [("add", {"a": 1, "b": 2})]
    assert second == {"index": 1, "message": {"role": "assistant", "content": '[{"name": "add", "arg'},
                      "logprobs": None, "finish_reason": "length"}
    plain = tr.whole_response([_collected("hello", "stop")], "x", 0, "m", True, _opts())
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "hello"}


def _stream(opts: tr.Options, pieces: list[str], finish: str = "stop") -> list[dict]:
    ch = tr.Chunker("chatcmpl-1", 0, "m", True, opts)
    chunks = [ch.role(0)]
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        msg = pb.GenerateResponse(text=text, token_ids=[7], finish_reason=finish if last else "")
        if last:
            msg.usage.CopyFrom(pb.Usage(prompt_tokens=3, completion_tokens=len(pieces)))
        chunks += ch.add(0, msg)
    if opts.include_usage:
        chunks.append(ch.usage(1))
    return chunks


def test_streamed_tool_calls_come_in_one_delta_then_the_finish():
    pieces = ['[{"name": "ad', 'd", "arguments": {"a": 1', ', "b": 2}}]']
    chunks = _stream(_opts(REQUIRED, stream=True, include_usage=True), pieces)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    assert [d["delta"] for d in deltas[1:-1]] == [{"tool_calls": deltas[1]["delta"]["tool_calls"]}]
    (call,) = deltas[1]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert deltas[-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    # cut short inside the call: the text, then "length"
    deltas = [c["choices"][0] for c in _stream(_opts(NAMED, stream=True), ['{"a": ', "1"], "length")]
    assert [d["delta"] for d in deltas[1:]] == [{"content": '{"a": 1'}, {}] and deltas[-1]["finish_reason"] == "length"
    # with log-probs asked for, they stream as they come; the call still comes whole at the end
    chunks = _stream(_opts(NAMED, stream=True, logprobs=0), ['{"a": 1, ', '"b": 2}'])
    deltas = [c["choices"][0] for c in chunks[1:]]
    assert [d["delta"] for d in deltas[:2]] == [{}, {}] and all(d["logprobs"] for d in deltas[:2])
    assert "tool_calls" in deltas[2]["delta"] and deltas[3]["finish_reason"] == "tool_calls"


def test_streamed_auto_sends_text_until_a_call_begins():
    pieces = ["Sure, ", "let me <", "tool_call>\n", '{"name": "add", "arguments": {"a": 1, "b": 2}}', "\n</tool_call>"]
    deltas = [c["choices"][0]["delta"] for c in _stream(_opts(AUTO, stream=True), pieces)[1:]]
    assert deltas[:2] == [{"content": "Sure, "}, {"content": "let me "}]
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas[2:-1]] == ["add"] and deltas[-1] == {}
    deltas = [c["choices"][0] for c in _stream(_opts(AUTO, stream=True), ["A <b> and <", "tool"])]
    assert "".join(d["delta"].get("content", "") for d in deltas) == "A <b> and <tool"  # held back, then sent
    assert deltas[-1]["finish_reason"] == "stop"
    chunks = _stream(_opts(AUTO, stream=True), ["<tool_call>{broken"])
    assert [c["choices"][0]["delta"] for c in chunks[1:]] == [{"content": "<tool_call>{broken"}, {}]


def test_compiler_errors_name_the_clients_field():
    _, opts = chat({"structured_outputs": {"regex": "(ab"}})
    msg, param = tr.client_error("sampling.constraint.regex: unbalanced parenthesis at 0", opts)
    assert param == "structured_outputs.regex" and msg == "structured_outputs.regex: unbalanced parenthesis at 0"
    _, opts = chat({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}})
    assert tr.client_error("sampling.constraint.json_schema: unknown type nope", opts) == (
        "response_format.json_schema.schema: unknown type nope", "response_format.json_schema.schema")
    assert tr.client_error("sampling.constraint.json_schema is empty", opts)[0] == \
        "response_format.json_schema.schema is empty"
    _, opts = chat({"tools": TOOLS, "tool_choice": "required"})
    assert tr.client_error("sampling.constraint.json_schema: x", opts) == ("tools: x", "tools")
    assert tr.client_error("sampling.top_p: must be in (0, 1]", opts) == ("sampling.top_p: must be in (0, 1]", "top_p")
    assert tr.client_error("messages.tools: not a JSON array", None)[1] == "tools"
    assert tr.client_error("sampling.constraint.regex: bad", None)[1] == "constraint.regex"


# ---- over HTTP, against the stack ---------------------------------------------------------------------


def _ask(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Write one example of a {name} record as JSON matching this schema: "
                                        f"{json.dumps(SCHEMAS[name])}"}]


def test_json_schemas_sampled_concurrently_fit(oai, model):
    """The ten schemas of baton/bench/schemas.py, ten samples each at temperature 0.8, sixteen at a time."""
    def one(name: str, i: int):
        rf = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
        r = oai.chat.completions.create(model=model, messages=_ask(name), response_format=rf, temperature=0.8,
                                        max_tokens=300, seed=i)
        return name, r.choices[0]

    jobs = [(name, i) for name in SCHEMAS for i in range(10)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda job: one(*job), jobs))
    failures = []
    for name, choice in results:
        try:
            assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{name}: {str(e)[:200]} in {choice.message.content[:300]!r}")
    assert not failures, f"{len(failures)} of {len(results)} outputs do not fit:\n" + "\n".join(failures[:10])


def test_regex_choice_and_json_object(oai, model):
    regex = r"[A-Z][a-z]{2,10}, [0-9]{1,3}"
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "A city and a number?"}],
                                    n=10, temperature=0.8, max_tokens=40, extra_body={"structured_outputs":
                                                                                      {"regex": regex}})
    assert len(r.choices) == 10
    for c in r.choices:
        assert re.fullmatch(regex, c.message.content) and c.finish_reason == "stop", c.message.content
    colors = ["red", "green", "blue", "light yellow"]
    r = oai.completions.create(model=model, prompt="My favourite color is", n=10, temperature=0.8, max_tokens=10,
                               extra_body={"structured_outputs": {"choice": colors}})
    assert all(c.text in colors and c.finish_reason == "stop" for c in r.choices), [c.text for c in r.choices]
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "The capital of France as "
                                                            "JSON, with a key city."}], temperature=0, max_tokens=100,
                                    response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"


def _check_calls(message, names=PARAMETERS) -> list[str]:
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    return [c.function.name for c in message.tool_calls]


def test_tool_choice_required_and_named(oai, model):
    msgs = [{"role": "user", "content": "What is the weather in Paris, and what is 2 plus 3?"}]
    # Sampled, a small model may go on adding calls (up to 16) past max_tokens; one call always fits.
    r = oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required", n=4,
                                    temperature=0.8, max_tokens=200, parallel_tool_calls=False)
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c.message
        assert len(_check_calls(c.message)) == 1
    r = oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required", temperature=0,
                                    max_tokens=300)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    _check_calls(r.choices[0].message)
    r = oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS, temperature=0.8, max_tokens=100, n=3,
                                    tool_choice={"type": "function", "function": {"name": "add"}})
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and _check_calls(c.message) == ["add"]
    cut = oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=4)
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert cut.choices[0].message.content.startswith("[")  # the raw text, cut inside the call
    # the conversation goes on with the call and its result
    call = r.choices[0].message.tool_calls[0]
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    r = oai.chat.completions.create(model=model, messages=follow, tools=TOOLS, tool_choice="none", max_tokens=8,
                                    temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="auto")
    assert e.value.body["param"] == "tool_choice" and "required" in e.value.body["message"]


def test_constraints_the_compiler_refuses_are_400_naming_the_field(oai, model):
    msgs = [{"role": "user", "content": "hi"}]
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {
                "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}},
            "response_format.json_schema.schema"),
           ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "structured_outputs.regex"),
           ({"extra_body": {"structured_outputs": {"grammar": "start: (("}}}, "structured_outputs.grammar")]
    for kwargs, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=model, messages=msgs, max_tokens=8, **kwargs)
        assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
        assert e.value.body["message"].startswith(f"{param}: ") and len(e.value.body["message"]) > len(param) + 2
        assert e.value.body["type"] == "invalid_request_error"
    r = oai.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens > 0


def test_streamed_json_schema_and_tool_calls(oai, model):
    schema = SCHEMAS["order"]
    chunks = list(oai.chat.completions.create(
        model=model, messages=_ask("order"), temperature=0.8, max_tokens=300, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": schema}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    chunks = list(oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0.8, max_tokens=200, stream=True,
        stream_options={"include_usage": True}))
    with_calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(with_calls) == 1
    for call in with_calls[0].choices[0].delta.tool_calls:
        assert call.id.startswith("call_") and call.function.name in PARAMETERS
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


# A ChatML template that offers the tools, as tool-calling models' templates do (Hermes style).
_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions: {{ tools | tojson }}. Call one as "
    "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tool_choice_auto_where_the_chat_template_renders_tools(stack, default_model):
    """A router whose model template takes tools, over the same workers: the template gets the tools (the
    prompt grows by them), and "auto" is served. The 135M model rarely calls a tool of its own accord, so
    what it answers is not asserted beyond its shape; reading calls back is unit-tested above."""
    from baton.api.client import Client
    from baton.services.gateway.server import Gateway
    from baton.tokenizer import Tokenizer
    from tests.stack_state import router_over

    t = default_model.tokenizer
    tok = Tokenizer(t._backend, vocab_size=t.vocab_size, bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id,
                    eos_token_ids=t.eos_token_ids, special_token_ids=t.special_token_ids, add_bos=t.add_bos,
                    chat_template=_TOOLS_TEMPLATE)
    router = router_over(stack, tok)
    gateway = Gateway(router.address, "127.0.0.1", 0, 4 << 20).start()
    try:
        msgs = [pb.ChatMessage(role="user", content="What is 2 + 3?")]
        with Client(router.address) as c:
            assert c.list_models()[0].chat_tools
            plain = c.stub.Tokenize(pb.TokenizeRequest(messages=pb.Messages(messages=msgs))).token_ids
            offered = c.stub.Tokenize(pb.TokenizeRequest(messages=pb.Messages(messages=msgs,
                                                                              tools=json.dumps(TOOLS)))).token_ids
            assert len(offered) > len(plain) and "add" in c.detokenize(list(offered)).text
        client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                             tools=TOOLS, max_tokens=24, temperature=0)
        choice = out.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        assert choice.message.content or choice.message.tool_calls
        assert out.usage.prompt_tokens > len(plain)  # the tools were in the prompt
    finally:
        gateway.stop()
        router.stop()
