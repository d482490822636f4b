"""Ten JSON schemas that cover what structured-output users ask for: nested objects, arrays with bounds,
enums, integers and numbers with ranges, required and optional fields, string patterns and ``anyOf``.
The structured-output tests and ``benchmarks/structured_output.py`` both use them. Strings and arrays
are bounded, so every schema has a finite longest answer."""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "maxLength": 24}

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": _NAME,
                               "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"}},
                "required": ["name", "email"],
                "additionalProperties": False,
            },
            "address": {
                "type": "object",
                "properties": {"city": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["user", "address"],
        "additionalProperties": False,
    },
    "tags": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "minItems": 1, "maxItems": 4}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "ranges": {
        "type": "object",
        "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                       "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                       "floor": {"type": "integer", "minimum": -3, "maximum": 12}},
        "required": ["temperature", "humidity", "floor"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {"title": _NAME, "subtitle": _NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
                       "draft": {"type": "boolean"}},
        "required": ["title"],
        "additionalProperties": False,
    },
    "patterns": {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"},
                       "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
        "required": ["phone", "code"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {"result": {"anyOf": [
            {"type": "object", "properties": {"ok": {"const": True}, "value": {"type": "integer", "minimum": 0,
                                                                              "maximum": 999}},
             "required": ["ok", "value"], "additionalProperties": False},
            {"type": "object", "properties": {"error": {"type": "string", "maxLength": 30}},
             "required": ["error"], "additionalProperties": False},
        ]}},
        "required": ["result"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"],
            "additionalProperties": False,
        }}, "express": {"type": "boolean"}},
        "required": ["items", "express"],
        "additionalProperties": False,
    },
    "matrix": {
        "type": "object",
        "properties": {"rows": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "integer", "minimum": -9, "maximum": 9}}},
            "label": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]}},
        "required": ["rows", "label"],
        "additionalProperties": False,
    },
}
