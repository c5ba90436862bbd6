"""Beam search is token-exact with transformers `generate(num_beams=4, do_sample=False)`.

float32, same weights, 24 prompts with shared prefixes, early_stopping True and False, with
prefix caching on and off, a token budget that chunks prefills, and a pool small enough to force
preemption (a beam group is preempted and resumed as a unit). To make beams finish early (a
random model rarely says EOS), the token the model produces most often is made a finishing token
on both sides: transformers' eos_token_id=[eos, t], the engine's stop_token_ids=[t]. After every
run every block is free.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.test_parity import shared_prefix_prompts
from tests.support.reference import assert_config_took_effect

WIDTH = 4
MAX_TOKENS = 12
NUM_PROMPTS = 24

Outputs = list[list[list[int]]]
"""Per prompt, the returned beams' generated token ids, best first."""

CONFIGS = {
    "cache-on": dict(num_device_blocks=512),
    "cache-off": dict(num_device_blocks=512, enable_prefix_caching=False),
    "chunked": dict(num_device_blocks=512, max_num_batched_tokens=64),
    # 24 four-beam groups over prompts of up to 300 tokens cannot all be resident in 48 blocks.
    "preempt": dict(num_device_blocks=48, max_num_batched_tokens=256),
}


@dataclass(frozen=True, slots=True)
class BeamOptions:
    """The search settings both sides get (transformers' generate and the engine's
    SamplingParams)."""

    early_stopping: bool | str
    max_tokens: int = MAX_TOKENS
    length_penalty: float = 1.0
    min_tokens: int = 0
    """transformers' min_new_tokens (0: none)."""


def hf_beams(
    path: Path, prompts: list[list[int]], finishing: list[int], opts: BeamOptions
) -> tuple[Outputs, list[list[float]]]:
    """transformers' returned beams (generated tokens, cut at each beam's own length) and scores."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    outs, scores = [], []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                num_beams=WIDTH,
                num_return_sequences=WIDTH,
                do_sample=False,
                max_new_tokens=opts.max_tokens,
                early_stopping=opts.early_stopping,
                length_penalty=opts.length_penalty,
                min_new_tokens=opts.min_tokens or None,
                eos_token_id=finishing,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_scores=True,
            )
            beams = []
            for row, used in zip(gen.sequences, gen.beam_indices, strict=True):
                length = int((used != -1).sum())
                beams.append(row[len(p) : len(p) + length].tolist())
            outs.append(beams)
            scores.append(gen.sequences_scores.tolist())
    return outs, scores


def engine_beams(
    llm: LLM, prompts: list[list[int]], stop: list[int], opts: BeamOptions
) -> tuple[Outputs, list[list[float]]]:
    """The engine's returned beams and their scores (cumulative logprob / length ** penalty)."""
    params = SamplingParams(
        n=WIDTH,
        temperature=0.0,
        use_beam_search=True,
        early_stopping=opts.early_stopping,
        length_penalty=opts.length_penalty,
        max_tokens=opts.max_tokens,
        min_tokens=opts.min_tokens,
        stop_token_ids=stop,
    )
    outs = llm.generate(prompts, params)
    llm.engine.core.kv.check_integrity()
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
    for o in outs:
        assert o.finished and len(o.outputs) == WIDTH
        for c in o.outputs:
            assert c.finish_reason in ("stop", "length")
            assert c.cumulative_logprob is not None
    tokens = [[c.token_ids for c in o.outputs] for o in outs]
    scores = [
        [c.cumulative_logprob / len(c.token_ids) ** opts.length_penalty for c in o.outputs]  # type: ignore[operator]
        for o in outs
    ]
    return tokens, scores


def frequent_token(llm: LLM, prompts: list[list[int]]) -> int:
    """The token greedy decoding produces most often over these prompts."""
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    counts = Counter(t for o in outs for t in o.token_ids)
    return counts.most_common(1)[0][0]


def check_beam_parity(
    path: Path, vocab: int, eos: int, settings: tuple[bool | str, ...] = (True, False)
) -> None:
    prompts = shared_prefix_prompts(vocab, NUM_PROMPTS, 300, seed=3)
    probe = LLM(str(path), dtype="float32", block_size=16, num_device_blocks=512)
    stop = frequent_token(probe, prompts)
    assert stop != eos
    for early in settings:
        expected, _ = hf_beams(path, prompts, [eos, stop], BeamOptions(early))
        ended = sum(1 for beams in expected for b in beams if b[-1] == stop)
        assert ended > 0, "no beam finished on the stop token: the finishing paths went untested"
        for name, cfg in CONFIGS.items():
            llm = probe if name == "cache-on" else None
            llm = llm or LLM(str(path), dtype="float32", block_size=16, **cfg)  # type: ignore[arg-type]
            got, _ = engine_beams(llm, prompts, [stop], BeamOptions(early))
            for i, (g, e) in enumerate(zip(got, expected, strict=True)):
                assert g == e, f"{name} early_stopping={early}: prompt {i} differs: {g} != {e}"
            assert_config_took_effect(name, llm.engine.get_stats())


