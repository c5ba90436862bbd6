"""Our Llama-family forward over a paged cache against transformers, plus loader and registry."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.config import ModelConfig
from engine.frontend.prompt import apply_chat_template
from engine.testing.tiny_models import build_tiny_llama
from engine.worker.attention import TorchAttentionBackend
from engine.worker.model_loader import (
    eos_token_ids,
    kv_dims,
    load_model,
    load_tokenizer,
    read_hf_config,
)
from engine.worker.models import get_model_class, model_family
from engine.worker.models.base import CausalLM
from engine.worker.models.layers.rotary import rope_inv_freq
from engine.worker.models.llama import LlamaForCausalLM
from engine.worker.models.sliding_window import kv_window, layer_windows
from tests.support.attention import make_attention_metadata

torch.set_num_threads(2)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _hf_logits(path: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 logits over each whole sequence ([len, vocab] each)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([seq])).logits[0].float() for seq in sequences]


def _paged_logits(
    model: CausalLM,
    sequences: list[list[int]],
    schedules: list[list[int]],
    block_size: int,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Runs `sequences` through our model step by step over a paged cache with shuffled blocks.

    schedules[i] lists how many tokens sequence i feeds per step (0 = not scheduled that step);
    chunks of several tokens are prefill, 1 after the prompt is a decode step. Every step is one
    flat batch of all scheduled sequences plus two padding tokens. Returns each sequence's logits.
    """
    assert [sum(s) for s in schedules] == [len(s) for s in sequences]
    rng = random.Random(seed)
    num_layers, num_kv_heads, head_dim = kv_dims(model.config)
    needed = [math.ceil(len(s) / block_size) for s in sequences]
    num_blocks = sum(needed) + 2
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [ids[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(sequences))]
    kv_cache = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    done = [0] * len(sequences)
    logits: list[list[torch.Tensor]] = [[] for _ in sequences]
    for step in range(max(len(s) for s in schedules)):
        active = [i for i, s in enumerate(schedules) if step < len(s) and s[step] > 0]
        context_lens = [done[i] for i in active]
        query_lens = [schedules[i][step] for i in active]
        meta, positions = make_attention_metadata(
            context_lens, query_lens, [tables[i] for i in active], block_size, num_padding_tokens=2
        )
        input_ids = [t for i, q in zip(active, query_lens, strict=True) for t in
                     sequences[i][done[i] : done[i] + q]] + [0, 0]  # fmt: skip
        with torch.no_grad():
            hidden = model(torch.tensor(input_ids), positions, kv_cache, meta)
            step_logits = model.compute_logits(hidden)
        at = 0
        for i, q in zip(active, query_lens, strict=True):
            logits[i].append(step_logits[at : at + q])
            at += q
            done[i] += q
    assert done == [len(s) for s in sequences]
    return [torch.cat(parts) for parts in logits]


def _check_parity(path: Path, block_size: int, atol: float = 1e-4) -> None:
    backend = TorchAttentionBackend()
    model, hf_config = load_model(ModelConfig(path=str(path)), torch.device("cpu"), backend)
    gen = torch.Generator().manual_seed(block_size)
    lengths = [45, 23, 70]
    sequences = [
        torch.randint(3, hf_config.vocab_size, (n,), generator=gen).tolist() for n in lengths
    ]
    schedules = [
        [7, 30, 4, 1, 1, 1, 1],  # chunked prefill of 41, then 4 decode steps
        [0, 20, 1, 1, 1],  # joins at step 1
        [16, 1, 33, 14, 1, 1, 1, 1, 1, 1],  # chunk boundaries at and off block edges
    ]
    ours = _paged_logits(model, sequences, schedules, block_size)
    want = _hf_logits(path, sequences)
    for got, ref in zip(ours, want, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, atol=atol, rtol=0)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("block_size", [16, 32])
def test_llama_matches_transformers(tiny_llama_path: Path, block_size: int) -> None:
    _check_parity(tiny_llama_path, block_size)


def test_llama3_rope_matches_transformers(tmp_path: Path) -> None:
    path = build_tiny_llama(tmp_path / "llama3", seed=1, rope_parameters=dict(LLAMA3_ROPE))
    assert read_hf_config(path).rope_parameters["rope_type"] == "llama3"
    _check_parity(path, 16)


def test_qwen2_matches_transformers(tiny_qwen2_path: Path) -> None:
    assert model_family(read_hf_config(tiny_qwen2_path)) == "qwen2"
    _check_parity(tiny_qwen2_path, 16)


def test_rope_inv_freq_both_config_styles() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    new = LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=2048,
        rope_parameters=dict(LLAMA3_ROPE),
    )  # fmt: skip
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](new)
    assert torch.equal(rope_inv_freq(new)[0], want)
    old_scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    old = SimpleNamespace(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=2048,
        rope_theta=500000.0, rope_scaling={**old_scaling, "type": old_scaling.pop("rope_type")},
    )  # fmt: skip
    assert torch.equal(rope_inv_freq(old)[0], want)
    plain = SimpleNamespace(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=2048, rope_theta=10000.0
    )
    default = LlamaConfig(hidden_size=64, num_attention_heads=4)
    want_default = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    assert torch.equal(rope_inv_freq(plain)[0], want_default)
    assert torch.equal(rope_inv_freq(default)[0], want_default)
    with pytest.raises(ValueError, match="dynamic"):
        rope_inv_freq(SimpleNamespace(**{**vars(plain), "rope_scaling": {"rope_type": "dynamic"}}))


