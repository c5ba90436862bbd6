"""Offline builders of tiny tokenizers and random-weight checkpoints for tests and benchmarks.

Every folder is a normal Hugging Face checkpoint (config.json, model.safetensors in float32,
tokenizer.json + tokenizer_config.json with a ChatML chat template, generation_config.json), so
both our loader and transformers read it. Weights come from a fixed seed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKENIZER_VOCAB_SIZE = 512

_CORPUS = """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single
step. To be or not to be, that is the question. All that glitters is not gold. The capital of
France is Paris, and the capital of Italy is Rome. Water boils at one hundred degrees. The sun
rises in the east and sets in the west. Cats and dogs are common pets; birds sing in the morning.
Once upon a time there was a little girl who lived in a village near the forest. She liked to
read books about science, history, music and the stars. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100.
What is your name? My name is Deja. How are you today? I am fine, thank you. Please tell me a
story about a robot who learns to paint. The robot painted the sky blue and the grass green.
Machine learning models predict the next token. A cache stores blocks of keys and values.
"""


def build_tokenizer(directory: str | Path) -> Path:
    """Trains a byte-level BPE (~512 tokens) on a built-in corpus and saves it into `directory`.

    Specials: <|endoftext|> (0, pad/bos), <|im_start|> (1), <|im_end|> (2, eos); ChatML template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.strip().splitlines() for _ in range(3)]
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out))
    return out


