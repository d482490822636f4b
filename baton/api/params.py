"""What a request asks for: sampling parameters (validated on construction), its priority, and the one
stop rule every place that decides "finished" calls.

This module is the request contract. It imports no torch and nothing of the engine, so the router
validates requests without loading the model stack. Each field's default is written here once: the
engine, the router's proto mapping (``baton.api.proto``) and the CLI's flags all read it from the field.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import numbers
from collections.abc import Collection
from dataclasses import dataclass, field, fields

from baton.api.errors import InvalidRequestError, shown

__all__ = ["Constraint", "FinishReason", "GREEDY_TEMPERATURE_EPS", "Priority", "SamplingParams", "check_stop"]

# Temperatures below this are treated as greedy: dividing logits by them would overflow float32.
GREEDY_TEMPERATURE_EPS = 1e-5
# Seeds are fed to torch.Generator.manual_seed, which takes 64-bit values.
_SEED_LIMIT = 2**64
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows
# Bounds on what a client may ask the detokenizer and the scheduler to check after every token.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# Bounds on a structured-output constraint: what the grammar compiler is asked to read.
MAX_CONSTRAINT_CHARS = 65536  # a schema, a regex or a grammar
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


class Priority(enum.IntEnum):
    """Interactive requests are admitted before batch ones and preempted after them."""

    INTERACTIVE = 0
    BATCH = 1


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class TopLogprobs:
    """The most likely tokens at one step, most likely first, with their log-probs under the raw logits."""

    token_ids: list[int]
    logprobs: list[float]
    token_bytes: list[bytes] = field(default_factory=list)  # from the router; empty inside the engine


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """What the output must be (structured output): the whole generated text, EOS excluded, is

    - ``json_schema``: one JSON value valid under ``value``, a JSON Schema as JSON text;
    - ``json_object``: any JSON object (``value`` empty);
    - ``regex``: a full match of the regular expression ``value``;
    - ``choice``: exactly one of ``choices``;
    - ``grammar``: a sentence of the context-free grammar ``value`` (llguidance's Lark syntax; GBNF,
      recognised by its ``::=`` rules, is converted).

    Only sizes and JSON syntax are checked here; the grammar compiler (``baton.grammar``) checks the
    rest with the tokenizer at hand. The field named in errors is ``constraint.<kind>``.
    """

    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequestError("constraint", f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, "
                                                    f"got {shown(self.kind)}")
        name = self.field
        if not isinstance(self.value, str):
            raise InvalidRequestError(name, f"{name} must be a string, got {shown(self.value)}")
        if len(self.value) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(name, f"{name}: {len(self.value)} characters; at most {MAX_CONSTRAINT_CHARS}")
        if self.kind == "choice":
            choices = self.choices
            if isinstance(choices, list):
                object.__setattr__(self, "choices", choices := tuple(choices))
            if not isinstance(choices, tuple) or not choices:
                raise InvalidRequestError(name, f"{name} must be a non-empty list of strings")
            if len(choices) > MAX_CHOICES:
                raise InvalidRequestError(name, f"{name}: {len(choices)} choices; at most {MAX_CHOICES}")
            for c in choices:
                if not isinstance(c, str) or not c:
                    raise InvalidRequestError(name, f"{name} must hold non-empty strings, got {shown(c)}")
                if len(c) > MAX_CHOICE_CHARS:
                    raise InvalidRequestError(name, f"{name}: a choice of {len(c)} characters; at most "
                                                    f"{MAX_CHOICE_CHARS}")
        elif self.choices:
            raise InvalidRequestError(name, f"{name} takes no choices")
        if self.kind in ("json_schema", "regex", "grammar") and not self.value:
            raise InvalidRequestError(name, f"{name} is empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as e:
                raise InvalidRequestError(name, f"{name} is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(name, f"{name} must be a JSON object, got {shown(schema)}")

    @property
    def field(self) -> str:
        return f"constraint.{self.kind}"

    @property
    def key(self) -> str:
        """A stable hash of the constraint's content: the compiled-grammar cache key."""
        h = hashlib.blake2b(digest_size=16)
        for part in (self.kind, self.value, *self.choices):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _require_int(name: str, value: object, minimum: int) -> int:
    if not _is_int(value):
        raise InvalidRequestError(name, f"{name} must be an integer, got {value!r}")
    result = int(value)  # type: ignore[arg-type]
    if result < minimum:
        raise InvalidRequestError(name, f"{name} must be >= {minimum}, got {result}")
    return result


def _require_float(name: str, value: object, *, low: float, high: float, low_open: bool = False,
                   high_open: bool = False) -> float:
    """Checks that ``value`` is a finite real number in the given interval and returns it as a float."""
    if not _is_number(value):
        raise InvalidRequestError(name, f"{name} must be a number, got {value!r}")
    result = float(value)  # type: ignore[arg-type]
    if not math.isfinite(result):
        raise InvalidRequestError(name, f"{name} must be a finite number, got {result}")
    too_low = result <= low if low_open else result < low
    too_high = result >= high if high_open else result > high
    if too_low or too_high:
        if high == math.inf:
            bound = f"> {low}" if low_open else f">= {low}"
        else:
            bound = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise InvalidRequestError(name, f"{name} must be {bound}, got {result}")
    return result


def _require_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(name, f"{name} must be true or false, got {value!r}")
    return value


