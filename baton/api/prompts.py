"""Checks every entry point applies to a prompt, in one place: the router before it routes, the engine
before it queues."""

from __future__ import annotations

from collections.abc import Iterable

from baton.api.errors import InvalidRequestError


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
