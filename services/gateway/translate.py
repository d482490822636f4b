"""OpenAI bodies -> GenerateRequest, and the router's messages -> OpenAI's responses and SSE chunks.
Pure functions and small classes, no I/O: unit-testable without a server."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field

from baton.api.errors import shown
from baton.api.params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from baton.services.gateway.fields import BadRequest, check_type
from baton.services.gateway.structured import (
    MAX_TOOLS,
    TOOL_CALL_OPEN,
    TOOL_NAME,
    Answer,
    ToolPlan,
    structured,
)
from baton.services.gateway.structured import openai_finish as _finish
from baton.v1 import generation_pb2 as pb

log = logging.getLogger(__name__)

# OpenAI's sampling fields and Baton's extras (named as vLLM names them) -> SamplingParams fields.
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos"}
_KNOWN = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
          "stop", "user", "priority", "logprobs", "top_logprobs", "response_format", "structured_outputs", "tools",
          "tool_choice", "parallel_tool_calls", *_SAMPLING}
# Fields a client relies on that Baton cannot honour yet: refused by name, never dropped.
_UNSUPPORTED = ("functions", "function_call", "logit_bias", "suffix", "echo", "best_of", "audio", "modalities",
                "prediction")
# vLLM's former structured-output fields: refused with the name that replaced them (never silently unconstrained).
_RENAMED = {"guided_json": "structured_outputs.json", "guided_regex": "structured_outputs.regex",
            "guided_choice": "structured_outputs.choice", "guided_grammar": "structured_outputs.grammar"}
_MAX_USER_CHARS = 256
_MAX_ID_CHARS = 256  # a tool call's id, as the client echoes it
MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # prompts x n per request; each is one more request for admission and the workers
MAX_TOP_LOGPROBS = 20
_LOWEST_LOGPROB = -9999.0  # JSON has no -Infinity


def param_of(details: str) -> str | None:
    """The field a router INVALID_ARGUMENT names ('sampling.top_p: ...' -> 'top_p')."""
    m = re.match(r"([a-z_]+(?:\.[a-z_]+)*)", details)
    if not m:
        return None
    name = m.group(1).removeprefix("sampling.")
    return "tools" if name.startswith("messages.tools") else name


_CONSTRAINT_ERROR = re.compile(r"sampling\.constraint(?:\.[a-z_]+)?(:?)\s*")


def client_error(details: str, opts: Options | None) -> tuple[str, str | None]:
    """A router INVALID_ARGUMENT -> (message, param) in the client's terms. A constraint the grammar compiler
    refused ('sampling.constraint.regex: ...') names the HTTP field that asked for it
    ('structured_outputs.regex: ...')."""
    m = _CONSTRAINT_ERROR.match(details)
    if m and opts is not None and opts.constraint_param:
        rest = details[m.end():]
        return f"{opts.constraint_param}{': ' if m.group(1) else ' '}{rest}", opts.constraint_param
    return details, param_of(details)


@dataclass(frozen=True)
class Options:
    model: str | None
    stream: bool
    include_usage: bool
    n: int = 1  # choices per prompt
    logprobs: int | None = None  # None: off; else the alternatives asked for at each token
    constraint_param: str | None = None  # the HTTP field the request's constraint came from
    tools: ToolPlan | None = None  # chat answers parsed into tool calls


def _text_of(content, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}: only text content parts are supported", where)
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where} must be a string or a list of text parts", where)


def _model(body: dict, served: list[str]) -> str | None:
    model = body.get("model")
    check_type(body, "model", (str,), "a string")
    if model is not None and model not in served:
        raise BadRequest(f"model {shown(model)} is not served here; GET /v1/models lists {', '.join(served)}", "model",
                         status=404)
    return model


def _messages(body: dict, into: pb.Messages) -> None:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        where = f"messages[{i}]"
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and calls not in (None, []):
            # The template sees text only: the calls as the Hermes blocks a tool-calling model writes.
            content = m.get("content")
            text = "" if content is None else _text_of(content, f"{where}.content")
            blocks = [_past_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(_list_of(
                calls, f"{where}.tool_calls", MAX_TOOLS))]
            into.messages.add(role="assistant", content="\n".join(([text] if text else []) + blocks))
            continue
        if m["role"] == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and (not isinstance(call_id, str) or len(call_id) > _MAX_ID_CHARS):
                raise BadRequest(f"{where}.tool_call_id must be a string of at most {_MAX_ID_CHARS} characters",
                                 f"{where}.tool_call_id")
        into.messages.add(role=m["role"], content=_text_of(m.get("content", ""), f"{where}.content"))


def _list_of(value, where: str, limit: int) -> list:
    if not isinstance(value, list) or len(value) > limit:
        raise BadRequest(f"{where} must be a list of at most {limit} entries", where)
    return value


def _past_call(call, where: str) -> str:
    """An earlier assistant tool call ({"id", "type": "function", "function": {"name", "arguments"}}) as text."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise BadRequest(f'{where} must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}',
                         where)
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise BadRequest(f"{where}.function.name must be 1 to 64 letters, digits, _ or -", f"{where}.function.name")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        raise BadRequest(f"{where}.function.arguments must be a string (the arguments as JSON)",
                         f"{where}.function.arguments")
    call_id = call.get("id")
    if call_id is not None and (not isinstance(call_id, str) or len(call_id) > _MAX_ID_CHARS):
        raise BadRequest(f"{where}.id must be a string of at most {_MAX_ID_CHARS} characters", f"{where}.id")
    try:
        parsed = json.loads(args)
    except (ValueError, RecursionError):
        parsed = args  # shown as the string it is
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': parsed}, ensure_ascii=False)}\n</tool_call>"


