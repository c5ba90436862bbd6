"""The CPU tier's CUDA path: KVOffload plans on a device cache with a pinned CPU tier, direct
(cuda/tier_copy.py) and staged, give what the CPU path gives."""

from __future__ import annotations

import pytest
import torch

from cuda.tier_copy import runs
from engine.kv.plan import KVPlan
from engine.kv_io.offload import KVOffload

L, BS, H, D = 3, 16, 2, 64


def test_runs_merge_consecutive_pairs() -> None:
    assert runs([(5, 9), (3, 1), (4, 2), (6, 10), (7, 0)]) == [(3, 1, 2), (5, 9, 2), (7, 0, 1)]
    assert runs([]) == []


def _apply(plan: KVPlan, dev: torch.Tensor, cpu: torch.Tensor, direct: bool | None) -> None:
    store = KVOffload(cpu)
    if direct is not None:
        store.direct_copies = direct
    store.apply(plan, dev)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_spill_then_swap_in_matches_cpu(direct: bool, dtype: torch.dtype) -> None:
    if direct:
        pytest.importorskip("cupy")
    g = torch.Generator().manual_seed(0)
    dev_cpu = torch.randn((L, 2, 12, BS, H, D), generator=g).to(dtype)
    tier_cpu = torch.randn((L, 2, 8, BS, H, D), generator=g).to(dtype)
    plan = KVPlan(spill=[(2, 0), (3, 1), (9, 5)], swap_in=[(6, 4), (7, 5 + 6), (2, 0)])
    # CPU reference: spills first, then swap-ins (source blocks never spilled in the same step)
    ref_dev, ref_tier = dev_cpu.clone(), tier_cpu.clone()
    KVOffload(ref_tier).apply(plan, ref_dev)

    dev = dev_cpu.cuda()
    tier = tier_cpu.pin_memory()
    _apply(plan, dev, tier, direct)
    assert torch.equal(tier, ref_tier)
    assert torch.equal(dev.cpu(), ref_dev)
