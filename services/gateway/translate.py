"""OpenAI bodies -> GenerateRequest, and the router's messages -> OpenAI's responses and SSE chunks.
Pure functions and small classes, no I/O: unit-testable without a server."""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field

from baton.api.errors import shown
from baton.api.params import MAX_STOP_CHARS, MAX_STOP_STRINGS
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
_MAX_USER_CHARS = 256
MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # prompts x n per request; each is one more request for admission and the workers
MAX_TOP_LOGPROBS = 20
_LOWEST_LOGPROB = -9999.0  # JSON has no -Infinity


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
    n: int = 1  # choices per prompt
    logprobs: int | None = None  # None: off; else the alternatives asked for at each token


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


def _model(body: dict, served: list[str]) -> str | None:
    model = body.get("model")
    _check_type(body, "model", (str,), "a string")
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
        into.messages.add(role=m["role"], content=_text_of(m.get("content", ""), f"messages[{i}].content"))


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
        _check_type(body, "logprobs", (bool,), "true or false")
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


def to_generate(body: dict, chat: bool, served: list[str]) -> tuple[list[pb.GenerateRequest], Options]:
    """The GenerateRequests for an OpenAI body, one per prompt (chat has one); raises BadRequest naming the
    field."""
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise BadRequest(f"{name} is not supported by this server", name)
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
    reqs = []
    for p in prompts:
        r = pb.GenerateRequest()
        r.CopyFrom(req)
        if isinstance(p, str):
            r.prompt = p
        elif p is not None:
            r.prompt_token_ids.ids.extend(p)
        reqs.append(r)
    return reqs, Options(model, stream, include_usage, n, logprobs)


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


def _finish(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length"}.get(reason or "", reason or None)


def whole_response(outs: list[Collected], rid: str, created: int, model: str, chat: bool, opts: Options) -> dict:
    choices = []
    for i, out in enumerate(outs):
        if chat:
            logprobs = out.logprobs.chat() if opts.logprobs is not None else None
            choices.append({"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": logprobs,
                            "finish_reason": _finish(out.finish_reason)})
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
        if msg.text or logprobs:
            out.append(self._chunk([self._choice(index, msg.text, None, logprobs=logprobs)]))
        if msg.finish_reason:
            self.usages[index] = msg.usage if msg.HasField("usage") else None
            out.append(self._chunk([self._choice(index, None, _finish(msg.finish_reason))]))
        return out

    def usage(self, choices: int) -> dict:
        return self._chunk([], usage=usage_of([self.usages.get(i) for i in range(choices)], self.tokens, self.opts.n))


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