def to_tokenize(body: dict, served: list[str]) -> pb.TokenizeRequest:
    """``POST /tokenize``: {"prompt": str} or {"messages": [...]} (rendered with the chat template)."""
    _model(body, served)
    req = pb.TokenizeRequest()
    if "messages" in body:
        _messages(body, req.messages)
    elif isinstance(body.get("prompt"), str):
        req.prompt = body["prompt"]
    else:
        raise BadRequest("give prompt (a string) or messages", "prompt")
    return req


def to_detokenize(body: dict, served: list[str]) -> pb.DetokenizeRequest:
    """``POST /detokenize``: {"tokens": [int, ...]}."""
    _model(body, served)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadRequest("tokens must be a list of token ids", "tokens")
    if any(not -2**31 <= t < 2**31 for t in tokens):
        raise BadRequest("tokens must be 32-bit integers", "tokens")
    return pb.DetokenizeRequest(token_ids=tokens)


def _logprobs_asked(body: dict, chat: bool) -> int | None:
    """None when no log-probs are asked for, else how many alternatives per token. Chat: ``logprobs``
    true and ``top_logprobs`` N; completions: ``logprobs`` N."""
    if chat:
        check_type(body, "logprobs", (bool,), "true or false")
        top = body.get("top_logprobs")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise BadRequest(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        if not body.get("logprobs"):
            if top:
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return top or 0
    n = body.get("logprobs")
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    return n


def _prompts(prompt) -> list:
    """A completions ``prompt`` -> one entry per prompt: a string or a list of token ids."""
    def ids(p) -> bool:
        return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    if isinstance(prompt, str) or ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids(p) for p in prompt):
        return prompt
    raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                     "prompt")