@pytest.mark.timeout(1200)  # transformers' beam search takes most of it
def test_beam_parity_tiny_llama(tiny_llama_path: Path) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_llama_path)
    check_beam_parity(tiny_llama_path, cfg.vocab_size, cfg.eos_token_id)


@pytest.mark.timeout(1200)  # transformers' beam search takes most of it
def test_beam_parity_tiny_qwen2(tiny_qwen2_path: Path) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_qwen2_path)
    check_beam_parity(tiny_qwen2_path, cfg.vocab_size, cfg.eos_token_id, (True,))


@pytest.mark.timeout(1200)  # transformers' beam search takes most of it
def test_beam_never_and_length_penalty(tiny_llama_path: Path) -> None:
    """early_stopping="never" with a length penalty that favours long beams, other penalties,
    min_tokens (transformers' min_new_tokens), and returning the best n < width
    (num_return_sequences)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_llama_path)
    prompts = shared_prefix_prompts(cfg.vocab_size, 6, 100, seed=5)
    llm = LLM(str(tiny_llama_path), dtype="float32", block_size=16, num_device_blocks=256)
    stop = frequent_token(llm, prompts)
    for early, lp, least in (("never", 2.0, 0), (False, 0.5, 0), (True, -1.0, 0), (True, 1.0, 4)):
        finishing = [cfg.eos_token_id, stop]
        opts = BeamOptions(early, length_penalty=lp, min_tokens=least)
        expected, want = hf_beams(tiny_llama_path, prompts, finishing, opts)
        got, scores = engine_beams(llm, prompts, [stop], opts)
        assert got == expected, f"early_stopping={early} length_penalty={lp} min_tokens={least}"
        if least:
            assert min(len(b) for beams in got for b in beams) >= least
        for s, w in zip(scores, want, strict=True):
            assert s == pytest.approx(w, rel=1e-5, abs=1e-4)
    two = SamplingParams(
        n=2, best_of=WIDTH, temperature=0.0, use_beam_search=True, max_tokens=MAX_TOKENS
    )
    expected, _ = hf_beams(tiny_llama_path, prompts, [cfg.eos_token_id], BeamOptions(False))
    for o, e in zip(llm.generate(prompts, two), expected, strict=True):
        assert [c.token_ids for c in o.outputs] == e[:2]
        assert [c.index for c in o.outputs] == [0, 1]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_beam_parity_demo_model(demo_model_path: Path) -> None:
    """The demo model on a few chat prompts, its real EOS only, caching on and chunked."""
    llm = LLM(str(demo_model_path), dtype="float32", block_size=16, max_num_batched_tokens=32)
    questions = ["What is the capital of France?", "Name a prime number.", "Say hi."]
    prompts = [llm.engine.tokenize(messages=[{"role": "user", "content": q}]) for q in questions]
    eos = list(llm.engine.model_info.eos_token_ids)
    opts = BeamOptions(True, max_tokens=24)
    expected, _ = hf_beams(demo_model_path, prompts, eos, opts)
    got, _ = engine_beams(llm, prompts, [], opts)
    assert got == expected


def test_beams_mixed_with_sampling_under_swap_preemption(tiny_llama_path: Path) -> None:
    """Beam groups batched with greedy and seeded requests, in a pool that forces preemption in
    swap mode (beam groups recompute; the others swap), give what a roomy engine gives."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama_path).vocab_size
    prompts = shared_prefix_prompts(vocab, 12, 260, seed=11)
    beam = SamplingParams(n=2, best_of=3, temperature=0.0, use_beam_search=True, max_tokens=10)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(n=2, temperature=0.8, seed=4, max_tokens=10, ignore_eos=True)
    params = [(beam, greedy, seeded)[i % 3] for i in range(len(prompts))]

    def run(**cfg: Any) -> tuple[list[list[list[int]]], LLM]:
        llm = LLM(str(tiny_llama_path), dtype="float32", block_size=16, **cfg)
        outs = llm.generate(prompts, params)
        llm.engine.core.kv.check_integrity()
        assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
        return [[c.token_ids for c in o.outputs] for o in outs], llm

    expected, _ = run(num_device_blocks=512)
    got, llm = run(
        num_device_blocks=40, num_cpu_blocks=256, preemption_mode="swap", max_num_batched_tokens=96
    )
    assert got == expected
    eng = llm.engine
    assert eng.core.scheduler.num_preemptions > 0 and eng.core.tiers is not None
    assert eng.core.tiers.counters.swap_outs > 0
