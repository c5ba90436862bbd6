"""Shared cases for structured-output tests: ten JSON schemas, a regex, a choice."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

# Strings are bounded (maxLength / patterns) so that a random tiny model can finish too.
SCHEMAS: list[dict[str, Any]] = [
    # 1. flat object, bounded integer
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    # 2. enum
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    # 3. nested object
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 10}},
                        "required": ["city"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    # 4. array of integers with bounded length
    {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "minItems": 1,
                "maxItems": 4,
            }
        },
        "required": ["scores"],
        "additionalProperties": False,
    },
    # 5. pattern strings
    {
        "type": "object",
        "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        },
        "required": ["zip", "code"],
        "additionalProperties": False,
    },
    # 6. optional fields (only one required)
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 10},
            "subtitle": {"type": "string", "maxLength": 10},
            "pages": {"type": "integer", "minimum": 1, "maximum": 999},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    # 7. booleans and a bounded number
    {
        "type": "object",
        "properties": {
            "active": {"type": "boolean"},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["active", "ratio"],
        "additionalProperties": False,
    },
    # 8. array of objects with an enum
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[a-z]{3}$"},
                        "size": {"enum": ["S", "M", "L"]},
                    },
                    "required": ["sku", "size"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    # 9. top-level enum of strings and a null
    {"enum": ["yes", "no", None]},
    # 10. $defs reference and an array of enums
    {
        "$defs": {"tag": {"enum": ["a", "b", "c"]}},
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
            "level": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["tags", "level"],
        "additionalProperties": False,
    },
]

REGEX = r"[A-Z][a-z]{2,6} [0-9]{1,3}"
CHOICES = ["positive", "negative", "neutral"]


def check_json(text: str, schema: dict[str, Any]) -> None:
    """Raises unless `text` is one JSON value valid under `schema`."""
    jsonschema.validate(json.loads(text), schema)


def check_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def prompt_for(schema: dict[str, Any]) -> str:
    return f"Reply with JSON matching this schema: {json.dumps(schema)}\n"
