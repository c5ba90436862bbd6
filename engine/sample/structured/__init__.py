"""Structured outputs: JSON schema, JSON object, regex, EBNF grammar and choice, on xgrammar.

spec.py      ResponseFormat, the picklable request-side description.
compiler.py  GrammarCompilerPool: validation, a bounded compile cache, a worker thread.
bitmask.py   The batch's token bitmask, filled from the matchers and applied in one op.
"""

from __future__ import annotations

from engine.sample.structured.spec import RESPONSE_FORMAT_KINDS, ResponseFormat

__all__ = ["RESPONSE_FORMAT_KINDS", "ResponseFormat"]
