"""The families' shared layers against transformers, and checkpoints refused or read as
published: sharded with an index, per-expert or fused expert tensors, bf16 on disk."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.config import ModelConfig
from engine.testing.tiny_models import FAMILY_BUILDERS
from engine.worker.attention import TorchAttentionBackend
from engine.worker.model_loader import iter_weights, load_model, read_hf_config
from engine.worker.models import SUPPORTED_ARCHITECTURES, get_model_class, model_family
from engine.worker.models.layers.linear import pack_linears
from engine.worker.models.layers.moe import MoESpec, SparseMoE
from engine.worker.models.layers.rotary import RotaryEmbedding, apply_rope, rope_inv_freq
from tests.engine.worker.test_model import _check_parity

torch.set_num_threads(2)
CPU = torch.device("cpu")


def _load(path: Path, dtype: str = "float32") -> Any:
    model, _ = load_model(ModelConfig(path=str(path), dtype=dtype), CPU, TorchAttentionBackend())
    return model


def _load_unpacked(path: Path) -> Any:
    """Our model with the checkpoint's weights, before the CPU packing (its full state dict)."""
    cfg = read_hf_config(path)
    model = get_model_class(cfg)(cfg, torch.float32, TorchAttentionBackend())
    model.load_weights(iter_weights(path))
    return model


def _rewrite(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of checkpoint `src` whose tensors `edit` changed in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family", sorted(FAMILY_BUILDERS))
def test_family_logits_match_transformers(family: str, tiny_family: Callable[[str], Path]) -> None:
    path = tiny_family(family)
    assert model_family(read_hf_config(path)) == family
    _check_parity(path, 16)


def test_registry_lists_families() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'") as err:
        get_model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"]))
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(err.value)
    for name in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                 "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"):  # fmt: skip
        assert name in SUPPORTED_ARCHITECTURES


