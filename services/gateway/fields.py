"""What every part of the gateway's body checks share: the refusal, naming the field, and a type check."""

from __future__ import annotations

import json


class BadRequest(ValueError):
    """A body Baton refuses: ``param`` names the field; ``status`` 400, 404 (unknown model) or 413."""

    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def check_type(body: dict, name: str, kinds: tuple, what: str) -> None:
    value = body.get(name)
    if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds):
        raise BadRequest(f"{name} must be {what}, got {json.dumps(value)[:80]}", name)