def to_generate(body: dict, chat: bool, served: list[str], tool_models: Collection[str] = ()
                ) -> tuple[list[pb.GenerateRequest], Options]:
    """The GenerateRequests for an OpenAI body, one per prompt (chat has one); raises BadRequest naming the
    field. ``tool_models``: the served models whose chat templates take tools (tool_choice "auto")."""
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise BadRequest(f"{name} is not supported by this server", name)
    for name, instead in _RENAMED.items():
        if body.get(name) is not None:
            raise BadRequest(f"{name} is not supported by this server; use {instead} (vLLM's current name) or "
                             "response_format", name)
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        log.info("ignoring unknown request fields: %s", ", ".join(unknown[:10]))
    model = _model(body, served)
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be an integer in [1, {MAX_N}]", "n")
    logprobs = _logprobs_asked(body, chat)
    check_type(body, "stream", (bool,), "true or false")
    stream = bool(body.get("stream", False))
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(opts, dict):
            raise BadRequest("stream_options must be an object", "stream_options")
    include_usage = bool((opts or {}).get("include_usage", False))

    req = pb.GenerateRequest()
    prompts: list = [None]
    if chat:
        _messages(body, req.messages)
    else:
        prompts = _prompts(body.get("prompt"))
        if len(prompts) * n > MAX_CHOICES:
            raise BadRequest(f"{len(prompts)} prompts x n={n} is {len(prompts) * n} choices; at most {MAX_CHOICES} "
                             "per request", "prompt")
        for p in prompts:
            if isinstance(p, list) and any(not -2**31 <= t < 2**31 for t in p):
                raise BadRequest("prompt token ids must be 32-bit integers", "prompt")

    sp = req.sampling
    if logprobs is not None:
        sp.logprobs = True
        sp.top_logprobs = logprobs
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    which = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None:
        _int32(max_tokens, which)
        sp.max_tokens = max_tokens
    for name, target in _SAMPLING.items():
        value = body.get(name)
        if value is None:
            continue
        if target == "ignore_eos":
            check_type(body, name, (bool,), "true or false")
        elif target == "seed":
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
                raise BadRequest("seed must be an integer in [0, 2**64)", name)
        elif target == "top_k":
            _int32(value, name)
            value = max(value, 0)  # vLLM: -1 (or 0) means off
        else:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise BadRequest(f"{name} must be a finite number", name)
            if abs(value) > 3.4e38:
                raise BadRequest(f"{name} is out of range", name)
        setattr(sp, target, value)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
            raise BadRequest(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings, each of 1 to "
                             f"{MAX_STOP_CHARS} characters", "stop")
        sp.stop.extend(stops)
    priority = body.get("priority")
    if priority is not None:
        _int32(priority, "priority")
        req.priority = pb.PRIORITY_BATCH if priority > 0 else pb.PRIORITY_INTERACTIVE
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > _MAX_USER_CHARS):
        raise BadRequest(f"user must be a string of at most {_MAX_USER_CHARS} characters", "user")
    chosen = model or (served[0] if served else None)
    wanted, plan, tools = structured(body, chat, chosen in tool_models)
    if wanted is not None:
        sp.constraint.CopyFrom(wanted[1])
    if tools:
        req.messages.tools = tools
    reqs = []
    for p in prompts:
        r = pb.GenerateRequest()
        r.CopyFrom(req)
        if isinstance(p, str):
            r.prompt = p
        elif p is not None:
            r.prompt_token_ids.ids.extend(p)
        reqs.append(r)
    return reqs, Options(model, stream, include_usage, n, logprobs, wanted[0] if wanted else None, plan)


def choice_requests(reqs: list[pb.GenerateRequest], n: int) -> list[pb.GenerateRequest]:
    """One request per choice, prompt by prompt: choice ``p * n + i`` is prompt p's i-th. A prompt's choices
    share it, so those after the first reuse its KV through the prefix cache; with a seed, choice i samples
    with seed + i (different choices, reproducible)."""
    out = []
    for req in reqs:
        for i in range(n):
            r = pb.GenerateRequest()
            r.CopyFrom(req)
            if i and r.sampling.HasField("seed"):
                r.sampling.seed = (r.sampling.seed + i) % 2**64
            out.append(r)
    return out


