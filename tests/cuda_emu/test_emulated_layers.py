"""cuda/layers.cu (RMSNorm with the residual add, RoPE, SiLU-and-mul) emulated on the CPU against
the torch composites the model runs without them: the residual add and RoPE bit for bit; the norm
and SiLU within one rounding step of T (their float32 sum order and exp differ from torch's CPU
kernels), nearly all elements identical."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cuda import layers
from engine.worker.models.layers.norm import RMSNorm
from engine.worker.models.layers.rotary import apply_rope
from tests.cuda_emu.emulator import Emulator

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def emulator() -> Emulator:
    return Emulator(layers.instantiations())


def _close(ours: torch.Tensor, ref: torch.Tensor, min_exact: float = 0.97) -> None:
    """Within one rounding step of the dtype everywhere; in 16-bit dtypes identical in most
    elements (in float32 a row's scale that differs in its last bit moves most of the row)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    a, b = ours.float(), ref.float()
    ulp = {torch.float32: 2**-20, torch.bfloat16: 2**-7, torch.float16: 2**-10}[ours.dtype]
    assert torch.all((a - b).abs() <= ulp * b.abs().clamp(min=1e-3) + 1e-6), (a - b).abs().max()
    exact = (a == b).float().mean().item()
    assert ours.dtype == torch.float32 or exact >= min_exact, exact


def _torch_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200, 1024])
def test_rms_norm_and_the_fused_residual_add(
    emu: Emulator, dtype: torch.dtype, hidden: int
) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(5, hidden, generator=g) * 3).to(dtype)
    h = torch.randn(5, hidden, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    _close(layers.rms_norm(x, w, 1e-5), _torch_norm(x, w, 1e-5))
    residual, normed = layers.add_rms_norm(x, h, w, 1e-6)
    assert torch.equal(residual, x + h)  # torch's add, bit for bit
    _close(normed, _torch_norm(x + h, w, 1e-6))
    assert [n for n, _, _ in emu.launches] == [layers.kernel_name("rms_norm", dtype)] * 2


def test_rms_norm_is_what_the_model_norm_computes(emu: Emulator) -> None:
    """The model's RMSNorm with the ops as its kernel gives what it gives without them."""
    norm = RMSNorm(128, 1e-5, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 128))
    x = torch.randn(3, 128).to(torch.bfloat16)
    ref = norm(x)
    norm.use_kernel(layers)
    _close(norm(x), ref)
    assert len(emu.launches) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim", "rot"), [(3, 64, 64), (2, 128, 64), (1, 96, 96)])
def test_rope_is_bit_exact(
    emu: Emulator, dtype: torch.dtype, heads: int, head_dim: int, rot: int
) -> None:
    g = torch.Generator().manual_seed(head_dim)
    tokens = 4
    # q and k side by side as the attention layer rotates them: a view with a wider token stride
    qkv = torch.randn(tokens, heads * head_dim + 32, generator=g).to(dtype)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    cos_sin = torch.randn(tokens, rot, generator=g).to(dtype)
    cos, sin = cos_sin[:, None, : rot // 2], cos_sin[:, None, rot // 2 :]
    ours = layers.rope(x, cos, sin)
    assert torch.equal(ours, apply_rope(x, cos, sin))
    assert ours.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(emu: Emulator, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(6, 2 * 300, generator=g) * 4).to(dtype)
    gate, up = gate_up.split(300, dim=-1)
    _close(layers.silu_and_mul(gate_up), F.silu(gate) * up)


def test_bad_inputs_are_refused_before_any_launch(emu: Emulator) -> None:
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="weight must be"):
        layers.rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="h must match"):
        layers.add_rms_norm(x, torch.randn(2, 32), torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="cos and sin"):
        layers.rope(x.view(2, 1, 64), torch.randn(2, 1, 40), torch.randn(2, 1, 40))
    with pytest.raises(ValueError, match="even"):
        layers.silu_and_mul(torch.randn(2, 7))
    assert not emu.launches


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_tokens_with_the_layer_kernels(
    emulator: Emulator, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, family: str
) -> None:
    """A whole engine (float32, chunked prefill, decode) whose norms, RoPE and MLP run the
    emulated kernels, as a CUDA model with the cupy backend does: the same greedy tokens as with
    torch's ops. Qwen3's QK norm runs over [T, heads, head_dim]; the lone prompt's one-token
    steps hand it contiguous heads, which go to the kernel as rows."""
    from engine import LLM, SamplingParams
    from engine.testing.tiny_models import build_tiny_llama, build_tiny_qwen3
    from engine.worker.models.base import CausalLM

    build = build_tiny_llama if family == "llama" else build_tiny_qwen3
    path = build(tmp_path, hidden_size=128, num_attention_heads=4)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 500) for _ in range(n)] for n in (3, 40, 75)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kwargs: dict[str, object] = dict(
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        num_device_blocks=64,
        max_num_batched_tokens=32,
    )
    monkeypatch.setattr(CausalLM, "use_cpu_layout", lambda self, kernels=None: None)

    def run() -> list[list[int]]:
        llm = LLM(model=str(path), **kwargs)
        together = [o.token_ids for o in llm.generate(prompts, params)]
        return together + [o.token_ids for o in llm.generate(prompts[:1], params)]

    expected = run()

    emulator.install(monkeypatch)
    emulator.launches.clear()
    monkeypatch.setattr(
        CausalLM, "use_cpu_layout", lambda self, kernels=None: self.use_kernels(layers)
    )
    got = run()
    used = {name.split("<")[0] for name, _, _ in emulator.launches}
    assert used == {"deja::rms_norm_kernel", "deja::rope_kernel", "deja::silu_and_mul_kernel"}
    assert got == expected
