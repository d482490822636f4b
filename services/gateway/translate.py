"""OpenAI bodies -> GenerateRequest, and the router's messages -> OpenAI's responses and SSE chunks.
Pure functions and small classes, no I/O: unit-testable without a server."""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field

from baton.v1 import generation_pb2 as pb

log = logging.getLogger(__name__)

# OpenAI's sampling fields and Baton's extras (named as vLLM names them) -> SamplingParams fields.
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos"}
_KNOWN = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
          "stop", "user", "priority", "logprobs", "top_logprobs", *_SAMPLING}
# Fields a client relies on that Baton cannot honour yet: refused by name, never dropped.
_UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias", "suffix",
                "echo", "best_of", "audio", "modalities", "prediction")
_MAX_STOP = 16
MAX_N = 16  # choices per request; each is one more request for admission and the workers


class BadRequest(ValueError):
    """A body Baton refuses: ``param`` names the field; ``status`` 400, 404 (unknown model) or 413."""

    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def param_of(details: str) -> str | None:
    """The field a router INVALID_ARGUMENT names ('sampling.top_p: ...' -> 'top_p')."""
    m = re.match(r"([a-z_]+(?:\.[a-z_]+)*)", details)
    return m.group(1).removeprefix("sampling.") if m else None


@dataclass(frozen=True)
class Options:
    model: str | None
    stream: bool
    include_usage: bool
    n: int = 1


def _check_type(body: dict, name: str, kinds: tuple, what: str) -> None:
    value = body.get(name)
    if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds):
        raise BadRequest(f"{name} must be {what}, got {json.dumps(value)[:80]}", name)


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


def to_generate(body: dict, chat: bool, served: list[str]) -> tuple[pb.GenerateRequest, Options]:
    """The GenerateRequest for an OpenAI body; raises BadRequest naming the field."""
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise BadRequest(f"{name} is not supported by this server", name)
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        log.info("ignoring unknown request fields: %s", ", ".join(unknown[:10]))
    model = body.get("model")
    _check_type(body, "model", (str,), "a string")
    if model is not None and model not in served:
        raise BadRequest(f"model {model!r} is not served here; GET /v1/models lists {', '.join(served)}", "model",
                         status=404)
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be an integer in [1, {MAX_N}]", "n")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise BadRequest("logprobs are not supported by this server's HTTP API yet", "logprobs")
    _check_type(body, "stream", (bool,), "true or false")
    stream = bool(body.get("stream", False))
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(opts, dict):
            raise BadRequest("stream_options must be an object", "stream_options")
    include_usage = bool((opts or {}).get("include_usage", False))

    req = pb.GenerateRequest()
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("messages must be a non-empty list", "messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a role", f"messages[{i}]")
            req.messages.messages.add(role=m["role"], content=_text_of(m.get("content", ""), f"messages[{i}].content"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            req.prompt = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            if any(not -2**31 <= t < 2**31 for t in prompt):
                raise BadRequest("prompt token ids must be 32-bit integers", "prompt")
            req.prompt_token_ids.ids.extend(prompt)
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise BadRequest("prompt: one prompt per request is supported by this server", "prompt")
        else:
            raise BadRequest("prompt must be a string, a list of one string, or a list of token ids", "prompt")

    sp = req.sampling
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
            _check_type(body, name, (bool,), "true or false")
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
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > _MAX_STOP:
            raise BadRequest(f"stop must be a non-empty string or a list of at most {_MAX_STOP} of them", "stop")
        sp.stop.extend(stops)
    priority = body.get("priority")
    if priority is not None:
        _int32(priority, "priority")
        req.priority = pb.PRIORITY_BATCH if priority > 0 else pb.PRIORITY_INTERACTIVE
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("user must be a string", "user")
    return req, Options(model, stream, include_usage, n)


def choice_requests(req: pb.GenerateRequest, n: int) -> list[pb.GenerateRequest]:
    """One request per choice. They share the prompt, so choices after the first reuse its KV through the
    prefix cache; with a seed, choice i samples with seed + i (different choices, reproducible)."""
    out = []
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


@dataclass
class Collected:
    text: str = ""
    finish_reason: str | None = None
    usage: pb.Usage | None = None
    tokens: int = 0

    def add(self, msg: pb.GenerateResponse) -> None:
        self.text += msg.text
        self.tokens += len(msg.token_ids)
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
        if msg.HasField("usage"):
            self.usage = msg.usage


def usage_of(usages: list[pb.Usage | None], completion_tokens: int) -> dict:
    """Usage over a request's choices: the prompt counted once, the completions summed."""
    known = [u for u in usages if u is not None]
    prompt = known[0].prompt_tokens if known else 0
    done = sum(u.completion_tokens for u in known) if len(known) == len(usages) else completion_tokens
    cached = known[0].cached_prompt_tokens if known else 0
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finish(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length"}.get(reason or "", reason or None)


def whole_response(outs: list[Collected], rid: str, created: int, model: str, chat: bool) -> dict:
    choices = []
    for i, out in enumerate(outs):
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                            "finish_reason": _finish(out.finish_reason)})
        else:
            choices.append({"index": i, "text": out.text, "logprobs": None,
                            "finish_reason": _finish(out.finish_reason)})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices,
            "usage": usage_of([o.usage for o in outs], sum(o.tokens for o in outs))}


@dataclass
class Chunker:
    """The SSE chunks of one stream, OpenAI's way: for each choice the role first (chat), content deltas
    and a chunk with its finish reason; then (asked for) one usage chunk with no choices."""

    rid: str
    created: int
    model: str
    chat: bool
    tokens: int = field(default=0)
    usages: dict[int, pb.Usage | None] = field(default_factory=dict)

    def _chunk(self, choices: list, **extra) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _choice(self, index: int, text: str | None, finish: str | None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}

    def role(self, index: int) -> dict:
        return self._chunk([self._choice(index, None, None, role=True)])

    def add(self, index: int, msg: pb.GenerateResponse) -> list[dict]:
        self.tokens += len(msg.token_ids)
        out = []
        if msg.text:
            out.append(self._chunk([self._choice(index, msg.text, None)]))
        if msg.finish_reason:
            self.usages[index] = msg.usage if msg.HasField("usage") else None
            out.append(self._chunk([self._choice(index, None, _finish(msg.finish_reason))]))
        return out

    def usage(self, n: int) -> dict:
        return self._chunk([], usage=usage_of([self.usages.get(i) for i in range(n)], self.tokens))


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
