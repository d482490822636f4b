"""Structured output and tool calls on the OpenAI API: ``response_format``, vLLM's ``structured_outputs``,
``tools`` with ``tool_choice`` -> the request's one ``Constraint`` (with the HTTP field it came from, to
name in errors), and a chat answer -> OpenAI's ``tool_calls``. Pure functions, no I/O.

tool_choice "required": the answer is constrained to a JSON array of calls {"name", "arguments"}, one
object schema per tool; a named function: to that function's parameters; "auto": free text, where the
model's chat template offers the tools and Hermes-style ``<tool_call>`` blocks are read back; "none": no
tools at all. An answer that did not end with "stop", or does not parse, comes back as text.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from baton.api.errors import shown
from baton.api.params import MAX_CHOICE_CHARS, MAX_CONSTRAINT_CHARS
from baton.api.params import MAX_CHOICES as MAX_CONSTRAINT_CHOICES
from baton.services.gateway.fields import BadRequest, check_type
from baton.v1 import generation_pb2 as pb

MAX_TOOLS = 128  # tools per request, and calls per earlier assistant message
MAX_TOOL_CALLS = 16  # calls in one answer with tool_choice "required" (1 with parallel_tool_calls: false)
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# The arguments of a tool declared without parameters: none at all.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def openai_finish(reason: str | None) -> str | None:
    """The router's finish reason as OpenAI's (empty: none yet)."""
    return {"stop": "stop", "length": "length"}.get(reason or "", reason or None)


@dataclass(frozen=True)
class Answer:
    """A chat choice's message as the client sees it: plain text, or tool calls (content None or the text
    around them)."""

    content: str | None
    tool_calls: list[dict] | None
    finish_reason: str | None


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


# Hermes-style calls in free text: <tool_call>{"name": ..., "arguments": {...}}</tool_call>; the last one may lack
# its closing tag (the model ended its turn there).
TOOL_CALL_OPEN = "<tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


@dataclass(frozen=True)
class ToolPlan:
    """How a chat answer becomes tool calls. ``required``: the answer is a JSON array of {"name", "arguments"};
    ``named``: the answer is the arguments of ``name``; ``auto``: free text with Hermes ``<tool_call>`` blocks.
    An answer that did not end with "stop" (max_tokens inside a call), or does not parse, is returned as text."""

    mode: str
    names: frozenset[str]
    name: str | None = None

    def parse(self, text: str, finish: str | None) -> Answer:
        raw = Answer(text, None, openai_finish(finish))
        if finish != "stop":
            return raw
        if self.mode == "auto":
            return self._hermes(text) or raw
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return raw
        if self.mode == "named":
            return Answer(None, [_call(self.name, text.strip())], "tool_calls") if isinstance(value, dict) else raw
        if not isinstance(value, list) or not value:
            return raw
        calls = []
        for item in value:
            if (not isinstance(item, dict) or item.get("name") not in self.names
                    or not isinstance(item.get("arguments"), dict)):
                return raw
            calls.append(_call(item["name"], json.dumps(item["arguments"], ensure_ascii=False)))
        return Answer(None, calls, "tool_calls")

    def _hermes(self, text: str) -> Answer | None:
        """None when ``text`` holds no well-formed call (it is then a plain answer)."""
        blocks = list(_HERMES.finditer(text))
        if not blocks:
            return None
        calls = []
        for b in blocks:
            try:
                call = json.loads(b.group(1).strip())
            except (ValueError, RecursionError):
                return None
            if not isinstance(call, dict) or call.get("name") not in self.names:
                return None
            args = call.get("arguments", call.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except (ValueError, RecursionError):
                    return None
            if not isinstance(args, dict):
                return None
            calls.append(_call(call["name"], json.dumps(args, ensure_ascii=False)))
        content = _HERMES.sub("", text).strip()
        return Answer(content or None, calls, "tool_calls")


def _json_text(value, param: str, what: str) -> str:
    """``value`` as compact JSON text of at most MAX_CONSTRAINT_CHARS characters."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as e:
        raise BadRequest(f"{param} must be plain JSON (no NaN or Infinity): {e}", param) from None
    except RecursionError:
        raise BadRequest(f"{param} is nested too deeply", param) from None
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise BadRequest(f"{param}: {what} of {len(text)} characters as JSON; at most {MAX_CONSTRAINT_CHARS}", param)
    return text


def _schema(value, param: str) -> str:
    if not isinstance(value, dict):
        raise BadRequest(f"{param} must be a JSON Schema object, got {shown(value)}", param)
    return _json_text(value, param, "a schema")


