"""Phi-3 / Phi-3.5 / Phi-4-mini: the shared decoder with what the shared layers already read from
the config: q/k/v and gate/up stored fused (`qkv_proj`, `gate_up_proj`, loaded as they are),
partial rotary (`partial_rotary_factor`, Phi-4-mini 0.75) and LongRoPE scaling."""

from __future__ import annotations

from engine.worker.models.base import CausalLM


class Phi3ForCausalLM(CausalLM):
    """Nothing to override: every difference is in the config the shared layers read."""
