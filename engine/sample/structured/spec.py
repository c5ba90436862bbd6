"""What a request asks its output to conform to (picklable; no compiled state lives here).

A `ResponseFormat` is plain data: it crosses process boundaries inside `SamplingParams`. The engine
turns it into a compiled grammar (engine/sample/structured/compiler.py) and one matcher per sample.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

RESPONSE_FORMAT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """One constraint on the generated text.

    kind:
      json_schema  `spec` is a JSON Schema document (JSON text); the output is one JSON value
                   that validates against it.
      json_object  any JSON object (`spec` is empty).
      regex        `spec` is a regular expression the whole output must match.
      grammar      `spec` is an EBNF grammar in xgrammar's (GBNF-like) syntax; start rule `root`.
      choice       the output is exactly one of `choices`.
    """

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in RESPONSE_FORMAT_KINDS:
            raise ValueError(
                f"response_format kind must be one of {RESPONSE_FORMAT_KINDS}, got {self.kind!r}"
            )
        if self.kind == "choice":
            if not self.choices:
                raise ValueError("response_format choice needs at least one choice")
            if any(not c for c in self.choices):
                raise ValueError("response_format choices must not be empty strings")
            if self.spec:
                raise ValueError("response_format choice takes choices, not a spec")
        elif self.choices:
            raise ValueError(f"response_format {self.kind} takes a spec, not choices")
        elif self.kind == "json_object":
            if self.spec:
                raise ValueError("response_format json_object takes no spec")
        elif not self.spec:
            raise ValueError(f"response_format {self.kind} needs a non-empty spec")

    # -- constructors --------------------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: str | dict[str, Any] | type) -> ResponseFormat:
        """From JSON text, a dict, or a pydantic model class (its `model_json_schema()`)."""
        if isinstance(schema, type):
            to_schema = getattr(schema, "model_json_schema", None)
            if to_schema is None:
                raise TypeError(f"{schema.__name__} is not a pydantic model class")
            schema = to_schema()
        if isinstance(schema, dict):
            schema = json.dumps(schema, sort_keys=True)
        if not isinstance(schema, str):
            raise TypeError(f"a JSON schema is a str, dict or pydantic class, got {type(schema)}")
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> ResponseFormat:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> ResponseFormat:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, ebnf: str) -> ResponseFormat:
        return cls("grammar", ebnf)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> ResponseFormat:
        return cls("choice", choices=tuple(choices))

    # -- identity ------------------------------------------------------------------------------
    @property
    def key(self) -> str:
        """Hash of the spec: equal formats share one compiled grammar."""
        payload = json.dumps([self.kind, self.spec, list(self.choices)], ensure_ascii=False)
        return hashlib.sha256(payload.encode()).hexdigest()

    def ebnf_for_choice(self) -> str:
        """The grammar of a choice format: `root ::= "a" | "b" | ...`.

        JSON string escapes are what xgrammar's EBNF string literals take.
        """
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choices)
