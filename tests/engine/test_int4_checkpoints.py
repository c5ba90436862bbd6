"""AWQ and GPTQ int4 folders (packed by the formats' rules in engine/testing/tiny_int4.py): greedy
tokens equal transformers' on the dequantized weights in float32, with the linears kept 4-bit
(Int4Linear) under caching, chunked prefill and preemption, and expanded; refusals at start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from engine import LLM, SamplingParams
from engine.testing.tiny_int4 import is_quantized, write_int4
from engine.testing.tiny_models import build_tiny_llama, build_tiny_qwen2
from engine.worker.attention.cpu_kernel import load_kernel
from engine.worker.model_loader import model_fingerprint
from engine.worker.models.layers.load_quant import Int8Linear, rtn_int4, rtn_int8
from engine.worker.models.layers.quantized import Int4Linear, Q8Linear
from tests.engine.test_parity import CONFIGS, shared_prefix_prompts
from tests.support.reference import assert_config_took_effect, hf_greedy

MAX_TOKENS = 12
CASES = {
    # name: (family, method, group_size, checkpoint_format)
    "awq-llama-g64": ("llama", "awq", 64, "gptq"),
    "gptq-llama-g128": ("llama", "gptq", 128, "gptq"),
    "gptq_v2-qwen2-channel": ("qwen2", "gptq", -1, "gptq_v2"),
    "awq-qwen2-g32": ("qwen2", "awq", 32, "gptq"),
}
FULL = ("awq-llama-g64", "gptq-llama-g128")
"""The cases run under every parity configuration (the others: the cache on)."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """case -> (packed folder, dequantized reference folder); hidden 128 so groups of 128 fit."""
    root = tmp_path_factory.mktemp("int4")
    shape = dict(hidden_size=128, intermediate_size=256)
    src = {
        "llama": build_tiny_llama(root / "llama", **shape),  # type: ignore[arg-type]
        "qwen2": build_tiny_qwen2(root / "qwen2", **shape),  # type: ignore[arg-type]
    }
    return {
        name: write_int4(src[family], root / name, method, group, fmt)
        for name, (family, method, group, fmt) in CASES.items()
    }


def _int4_layers(llm: LLM) -> list[str]:
    model = llm.engine.core.executor.driver.model
    return [name for name, m in model.named_modules() if isinstance(m, Int4Linear)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("case", list(CASES))
def test_int4_folder_matches_transformers_dequantized(
    case: str, folders: dict[str, tuple[Path, Path]]
) -> None:
    packed, reference = folders[case]
    prompts = shared_prefix_prompts(512, 16, 600, seed=4)
    want = hf_greedy(reference, prompts, MAX_TOKENS)
    configs = CONFIGS if case in FULL else {"cache-on": CONFIGS["cache-on"]}
    for name, cfg in configs.items():
        llm = LLM(str(packed), dtype="float32", block_size=16, **cfg)  # type: ignore[arg-type]
        # 2 layers x (qkv, o, gate_up, down): every projection computes on its 4-bit rows
        assert len(_int4_layers(llm)) == 8, _int4_layers(llm)
        assert llm.engine.model_info.quantization == CASES[case][1]
        got = _greedy(llm, prompts)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"{case} {name}: prompt {i} differs: {g} != {w}"
        assert_config_took_effect(name, llm.engine.get_stats())
        kv = llm.engine.core.kv
        assert kv.num_free_blocks == kv.num_blocks


def test_expanded_int4_folder_matches_too(folders: dict[str, tuple[Path, Path]]) -> None:
    packed, reference = folders["gptq-llama-g128"]
    prompts = shared_prefix_prompts(512, 4, 300, seed=5)
    llm = LLM(str(packed), dtype="float32", quantization="none", num_device_blocks=128)
    assert _int4_layers(llm) == []
    kept = LLM(str(packed), dtype="float32", num_device_blocks=16).engine.model_info
    info = llm.engine.model_info
    assert (info.quantization, kept.quantization) == ("none", "gptq")
    assert kept.weight_bytes < 0.75 * info.weight_bytes  # the projections at ~0.16x of float32
    assert _greedy(llm, prompts) == hf_greedy(reference, prompts, MAX_TOKENS)


def test_fingerprint_tells_kept_from_expanded(folders: dict[str, tuple[Path, Path]]) -> None:
    packed, _ = folders["awq-llama-g64"]
    assert model_fingerprint(packed, "auto") != model_fingerprint(packed, "none")


def _variant(packed: Path, tmp_path: Path, qc: dict[str, object] | None = None) -> Path:
    out = tmp_path / "variant"
    out.mkdir()
    for f in packed.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    if qc is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"].update(qc)
        (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("case", "qc", "message"),
    [
        ("awq-llama-g64", {"bits": 8}, "AWQ checkpoint with bits 8 is not supported"),
        ("awq-llama-g64", {"version": "gemv"}, "version 'gemv' is not supported"),
        ("awq-llama-g64", {"group_size": 48}, "group_size 48 is not supported"),
        ("gptq-llama-g128", {"desc_act": True}, "desc_act true"),
        ("gptq-llama-g128", {"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        ("gptq-llama-g128", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ],
)
def test_unsupported_settings_are_refused_at_start(
    case: str,
    qc: dict[str, object],
    message: str,
    folders: dict[str, tuple[Path, Path]],
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(_variant(folders[case][0], tmp_path, qc)), dtype="float32", num_device_blocks=64)


def test_missing_and_misshapen_tensors_are_refused(
    folders: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    packed = _variant(folders["awq-llama-g64"][0], tmp_path)
    tensors = load_file(packed / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    save_file(tensors, str(packed / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj lacks qzeros"):
        LLM(str(packed), dtype="float32", num_device_blocks=64)

    tensors = load_file(folders["awq-llama-g64"][0] / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.scales"] = tensors[
        "model.layers.0.self_attn.o_proj.scales"
    ][:1]
    save_file(tensors, str(packed / "model.safetensors"))
    with pytest.raises(ValueError, match=r"o_proj: qweight .* do not fit an? AWQ group_size 64"):
        LLM(str(packed), dtype="float32", num_device_blocks=64)


def test_quantization_flag_must_match_the_checkpoint(
    folders: dict[str, tuple[Path, Path]], tiny_llama_path: Path
) -> None:
    with pytest.raises(ValueError, match="quantization awq needs an AWQ checkpoint"):
        LLM(str(folders["gptq-llama-g128"][0]), quantization="awq", num_device_blocks=64)
    with pytest.raises(ValueError, match="quantization gptq needs a GPTQ checkpoint"):
        LLM(str(tiny_llama_path), quantization="gptq", num_device_blocks=64)
    llm = LLM(
        str(folders["gptq-llama-g128"][0]),
        dtype="float32",
        quantization="gptq",
        num_device_blocks=64,
    )
    assert len(_int4_layers(llm)) == 8


def _rtn_reference(src: Path, dst: Path, kind: str) -> Path:
    """`src` with each projection replaced by its load-time quantization dequantized, computed
    here by the rules deja documents (int4: groups of 32, scale (max - min) / 15, zero min + 8
    scale, q nearest; int8: one scale a row, absmax / 127): transformers' reference weights."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    for name, w in tensors.items():
        if not is_quantized(name):
            continue
        w = w.astype(np.float32)
        if kind == "int8":
            scale = np.maximum(np.abs(w).max(axis=1), 1e-8) / 127
            tensors[name] = np.clip(np.round(w / scale[:, None]), -127, 127) * scale[:, None]
            continue
        n, k = w.shape
        g = w.reshape(n, k // 32, 32)
        lo, hi = g.min(-1), g.max(-1)
        scale = np.maximum((hi - lo) / 15, 1e-8)
        zero = lo + 8 * scale
        q = np.clip(np.round((g - zero[..., None]) / scale[..., None]) + 8, 0, 15)
        tensors[name] = ((q - 8) * scale[..., None] + zero[..., None]).reshape(n, k)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
              str(dst / "model.safetensors"))  # fmt: skip
    return dst


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_load_time_quantization_matches_transformers_dequantized(
    kind: str, tiny_qwen2_path: Path, tmp_path: Path
) -> None:
    """--quantization int4 | int8 on a float checkpoint (Qwen2: biases, a tied head): tokens equal
    transformers' on the weights quantized by the documented rule, under the cache and
    preemption."""
    reference = _rtn_reference(tiny_qwen2_path, tmp_path / "ref", kind)
    prompts = shared_prefix_prompts(512, 16, 600, seed=4)
    want = hf_greedy(reference, prompts, MAX_TOKENS)
    kinds = (Int4Linear,) if kind == "int4" else (Q8Linear,)
    for name in ("cache-on", "preempt"):
        llm = LLM(str(tiny_qwen2_path), dtype="float32", quantization=kind, block_size=16,
                  **CONFIGS[name])  # type: ignore[arg-type]  # fmt: skip
        model = llm.engine.core.executor.driver.model
        assert sum(isinstance(m, kinds) for m in model.modules()) == 8
        got = _greedy(llm, prompts)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"{kind} {name}: prompt {i} differs: {g} != {w}"
        assert_config_took_effect(name, llm.engine.get_stats())


