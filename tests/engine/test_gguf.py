"""GGUF files served as they are: the quantized layers against the dequantized weights, the
reader's refusals, and greedy parity with transformers' own GGUF loader (float32, the quantized
layers in play) under caching, chunked prefill and preemption."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.tiny_gguf import quantized_blocks, write_gguf
from engine.testing.tiny_models import build_tiny_llama
from engine.worker.gguf_checkpoint import QuantizedRows, find_gguf
from engine.worker.models.layers.group_rows import (
    Int4Rows,
    Int4Sources,
    Q8Rows,
    unpack,
    unpack_q6_k,
    unpack_q8_0,
)
from engine.worker.models.layers.quantized import (
    GEMV_ROWS,
    GroupedLinear,
    HeadRowsEmbedding,
    Int4Linear,
    Q8Linear,
    QuantizedEmbedding,
)
from tests.engine.test_parity import CONFIGS, shared_prefix_prompts
from tests.support.reference import assert_config_took_effect, hf_reference

LINEAR_TYPES = ("Q4_0", "Q4_1")
EMBEDDING_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0")
MAX_TOKENS = 12

LLAMA_TYPES = {
    # q / k / v in one 4-bit type: the fused qkv weight is kept; Q8_0 linears are kept 8-bit;
    # Q5_0 ones are expanded at load; the Q8_0 embedding stays in its blocks
    "q_proj": "Q4_0",
    "k_proj": "Q4_0",
    "v_proj": "Q4_0",
    "o_proj": "Q4_1",
    "gate_proj": "Q8_0",
    "up_proj": "Q8_0",
    "layers.0.mlp.down_proj": "Q5_0",
    "down_proj": "Q4_1",
    "embed_tokens": "Q8_0",
    "lm_head": "Q4_0",
}
QWEN2_TYPES = {"proj": "Q4_1", "embed_tokens": "Q8_0"}
"""Tied embeddings, as in the demo's file: one Q8_0 tensor is the LM head (a Q8Linear) and the
embedding reads its rows."""


def _rows(kind: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedRows, torch.Tensor]:
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quants.quantize(w, qtype)
    return QuantizedRows(qtype, raw, (n, k)), torch.from_numpy(quants.dequantize(raw, qtype).copy())


@pytest.mark.parametrize("kind", LINEAR_TYPES)
def test_int4_linear_matches_dequantized_weight(kind: str) -> None:
    rows, dense = _rows(kind, 48, 96)
    q, scale, zero = unpack(rows)
    bias = torch.randn(48)
    layer = Int4Linear(q, scale, zero, bias, torch.float32)
    x = torch.randn(2, 5, 96)
    err = (layer(x) - (x @ dense.T + bias)).abs().max().item()
    assert err < 1e-4, err
    bf16 = Int4Linear(q, scale, zero, None, torch.bfloat16)
    y = bf16(x.bfloat16()).float()
    rel = ((y - x @ dense.T).norm() / (x @ dense.T).norm()).item()
    assert rel < 0.02, rel


@pytest.mark.parametrize(
    ("kind", "stored"),
    [("Q4_0", torch.float16), ("Q4_1", torch.float16), ("Q4_K", torch.float32)],
)
def test_group_scales_keep_the_files_fp16_pairs_where_exact(kind: str, stored: torch.dtype) -> None:
    """Q4_0 / Q4_1 keep each block's fp16 (d, m): 20 bytes a group, as in the file; Q4_K's
    scales (d times a 6-bit scale) are not fp16 values and stay float32. Either way the layer is
    the dequantized weight's product."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    w = np.random.default_rng(3).standard_normal((48, 256)).astype(np.float32)
    raw = quantized_blocks(w, qtype, np.random.default_rng(4))
    dense = torch.from_numpy(quants.dequantize(raw, qtype).copy())
    layer = Int4Linear(*unpack(QuantizedRows(qtype, raw, (48, 256))), None, torch.float32)
    assert layer.scale.dtype == layer.zero.dtype == stored
    group_bytes = layer.qs[0, :16].numel() + 2 * layer.scale.element_size()
    assert group_bytes == (20 if stored == torch.float16 else 24)
    x = torch.randn(3, 256)
    assert (layer(x) - x @ dense.T).abs().max().item() < 1e-4
    head = Q8Linear(*unpack_q8_0(_rows("Q8_0", 48, 256)[0]), None, torch.float32)
    assert head.scale.dtype == torch.float16