def _describe(help: str):
    """A field's one-line help, read by the CLI's flags (``baton generate --help``)."""
    return {"help": help}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Every field is validated on construction.

    ``stop`` accepts a single string or a list/tuple of non-empty strings; ``stop_token_ids`` a list/tuple
    of non-negative ints. Both are stored as tuples, so the params are hashable. Numeric fields accept any
    int/float (not bool) and are stored as ``int``/``float``.

    A new field: add it here (default, help, check in ``__post_init__``), to ``SamplingParams`` in
    protos/baton/v1/generation.proto under the same name, and where the sampler uses it. The proto
    mapping and the CLI flag follow from the field.
    """

    max_tokens: int = field(default=16, metadata=_describe("tokens to generate at most"))
    temperature: float = field(default=1.0, metadata=_describe("0 = greedy"))
    top_p: float = field(default=1.0, metadata=_describe("nucleus sampling: keep the top tokens whose mass "
                                                          "reaches this, in (0, 1]"))
    top_k: int = field(default=0, metadata=_describe("keep the k most likely tokens; 0 = off"))
    min_p: float = field(default=0.0, metadata=_describe("drop tokens below this fraction of the top "
                                                          "token's probability, in [0, 1]"))
    seed: int | None = field(default=None, metadata=_describe("makes sampled output reproducible"))
    stop: tuple[str, ...] = field(default=(), metadata=_describe("stop string (repeatable)"))
    stop_token_ids: tuple[int, ...] = field(default=(), metadata=_describe("stop token id (repeatable)"))
    ignore_eos: bool = field(default=False, metadata=_describe("keep generating after end-of-sequence"))
    repetition_penalty: float = field(default=1.0, metadata=_describe("> 0; 1 = off"))
    presence_penalty: float = field(default=0.0, metadata=_describe("in [-2, 2]"))
    frequency_penalty: float = field(default=0.0, metadata=_describe("in [-2, 2]"))
    logprobs: bool = field(default=False, metadata=_describe("log-probability of each chosen token"))
    top_logprobs: int = field(default=0, metadata=_describe(
        f"also the N most likely tokens at each step with their log-probabilities, 0-{MAX_TOP_LOGPROBS}; "
        "needs logprobs"))
    constraint: Constraint | None = field(default=None, metadata=_describe(
        "structured output: the text must fit a JSON schema, a regex, a choice or a grammar"))
    no_speculation: bool = field(default=False, metadata=_describe(
        "decode without speculative proposals (the output is the same either way; this only changes its pace)"))

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        put("max_tokens", _require_int("max_tokens", self.max_tokens, minimum=1))
        put("temperature", _require_float("temperature", self.temperature, low=0.0, high=math.inf))
        put("top_p", _require_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True))
        put("top_k", _require_int("top_k", self.top_k, minimum=0))
        put("min_p", _require_float("min_p", self.min_p, low=0.0, high=1.0))
        if self.seed is not None:
            if not _is_int(self.seed):
                raise InvalidRequestError("seed", f"seed must be an integer or null, got {self.seed!r}")
            seed = int(self.seed)
            if not 0 <= seed < _SEED_LIMIT:
                raise InvalidRequestError("seed", f"seed must be in [0, 2**64), got {seed}")
            put("seed", seed)
        put("stop", _normalize_stop(self.stop))
        put("stop_token_ids", _normalize_stop_token_ids(self.stop_token_ids))
        put("ignore_eos", _require_bool("ignore_eos", self.ignore_eos))
        put("repetition_penalty", _require_float("repetition_penalty", self.repetition_penalty, low=0.0,
                                                 high=math.inf, low_open=True))
        put("presence_penalty", _require_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0))
        put("frequency_penalty", _require_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0))
        put("logprobs", _require_bool("logprobs", self.logprobs))
        put("top_logprobs", _require_int("top_logprobs", self.top_logprobs, minimum=0))
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidRequestError("top_logprobs", f"top_logprobs must be at most {MAX_TOP_LOGPROBS}, "
                                                      f"got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidRequestError("constraint", f"constraint must be a Constraint, got {shown(self.constraint)}")
        put("no_speculation", _require_bool("no_speculation", self.no_speculation))

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0, or too small to divide by)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _normalize_stop(stop: object) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise InvalidRequestError("stop", f"stop must be a string or a list of strings, got {shown(stop)}")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError("stop", f"stop: {len(stop)} strings; at most {MAX_STOP_STRINGS}")
    for item in stop:
        if not isinstance(item, str):
            raise InvalidRequestError("stop", f"stop must contain only strings, got {shown(item)}")
        if not item:
            raise InvalidRequestError("stop", "stop strings must be non-empty, got ''")
        if len(item) > MAX_STOP_CHARS:
            raise InvalidRequestError("stop", f"stop: a string of {len(item)} characters; at most {MAX_STOP_CHARS}")
    return tuple(stop)


def _normalize_stop_token_ids(ids: object) -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequestError("stop_token_ids", f"stop_token_ids must be a list of integers, got {shown(ids)}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError("stop_token_ids", f"stop_token_ids: {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
    for item in ids:
        if not _is_int(item):
            raise InvalidRequestError("stop_token_ids",
                                      f"stop_token_ids must contain only integers, got {shown(item)}")
        if item < 0:
            raise InvalidRequestError("stop_token_ids", f"stop_token_ids must be >= 0, got {item}")
    return tuple(int(item) for item in ids)


def check_stop(params: SamplingParams, token: int, num_output_tokens: int, num_tokens: int,
               max_model_len: int, eos_token_ids: Collection[int], constraint_done: bool = False
               ) -> FinishReason | None:
    """Whether the token just sampled ends the request: a stop token id or EOS (unless ignored) is
    ``stop``, and so is a constraint whose structure is complete and can take no more text
    (``constraint_done``); ``max_tokens`` outputs or a full context (``num_tokens``, prompt and output,
    reached ``max_model_len``) is ``length``, also inside an unfinished structure. Stop strings are the
    detokenizer's, which sees text. The scheduler calls this after every sampled token and the prefill
    worker for the first one: one rule."""
    if constraint_done or token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        return FinishReason.STOP
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
