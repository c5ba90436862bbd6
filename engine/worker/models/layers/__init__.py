"""Layers the model families combine, one concept a file: linear (CPU packing), norm, rotary,
mlp (gated, SiLU / GELU-tanh), attention (fused qkv, QK norm, window, soft-cap) and moe
(batched top-k experts). A family file in models/ declares only how it differs."""
