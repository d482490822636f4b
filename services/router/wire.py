"""The router's wire: the Generation service's registration (malformed requests refused with the
parser's message), reading a request into prompt ids and resolved sampling parameters, who the client
is, and the statuses the router answers with. No torch, no engine: tests/test_layers.py checks."""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc

from baton import security
from baton.api import InvalidRequestError, SamplingParams, check_prompt_ids
from baton.api.params import MAX_CONSTRAINT_CHARS
from baton.api.prompts import check_message_count, check_request_id
from baton.api.proto import sampling_from_proto
from baton.config import Limits
from baton.grammar import Grammars
from baton.tokenizer import Tokenizer, TokenizerError
from baton.v1 import generation_pb2 as pb
from baton.v1 import generation_pb2_grpc as pbgrpc

SERVICE_NAME = "baton.v1.Generation"
RETRY_PUSHBACK_MS = 500
# A token is rarely more than a few dozen characters: texts far above the prompt limit are refused
# before they are tokenized.
MAX_CHARS_PER_TOKEN = 64
MAX_TOOLS = 128


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int


class Malformed:
    """What a request that does not parse becomes (instead of gRPC's generic INTERNAL error)."""

    def __init__(self, kind: str, error: Exception) -> None:
        self.message = f"the request is not a valid {kind}: {error or type(error).__name__}"