def _pattern(value, param: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{param} must be a non-empty string ({what}), got {shown(value)}", param)
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise BadRequest(f"{param}: {len(value)} characters; at most {MAX_CONSTRAINT_CHARS}", param)
    return value


def _response_format(body: dict) -> tuple[str, pb.Constraint] | None:
    """OpenAI's ``response_format``: text (no constraint), json_object, or json_schema {name, schema, strict}."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise BadRequest('response_format must be an object: {"type": "text"}, {"type": "json_object"} or '
                         '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}', "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", pb.Constraint(json_object=True)
    if kind != "json_schema":
        raise BadRequest(f"response_format.type must be text, json_object or json_schema, got {shown(kind)}",
                         "response_format.type")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequest('response_format.json_schema must be an object {"name": ..., "schema": {...}, "strict": ...}',
                         "response_format.json_schema")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not TOOL_NAME.fullmatch(name)):
        raise BadRequest("response_format.json_schema.name must be 1 to 64 letters, digits, _ or -",
                         "response_format.json_schema.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise BadRequest("response_format.json_schema.strict must be true or false",
                         "response_format.json_schema.strict")
    param = "response_format.json_schema.schema"
    if "schema" not in spec:
        raise BadRequest(f"{param} is missing: give the JSON Schema the answer must follow", param)
    return param, pb.Constraint(json_schema=_schema(spec["schema"], param))


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _structured_outputs(body: dict) -> list[tuple[str, pb.Constraint]]:
    """vLLM's ``structured_outputs``: json (a schema object or its JSON text), regex, choice, grammar,
    json_object. A key set to null or false asks for nothing (clients that send every key do that)."""
    so = body.get("structured_outputs")
    if so is None:
        return []
    if not isinstance(so, dict):
        raise BadRequest(f"structured_outputs must be an object with one of {', '.join(_STRUCTURED_KINDS)}",
                         "structured_outputs")
    out = []
    for key, value in so.items():
        if value is None or value is False or key == "disable_fallback":
            continue
        param = f"structured_outputs.{key}"
        if key == "json":
            if isinstance(value, str):
                if len(value) > MAX_CONSTRAINT_CHARS:
                    raise BadRequest(f"{param}: {len(value)} characters; at most {MAX_CONSTRAINT_CHARS}", param)
                try:
                    value = json.loads(value)
                except (ValueError, RecursionError) as e:
                    raise BadRequest(f"{param} is not valid JSON: {e}", param) from None
            out.append((param, pb.Constraint(json_schema=_schema(value, param))))
        elif key in ("regex", "grammar"):
            text = _pattern(value, param, "a regular expression" if key == "regex" else "a Lark or GBNF grammar")
            out.append((param, pb.Constraint(**{key: text})))
        elif key == "choice":
            if (not isinstance(value, list) or not 1 <= len(value) <= MAX_CONSTRAINT_CHOICES
                    or not all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS for c in value)):
                raise BadRequest(f"{param} must be a list of 1 to {MAX_CONSTRAINT_CHOICES} strings, each of 1 to "
                                 f"{MAX_CHOICE_CHARS} characters", param)
            out.append((param, pb.Constraint(choice=pb.Choices(choices=value))))
        elif key == "json_object":
            if value is not True:
                raise BadRequest(f"{param} must be true or false", param)
            out.append((param, pb.Constraint(json_object=True)))
        else:
            raise BadRequest(f"structured_outputs.{shown(key, 40)} is not supported by this server; give one of "
                             f"{', '.join(_STRUCTURED_KINDS)}", "structured_outputs")
    return out


def _tools(body: dict) -> list[dict]:
    """The request's tools, checked and rebuilt with only the fields a template or a schema uses."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequest(f'tools must be a list of at most {MAX_TOOLS} {{"type": "function", "function": {{...}}}}',
                         "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise BadRequest(f'{where} must be {{"type": "function", "function": {{"name", "description", '
                             '"parameters"}}; only function tools are supported', f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise BadRequest(f'{where}.function must be an object {{"name", "description", "parameters"}}',
                             f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise BadRequest(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {shown(name)}",
                             f"{where}.function.name")
        if name in names:
            raise BadRequest(f"{where}.function.name: {name} names two tools", f"{where}.function.name")
        names.add(name)
        entry = {"name": name}
        if fn.get("description") is not None:
            if not isinstance(fn["description"], str):
                raise BadRequest(f"{where}.function.description must be a string", f"{where}.function.description")
            entry["description"] = fn["description"]
        if fn.get("parameters") is not None:
            if not isinstance(fn["parameters"], dict):
                raise BadRequest(f"{where}.function.parameters must be a JSON Schema object, got "
                                 f"{shown(fn['parameters'])}", f"{where}.function.parameters")
            entry["parameters"] = fn["parameters"]
        out.append({"type": "function", "function": entry})
    return out


def _arguments_schema(tool: dict, defs: dict, key: str) -> dict:
    """A tool's parameters as one schema; with local $refs ('#/...') moved under the root's $defs[key] (refs
    rewritten), so that they still resolve inside a larger schema."""
    params = tool["function"].get("parameters")
    if params is None:
        return _NO_PARAMETERS
    if '"$ref":"#' not in json.dumps(params, separators=(",", ":")):
        return params

    def moved(node):
        if isinstance(node, dict):
            return {k: (f"#/$defs/{key}{v[1:]}" if k == "$ref" and isinstance(v, str) and v.startswith("#")
                        else moved(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [moved(v) for v in node]
        return node

    defs[key] = moved(params)
    return {"$ref": f"#/$defs/{key}"}


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """tool_choice "required": a JSON array of 1 to MAX_TOOL_CALLS calls (1 without parallel calls), each
    {"name": one tool's name, "arguments": that tool's parameters}."""
    defs: dict = {}
    calls = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": _arguments_schema(t, defs, f"tool_{i}")},
              "required": ["name", "arguments"], "additionalProperties": False} for i, t in enumerate(tools)]
    schema = {"type": "array", "minItems": 1, "maxItems": MAX_TOOL_CALLS if parallel else 1,
              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if defs:
        schema["$defs"] = defs
    return schema


_TOOL_CHOICES = ('"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def _tool_choice(body: dict, tools: list[dict], chat_tools: bool, other: list[tuple[str, pb.Constraint]]
                 ) -> tuple[ToolPlan | None, tuple[str, pb.Constraint] | None, bool]:
    """tool_choice with the tools: (how the answer is parsed, the constraint it needs, whether the template
    is given the tools)."""
    choice = body.get("tool_choice")
    explicit = choice is not None
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"tool_choice must be {_TOOL_CHOICES}", "tool_choice")
        name = fn["name"]
    elif choice in ("none", "auto", "required"):
        name = None
    else:
        raise BadRequest(f"tool_choice must be {_TOOL_CHOICES}, got {shown(choice)}", "tool_choice")
    check_type(body, "parallel_tool_calls", (bool,), "true or false")
    if choice == "none":
        return None, None, False
    if not tools:
        if choice == "auto":
            return None, None, False
        raise BadRequest("tool_choice asks for a tool call but the request has no tools", "tool_choice")
    names = frozenset(t["function"]["name"] for t in tools)
    if name is not None:
        i = next((i for i, t in enumerate(tools) if t["function"]["name"] == name), None)
        if i is None:
            known = ", ".join(sorted(names)[:8]) + (", ..." if len(names) > 8 else "")
            raise BadRequest(f"tool_choice names {shown(name)}, which is not among the tools ({known})", "tool_choice")
        params = tools[i]["function"].get("parameters", _NO_PARAMETERS)
        param = f"tools[{i}].function.parameters"
        return (ToolPlan("named", names, name), (param, pb.Constraint(json_schema=_schema(params, param))),
                chat_tools)
    if choice == "required":
        schema = required_schema(tools, body.get("parallel_tool_calls") is not False)
        return ToolPlan("required", names), ("tools", pb.Constraint(json_schema=_json_text(
            schema, "tools", "the schema of the tools' calls"))), chat_tools
    # auto: the model decides, in its own words; its chat template must know how to offer the tools.
    if not chat_tools:
        raise BadRequest('tool_choice "auto" (the default with tools) needs a model whose chat template takes tools, '
                         'and this model\'s does not: set tool_choice to "required" (the answer is one or more calls) '
                         'or {"type": "function", "function": {"name": ...}} (a call to that function), or "none"',
                         "tool_choice" if explicit else "tools")
    if other:
        raise BadRequest(f'tool_choice "auto" lets the model answer in text or call a tool, which {other[0][0]} '
                         'cannot constrain: set tool_choice to "none" to answer in that format, or to "required" or a '
                         'function to call a tool', "tool_choice")
    return ToolPlan("auto", names), None, True


def structured(body: dict, chat: bool, chat_tools: bool) -> tuple[tuple[str, pb.Constraint] | None,
                                                                    ToolPlan | None, str]:
    """The request's one constraint (with the HTTP field it came from), its tool plan and the tools JSON the
    chat template is given ('' for none)."""
    wanted = [w for w in (_response_format(body),) if w is not None] + _structured_outputs(body)
    fields = [w[0] for w in wanted]  # the fields that asked, as the client wrote them
    if not chat:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(name) not in (None, []):
                raise BadRequest(f"{name} is only for /v1/chat/completions", name)
        plan, rendered, tools_text = None, False, ""
    else:
        tools = _tools(body)
        tools_text = _json_text(tools, "tools", "tool definitions")  # bounded, even where not rendered
        plan, constraint, rendered = _tool_choice(body, tools, chat_tools, wanted)
        if constraint is not None:
            wanted.append(constraint)
            fields.append("tool_choice")
    if len(wanted) > 1:
        raise BadRequest(f"{' and '.join(fields)} each constrain the output; a request takes one of them",
                         fields[-1])
    return (wanted[0] if wanted else None), plan, (tools_text if rendered else "")
