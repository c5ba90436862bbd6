"""Speculative decoding changes no output: greedy float32 tokens equal transformers' with every
method and configuration, seeded samples equal the plain engine's, sampled outputs keep the
target's distribution (and a broken acceptance rule is caught), one tenant's outputs never
propose tokens to another, and bad configurations are refused."""

from __future__ import annotations

import random
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import SpeculativeConfig
from engine.core import step_update
from engine.core.spec.proposer import Proposer
from engine.worker import model_runner
from tests.engine.test_parity import CONFIGS, shared_prefix_prompts
from tests.support.checkpoints import with_other_tokenizer
from tests.support.reference import assert_config_took_effect, hf_greedy

MAX_TOKENS = 24
SPEC_CONFIGS = {
    **CONFIGS,
    "async": dict(num_device_blocks=512, async_scheduling=True),
}


def repeating_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase (so prompt lookup finds matches), with random lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(10, vocab) for _ in range(rng.randrange(4, 24))]
        reps = 2 + i % 4
        out.append(phrase * reps + phrase[: rng.randrange(0, len(phrase))])
    return out


def spec(method: str, **kw: Any) -> dict[str, Any]:
    return {"method": method, "num_speculative_tokens": 4, "disable_by_batch_size": 64, **kw}


@pytest.fixture(scope="module")
def draft_path(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with noise (0.006) on every matrix: a draft model that agrees with it
    often, not always."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("draft") / "model"
    shutil.copytree(tiny_llama_path, out)
    weights = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    noisy = {
        k: v + 0.006 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v
        for k, v in weights.items()
    }
    save_file(noisy, out / "model.safetensors", metadata={"format": "pt"})
    return out


def method_spec(method: str, draft: Path) -> dict[str, Any]:
    return spec(method, model=str(draft)) if method == "draft_model" else spec(method)


def generate(path: Path, prompts: list[list[int]], params: SamplingParams, **cfg: Any) -> Any:
    llm = LLM(str(path), dtype="float32", block_size=16, **cfg)
    outs = llm.generate(prompts, params)
    core = llm.engine.core
    core.kv.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_blocks
    return outs, llm


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_greedy_matches_transformers_in_every_configuration(
    tiny_llama_path: Path, draft_path: Path, method: str
) -> None:
    vocab = 512
    prompts = repeating_prompts(vocab, 8, seed=2) + shared_prefix_prompts(vocab, 16, 300, seed=1)
    expected = hf_greedy(tiny_llama_path, prompts, MAX_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name, cfg in SPEC_CONFIGS.items():
        outs, llm = generate(
            tiny_llama_path, prompts, params, speculative_config=method_spec(method, draft_path),
            **cfg,
        )  # fmt: skip
        for i, (o, e) in enumerate(zip(outs, expected, strict=True)):
            assert o.token_ids == e, f"{method} {name}: prompt {i} differs"
        stats = llm.engine.get_stats()
        assert stats.spec is not None and stats.spec.num_accepted_tokens > 0, name
        assert stats.spec.num_drafts < sum(len(o.token_ids) for o in outs)
        assert_config_took_effect(name, stats)
        accepted = sum(o.metrics.num_accepted_tokens for o in outs if o.metrics is not None)
        assert accepted == stats.spec.num_accepted_tokens


def test_greedy_qwen2_matches_transformers(tiny_qwen2_path: Path) -> None:
    """The parity suite's other model (GQA, q/k/v biases, tied embeddings), n-gram proposals."""
    prompts = repeating_prompts(512, 8, seed=13)
    expected = hf_greedy(tiny_qwen2_path, prompts, MAX_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name, cfg in SPEC_CONFIGS.items():
        outs, llm = generate(
            tiny_qwen2_path, prompts, params, speculative_config=spec("ngram"), **cfg
        )
        assert [o.token_ids for o in outs] == expected, name
        stats = llm.engine.get_stats().spec
        assert stats is not None and stats.num_accepted_tokens > 0, name


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_samples_equal_the_plain_engine(
    tiny_llama_path: Path, draft_path: Path, method: str
) -> None:
    """A seeded sample's generator is rewound to the kept positions, so speculation changes
    none of its tokens; logprobs agree; n > 1 behaves the same."""
    prompts = repeating_prompts(512, 6, seed=3)
    params = SamplingParams(
        n=2, temperature=0.3, top_k=3, seed=11, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True
    )
    plain, _ = generate(tiny_llama_path, prompts, params, num_device_blocks=512)
    specd, llm = generate(
        tiny_llama_path, prompts, params, num_device_blocks=512,
        speculative_config=method_spec(method, draft_path),
    )  # fmt: skip
    stats = llm.engine.get_stats().spec
    assert stats is not None and stats.num_accepted_tokens > 0
    for a, b in zip(plain, specd, strict=True):
        for sa, sb in zip(a.outputs, b.outputs, strict=True):
            assert sa.token_ids == sb.token_ids
            assert sa.logprobs is not None and sb.logprobs is not None
            for la, lb in zip(sa.logprobs, sb.logprobs, strict=True):
                assert la.token_id == lb.token_id
                assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)


def test_stop_strings_and_max_tokens_cut_an_accepted_run(tiny_llama_path: Path) -> None:
    prompts = repeating_prompts(512, 6, seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain, llm = generate(tiny_llama_path, prompts, greedy, num_device_blocks=512)
    # A stop string from the middle of each plain output, and a max_tokens that ends mid-run.
    tok = llm.engine.core.tokenizer
    for o, p in zip(plain, prompts, strict=True):
        stop = tok.decode(o.token_ids[9:11])
        for params in (
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop], ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        ):
            a, _ = generate(tiny_llama_path, [p], params, num_device_blocks=512)
            b, _ = generate(
                tiny_llama_path, [p], params, num_device_blocks=512,
                speculative_config=spec("ngram"),
            )  # fmt: skip
            assert (a[0].text, a[0].finish_reason) == (b[0].text, b[0].finish_reason)
            assert a[0].token_ids == b[0].token_ids


def _first_three(outs: list[Any]) -> Counter[tuple[int, ...]]:
    return Counter(tuple(s.token_ids[:3]) for o in outs for s in o.outputs)


def _homogeneity_p(a: Counter[tuple[int, ...]], b: Counter[tuple[int, ...]]) -> float:
    """p-value of the chi-square test that two samples come from one distribution (cells with
    fewer than 5 expected counts pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    cells = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    rows: list[tuple[int, int]] = []
    rest = [0, 0]
    for c in cells:
        if (a[c] + b[c]) * min(na, nb) / (na + nb) >= 5:
            rows.append((a[c], b[c]))
        else:
            rest[0] += a[c]
            rest[1] += b[c]
    if sum(rest):
        rows.append((rest[0], rest[1]))
    stat = 0.0
    for x, y in rows:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    df = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


SAMPLES = 20_000


def _sample_many(path: Path, prompt: list[int], greedy: list[int], cfg: dict[str, Any]) -> Any:
    """SAMPLES unseeded samples of 4 tokens (top_k 3), each proposing the greedy continuation
    from its position: tokens 2 and 3 are verified in one step (the first comes from the
    prompt's step)."""
    params = SamplingParams(n=16, temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", block_size=16, num_device_blocks=4096, seed=5, **cfg)
    outs = llm.generate([prompt] * (SAMPLES // 16), params)
    return outs, llm


def test_sampled_outputs_keep_the_target_distribution(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = repeating_prompts(512, 1, seed=6)[0]
    greedy = hf_greedy(tiny_llama_path, [prompt], 4)[0]

    def propose(self: Proposer, seq: Any, max_tokens: int) -> list[int]:
        return greedy[seq.num_output_tokens : seq.num_output_tokens + max_tokens]

    monkeypatch.setattr(Proposer, "propose", propose)
    plain, _ = _sample_many(tiny_llama_path, prompt, greedy, {})
    every_batch = {"speculative_config": spec("ngram", disable_by_batch_size=10**6)}
    specd, llm = _sample_many(tiny_llama_path, prompt, greedy, every_batch)
    stats = llm.engine.get_stats().spec
    assert stats is not None
    # Both ways of ending a proposal ran many times, and second proposed tokens were kept.
    assert stats.num_drafts > SAMPLES * 0.9
    assert 0.1 < stats.acceptance_rate < 0.9, stats
    assert stats.accepted_per_pos[1] > 500, stats
    a, b = _first_three(plain), _first_three(specd)
    assert len(a) > 5  # a distribution over several outcomes, not a near-constant
    assert _homogeneity_p(a, b) > 0.01

    # The same test catches a rule that keeps the first proposed token whatever was sampled.
    def keep_first(drafts: list[int], token_ids: list[int], row: int) -> int:
        return max(1, model_runner_num_accepted(drafts, token_ids, row))

    model_runner_num_accepted = model_runner.num_accepted
    monkeypatch.setattr(model_runner, "num_accepted", keep_first)
    monkeypatch.setattr(step_update, "num_accepted", keep_first)
    broken, _ = _sample_many(tiny_llama_path, prompt, greedy, every_batch)
    assert _homogeneity_p(a, _first_three(broken)) < 0.01


def test_suffix_cache_never_crosses_tenants(tiny_llama_path: Path) -> None:
    """Tenant A's finished output is proposed to A's next request, never to B's (another
    cache salt), even for the very same prompt."""
    vocab = 512
    rng = random.Random(8)
    prompt = [rng.randrange(10, vocab) for _ in range(40)]  # no repeats: prompt lookup is idle
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(
        str(tiny_llama_path), dtype="float32", block_size=16, num_device_blocks=512,
        speculative_config=spec("suffix"),
    )  # fmt: skip
    first = llm.generate([prompt], params, cache_salt="tenant-a")[0]
    other = llm.generate([prompt], params, cache_salt="tenant-b")[0]
    again = llm.generate([prompt], params, cache_salt="tenant-a")[0]
    assert other.token_ids == first.token_ids == again.token_ids
    a1, b, a2 = (o.metrics for o in (first, other, again))
    assert a1 is not None and b is not None and a2 is not None
    # B's request saw only its own text, exactly as A's first did: A's output proposed nothing.
    assert (b.num_draft_tokens, b.num_accepted_tokens) == (
        a1.num_draft_tokens,
        a1.num_accepted_tokens,
    )
    # A's second request is proposed A's first output and takes most of it.
    assert a2.num_accepted_tokens >= 24 > a1.num_accepted_tokens


def test_no_proposals_above_the_batch_limit(tiny_llama_path: Path) -> None:
    prompts = repeating_prompts(512, 12, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    _, llm = generate(
        tiny_llama_path, prompts, params, num_device_blocks=512,
        speculative_config=spec("ngram", disable_by_batch_size=11),
    )  # fmt: skip
    stats = llm.engine.get_stats().spec
    assert stats is not None and stats.num_drafts == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"method": "medusa"}', "speculative method must be one of"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be a int"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup"),
        ('{"method": "ngram", "lookahead": 3}', "unknown key"),
        ('{"method": "ngram", "model": "some/folder"}', "goes with method"),
        ('{"method": "draft_model"}', "goes with method"),
        ('{"method": "eagle", "model": "some/folder"}', "speculative method must be one of"),
    ],
)
def test_bad_speculative_config_is_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(text)


def test_beam_search_with_speculation_is_refused(tiny_llama_path: Path) -> None:
    llm = LLM(
        str(tiny_llama_path), dtype="float32", block_size=16, num_device_blocks=128,
        speculative_config=spec("ngram"),
    )  # fmt: skip
    params = SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="speculative decoding"):
        llm.generate([[11, 12, 13]], params)


@pytest.mark.timeout(600)
def test_two_ranks_verify_proposals_like_one(tiny_llama_path: Path) -> None:
    """Tensor parallelism: rank 1 runs the 1 + k positions too; the greedy tokens are the same."""
    prompts = repeating_prompts(512, 6, seed=10)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = hf_greedy(tiny_llama_path, prompts, MAX_TOKENS)
    outs, llm = generate(
        tiny_llama_path, prompts, params, num_device_blocks=256, tensor_parallel_size=2,
        speculative_config=spec("ngram"),
    )  # fmt: skip
    try:
        assert [o.token_ids for o in outs] == expected
        stats = llm.engine.get_stats().spec
        assert stats is not None and stats.num_accepted_tokens > 0
    finally:
        llm.engine.core.executor.close()


def test_the_target_as_its_own_draft_is_always_accepted(tiny_llama_path: Path) -> None:
    """The draft model's cache follows the target's blocks: drafting with the target's own
    weights proposes exactly what the target then samples (greedy), proposal after proposal."""
    prompts = repeating_prompts(512, 6, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    cfg = spec("draft_model", model=str(tiny_llama_path))
    _, llm = generate(
        tiny_llama_path, prompts, params, num_device_blocks=512, speculative_config=cfg
    )
    stats = llm.engine.get_stats().spec
    assert stats is not None and stats.num_drafts > 20
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_draft_model_with_another_tokenizer_is_refused(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    other = with_other_tokenizer(tiny_llama_path, tmp_path / "other")
    with pytest.raises(ValueError, match="another tokenizer"):
        LLM(str(tiny_llama_path), speculative_config={"model": str(other)})


def test_structured_outputs_verify_only_what_the_grammar_accepts(tiny_llama_path: Path) -> None:
    """Under a grammar a proposal is cut to what the grammar accepts and each verifying row is
    masked after the proposed tokens before it: outputs equal the plain engine's, and a forced
    answer quoted in the prompt is taken several tokens a step."""
    from engine.sample.structured import ResponseFormat

    sentence = "The quick brown fox jumps over the lazy dog. A cache stores blocks."
    other = "Water boils at one hundred degrees, and the sun rises in the east."
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["name", "count"],
    }
    cases = [
        (ResponseFormat.choice([sentence, other]), True),
        (ResponseFormat.json_schema(schema), False),
    ]
    llm = LLM(str(tiny_llama_path), dtype="float32", num_device_blocks=256)
    tok = llm.engine.core.tokenizer
    stem = tok.encode(f'{sentence} {other} {{"name": "fox", "count": 3}}')
    eos = set(llm.engine.core.model_info.eos_token_ids)
    for fmt, forced in cases:
        params = SamplingParams(temperature=0.0, max_tokens=80, response_format=fmt)
        # The prompt quotes the model's own constrained answer (its tokenization of it).
        first = llm.generate([stem], params)[0].token_ids
        prompt = stem + [t for t in first if t not in eos] + stem
        plain = llm.generate([prompt], params)[0]
        specd, _ = generate(
            tiny_llama_path, [prompt], params, num_device_blocks=256,
            speculative_config=spec("ngram"),
        )  # fmt: skip
        assert specd[0].token_ids == plain.token_ids
        assert specd[0].text == plain.text
        m = specd[0].metrics
        assert m is not None and m.num_spec_steps > 0  # proposals were verified, masked
        if forced:
            assert plain.text in (sentence, other)
            assert m.num_accepted_tokens >= 5


def test_swap_preemption_and_the_cpu_tier(tiny_llama_path: Path) -> None:
    """Proposals with preemption by swap (a sample's KV spilled to the CPU tier and back) and
    with the CPU tier behind the prefix cache: the greedy tokens are transformers'."""
    prompts = repeating_prompts(512, 12, seed=14) + shared_prefix_prompts(512, 8, 300, seed=3)
    expected = hf_greedy(tiny_llama_path, prompts, MAX_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    swap = dict(
        num_device_blocks=48, max_num_batched_tokens=128, preemption_mode="swap",
        num_cpu_blocks=512,
    )  # fmt: skip
    outs, llm = generate(tiny_llama_path, prompts, params, speculative_config=spec("ngram"), **swap)
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    cpu = next(t for t in stats.tiers if t.name == "cpu")
    assert cpu.swap_ins > 0
    assert stats.spec is not None and stats.spec.num_accepted_tokens > 0