def _lenient(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the client's
            return Malformed(cls.DESCRIPTOR.full_name, e)
    return parse


def refuse_malformed(request, context) -> None:
    if isinstance(request, Malformed):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def add_generation_service(service: pbgrpc.GenerationServicer, server: grpc.Server) -> None:
    """Like the generated ``add_GenerationServicer_to_server``, but a request that does not parse (bad
    wire format, invalid UTF-8 in a string) reaches the servicer as ``Malformed`` and is refused with
    INVALID_ARGUMENT and the parser's message."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            service.Tokenize, request_deserializer=_lenient(pb.TokenizeRequest),
            response_serializer=pb.TokenizeResponse.SerializeToString),
        "Detokenize": grpc.unary_unary_rpc_method_handler(
            service.Detokenize, request_deserializer=_lenient(pb.DetokenizeRequest),
            response_serializer=pb.DetokenizeResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels, request_deserializer=_lenient(pb.ListModelsRequest),
            response_serializer=pb.ListModelsResponse.SerializeToString),
        "LoadAdapter": grpc.unary_unary_rpc_method_handler(
            service.LoadAdapter, request_deserializer=_lenient(pb.LoadAdapterRequest),
            response_serializer=pb.ModelInfo.SerializeToString),
        "UnloadAdapter": grpc.unary_unary_rpc_method_handler(
            service.UnloadAdapter, request_deserializer=_lenient(pb.UnloadAdapterRequest),
            response_serializer=pb.UnloadAdapterResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def exhausted(context, message: str) -> None:
    """RESOURCE_EXHAUSTED with gRPC's retry hint (``grpc-retry-pushback-ms``): try again after a pause."""
    context.set_trailing_metadata((("grpc-retry-pushback-ms", str(RETRY_PUSHBACK_MS)),))
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def client_id(context, gateway_key: str | None = None) -> str:
    """Who is asking: its bearer token's name, else the HTTP client a gateway holding ``gateway_key`` speaks
    for, else the peer's address without its port (``ipv4:127.0.0.1:5555`` -> ``ipv4:127.0.0.1``)."""
    metadata = context.invocation_metadata()
    token = security.bearer(metadata)
    if token:
        return security.token_client_id(token)
    forwarded = security.forwarded_client(metadata, gateway_key)
    if forwarded:
        return forwarded
    peer = context.peer() or "unknown"
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


def remaining(context) -> float | None:
    """The client's remaining deadline for downstream calls; None when it set none (gRPC then
    reports an enormous value, which must not be passed on as a timeout)."""
    r = context.time_remaining()
    return None if r is None or r > 1e7 else max(r, 0.001)


class RequestReader:
    """A Generate or Tokenize request -> prompt ids and resolved sampling parameters, checked against the
    model and the router's limits. Raises InvalidRequestError naming the field."""

    def __init__(self, tokenizer: Tokenizer, model: ModelInfo, limits: Limits) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.limits = limits
        self.defaults = SamplingParams(max_tokens=limits.default_max_tokens)
        self.grammars = Grammars(tokenizer)  # structured output: a bad constraint is refused here

    @property
    def max_prompt_tokens(self) -> int:
        return self.limits.max_prompt_tokens or self.model.max_model_len - 1

    def prompt_ids(self, request) -> list[int]:
        which = request.WhichOneof("input")
        limit = self.max_prompt_tokens
        if which == "prompt" and len(request.prompt) > MAX_CHARS_PER_TOKEN * limit:
            raise InvalidRequestError("prompt", f"prompt: {len(request.prompt)} characters is far above this "
                                      f"server's limit of {limit} prompt tokens")
        if which == "messages":
            check_message_count(len(request.messages.messages))
            chars = sum(len(m.content) + len(m.role) for m in request.messages.messages)
            if chars > MAX_CHARS_PER_TOKEN * limit:
                raise InvalidRequestError("messages", f"messages: {chars} characters is far above this server's "
                                          f"limit of {limit} prompt tokens")
        try:
            if which == "prompt":
                ids = self.tokenizer.encode(request.prompt) if request.prompt else []
            elif which == "messages":
                msgs = [{"role": m.role, "content": m.content} for m in request.messages.messages]
                if not msgs:
                    raise InvalidRequestError("messages", "messages is empty")
                ids = self.tokenizer.encode_chat(msgs, tools=self.tools(request.messages.tools))
            elif which == "prompt_token_ids":
                ids = list(request.prompt_token_ids.ids)
                if not ids:
                    raise InvalidRequestError("prompt_token_ids", "prompt_token_ids is empty")
            else:
                raise InvalidRequestError("input", "set exactly one of prompt, messages or prompt_token_ids")
        except (TokenizerError, ValueError) as e:
            if isinstance(e, InvalidRequestError):
                raise
            raise InvalidRequestError("messages" if which == "messages" else "prompt", str(e)) from e
        ids = check_prompt_ids(ids, self.model.vocab_size, self.model.max_model_len)
        if len(ids) > limit:
            raise InvalidRequestError("prompt", f"prompt has {len(ids)} tokens; this server accepts at most {limit} "
                                      "(--max-prompt-tokens)")
        return ids

    def tools(self, text: str) -> list | None:
        """Messages.tools: a JSON array of tool definitions for the chat template, or None when unset."""
        if not text:
            return None
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError("messages.tools", f"messages.tools: {len(text)} characters; at most "
                                      f"{MAX_CONSTRAINT_CHARS}")
        if not self.tokenizer.chat_tools:
            raise InvalidRequestError("messages.tools", "messages.tools: this model's chat template does not "
                                      "render tools; leave them out (or constrain the answer to a tool's schema)")
        try:
            tools = json.loads(text)
        except ValueError as e:
            raise InvalidRequestError("messages.tools", f"messages.tools is not valid JSON: {e}") from None
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise InvalidRequestError("messages.tools", "messages.tools must be a JSON array of objects")
        if len(tools) > MAX_TOOLS:
            raise InvalidRequestError("messages.tools", f"messages.tools: {len(tools)} tools; at most {MAX_TOOLS}")
        return tools

    def detokenize(self, request) -> tuple[str, list[bytes]]:
        """A Detokenize request -> its text and each token's bytes."""
        ids = list(request.token_ids)
        if len(ids) > self.model.max_model_len:
            raise InvalidRequestError("token_ids", f"token_ids: {len(ids)} ids; at most {self.model.max_model_len} "
                                      "(the model's context) per request")
        bad = [i for i in ids if not 0 <= i < self.tokenizer.vocab_size]
        if bad:
            raise InvalidRequestError("token_ids", f"token_ids: {bad[:5]} are outside the vocabulary "
                                      f"[0, {self.tokenizer.vocab_size})")
        return self.tokenizer.decode(ids), [self.tokenizer.token_bytes(i) for i in ids]

    def label(self, request) -> str:
        """The client's request id: a label only (the stack knows the request by an id of its own)."""
        return check_request_id(request.request_id)

    def sampling(self, request) -> SamplingParams:
        """The request's params with the router's defaults resolved: what the workers receive."""
        try:
            params = sampling_from_proto(request.sampling, self.defaults)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"sampling.{e.field}", e.detail("sampling.")) from e
        if params.max_tokens > self.limits.max_output_tokens:
            raise InvalidRequestError("sampling.max_tokens", f"sampling.max_tokens: {params.max_tokens} is above this "
                                      f"server's limit of {self.limits.max_output_tokens} (--max-output-tokens)")
        return params
