"""The simulated replica's cost model: step time and cache sizes.

    step_s = step_overhead_s + prefill_token_s * P + prefill_pair_s * A
             + decode_seq_s * B + context_token_s * C

for a step computing P prefill tokens with A (new token, earlier token) attention pairs among
them, and B decode tokens whose sequences hold C context tokens in all. A prompt block found in the CPU tier costs `swap_block_s` to bring back instead of
`block_size * prefill_token_s` to recompute.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    name: str
    step_overhead_s: float
    prefill_token_s: float
    prefill_pair_s: float
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

    def step_s(
        self, prefill_tokens: int, prefill_pairs: float, decode_seqs: int, context_tokens: int
    ) -> float:
        return (
            self.step_overhead_s
            + self.prefill_token_s * prefill_tokens
            + self.prefill_pair_s * prefill_pairs
            + self.decode_seq_s * decode_seqs
            + self.context_token_s * context_tokens
        )

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


CPU = CostModel(
    name="cpu",
    # fitted by bench/sim/calibrate.py (rows and fit in bench/sim/calibration_cpu.json): engine
    # steps of the demo model (SmolLM2-135M, fp32, torch attention), one thread, CPU time of
    # the process, on this 2-core machine; every step within 13 % of the fit. Prefill is about
    # 380 tokens/s from scratch at 256 tokens, 210 tokens/s at 2,048 (attention).
    step_overhead_s=0.0488,
    prefill_token_s=0.00264,
    prefill_pair_s=0.00000205,
    decode_seq_s=0.00455,
    context_token_s=0.0000177,
    swap_block_s=0.0005,
    # `deja serve` defaults: 1 GiB of device KV and 0.5 GiB of CPU tier at 46,080 bytes a token
    device_blocks=1456,
    cpu_blocks=728,
    source="demo model, one CPU core of this machine (bench/sim/calibration_cpu.json)",
)

GPU = CostModel(
    name="gpu",
    # parameters, not a measurement: an 8B Llama in bf16 on one H100-class GPU: ~12k prefill
    # tokens/s, a decode step ~6 ms of weight reads plus ~50 us a sequence, 131 KB of KV a token
    # read at ~3 TB/s, 60 GB of KV (28,000 blocks of 16) and twice that in host memory.
    step_overhead_s=0.006,
    prefill_token_s=0.000083,
    prefill_pair_s=0.000000000003,
    decode_seq_s=0.00005,
    context_token_s=0.000000044,
    swap_block_s=0.00002,
    step_tokens=8192,
    device_blocks=28000,
    cpu_blocks=56000,
    source="parameters for an 8B model on one H100-class GPU (not measured)",
)

PROFILES = {"cpu": CPU, "gpu": GPU}