def test_load_time_layers_in_bf16_match_their_dequantized_weights() -> None:
    """The bf16 paths (torch's int8 kernel, the int4 and int8 products on the groups) compute with
    the weight the layer holds; each rounded weight is within half a step of the original."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(128, 96, generator=gen)
    bias = torch.randn(128, generator=gen)
    x = torch.randn(5, 96, generator=gen)
    int8 = Int8Linear(w, bias, torch.bfloat16)
    w8 = int8.weight_int8.float() * int8.scales.float()[:, None]
    assert (w8 - w).abs().max() <= int8.scales.float().max() / 2 + 1e-6
    rows = rtn_int4(w.to(torch.bfloat16))
    q, scale, zero = (torch.from_numpy(a) for a in rows)
    w4 = ((q.view(128, 3, 32) - 8) * scale[..., None] + zero[..., None]).view(128, 96)
    assert (w4 - w).abs().max() <= scale.max() / 2 + 0.02  # bf16 input rounding on top
    int4 = Int4Linear(*rows, bias, torch.bfloat16)
    rows8 = rtn_int8(w.to(torch.bfloat16))
    q8 = Q8Linear(*rows8, bias, torch.bfloat16)
    w8g = torch.from_numpy(rows8.q).float() * torch.from_numpy(rows8.scale).repeat_interleave(32, 1)
    assert (w8g - w).abs().max() <= rows8.scale.max() / 2 + 0.02  # bf16 input rounding on top
    ops = load_kernel().ops
    if ops is not None:
        int4.use_kernel(ops)  # 5 rows: the product on the groups
        q8.use_kernel(ops)
    for layer, dense in ((int8, w8), (int4, w4), (q8, w8g)):
        want = x @ dense.T + bias
        got = layer(x.to(torch.bfloat16)).float()
        assert ((got - want).norm() / want.norm()).item() < 0.02, type(layer).__name__


def test_load_time_quantization_of_a_quantized_checkpoint_is_refused(
    folders: dict[str, tuple[Path, Path]],
) -> None:
    with pytest.raises(ValueError, match="quantization int4 quantizes a 16- or 32-bit checkpoint"):
        LLM(str(folders["awq-llama-g64"][0]), quantization="int4", num_device_blocks=64)


def test_fingerprint_tells_load_time_quantization(tiny_llama_path: Path) -> None:
    fps = {model_fingerprint(tiny_llama_path, q) for q in ("auto", "int4", "int8")}
    assert len(fps) == 3


@pytest.mark.timeout(900)
def test_load_time_int4_on_two_ranks(tiny_qwen2_path: Path, tmp_path: Path) -> None:
    """Each rank quantizes its shard; with 64 of the 128 inputs of a row-parallel layer a rank,
    the groups are one rank's: tokens equal transformers' on the one-rank quantized weights."""
    src = build_tiny_qwen2(tmp_path / "m", hidden_size=128, intermediate_size=256)
    reference = _rtn_reference(src, tmp_path / "ref", "int4")
    prompts = shared_prefix_prompts(512, 8, 300, seed=8)
    llm = LLM(str(src), dtype="float32", quantization="int4", tensor_parallel_size=2,
              num_device_blocks=256)  # fmt: skip
    assert llm.engine.model_info.quantization == "int4"
    assert _greedy(llm, prompts) == hf_greedy(reference, prompts, MAX_TOKENS)
    llm.engine.core.executor.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", FULL)
def test_int4_folder_on_two_ranks(case: str, folders: dict[str, tuple[Path, Path]]) -> None:
    """Each rank keeps its part of every 4-bit linear (output rows, or whole groups of 32 of a
    row-parallel layer's inputs: a group of 64 or 128 split between ranks keeps its scale);
    tokens equal transformers' on the dequantized folder."""
    packed, reference = folders[case]
    prompts = shared_prefix_prompts(512, 8, 300, seed=6)
    llm = LLM(str(packed), dtype="float32", tensor_parallel_size=2, num_device_blocks=256)
    assert len(_int4_layers(llm)) == 8, _int4_layers(llm)
    assert _greedy(llm, prompts) == hf_greedy(reference, prompts, MAX_TOKENS)
    llm.engine.core.executor.close()
