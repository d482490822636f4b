"""Checks every entry point applies to a prompt, in one place: the router before it routes, the engine
before it queues; and the bounds on the other things a client names (its request id, its messages)."""

from __future__ import annotations

from collections.abc import Iterable

from baton.api.errors import InvalidRequestError

MAX_REQUEST_ID_CHARS = 128
MAX_MESSAGES = 1024


def check_request_id(request_id: str) -> str:
    """A client's request id is a label it reads back (on the first response message, in logs and traces),
    never a key: at most MAX_REQUEST_ID_CHARS printable characters."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"request_id has {len(request_id)} characters; at most "
                                  f"{MAX_REQUEST_ID_CHARS}")
    if not request_id.isprintable():
        raise InvalidRequestError("request_id", "request_id must be printable characters (no control characters "
                                  "or line breaks)")
    return request_id


def check_message_count(count: int) -> None:
    if count > MAX_MESSAGES:
        raise InvalidRequestError("messages", f"messages: {count} messages; at most {MAX_MESSAGES}")


def check_prompt_ids(prompt_token_ids: Iterable[int], vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt as a list, or InvalidRequestError naming the field: empty, an id outside the
    vocabulary, or no room in the context for at least one new token."""
    ids = list(prompt_token_ids)
    if not ids:
        raise InvalidRequestError("prompt", "prompt is empty")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(
            "prompt", f"prompt has {len(ids)} tokens but the context holds {max_model_len} "
            "(prompt plus at least one new token); shorten the prompt")
    return ids
