"""What the engine hands back: offline outputs and streamed deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    """Top-k (token id, logprob) pairs, best first; empty when logprobs=0."""


@dataclass(slots=True)
class CachedTokens:
    """Prompt tokens served from the prefix cache, split by tier."""

    device: int = 0
    cpu: int = 0
    disk: int = 0
    remote: int = 0
    """Served by the tier shared by every replica (loaded from another replica's work)."""

    @property
    def total(self) -> int:
        return self.device + self.cpu + self.disk + self.remote


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic()) of one request's life."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_spec_steps: int = 0
    """Steps that verified a proposal for one of its samples (speculative decoding)."""
    num_draft_tokens: int = 0
    """Tokens proposed for its samples."""
    num_accepted_tokens: int = 0
    """Of those, the tokens accepted."""

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n samples. In a streamed delta, text/token_ids/logprobs are new only."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    """stop, length, abort or error; None while running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the sample, if any."""
    cumulative_logprob: float | None = None
    """Sum of its tokens' logprobs, on its last delta: beam search, best_of, or with logprobs."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """One request's state. `LLM.generate` returns it cumulative; `AsyncEngine` streams deltas."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    cached_tokens: CachedTokens = field(default_factory=CachedTokens)
    metrics: RequestMetrics | None = None
    error: str | None = None
    """Why the request failed (finish_reason "error")."""
    pinned: bool | None = None
    """For requests with pin_ttl_s: whether the prefix could be pinned (False: over the cap)."""

    # Shortcuts to the first sample (what most callers with n=1 want).
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by `later` (the next delta of the same request) as one delta, in
        place: each sample's text, tokens and logprobs appended, the rest taken from `later`.
        Streams merge the deltas a slow reader has not taken yet (as vLLM's
        RequestOutputCollector does), so a reader that falls behind gets fewer, larger messages;
        `LLM.generate` adds up a request's deltas with it.

        NOTE: this delta's lists grow in place; a sample new in `later` is taken over as it is.
        """
        by_index = {c.index: c for c in self.outputs}
        for c in later.outputs:
            mine = by_index.get(c.index)
            if mine is None:
                self.outputs.append(c)
                by_index[c.index] = c
                continue
            mine.text += c.text
            mine.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                if mine.logprobs is None:
                    mine.logprobs = []
                mine.logprobs.extend(c.logprobs)
            mine.finish_reason = c.finish_reason
            mine.stop_reason = c.stop_reason
            mine.cumulative_logprob = c.cumulative_logprob
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.cached_tokens = later.cached_tokens
        self.metrics = later.metrics
        self.error = later.error
        self.pinned = later.pinned
        return self