def _int32(value, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not -2**31 <= value < 2**31:
        raise BadRequest(f"{name} must be an integer", name)


def _lp(value: float) -> float:
    return max(value, _LOWEST_LOGPROB)


def _token(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _chat_token(raw: bytes, logprob: float) -> dict:
    return {"token": _token(raw), "logprob": _lp(logprob), "bytes": list(raw)}


@dataclass
class TokenLogprobs:
    """The log-probs of a run of tokens, as the router sends them (with each token's bytes)."""

    logprobs: list[float] = field(default_factory=list)
    token_bytes: list[bytes] = field(default_factory=list)
    top: list[pb.TopLogprobs] = field(default_factory=list)

    def add(self, msg: pb.GenerateResponse) -> None:
        self.logprobs += msg.logprobs
        self.token_bytes += msg.token_bytes
        self.top += msg.top_logprobs

    def chat(self) -> dict:
        """OpenAI's chat ``logprobs``: per token its text, log-prob, bytes and the top alternatives."""
        content = []
        for i, (lp, raw) in enumerate(zip(self.logprobs, self.token_bytes)):
            top = self.top[i] if i < len(self.top) else None
            alternatives = [] if top is None else [_chat_token(b, v) for b, v in zip(top.token_bytes, top.logprobs)]
            content.append({**_chat_token(raw, lp), "top_logprobs": alternatives})
        return {"content": content, "refusal": None}

    def completion(self, offset: int, alternatives: bool) -> dict:
        """OpenAI's completions ``logprobs``; ``offset``: where these tokens start in the choice's text."""
        tokens = [_token(b) for b in self.token_bytes]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        top = [{_token(b): _lp(v) for b, v in zip(t.token_bytes, t.logprobs)} for t in self.top]
        return {"tokens": tokens, "token_logprobs": [_lp(v) for v in self.logprobs],
                "top_logprobs": top if alternatives else None, "text_offset": offsets}


@dataclass
class Collected:
    text: str = ""
    finish_reason: str | None = None
    usage: pb.Usage | None = None
    tokens: int = 0
    logprobs: TokenLogprobs = field(default_factory=TokenLogprobs)

    def add(self, msg: pb.GenerateResponse) -> None:
        self.text += msg.text
        self.tokens += len(msg.token_ids)
        self.logprobs.add(msg)
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
        if msg.HasField("usage"):
            self.usage = msg.usage


def usage_of(usages: list[pb.Usage | None], completion_tokens: int, n: int) -> dict:
    """Usage over a request's choices (``n`` per prompt): each prompt counted once, the completions summed."""
    groups = [[u for u in usages[p:p + n] if u is not None] for p in range(0, len(usages), n)]
    prompt = sum(g[0].prompt_tokens for g in groups if g)
    cached = sum(g[0].cached_prompt_tokens for g in groups if g)
    known = [u for g in groups for u in g]
    done = sum(u.completion_tokens for u in known) if len(known) == len(usages) else completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _message(answer: Answer) -> dict:
    message = {"role": "assistant", "content": answer.content}
    if answer.tool_calls:
        message["tool_calls"] = answer.tool_calls
    return message


def whole_response(outs: list[Collected], rid: str, created: int, model: str, chat: bool, opts: Options) -> dict:
    choices = []
    for i, out in enumerate(outs):
        if chat:
            logprobs = out.logprobs.chat() if opts.logprobs is not None else None
            answer = (opts.tools.parse(out.text, out.finish_reason) if opts.tools is not None
                      else Answer(out.text, None, _finish(out.finish_reason)))
            choices.append({"index": i, "message": _message(answer), "logprobs": logprobs,
                            "finish_reason": answer.finish_reason})
        else:
            logprobs = out.logprobs.completion(0, opts.logprobs > 0) if opts.logprobs is not None else None
            choices.append({"index": i, "text": out.text, "logprobs": logprobs,
                            "finish_reason": _finish(out.finish_reason)})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices,
            "usage": usage_of([o.usage for o in outs], sum(o.tokens for o in outs), opts.n)}


@dataclass
class Chunker:
    """The SSE chunks of one stream, OpenAI's way: for each choice the role first (chat), content deltas
    (with their tokens' log-probs when asked) and a chunk with its finish reason; then (asked for) one usage
    chunk with no choices."""

    rid: str
    created: int
    model: str
    chat: bool
    opts: Options
    tokens: int = field(default=0)
    usages: dict[int, pb.Usage | None] = field(default_factory=dict)
    offsets: dict[int, int] = field(default_factory=dict)  # completions: each choice's text so far
    # With tools: each choice's text held back (all of it for required/named calls; for "auto" from the first
    # "<tool_call>", or what may begin one), sent parsed at its end.
    held: dict[int, str] = field(default_factory=dict)
    in_call: dict[int, bool] = field(default_factory=dict)

    def _chunk(self, choices: list, **extra) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _choice(self, index: int, text: str | None, finish: str | None, role: bool = False,
                logprobs: TokenLogprobs | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return {"index": index, "delta": delta, "logprobs": logprobs.chat() if logprobs else None,
                    "finish_reason": finish}
        rendered = None
        if logprobs:
            rendered = logprobs.completion(self.offsets.get(index, 0), self.opts.logprobs > 0)
            self.offsets[index] = self.offsets.get(index, 0) + sum(len(t) for t in rendered["tokens"])
        return {"index": index, "text": text or "", "logprobs": rendered, "finish_reason": finish}

    def role(self, index: int) -> dict:
        return self._chunk([self._choice(index, None, None, role=True)])

    def add(self, index: int, msg: pb.GenerateResponse) -> list[dict]:
        self.tokens += len(msg.token_ids)
        out = []
        logprobs = None
        if self.opts.logprobs is not None and msg.token_ids:
            logprobs = TokenLogprobs()
            logprobs.add(msg)
        tools = self.chat and self.opts.tools is not None
        text = self._release(index, msg.text) if tools else msg.text
        if text or logprobs:
            out.append(self._chunk([self._choice(index, text, None, logprobs=logprobs)]))
        if msg.finish_reason:
            self.usages[index] = msg.usage if msg.HasField("usage") else None
            finish = _finish(msg.finish_reason)
            if tools:
                finish = self._answer(index, msg.finish_reason, out)
            out.append(self._chunk([self._choice(index, None, finish)]))
        return out

    def _release(self, index: int, text: str) -> str:
        """What of a tool-using choice's text may go out now: none of a required or named call; with "auto",
        the text before a "<tool_call>" (keeping back an end that may begin one)."""
        held = self.held.get(index, "") + text
        if self.opts.tools.mode != "auto" or self.in_call.get(index):
            self.held[index] = held
            return ""
        at = held.find(TOOL_CALL_OPEN)
        if at >= 0:
            self.in_call[index] = True
        else:
            at = len(held)
            for k in range(min(len(TOOL_CALL_OPEN) - 1, len(held)), 0, -1):
                if held.endswith(TOOL_CALL_OPEN[:k]):
                    at = len(held) - k
                    break
        self.held[index] = held[at:]
        return held[:at]

    def _answer(self, index: int, finish: str, out: list[dict]) -> str | None:
        """At a tool-using choice's end: its held text as content or as one delta of tool calls; the finish."""
        held = self.held.pop(index, "")
        if self.opts.tools.mode == "auto" and not self.in_call.pop(index, False):
            answer = Answer(held, None, _finish(finish))
        else:
            answer = self.opts.tools.parse(held, finish)
        if answer.content:
            out.append(self._chunk([self._choice(index, answer.content, None)]))
        if answer.tool_calls:
            delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(answer.tool_calls)]}
            out.append(self._chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]))
        return answer.finish_reason

    def usage(self, choices: int) -> dict:
        return self._chunk([], usage=usage_of([self.usages.get(i) for i in range(choices)], self.tokens, self.opts.n))


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