@pytest.mark.parametrize("kind", EMBEDDING_TYPES)
def test_quantized_embedding_rows_are_exact(kind: str) -> None:
    rows, dense = _rows(kind, 40, 64, seed=1)
    ids = torch.tensor([[3, 0, 39], [7, 7, 1]])
    assert torch.equal(QuantizedEmbedding(rows, torch.float32)(ids), dense[ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_few_and_many_row_paths_match_the_dequantized_weight(kind: str, dtype: torch.dtype) -> None:
    """With the C++ kernels, up to GEMV_ROWS rows multiply on the groups and more expand the
    weight (bfloat16 rows past the few-row bound: the slab product, where built); without them
    torch ops expand it; each agrees with the dequantized weight."""
    from engine.worker.attention.cpu_kernel import load_kernel

    ops = load_kernel().ops
    if ops is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    rows, dense = _rows(kind, 40, 96, seed=2)
    bias = torch.randn(40)

    def layer() -> GroupedLinear:
        if kind == "Q8_0":
            return Q8Linear(*unpack_q8_0(rows), bias, dtype)
        return Int4Linear(*unpack(rows), bias, dtype)

    fast, plain = layer(), layer()
    fast.use_kernel(ops)
    tol = 1e-5 if dtype == torch.float32 else 0.02
    for m in (1, 3, 4, 5, GEMV_ROWS, GEMV_ROWS + 1, 100):
        x = torch.randn(m, 96)
        want = x @ dense.T + bias
        for which in (fast, plain):
            got = which(x.to(dtype)).float()
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < tol, (m, which is fast, rel)


def test_q8_rows_and_head_rows_embedding_are_exact() -> None:
    rows, dense = _rows("Q8_0", 40, 64, seed=5)
    head = Q8Linear(*unpack_q8_0(rows), None, torch.float32)
    ids = torch.tensor([[3, 0, 39], [7, 7, 1]])
    assert torch.equal(HeadRowsEmbedding(head, torch.float32)(ids), dense[ids])


def test_quantized_linear_refuses_shapes_it_cannot_take() -> None:
    q = np.zeros((16, 48), dtype=np.int32)  # 48 inputs: not whole groups of 32
    scale = np.ones((16, 1), dtype=np.float32)
    with pytest.raises(ValueError, match="in_features % 32"):
        Int4Linear(q, scale, scale, None, torch.float32)


@pytest.fixture(scope="module")
def llama_gguf(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_llama_path, tmp_path_factory.mktemp("gguf") / "llama.gguf", LLAMA_TYPES)


@pytest.fixture(scope="module")
def qwen2_gguf(tiny_qwen2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_qwen2_path, tmp_path_factory.mktemp("gguf") / "qwen2.gguf", QWEN2_TYPES)


def _quantized_layers(llm: LLM) -> list[str]:
    model = llm.engine.core.executor.driver.model
    kinds = (GroupedLinear, QuantizedEmbedding, HeadRowsEmbedding)
    return [name for name, m in model.named_modules() if isinstance(m, kinds)]


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_gguf_matches_transformers_dequantized(
    which: str, llama_gguf: Path, qwen2_gguf: Path
) -> None:
    """Greedy tokens equal transformers' on the file's dequantized weights, with every kept
    layer computing on its blocks, under each parity configuration."""
    file = llama_gguf if which == "llama" else qwen2_gguf
    prompts = shared_prefix_prompts(512, 16, 600, seed=4)
    want, _ = hf_reference(file.parent, prompts, MAX_TOKENS, gguf_file=file.name)
    for name, cfg in CONFIGS.items():
        llm = LLM(str(file), dtype="float32", quantization="gguf", block_size=16, **cfg)  # type: ignore[arg-type]
        layers = _quantized_layers(llm)
        if which == "llama":  # 2 x (qkv, o, gate_up), layer 1's down, the head, the embedding
            assert len(layers) == 9, layers
            assert "model.layers.0.mlp.down_proj" not in layers  # Q5_0: expanded
        else:  # 2 layers x (qkv, o, gate_up, down) + the tied Q8_0 head + the embedding
            assert len(layers) == 10, layers
            assert isinstance(llm.engine.core.executor.driver.model.lm_head, Q8Linear)
        outs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        )
        got = [o.outputs[0].token_ids for o in outs]
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"{which} {name}: prompt {i} differs: {g} != {w}"
        assert_config_took_effect(name, llm.engine.get_stats())
        kv = llm.engine.core.kv
        assert kv.num_free_blocks == kv.num_blocks


def test_gguf_quantization_none_expands_and_auto_keeps(llama_gguf: Path) -> None:
    llm = LLM(str(llama_gguf), dtype="float32", quantization="none", num_device_blocks=64)
    assert _quantized_layers(llm) == []
    llm = LLM(str(llama_gguf), dtype="float32", num_device_blocks=64)  # auto
    assert len(_quantized_layers(llm)) == 9


def test_gguf_folder_is_found_and_tokenizer_read(llama_gguf: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(llama_gguf, folder / "llama.gguf")
    assert find_gguf(folder) == folder / "llama.gguf"
    llm = LLM(str(folder), dtype="bfloat16", num_device_blocks=64)  # auto: kept
    assert len(_quantized_layers(llm)) == 9
    tok = llm.engine.core.tokenizer
    assert tok.eos_token_id == 2 and tok.chat_template
    out = llm.generate(
        ["Hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 4
    shutil.copy(llama_gguf, folder / "other.gguf")
    with pytest.raises(ValueError, match="2 GGUF files"):
        find_gguf(folder)


def test_fingerprint_tells_kept_from_expanded(llama_gguf: Path, tiny_llama_path: Path) -> None:
    from engine.worker.model_loader import model_fingerprint

    kept, expanded = model_fingerprint(llama_gguf, "gguf"), model_fingerprint(llama_gguf, "none")
    assert kept != expanded
    assert model_fingerprint(tiny_llama_path, "gguf") == model_fingerprint(tiny_llama_path)


def test_bad_gguf_files_are_refused_at_start(llama_gguf: Path, tmp_path: Path) -> None:
    wrong_magic = tmp_path / "magic.gguf"
    wrong_magic.write_bytes(b"GGML" + llama_gguf.read_bytes()[4:])
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(llama_gguf.read_bytes()[: llama_gguf.stat().st_size // 2])
    for bad in (wrong_magic, truncated):
        with pytest.raises(ValueError, match="not a readable GGUF file"):
            LLM(str(bad), dtype="float32", num_device_blocks=64)


def test_unsupported_architecture_and_misplaced_options(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    import gguf

    other = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(other), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture 'gpt2'.*deja serves llama, qwen2, qwen3"):
        LLM(str(other), dtype="float32", num_device_blocks=64)
    with pytest.raises(ValueError, match="quantization gguf needs a GGUF model"):
        LLM(str(tiny_llama_path), dtype="float32", quantization="gguf", num_device_blocks=64)


def test_q4_k_rows_are_exact() -> None:
    """Q4_K super-blocks unpack into groups of 32 exactly: the layer (float32) computes with the
    weight gguf dequantizes."""
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(3).standard_normal((48, 512)).astype(np.float32)
    raw = quantized_blocks(w, GGMLQuantizationType.Q4_K, np.random.default_rng(4))
    dense = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_K).copy())
    q, scale, zero = unpack(QuantizedRows(GGMLQuantizationType.Q4_K, raw, (48, 512)))
    expanded = (q.reshape(48, 16, 32) - 8) * scale[..., None] + zero[..., None]
    np.testing.assert_allclose(expanded.reshape(48, 512), dense.numpy(), rtol=1e-6, atol=1e-7)
    layer = Int4Linear(q, scale, zero, None, torch.float32)
    x = torch.randn(5, 512)
    torch.testing.assert_close(layer(x), x @ dense.T, rtol=1e-5, atol=1e-5)


def test_q4_k_m_style_file_matches_transformers(tmp_path: Path) -> None:
    """A Q4_K_M-like file (Q4_K projections, a Q8_0 down projection and head): the Q4_K linears
    stay 4-bit, the Q8_0 ones 8-bit, and greedy tokens equal transformers' GGUF loader in
    float32."""
    src = build_tiny_llama(tmp_path / "m", hidden_size=256, intermediate_size=512)
    types = {"down_proj": "Q8_0", "_proj": "Q4_K", "lm_head": "Q8_0"}
    file = write_gguf(src, tmp_path / "q4km.gguf", types)
    prompts = shared_prefix_prompts(512, 8, 400, seed=7)
    want, _ = hf_reference(file.parent, prompts, MAX_TOKENS, gguf_file=file.name)
    llm = LLM(str(file), dtype="float32", quantization="gguf", block_size=16, num_device_blocks=256)
    # 2 layers x (qkv, o, gate_up) 4-bit, their down projections and the head 8-bit
    layers = dict(llm.engine.core.executor.driver.model.named_modules())
    kept = [n for n in _quantized_layers(llm) if "embed" not in n]
    assert sum(isinstance(layers[n], Int4Linear) for n in kept) == 6
    assert sum(isinstance(layers[n], Q8Linear) for n in kept) == 3
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in outs] == want


def test_q6_k_rows_are_exact() -> None:
    """Q6_K's 6-bit values minus 32 in int8, a scale d sc_j every 16 inputs: the dequantized
    weight exactly; its products (few rows on the groups, many expanded) agree with it."""
    from gguf import GGMLQuantizationType, quants

    from engine.worker.attention.cpu_kernel import load_kernel

    qtype = GGMLQuantizationType.Q6_K
    w = np.random.default_rng(8).standard_normal((40, 512)).astype(np.float32)
    raw = quantized_blocks(w, qtype, np.random.default_rng(9))
    dense = torch.from_numpy(quants.dequantize(raw, qtype).copy())
    rows = unpack_q6_k(QuantizedRows(qtype, raw, (40, 512)))
    assert rows.scale.shape == (40, 32) and rows.q.dtype == np.int8
    layer = Q8Linear(*rows, None, torch.float32)
    assert torch.equal(layer._dense(torch.float32), dense)
    ids = torch.tensor([3, 39])
    assert torch.equal(layer.rows(ids, torch.float32), dense[ids])
    ops = load_kernel().ops
    if ops is not None:
        layer.use_kernel(ops)
    for m in (1, 5, 100):
        x = torch.randn(m, 512)
        torch.testing.assert_close(layer(x), x @ dense.T, rtol=1e-5, atol=1e-4)


def test_q4_k_m_file_with_q6_k_matches_transformers(tmp_path: Path) -> None:
    """A file laid out as llama.cpp's Q4_K_M: Q4_K projections, Q6_K for the head, a v and a down
    projection, and a gate / up pair of Q8_0 and Q6_K (one 8-bit weight with a scale every 16
    inputs). The Q6_K and Q8_0 linears stay 8-bit, a q / k / v of Q4_K and Q6_K is expanded, and
    greedy tokens equal transformers' GGUF loader in float32."""
    src = build_tiny_llama(tmp_path / "m", hidden_size=256, intermediate_size=512)
    types = {
        "layers.0.self_attn.v_proj": "Q6_K",
        "layers.0.mlp.down_proj": "Q6_K",
        "layers.1.mlp.gate_proj": "Q8_0",
        "layers.1.mlp.up_proj": "Q6_K",
        "_proj": "Q4_K",
        "lm_head": "Q6_K",
    }
    file = write_gguf(src, tmp_path / "q4km.gguf", types)
    prompts = shared_prefix_prompts(
        512, 8, 400, seed=12
    )  # no greedy path meets EOS (masked by the reference)
    want, _ = hf_reference(file.parent, prompts, MAX_TOKENS, gguf_file=file.name)
    llm = LLM(str(file), dtype="float32", quantization="gguf", block_size=16, num_device_blocks=256)
    model = llm.engine.core.executor.driver.model
    layers = dict(model.named_modules())
    kept = [n for n in _quantized_layers(llm) if "embed" not in n]
    assert "model.layers.0.self_attn.qkv_proj" not in kept  # 4-bit and 8-bit shards: expanded
    assert sum(isinstance(layers[n], Int4Linear) for n in kept) == 5
    eight = [n for n in kept if isinstance(layers[n], Q8Linear)]
    assert sorted(eight) == [
        "lm_head",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.gate_up_proj",
    ]
    assert all(layers[n].scale.shape[1] == layers[n].in_features // 16 for n in eight)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.timeout(900)
@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_gguf_on_two_ranks(which: str, llama_gguf: Path, qwen2_gguf: Path) -> None:
    """Tensor parallelism over a GGUF file: each rank keeps its part of every kept linear (the
    output rows of the column-parallel ones, whole groups of the inputs of the row-parallel o
    and down projections, its vocabulary rows of an untied head); greedy tokens equal
    transformers' on the file's dequantized weights."""
    file = llama_gguf if which == "llama" else qwen2_gguf
    prompts = shared_prefix_prompts(512, 8, 300, seed=4)
    want, _ = hf_reference(file.parent, prompts, MAX_TOKENS, gguf_file=file.name)
    llm = LLM(str(file), dtype="float32", tensor_parallel_size=2, num_device_blocks=256)
    model = llm.engine.core.executor.driver.model
    kept = [n for n, m in model.named_modules() if isinstance(m, GroupedLinear)]
    # llama: 2 x (qkv, o, gate_up), layer 1's down, the head; qwen2: 2 x 4 (its head is tied)
    assert len(kept) == 8, kept
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in outs] == want
    llm.engine.core.executor.close()


def test_sources_cut_for_a_rank_keep_whole_groups_only() -> None:
    """A rank's part of a kept weight: output rows as they are; inputs in whole groups of 32 (a
    Q6_K weight's 16-input scales cut with them); a part that splits a group is left out (that
    linear is expanded), as is a weight the rank holds none of."""
    from gguf import GGMLQuantizationType

    rows4, _ = _rows("Q4_1", 8, 128)
    q6 = GGMLQuantizationType.Q6_K
    raw6 = quantized_blocks(np.ones((8, 256), np.float32), q6, np.random.default_rng(0))
    rows6 = unpack_q6_k(QuantizedRows(q6, raw6, (8, 256)))
    four = unpack(rows4)
    whole: dict[str, Int4Rows | Q8Rows] = {"a": four, "b": four, "c": rows6, "d": rows6, "e": rows6}
    sources = Int4Sources({n: r.q.shape for n, r in whole.items()}, whole.__getitem__)
    part = sources.sliced({"a": (0, 2, 4), "b": (1, 48, 32), "c": (1, 64, 128), "d": None})
    assert dict(part.shapes) == {"a": (4, 128), "c": (8, 128), "e": (8, 256)}
    a = part.unpack("a")
    assert all(np.array_equal(x, y[2:6]) for x, y in zip(a, whole["a"], strict=True))
    c = part.unpack("c")
    assert np.array_equal(c.q, rows6.q[:, 64:192]) and np.array_equal(c.scale, rows6.scale[:, 4:12])
