"""The simulated replica's cost model: step time and cache sizes.

    step_s = step_overhead_s + prefill_token_s * P + decode_seq_s * B + context_token_s * C

for a step computing P prefill tokens and B decode tokens whose sequences hold C context tokens
in all. A prompt block found in the CPU tier costs `swap_block_s` to bring back instead of
`block_size * prefill_token_s` to recompute.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True, slots=True)
class CostModel:
    name: str
    step_overhead_s: float
    prefill_token_s: float
    decode_seq_s: float
    context_token_s: float
    swap_block_s: float
    """Seconds to bring one block back from the CPU tier."""
    step_tokens: int = 2048
    """Token budget per step (max_num_batched_tokens)."""
    max_num_seqs: int = 256
    block_size: int = 16
    device_blocks: int = 4096
    cpu_blocks: int = 2048
    source: str = ""
    """Where the numbers come from."""

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return (
            self.step_overhead_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
            + self.context_token_s * context_tokens
        )

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def with_fit(self, fit: dict[str, float]) -> CostModel:
        return replace(self, **{k: v for k, v in fit.items() if k in self.as_dict()})


CPU = CostModel(
    name="cpu",
    # fitted by `python -m bench.sim.calibrate` (engine steps of the demo model, SmolLM2-135M,
    # fp32, 2 cores, this machine, load average about 1.5 during the fit)
    step_overhead_s=0.030,
    prefill_token_s=0.00045,
    decode_seq_s=0.0045,
    context_token_s=0.0000020,
    swap_block_s=0.0005,
    device_blocks=4096,
    cpu_blocks=2048,
    source="demo model on this machine's CPU (bench/sim/calibrate.py)",
)

GPU = CostModel(
    name="gpu",
    # parameters, not a measurement: an 8B model in bf16 on one H100-class GPU (prefill about
    # 12k tokens/s, a decode step about 8 ms plus ~0.1 ms per sequence)
    step_overhead_s=0.008,
    prefill_token_s=0.000083,
    decode_seq_s=0.0001,
    context_token_s=0.00000002,
    swap_block_s=0.00002,
    step_tokens=8192,
    device_blocks=30000,
    cpu_blocks=60000,
    source="parameters for an 8B model on one H100-class GPU (not measured)",
)

PROFILES = {"cpu": CPU, "gpu": GPU}
