"""Command-line flags derived from the config fields (baton/config.py): the flag, its default and its
help come from the field that declares ``flag=`` in its ``setting``, so a default is written once."""

from __future__ import annotations

import argparse
import typing
from dataclasses import fields
from typing import Any

_NONE = type(None)


def _flag_name(f) -> str:
    flag = f.metadata["flag"]
    return flag if isinstance(flag, str) else "--" + f.name.replace("_", "-")


def _value_type(cls: type, f) -> type:
    """int, float, str or bool for a field annotated ``int``, ``float | None``, ..."""
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not _NONE] or [hint]
    return args[0]


def _repeated(cls: type, f) -> bool:
    return typing.get_origin(typing.get_type_hints(cls)[f.name]) is tuple


def flag_fields(cls: type) -> list:
    return [f for f in fields(cls) if f.metadata.get("flag")]


def add_flags(parser: argparse.ArgumentParser | Any, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag for each of ``cls``'s fields that declares one (less ``skip``)."""
    for f in flag_fields(cls):
        if f.name in skip:
            continue
        meta, name = f.metadata, _flag_name(f)
        kind = _value_type(cls, f)
        dest = f"{cls.__name__}.{f.name}"
        if _repeated(cls, f):  # tuple[str, ...]: the flag once per value
            parser.add_argument(name, dest=dest, action="append", default=None, metavar=meta["metavar"],
                                help=meta["help"])
            continue
        if kind is bool:  # a switch that turns the default around
            action = "store_false" if f.default else "store_true"
            parser.add_argument(name, dest=dest, action=action, help=meta["help"])
            continue
        default = f.default
        if default is None:
            default = meta["off"]
        elif meta["scale"] != 1:
            default = default / meta["scale"]
        shown = "" if default is None else f" (default {default:g})" if isinstance(default, float) else \
            f" (default {default})"
        metavar = meta["metavar"] or (None if meta["choices"] else name.removeprefix("--").upper().replace("-", "_"))
        parser.add_argument(name, dest=dest, type=float if meta["scale"] != 1 else kind, default=default,
                            choices=meta["choices"], metavar=metavar, help=meta["help"] + shown)


def from_flags(cls: type, args: argparse.Namespace, **values: Any) -> dict[str, Any]:
    """The keyword arguments of ``cls`` that its flags set (with ``values`` on top)."""
    kwargs: dict[str, Any] = {}
    for f in flag_fields(cls):
        dest = f"{cls.__name__}.{f.name}"
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        meta = f.metadata
        if _repeated(cls, f):
            if value is not None:
                kwargs[f.name] = tuple(value)
            continue
        if value is not None and meta["off"] is not None and value == meta["off"]:
            value = None
        elif value is not None and meta["scale"] != 1:
            value = value * meta["scale"]
            if _value_type(cls, f) is int:
                value = int(value)
        kwargs[f.name] = value
    return {**kwargs, **values}
