"""Speculative decoding's proposals (the scheduler's side): prompt lookup, the per-tenant suffix
corpus, each sample's adaptive state; verification is the worker's (engine/worker/model_runner.py)."""