def test_unsupported_architecture() -> None:
    cfg = SimpleNamespace(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        get_model_class(cfg)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert name in str(err.value)


def test_sliding_window_layers() -> None:
    """Mistral: every layer; Qwen2: layers >= max_window_layers, or layer_types when present."""
    from transformers import MistralConfig, Qwen2Config

    base: dict[str, Any] = {"num_hidden_layers": 4, "max_position_embeddings": 32768}
    mistral = SimpleNamespace(**base, architectures=["MistralForCausalLM"], sliding_window=4096)
    assert get_model_class(mistral) is LlamaForCausalLM  # no longer refused
    assert layer_windows(mistral) == [4096] * 4
    assert kv_window(layer_windows(mistral)) == 4096
    assert layer_windows(SimpleNamespace(**base, sliding_window=None)) == [None] * 4
    assert layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=64)) == [64] * 3
    qwen = dict(base, model_type="qwen2", sliding_window=64, max_window_layers=1)
    assert layer_windows(SimpleNamespace(**qwen, use_sliding_window=False)) == [None] * 4
    assert layer_windows(SimpleNamespace(**qwen, use_sliding_window=True)) == [None, 64, 64, 64]
    hf = Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2
    )
    assert layer_windows(hf) == [None, None, 64, 64]
    assert kv_window(layer_windows(hf)) is None  # a full layer keeps every block
    off = Qwen2Config(num_hidden_layers=2, use_sliding_window=False, sliding_window=64)
    assert layer_windows(off) == [None, None]
    types = SimpleNamespace(
        **base, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2
    )
    assert layer_windows(types) == [8, None, 8, None]
    assert kv_window([8, 16]) == 16
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        layer_windows(SimpleNamespace(**base, sliding_window=0))
    with pytest.raises(ValueError, match="layer_types has 2 entries"):
        layer_windows(SimpleNamespace(**base, sliding_window=8, layer_types=["full_attention"] * 2))


class _PlainBackend(TorchAttentionBackend):
    """A backend whose forward takes neither a sliding window nor a soft-cap."""

    def forward(self, q, k, v, kv_cache, meta, scale):  # type: ignore[no-untyped-def,override]
        return super().forward(q, k, v, kv_cache, meta, scale)


def test_window_refused_by_a_backend_without_it(tmp_path: Path) -> None:
    from transformers import MistralConfig

    cfg = MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, sliding_window=32,
        architectures=["MistralForCausalLM"],
    )  # fmt: skip
    assert get_model_class(cfg) is LlamaForCausalLM
    with pytest.raises(ValueError, match="sliding_window=32 on layer 0"):
        LlamaForCausalLM(cfg, torch.float32, _PlainBackend())


def test_loader_errors_and_helpers(tiny_llama_path: Path, tmp_path: Path) -> None:
    backend = TorchAttentionBackend()
    cpu = torch.device("cpu")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(ModelConfig(path=str(tmp_path / "nope")), cpu, backend)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(ModelConfig(path=str(empty)), cpu, backend)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_llama_path, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(ModelConfig(path=str(no_weights)), cpu, backend)

    model, hf_config = load_model(
        ModelConfig(path=str(tiny_llama_path), dtype="bfloat16"), cpu, backend
    )
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())
    assert kv_dims(hf_config) == (2, 2, 16)
    tokenizer = load_tokenizer(tiny_llama_path)
    assert eos_token_ids(tiny_llama_path, hf_config, tokenizer) == (2,)
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "What is your name?"}])
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])

    gen_cfg = tmp_path / "eos"
    gen_cfg.mkdir()
    (gen_cfg / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert eos_token_ids(gen_cfg, SimpleNamespace(eos_token_id=2), tokenizer) == (2, 7)


@pytest.mark.slow
def test_demo_model_matches_transformers(demo_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    backend = TorchAttentionBackend()
    model, hf_config = load_model(
        ModelConfig(path=str(demo_model_path)), torch.device("cpu"), backend
    )
    assert hf_config.num_hidden_layers == 30 and hf_config.tie_word_embeddings
    tokenizer = load_tokenizer(demo_model_path)
    hf = AutoModelForCausalLM.from_pretrained(str(demo_model_path), dtype=torch.float32).eval()
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    new_tokens = 8
    sequences, want = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])
            out = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
            sequences.append(out[0].tolist())
            want.append(hf(out).logits[0].float())
    assert tokenizer.decode(sequences[0][-new_tokens:]).startswith("The capital of France is")
    # prefill in two chunks, then teacher-forced decode steps over transformers' greedy tokens
    schedules = [[len(s) - new_tokens - 12, 12] + [1] * new_tokens for s in sequences]
    ours = _paged_logits(model, sequences, schedules, block_size=16)
    for got, ref, seq in zip(ours, want, sequences, strict=True):
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=0)
        assert got[-new_tokens - 1 : -1].argmax(-1).tolist() == seq[-new_tokens:]


def test_resolve_model_path(tiny_llama_path: Path, tmp_path: Path) -> None:
    from engine.demo import resolve_model_path

    assert resolve_model_path(str(tiny_llama_path), tmp_path) == str(tiny_llama_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing"), tmp_path)
