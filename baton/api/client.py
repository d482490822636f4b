"""The client of ``baton serve``'s gRPC API: one channel (TLS when given a CA), the bearer token, and
calls that stream or collect. ``baton generate --server``, ``baton bench``, the benchmarks and the tests
all use it."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import grpc

from baton.api.params import SamplingParams, TopLogprobs
from baton.api.proto import sampling_to_proto, top_logprobs_from_proto
from baton.v1 import generation_pb2 as pb
from baton.v1 import generation_pb2_grpc as pbgrpc


def client_channel(address: str, tls_ca: str | None = None, options: list | None = None) -> grpc.Channel:
    """A channel to ``baton serve``: TLS when a CA file is given (the server's certificate or its CA)."""
    if tls_ca:
        with open(tls_ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        return grpc.secure_channel(address, creds, options=options)
    return grpc.insecure_channel(address, options=options)


def auth_metadata(token: str | None) -> list[tuple[str, str]]:
    """The bearer token as gRPC metadata; ``BATON_TOKEN`` when none is given."""
    token = token or os.environ.get("BATON_TOKEN")
    return [("authorization", f"Bearer {token}")] if token else []


def generate_request(prompt: str | None = None, *, messages: list[Mapping[str, str]] | None = None,
                     prompt_token_ids: list[int] | None = None,
                     sampling: SamplingParams | pb.SamplingParams | Mapping | None = None,
                     request_id: str = "", priority: int = pb.PRIORITY_UNSPECIFIED,
                     adapter: str = "") -> pb.GenerateRequest:
    """A GenerateRequest from plain values: exactly one of prompt, messages or prompt_token_ids. A mapping
    for ``sampling`` sets only the fields it names (the server's defaults fill the rest). adapter: a LoRA
    adapter's name (empty: the base model)."""
    if isinstance(sampling, SamplingParams):
        sp = sampling_to_proto(sampling)
    elif isinstance(sampling, Mapping):
        sp = pb.SamplingParams(**sampling)
    else:
        sp = sampling
    req = pb.GenerateRequest(request_id=request_id, sampling=sp, priority=priority, adapter=adapter)
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:
        req.messages.CopyFrom(pb.Messages(messages=[pb.ChatMessage(role=m["role"], content=m["content"])
                                                    for m in messages]))
    elif prompt_token_ids is not None:
        req.prompt_token_ids.CopyFrom(pb.TokenIds(ids=prompt_token_ids))
    return req


@dataclass
class Completion:
    """A whole answer, joined from the stream."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: pb.Usage | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    token_bytes: list[bytes] = field(default_factory=list)  # with logprobs: each token's bytes
    request_id: str = ""
    messages: int = 0  # stream messages received

    def add(self, msg: pb.GenerateResponse) -> None:
        self.request_id = self.request_id or msg.request_id
        self.token_ids += msg.token_ids
        self.text += msg.text
        self.logprobs += msg.logprobs
        self.top_logprobs += [top_logprobs_from_proto(t) for t in msg.top_logprobs]
        self.token_bytes += msg.token_bytes
        self.messages += 1
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
        if msg.HasField("usage"):
            self.usage = msg.usage


class Client:
    """``with Client("127.0.0.1:50051") as c: print(c.complete(generate_request("Hi")).text)``."""

    def __init__(self, address: str | None = None, *, tls_ca: str | None = None, token: str | None = None,
                 channel: grpc.Channel | None = None, options: list | None = None) -> None:
        """Give an address (the client owns its channel) or an open ``channel`` (the caller's)."""
        if (address is None) == (channel is None):
            raise ValueError("give an address or a channel")
        self._owns_channel = channel is None
        self.channel = channel if channel is not None else client_channel(address, tls_ca, options)
        self.stub = pbgrpc.GenerationStub(self.channel)
        self.metadata = auth_metadata(token)

    def stream(self, request: pb.GenerateRequest, timeout: float | None = None,
               metadata: list[tuple[str, str]] | None = None):
        """The Generate call itself: an iterator of GenerateResponse that can also be cancelled
        (``.cancel()``); raises grpc.RpcError with the server's status."""
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata + list(metadata or ()))

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None,
                 metadata: list[tuple[str, str]] | None = None) -> Iterator[pb.GenerateResponse]:
        yield from self.stream(request, timeout, metadata)

    def complete(self, request: pb.GenerateRequest, timeout: float | None = None,
                 metadata: list[tuple[str, str]] | None = None) -> Completion:
        out = Completion()
        for msg in self.stream(request, timeout, metadata):
            out.add(msg)
        return out

    def tokenize(self, prompt: str | None = None, *, messages: list[Mapping[str, str]] | None = None,
                 timeout: float | None = None) -> list[int]:
        req = pb.TokenizeRequest()
        if messages is not None:
            req.messages.CopyFrom(generate_request(messages=messages).messages)
        else:
            req.prompt = prompt or ""
        return list(self.stub.Tokenize(req, timeout=timeout, metadata=self.metadata).token_ids)

    def detokenize(self, token_ids: list[int], timeout: float | None = None) -> pb.DetokenizeResponse:
        """The text for ``token_ids`` and each token's bytes."""
        return self.stub.Detokenize(pb.DetokenizeRequest(token_ids=token_ids), timeout=timeout,
                                    metadata=self.metadata)

    def list_models(self, timeout: float | None = None) -> list[pb.ModelInfo]:
        return list(self.stub.ListModels(pb.ListModelsRequest(), timeout=timeout, metadata=self.metadata).models)

    def load_adapter(self, name: str, path: str, timeout: float | None = None) -> pb.ModelInfo:
        """List a LoRA adapter (a PEFT folder under the server's --lora-root) under ``name``."""
        return self.stub.LoadAdapter(pb.LoadAdapterRequest(name=name, path=path), timeout=timeout,
                                     metadata=self.metadata)

    def unload_adapter(self, name: str, timeout: float | None = None) -> bool:
        return self.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=timeout,
                                       metadata=self.metadata).unloaded

    def close(self) -> None:
        if self._owns_channel:
            self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