def test_mismatched_checkpoints_refused_by_name(
    tiny_family: Callable[[str], Path], tmp_path: Path
) -> None:
    mixtral = tiny_family("mixtral")
    expert = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    missing = _rewrite(mixtral, tmp_path / "missing", lambda t: t.__delitem__(expert))
    with pytest.raises(ValueError, match=r"missing weights: \[.*experts\.5\.w3\.weight"):
        _load(missing)
    router = "model.layers.0.block_sparse_moe.gate.weight"
    with pytest.raises(
        ValueError, match=r"missing weights: \['model\.layers\.0\.block_sparse_moe\.gate"
    ):
        _load(_rewrite(mixtral, tmp_path / "no-router", lambda t: t.__delitem__(router)))

    def extra(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.rotary_scale"] = torch.ones(4)

    with pytest.raises(
        ValueError,
        match=r"unexpected checkpoint weight 'model\.layers\.0\.self_attn\.rotary_scale'",
    ):
        _load(_rewrite(mixtral, tmp_path / "extra", extra))

    qwen3 = tiny_family("qwen3")
    k_norm = "model.layers.1.self_attn.k_norm.weight"

    def wrong_shape(t: dict[str, torch.Tensor]) -> None:
        t[k_norm] = torch.ones(16)

    with pytest.raises(ValueError, match=rf"{k_norm}' has shape \(16,\), expected \(32,\)"):
        _load(_rewrite(qwen3, tmp_path / "shape", wrong_shape))

    phi3 = tiny_family("phi3")
    fused = "model.layers.0.self_attn.qkv_proj.weight"

    def split(t: dict[str, torch.Tensor]) -> None:  # q_proj given besides the fused qkv_proj
        t["model.layers.0.self_attn.q_proj.weight"] = t[fused][:64].clone()

    with pytest.raises(ValueError, match=r"qkv_proj\.weight' overlaps weights already loaded"):
        _load(_rewrite(phi3, tmp_path / "twice", split))


def test_sharded_index_and_bf16_on_disk(tiny_family: Callable[[str], Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = tiny_family("qwen3_moe")
    want = _load_unpacked(src)
    hf: Any = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    sharded = tmp_path / "sharded"
    shutil.copytree(src, sharded)
    (sharded / "model.safetensors").unlink()
    hf.save_pretrained(str(sharded), max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert any(".experts.7.down_proj.weight" in name for name in index["weight_map"])
    got = _load_unpacked(sharded)
    for (name, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items(), strict=True):
        assert torch.equal(a, b), name

    bf16 = tmp_path / "bf16"
    hf.to(torch.bfloat16).save_pretrained(str(bf16))
    shutil.copy(src / "tokenizer.json", bf16)
    model = _load_unpacked(bf16)
    gate = model.model.layers[0].mlp.experts.gate_up_proj
    assert gate.dtype == torch.float32
    want_gate = want.model.layers[0].mlp.experts.gate_up_proj
    torch.testing.assert_close(gate, want_gate.bfloat16().float())


def test_fused_expert_tensors_load(tiny_family: Callable[[str], Path], tmp_path: Path) -> None:
    """transformers' own 3D expert layout (experts.gate_up_proj / down_proj) loads as stored."""
    src = tiny_family("qwen3_moe")

    def fuse(t: dict[str, torch.Tensor]) -> None:
        prefix = "model.layers.0.mlp.experts"
        gate_up, down = [], []
        for e in range(8):
            gate = t.pop(f"{prefix}.{e}.gate_proj.weight")
            gate_up.append(torch.cat([gate, t.pop(f"{prefix}.{e}.up_proj.weight")]))
            down.append(t.pop(f"{prefix}.{e}.down_proj.weight"))
        t[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        t[f"{prefix}.down_proj"] = torch.stack(down)

    want = _load_unpacked(src).state_dict()
    got = _load_unpacked(_rewrite(src, tmp_path / "fused", fuse)).state_dict()
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name


def _reference_moe(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the top-k experts' MLPs weighted by the routing weights."""
    weights, ids = moe.route(x)
    experts = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            gate, up = torch.nn.functional.linear(x[t], experts.gate_up_proj[e]).chunk(2)
            out[t] += w * torch.nn.functional.linear(experts.act(gate) * up, experts.down_proj[e])
    return out


@pytest.mark.parametrize("path", ["grouped", "loop", "packed"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_batched_matches_per_token(path: str, renormalize: bool) -> None:
    torch.manual_seed(0)
    spec = MoESpec(
        hidden_size=64, intermediate_size=32, num_experts=8, top_k=2, renormalize=renormalize
    )
    moe = SparseMoE(spec, torch.float32)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        moe.experts.grouped = path == "grouped"
        inputs = [torch.randn(tokens, 64) for tokens in (1, 3, 64)]  # decode, idle experts, batch
        want = [_reference_moe(moe, x) for x in inputs]
        if path == "packed":
            pack_linears(moe)
            assert moe.experts.packed is not None and not hasattr(moe.experts, "down_proj")
        for x, ref in zip(inputs, want, strict=True):
            torch.testing.assert_close(moe(x), ref, atol=1e-5, rtol=1e-5)
    if renormalize:
        weights, _ = moe.route(torch.randn(5, 64))
        torch.testing.assert_close(weights.sum(-1), torch.ones(5))


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 256,
         "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
         "short_factor": [1.0 + i / 10 for i in range(12)], "long_factor": [2.0 + i for i in range(12)],
         "original_max_position_embeddings": 512},
    ],
)  # fmt: skip
def test_rope_variants_match_transformers(rope: dict[str, object]) -> None:
    from transformers import LlamaConfig, Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = str(rope["rope_type"])
    # Phi3Config allows only longrope and sets its original context from its own field.
    sizes: dict[str, Any] = {"hidden_size": 128, "num_attention_heads": 4}
    sizes.update(max_position_embeddings=2048, rope_parameters=dict(rope))
    cfg = (
        Phi3Config(**sizes, original_max_position_embeddings=512)
        if rope_type == "longrope"
        else LlamaConfig(**sizes)
    )
    want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, None)
    got, scale = rope_inv_freq(cfg, 32)
    assert torch.equal(got, want) and scale == pytest.approx(want_scale)
    if rope_type == "longrope":
        want_long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, None, seq_len=513)
        assert torch.equal(rope_inv_freq(cfg, 32, long=True)[0], want_long)
        rotary = RotaryEmbedding(cfg, 32, torch.float32)
        assert rotary.rotary_dim == 24
        cos, sin = rotary(torch.tensor([3, 511, 512, 2000]))
        assert torch.equal(cos[0, 0], (3 * want).cos() * want_scale)
        assert torch.equal(cos[2, 0], (512 * want_long).cos() * want_scale)
        x = torch.randn(4, 2, 32)
        out = apply_rope(x, cos, sin)
        assert torch.equal(out[..., 24:], x[..., 24:])  # the non-rotary dims pass through
