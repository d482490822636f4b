"""Proto <-> request-layer values, derived from the dataclass fields: a new sampling field needs no
edit here as long as the proto field carries the same name."""

from __future__ import annotations

from dataclasses import MISSING, fields

from baton.api.errors import InvalidRequestError
from baton.api.params import Constraint, Priority, SamplingParams, TopLogprobs
from baton.v1 import generation_pb2 as pb

_FIELDS = fields(SamplingParams)
_PROTO_FIELDS = pb.SamplingParams.DESCRIPTOR.fields_by_name


def _default(f):
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]


def sampling_from_proto(sp: pb.SamplingParams, defaults: SamplingParams | None = None) -> SamplingParams:
    """Proto -> SamplingParams; unset fields take ``defaults``' values (the dataclass defaults when None).
    Raises InvalidRequestError naming the field."""
    kwargs = {}
    for f in _FIELDS:
        pf = _PROTO_FIELDS[f.name]
        if f.name == "constraint":  # a message: never a router default
            kwargs[f.name] = constraint_from_proto(sp.constraint) if sp.HasField("constraint") else None
            continue
        if pf.is_repeated:
            value = tuple(getattr(sp, f.name))
            unset = not value
        elif pf.has_presence:
            unset = not sp.HasField(f.name)
            value = None if unset else getattr(sp, f.name)
        else:  # a plain proto3 scalar: its zero value means "not asked for"
            value = getattr(sp, f.name)
            unset = not value
        kwargs[f.name] = (getattr(defaults, f.name) if defaults is not None else _default(f)) if unset else value
    return SamplingParams(**kwargs)


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """Every field set explicitly: what the router sends the workers, resolved, so no worker defaults."""
    sp = pb.SamplingParams()
    for f in _FIELDS:
        value = getattr(params, f.name)
        if value is None:
            continue
        if isinstance(value, Constraint):
            sp.constraint.CopyFrom(constraint_to_proto(value))
        elif isinstance(value, tuple):
            getattr(sp, f.name).extend(value)
        else:
            setattr(sp, f.name, value)
    return sp


def constraint_from_proto(c: pb.Constraint) -> Constraint | None:
    """None when no kind is set (an empty message asks for nothing)."""
    kind = c.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return Constraint(kind, choices=tuple(c.choice.choices))
    if kind == "json_object":
        if not c.json_object:
            return None
        return Constraint(kind)
    return Constraint(kind, getattr(c, kind))


def constraint_to_proto(c: Constraint) -> pb.Constraint:
    if c.kind == "choice":
        return pb.Constraint(choice=pb.Choices(choices=c.choices))
    if c.kind == "json_object":
        return pb.Constraint(json_object=True)
    return pb.Constraint(**{c.kind: c.value})


def resolved_sampling(sp: pb.SamplingParams) -> SamplingParams:
    """A worker's view of the params the router resolved: every field with a default must be present
    (a missing one is the router's bug, refused rather than filled with a default of the worker's)."""
    for f in _FIELDS:
        pf = _PROTO_FIELDS[f.name]
        if pf.has_presence and _default(f) is not None and not sp.HasField(f.name) and f.name != "constraint":
            raise InvalidRequestError(f.name, f"{f.name} was not resolved by the router")
    return sampling_from_proto(sp)


def priority_from_proto(value: int) -> Priority:
    """Batch only when asked; unspecified and unknown values are interactive."""
    return Priority.BATCH if value == pb.PRIORITY_BATCH else Priority.INTERACTIVE


def priority_to_proto(priority: Priority) -> int:
    return pb.PRIORITY_BATCH if priority == Priority.BATCH else pb.PRIORITY_INTERACTIVE


def top_logprobs_to_proto(top: TopLogprobs) -> pb.TopLogprobs:
    return pb.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs)


def top_logprobs_from_proto(top: pb.TopLogprobs) -> TopLogprobs:
    return TopLogprobs(list(top.token_ids), list(top.logprobs), list(top.token_bytes))
