"""The text of a request's outputs, made in the front end from the core's token deltas.

As in vLLM v1, the engine core's step ends with token ids, logprobs and finish reasons; the text
is made here, on the caller's side of the core: in the API server's process for an engine core in
a process of its own (engine/frontend/core_client.py), where it overlaps the core's next step, and
after the step for the in-process front ends (`LLMEngine`, so the offline `LLM` and `AsyncEngine`).

The core still decodes the requests that have stop strings, since a stop string decides when a
sample ends and frees its blocks (engine/core/output_processor.py); it sends no text either way.
This side runs the same `IncrementalDetokenizer` over the same tokens, so it finds the same stop
string at the same token and cuts the text at the same place.

Which tokens are text (engine/core/output_processor.py's stop rules): every output token except
the one that ended a sample by a stop token id, an EOS token, the grammar's end or the grammar's
refusal (finish_reason "stop" or "error" with no stop string). Held-back text (an incomplete
character, a possible start of a stop string) is flushed when a sample ends, except by a stop
string or an abort. Beam search sends whole beams once, at the end: each is decoded in one go.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.detokenizer import IncrementalDetokenizer, make_decode
from engine.outputs import CompletionOutput, RequestOutput
from engine.sample.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True, eq=False)
class RequestText:
    """One request's detokenizers, one per sample index, made as its samples first appear."""

    tokenizer: PreTrainedTokenizerBase
    prompt_token_ids: list[int]
    params: SamplingParams
    _detoks: dict[int, IncrementalDetokenizer] = field(default_factory=dict, init=False)
    """Sample index -> its detokenizer."""

    def apply(self, out: RequestOutput) -> None:
        """Fills in the text of every sample's delta in `out` (in place)."""
        if self.params.use_beam_search:
            if out.outputs:  # whole beams, best first, once
                decode = make_decode(self.tokenizer, self.params.skip_special_tokens)
                for c in out.outputs:
                    c.text = decode(c.token_ids)
            return
        for c in out.outputs:
            self._fill(c)

    def _fill(self, c: CompletionOutput) -> None:
        detok = self._detoks.get(c.index)
        if detok is None:
            detok = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids, self.params)
            self._detoks[c.index] = detok
        ids = c.token_ids
        reason = c.finish_reason
        by_stop_string = isinstance(c.stop_reason, str)
        if ids and reason in ("stop", "error") and not by_stop_string:
            ids = ids[:-1]  # the token that ended the sample is not text
        add = detok.add
        if len(ids) == 1:
            text = add(ids[0])
        else:
            text = "".join([add(t) for t in ids])
        if reason is not None and reason != "abort" and not by_stop_string:
            text += detok.flush()
        c.text = text


class OutputText:
    """The front end's text step: the `RequestText` of every request it has open."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestText] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._requests[request_id] = RequestText(self.tokenizer, prompt_token_ids, params)

    def discard(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def apply(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """Fills in the text of `outs` (in place; returns them); forgets finished requests."""
        requests = self._requests
        for out in outs:
            text = requests.get(out.request_id)
            if text is None:
                continue
            text.apply(out)
            if out.finished:
                del requests[out.request_id]
        return outs
