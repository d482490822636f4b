from baton.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    priority: _generation_pb2.Priority
    adapter: Adapter
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[_generation_pb2.Priority, str]] = ..., adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "path", "content_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    content_id: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., content_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "first_logprob", "finish_reason", "cached_prompt_tokens", "kv_bytes", "sampler_state", "worker", "first_top_logprobs", "adapters")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_STATE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    first_logprob: float
    finish_reason: str
    cached_prompt_tokens: int
    kv_bytes: int
    sampler_state: bytes
    worker: str
    first_top_logprobs: _generation_pb2.TopLogprobs
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, first_token: _Optional[int] = ..., first_logprob: _Optional[float] = ..., finish_reason: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., sampler_state: _Optional[bytes] = ..., worker: _Optional[str] = ..., first_top_logprobs: _Optional[_Union[_generation_pb2.TopLogprobs, _Mapping]] = ..., adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token", "first_logprob", "sampling", "prefill_worker", "sampler_state", "cached_prompt_tokens", "priority", "first_top_logprobs", "adapter", "generated_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_STATE_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    first_logprob: float
    sampling: _generation_pb2.SamplingParams
    prefill_worker: str
    sampler_state: bytes
    cached_prompt_tokens: int
    priority: _generation_pb2.Priority
    first_top_logprobs: _generation_pb2.TopLogprobs
    adapter: Adapter
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., first_logprob: _Optional[float] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., prefill_worker: _Optional[str] = ..., sampler_state: _Optional[bytes] = ..., cached_prompt_tokens: _Optional[int] = ..., priority: _Optional[_Union[_generation_pb2.Priority, str]] = ..., first_top_logprobs: _Optional[_Union[_generation_pb2.TopLogprobs, _Mapping]] = ..., adapter: _Optional[_Union[Adapter, _Mapping]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
