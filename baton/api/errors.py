"""The request layer's error: which field of a request is wrong and what would be accepted."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request field has an invalid value. ``field`` names it; the message says what is accepted."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def detail(self, prefix: str = "") -> str:
        """'field: message' (the message alone when it already starts with the field), so that a client
        sees which field to fix. ``prefix`` names the enclosing message, e.g. ``"sampling."``."""
        msg = str(self)
        return f"{prefix}{msg}" if msg.startswith(self.field) else f"{prefix}{self.field}: {msg}"


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: what an error message may echo of a client's value
    (a 1 MB field must not come back as a 1 MB error)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
