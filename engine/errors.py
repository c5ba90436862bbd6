"""Errors the engine raises to its callers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The step loop failed; no request can make progress until the engine is rebuilt."""


class StreamOverflowError(RuntimeError):
    """A stream's reader fell too far behind; the request was aborted and its blocks freed."""
