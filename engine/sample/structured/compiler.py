"""Compiles response formats into xgrammar grammars: once per distinct spec, off the step loop.

Contracts:
- `validate_response_format` parses a spec without the tokenizer (milliseconds) and raises
  ValueError carrying the grammar compiler's own message; it runs at request time, in whatever
  process prepares requests (engine/frontend/input_processor.py), before anything is queued.
- `submit` returns a future of the compiled grammar. Equal specs (same `ResponseFormat.key`) share
  one entry of a bounded LRU cache; a miss compiles on the pool's worker thread, never on the
  caller's. A failed compile is not cached.
- The tokenizer info (xgrammar's view of the vocabulary) is built once, lazily, on the worker
  thread, the first time a grammar is compiled. xgrammar (and torch) are imported on first use
  (xgrammar takes seconds), so engines that never see a structured request never pay for it, and
  torch-free processes (the CLI, the replica agent) can import this module.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.sample.structured.spec import ResponseFormat
from engine.stats import GrammarCacheStats

if TYPE_CHECKING:
    import numpy as np
    import xgrammar as xgr

_JSON_OBJECT_SCHEMA = '{"type": "object"}'
_JSON_KINDS = ("json_schema", "json_object")
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " (and sometimes a failed
# check's text); the caller wants the message after it.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def compiler_message(exc: BaseException) -> str:
    """The grammar compiler's own message, without xgrammar's source location prefix."""
    return _CPP_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__


def validate_response_format(fmt: ResponseFormat) -> None:
    """Raises ValueError with the compiler's message when `fmt` does not parse."""
    import xgrammar as xgr

    try:
        if fmt.kind == "json_schema":
            xgr.Grammar.from_json_schema(fmt.spec)
        elif fmt.kind == "regex":
            xgr.Grammar.from_regex(fmt.spec)
        elif fmt.kind == "grammar":
            xgr.Grammar.from_ebnf(fmt.spec)
        elif fmt.kind == "choice":
            xgr.Grammar.from_ebnf(fmt.ebnf_for_choice())
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError from its C++ core
        raise ValueError(f"invalid {fmt.kind}: {compiler_message(exc)}") from exc


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled response format (engine side only)."""

    compiled: xgr.CompiledGrammar
    token_filter: np.ndarray | None
    """[W] int32 packed mask ANDed into each step's row, or None. JSON formats ban tokens holding
    raw control bytes (< 0x20): JSON forbids them in strings, but xgrammar's string rule lets
    them through (seen with byte-level BPE vocabularies, whose 256 byte tokens include them)."""


class GrammarCompilerPool:
    """Per-engine grammar compiler, cache and worker thread."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        *,
        cache_size: int = 256,
        max_threads: int = 1,
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"grammar cache_size must be >= 1, got {cache_size}")
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.cache_size = cache_size
        self._max_threads = max_threads
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future[Grammar]] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self._compiler: xgr.GrammarCompiler | None = None
        """Built on the worker thread only."""
        self._json_filter: np.ndarray | None = None
        self._stats = GrammarCacheStats()

    def submit(self, fmt: ResponseFormat) -> Future[Grammar]:
        """The compiled grammar of `fmt`: a cached future, or a new compile on the worker."""
        key = fmt.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self._stats.hits += 1
                return fut
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="deja-grammar")
            fut = self._executor.submit(self._compile, fmt)
            self._cache[key] = fut
            self._stats.compiles += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f: self._drop_failed(key, f))
        return fut

    def _drop_failed(self, key: str, fut: Future[Grammar]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]

    # -- worker thread -------------------------------------------------------------------------
    def _compile(self, fmt: ResponseFormat) -> Grammar:
        start = time.perf_counter()
        compiler = self._get_compiler()
        try:
            # NOTE: compact JSON (no free whitespace): with free whitespace, small models
            # often emit newlines until max_tokens. Output is `{"a": 1, "b": [2, 3]}`.
            if fmt.kind == "json_schema":
                compiled = compiler.compile_json_schema(fmt.spec, any_whitespace=False)
            elif fmt.kind == "json_object":
                compiled = compiler.compile_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=False)
            elif fmt.kind == "regex":
                compiled = compiler.compile_regex(fmt.spec)
            elif fmt.kind == "grammar":
                compiled = compiler.compile_grammar(fmt.spec)
            else:
                compiled = compiler.compile_grammar(fmt.ebnf_for_choice())
        except Exception as exc:
            raise ValueError(f"invalid {fmt.kind}: {compiler_message(exc)}") from exc
        with self._lock:
            self._stats.compile_seconds += time.perf_counter() - start
        return Grammar(compiled, self._json_filter if fmt.kind in _JSON_KINDS else None)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            import numpy as np
            import xgrammar as xgr

            from engine.sample.structured.bitmask import pack_allowed

            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=list(self.stop_token_ids),
            )
            stops = set(self.stop_token_ids)
            allowed = np.ones(self.vocab_size, dtype=bool)  # ids past the tokenizer's: True
            for i, t in enumerate(info.decoded_vocab[: self.vocab_size]):
                allowed[i] = i in stops or not any(b < 0x20 for b in bytes(t))
            self._json_filter = pack_allowed(allowed)
            # NOTE: xgrammar keeps its own cache too; ours decides lifetime and is the one counted.
            self._compiler = xgr.GrammarCompiler(
                info, max_threads=self._max_threads, cache_enabled=False
            )
        return self._compiler

    # -- matchers and lifetime -----------------------------------------------------------------
    @staticmethod
    def new_matcher(grammar: Grammar) -> xgr.GrammarMatcher:
        """A fresh matcher at the grammar's start (one per sample)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(grammar.compiled)

    def stats(self) -> GrammarCacheStats:
        with self._lock:
            s = self._stats
            return GrammarCacheStats(len(self._cache), s.hits, s.compiles, s.compile_seconds)

    def close(self) -> None:
        """Stops the worker; queued compiles are cancelled."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
