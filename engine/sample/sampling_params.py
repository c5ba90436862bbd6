"""Per-request sampling parameters (the vLLM names and meanings)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from engine.sample.structured.spec import ResponseFormat


def apply_defaults(
    params: SamplingParams, unset: Iterable[str], defaults: Mapping[str, float]
) -> SamplingParams:
    """Sets each field named in `unset` (what the request left unset) that `defaults` holds (the
    model's generation_config.json settings, ModelInfo.sampling_defaults); returns `params`."""
    for name in unset:
        if name in defaults:
            value = defaults[name]
            setattr(params, name, int(value) if name == "top_k" else float(value))
    return params


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    """Parallel samples of one prompt; they share the prompt's KV blocks."""
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = 0
    """0 (or -1) keeps every token."""
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    """> 1 discourages tokens seen in the prompt or output (divides positive logits)."""
    presence_penalty: float = 0.0
    """Subtracted once from tokens already generated."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence of tokens already generated."""
    seed: int | None = None
    """Same seed, same output, whatever else is in the batch."""
    max_tokens: int | None = 16
    """None: up to max_model_len."""
    min_tokens: int = 0
    """EOS and stop token ids are suppressed until this many tokens exist. With a response_format
    the grammar wins: a sample whose output is complete ends there (see response_format)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; matched across token boundaries and left out of the text."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: no logprobs; k >= 0: the chosen token's logprob plus the top k."""
    skip_special_tokens: bool = True
    pin_ttl_s: float = 0.0
    """Keep this prompt's prefix blocks out of eviction for this long (0: no pin)."""
    response_format: ResponseFormat | None = None
    """Constrain the output to a JSON schema, JSON object, regex, grammar or choice. EOS is
    allowed exactly when the grammar accepts; an output cut by max_tokens ends with "length" and
    holds the partial (invalid) text; when the grammar ends, the sample stops (even with
    ignore_eos). min_tokens applies while the grammar can go on: once the output is complete and
    the grammar allows only its end, the sample stops ("stop") even below min_tokens. A choice
    format rejects a min_tokens above its longest choice's UTF-8 bytes (it can never be met)."""
    best_of: int | None = None
    """Sampling: draw best_of samples and return the n with the highest cumulative logprob (None:
    n). Beam search: the beam width (None: n)."""
    use_beam_search: bool = False
    """Beam search as transformers' generate(num_beams=beam_width, do_sample=False): deterministic
    (temperature 0), returns the n best finished beams, best first, each with its
    cumulative_logprob. Needs the default top_k/top_p/min_p and penalties, no stop strings,
    logprobs or response_format; outputs arrive in one message when the search ends."""
    length_penalty: float = 1.0
    """Beam search: a finished beam scores cumulative_logprob / generated_tokens ** length_penalty
    (transformers' rule; > 0 favours longer outputs)."""
    early_stopping: bool | str = False
    """Beam search: True stops as soon as beam_width beams have finished; False stops when the
    best running beam, at its current length, cannot beat the worst finished one; "never" only
    when no running beam could beat it at any length up to max_tokens (transformers' meanings)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def beam_width(self) -> int:
        """Beams kept per step (beam search only)."""
        return self.best_of or self.n

    @property
    def num_samples(self) -> int:
        """Sequences sampled from the prompt: best_of (or n); 1 for beam search, which forks."""
        return 1 if self.use_beam_search else (self.best_of or self.n)

    @property
    def ranks_samples(self) -> bool:
        """best_of > n: the samples are ranked by cumulative logprob and only n returned."""
        return not self.use_beam_search and self.best_of is not None and self.best_of > self.n

    @property
    def wants_logprob(self) -> bool:
        """The sampler must report the chosen tokens' logprobs (asked, or to rank samples)."""
        return self.logprobs is not None or self.ranks_samples

    def validate(self, *, vocab_size: int, max_n: int, max_logprobs: int) -> None:
        """Raises ValueError with a message that says what to fix."""
        if not 1 <= self.n <= max_n:
            raise ValueError(f"n must be between 1 and {max_n}, got {self.n}")
        if self.best_of is not None:
            if not self.n <= self.best_of <= max_n:
                raise ValueError(
                    f"best_of must be between n ({self.n}) and {max_n}, got {self.best_of}"
                )
            if self.best_of > 1 and self.greedy and not self.use_beam_search:
                raise ValueError(
                    "best_of > 1 with greedy sampling (temperature 0) gives identical samples: "
                    "set temperature > 0, or use_beam_search=True for deterministic search"
                )
        if self.use_beam_search:
            self._validate_beam_search()
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise ValueError(f"logprobs must be between 0 and {max_logprobs}, got {self.logprobs}")
        if self.pin_ttl_s < 0:
            raise ValueError(f"pin_ttl_s must be >= 0, got {self.pin_ttl_s}")
        if self.response_format is not None and not isinstance(
            self.response_format, ResponseFormat
        ):
            raise ValueError(
                f"response_format must be a ResponseFormat, got {type(self.response_format)}"
            )
        fmt = self.response_format
        if fmt is not None and fmt.kind == "choice":
            # A token holds at least one byte, so a choice output has at most as many tokens as
            # its longest choice has bytes: a min_tokens above that can never be met.
            longest = max(len(c.encode()) for c in fmt.choices)
            if self.min_tokens > longest:
                raise ValueError(
                    f"min_tokens ({self.min_tokens}) cannot be met by a choice response_format: "
                    f"the longest choice is {longest} bytes, so at most {longest} tokens"
                )

    def _validate_beam_search(self) -> None:
        def refuse(what: str) -> ValueError:
            return ValueError(f"beam search does not support {what}")

        if self.temperature != 0.0:
            raise ValueError(
                f"beam search is deterministic: set temperature=0 (got {self.temperature})"
            )
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")
        if self.response_format is not None:
            raise refuse("structured outputs (response_format)")
        if self.stop:
            raise refuse("stop strings; use stop_token_ids")
        if self.logprobs is not None:
            raise refuse("logprobs; each output carries its cumulative_logprob")
        if self.top_k or self.top_p != 1.0 or self.min_p:
            raise refuse("top_k, top_p or min_p (they shape sampling, and beam search samples not)")
        if self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty:
            raise refuse("repetition, presence or frequency penalties")
