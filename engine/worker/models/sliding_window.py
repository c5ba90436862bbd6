"""Sliding-window attention from a checkpoint's config: the window of each layer.

Semantics (transformers' `sliding_window_overlay` on top of the causal mask): with window W, a
query at position p sees key position k iff k <= p and p - k < W, i.e. the last W positions up
to and including its own. None means full causal attention.

Where the config says so:
- Mistral: `sliding_window` (every layer; None or absent: off).
- Qwen2: `use_sliding_window` + `sliding_window`, per layer by `layer_types` ("sliding_attention"
  layers slide); transformers 5 computes `layer_types` from `max_window_layers` (layers i >=
  max_window_layers slide) and we do the same for a config object without it.
- Any config with `layer_types` (Gemma 2/3, Qwen3 ...): "sliding_attention" layers get the window.
"""

from __future__ import annotations

from typing import Any

SLIDING = "sliding_attention"


def layer_windows(hf_config: Any) -> list[int | None]:
    """The sliding window of every layer (None: full attention); ValueError on a bad window."""
    num_layers = int(hf_config.num_hidden_layers)
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:
        window = None
    if window is None:
        return [None] * num_layers
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        return [window if t == SLIDING else None for t in layer_types]
    max_window_layers = getattr(hf_config, "max_window_layers", None)
    if getattr(hf_config, "model_type", None) == "qwen2" and max_window_layers is not None:
        return [window if i >= int(max_window_layers) else None for i in range(num_layers)]
    return [window] * num_layers


def kv_window(windows: list[int | None]) -> int | None:
    """The window the KV manager may release blocks by: when every layer slides, the largest
    window (a key outside it is outside every layer's); None when any layer attends fully."""
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)
