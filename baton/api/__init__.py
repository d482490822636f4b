"""The request layer: what a request is and how it is checked, without torch or the engine.

- ``params``: SamplingParams (validated), Priority, FinishReason, TopLogprobs, the stop rule ``check_stop``.
- ``errors``: InvalidRequestError, which names the field to fix.
- ``prompts``: the prompt checks the router and the engine share.
- ``proto``: proto <-> params, derived from the dataclass fields.
- ``client``: the gRPC client of ``baton serve``.
"""

from __future__ import annotations

from baton.api.errors import InvalidRequestError
from baton.api.params import FinishReason, Priority, SamplingParams, TopLogprobs, check_stop
from baton.api.prompts import check_prompt_ids

__all__ = ["FinishReason", "InvalidRequestError", "Priority", "SamplingParams", "TopLogprobs", "check_prompt_ids",
           "check_stop"]
