"""Sampling (vLLM V1's `v1/sample`): parameters, the vectorized sampler, structured outputs.

sampling_params.py  per-request sampling parameters (vLLM's names and meanings)
sampler.py          vectorized sampling over a batch of logits rows
structured/         JSON schema, regex, grammar and choice constraints as token masks
"""