def _special_ids(directory: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    vocab = tok.get_vocab()
    return {
        "vocab_size": len(tok),
        "bos_token_id": vocab["<|endoftext|>"],
        "eos_token_id": vocab["<|im_end|>"],
        "pad_token_id": vocab["<|endoftext|>"],
    }


def _save_random(directory: Path, config: Any, seed: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    std = config.initializer_range
    with torch.no_grad():
        # Zero biases and unit norm weights would hide bugs in those paths: perturb them.
        for name, param in model.named_parameters():
            if not param.any():  # e.g. a router initialized to zeros: every expert would tie
                param.normal_(0.0, std)
            if name.endswith("bias"):
                param.normal_(0.0, std)
            elif name.endswith("norm.weight"):
                param.add_(torch.randn_like(param), alpha=std)
    model.save_pretrained(str(directory))
    return directory


_TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.1,
}


def build_tiny_llama(directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Random Llama (2 layers, hidden 64, 4 heads / 2 KV heads, untied) plus the tokenizer.

    `overrides` go into LlamaConfig (e.g. rope_parameters={...} for llama3 scaling).
    """
    from transformers import LlamaConfig

    out = build_tokenizer(directory)
    kwargs = {**_TINY_DEFAULTS, **_special_ids(out), "tie_word_embeddings": False, **overrides}
    return _save_random(out, LlamaConfig(**kwargs), seed)


def build_tiny_qwen2(directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Random Qwen2 (q/k/v bias, tied embeddings, 2 layers, 4 heads / 2 KV heads) plus tokenizer."""
    from transformers import Qwen2Config

    out = build_tokenizer(directory)
    kwargs = {
        **_TINY_DEFAULTS,
        **_special_ids(out),
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        **overrides,
    }
    return _save_random(out, Qwen2Config(**kwargs), seed)


def build_tiny_mistral(
    directory: str | Path, sliding_window: int | None = 64, seed: int = 0, **overrides: Any
) -> Path:
    """Random Mistral (every layer slides over `sliding_window` positions, 2 layers, 4 heads /
    2 KV heads, untied) plus the tokenizer."""
    from transformers import MistralConfig

    out = build_tokenizer(directory)
    kwargs = {
        **_TINY_DEFAULTS,
        **_special_ids(out),
        "tie_word_embeddings": False,
        "sliding_window": sliding_window,
        **overrides,
    }
    return _save_random(out, MistralConfig(**kwargs), seed)


def build_tiny_qwen2_sliding(
    directory: str | Path, sliding_window: int = 64, seed: int = 0, **overrides: Any
) -> Path:
    """Random Qwen2 with `use_sliding_window`: 3 layers, the first full (max_window_layers=1,
    as transformers reads it: layers i >= max_window_layers slide), the others sliding."""
    kwargs = {
        "num_hidden_layers": 3,
        "use_sliding_window": True,
        "sliding_window": sliding_window,
        "max_window_layers": 1,
        **overrides,
    }
    return build_tiny_qwen2(directory, seed, **kwargs)


def build_random_llama(directory: str | Path, config_dict: dict[str, Any], seed: int = 0) -> Path:
    """Random Llama of any size (e.g. for benchmarks) plus the tiny tokenizer.

    `config_dict` holds LlamaConfig fields; vocab_size defaults to the tokenizer's size (a larger
    vocab is fine: the extra ids are never produced by the tokenizer but may be sampled).
    """
    from transformers import LlamaConfig

    out = build_tokenizer(directory)
    kwargs = {**_special_ids(out), **config_dict}
    return _save_random(out, LlamaConfig(**kwargs), seed)


def _tiny(directory: str | Path, config_class: str, seed: int, **settings: Any) -> Path:
    """The tokenizer plus a random checkpoint of transformers' `config_class` with the tiny
    defaults, the tokenizer's special ids and `settings` (later keys win)."""
    import transformers

    out = build_tokenizer(directory)
    config = getattr(transformers, config_class)(
        **{**_TINY_DEFAULTS, **_special_ids(out), **settings}
    )
    return _save_random(out, config, seed)


def build_tiny_qwen3(directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Random Qwen3: QK norm, explicit head_dim 32 (not hidden / heads), tied embeddings."""
    settings = {"head_dim": 32, "tie_word_embeddings": True, **overrides}
    return _tiny(directory, "Qwen3Config", seed, **settings)


def build_tiny_qwen3_moe(directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Random Qwen3-MoE: 8 experts, top-2, norm_topk_prob; layer 0 sparse, layer 1 dense
    (mlp_only_layers); untied."""
    settings = {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1],
        "tie_word_embeddings": False, **overrides,
    }  # fmt: skip
    return _tiny(directory, "Qwen3MoeConfig", seed, **settings)


def build_tiny_mixtral(directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Random Mixtral: 8 experts, top-2, expert width 64, no sliding window, untied."""
    settings = {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64,
        "sliding_window": None, "tie_word_embeddings": False, **overrides,
    }  # fmt: skip
    return _tiny(directory, "MixtralConfig", seed, **settings)


def build_tiny_phi3(directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Random Phi-3 with Phi-4-mini's traits: fused qkv_proj / gate_up_proj, partial rotary
    (half of head_dim 16) and LongRoPE (original context 1024 of 4096)."""
    half = 8 // 2  # rotary dims / 2
    rope = {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0 + 0.25 * i for i in range(half)],
        "long_factor": [2.0 + 1.5 * i for i in range(half)],
        "original_max_position_embeddings": 1024,
    }  # fmt: skip
    settings = {
        "max_position_embeddings": 4096, "original_max_position_embeddings": 1024,
        "rope_parameters": rope, "sliding_window": None, "tie_word_embeddings": False,
        **overrides,
    }  # fmt: skip
    return _tiny(directory, "Phi3Config", seed, **settings)


GEMMA_WINDOW = 32
"""The tiny Gemmas' sliding window: the parity prompts run to 300 tokens, past 4x the window."""


def build_tiny_gemma2(directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Random Gemma 2: sliding (window 32) and global layers alternating, attention soft-cap 50
    and final soft-cap 30, query_pre_attn_scalar 24 (not head_dim 16), tied embeddings."""
    settings = {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": GEMMA_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, **overrides,
    }  # fmt: skip
    return _tiny(directory, "Gemma2Config", seed, **settings)


def build_tiny_gemma3(directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Random Gemma 3 (text): a local layer (window 32, rope base 10k) then a global one (base
    1M), QK norm, query_pre_attn_scalar 24, tied embeddings."""
    settings = {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": GEMMA_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        **overrides,
    }  # fmt: skip
    return _tiny(directory, "Gemma3TextConfig", seed, **settings)


FAMILY_BUILDERS: dict[str, Callable[[str | Path], Path]] = {
    "qwen3": build_tiny_qwen3,
    "qwen3_moe": build_tiny_qwen3_moe,
    "mixtral": build_tiny_mixtral,
    "phi3": build_tiny_phi3,
    "gemma2": build_tiny_gemma2,
    "gemma3": build_tiny_gemma3,
}
"""Family name -> builder of its tiny checkpoint (the families beyond Llama and Qwen2)."""


LLAMA_32_1B: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "vocab_size": 128256,
    "initializer_range": 0.02,
}
"""Llama-3.2-1B's architecture (config.json of meta-llama/Llama-3.2-1B)."""
PAD = 0
"""The random checkpoint's pad token (transformers pads its static batches with it)."""


def ensure_random_llama(cache_dir: Path, dtype: str) -> Path:
    """Llama-3.2-1B-shaped random checkpoint (+ a tiny tokenizer), built on the GPU once."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = cache_dir / f"random-llama-3.2-1b-{dtype}"
    if (out / "config.json").exists():
        return out
    build_tokenizer(out)
    config = LlamaConfig(
        **LLAMA_32_1B, bos_token_id=0, eos_token_id=2, pad_token_id=PAD, dtype=dtype
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(out))
    del model
    torch.cuda.empty_cache()
    return out
