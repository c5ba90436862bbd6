"""The measurements of `deja bench peer`, the same code for deja and for a peer engine.

Standard library only: `deja bench peer` imports it to time our engine in its own process, and
runs it as a script under the peer's Python (vLLM's CPU build lives in its own virtual environment
with its own torch) to time the peer on the very same token ids:

    VPY bench/peer_probe.py JOB.json OUT.json      (the peer: vLLM's offline LLM)

JOB.json is written by bench/peer.py: the model folder, dtype, and the prompts of every column.
Every column is timed with the same calls on both sides: `generate(prompts, max_tokens)` runs a
batch to completion (greedy, EOS ignored) and returns the output ids.

Columns:
- offline: every request of a mixed workload at once; output tokens / wall seconds.
- decode: batch-1 decode tok/s = (n - 1) / (t(n tokens) - t(1 token)), each on a fresh prompt of
  the same length (a fresh prompt has no cached prefix on either side).
- ttft_short, ttft_cold: one fresh prompt, one output token: the wall time of that call.
- ttft_cached: a long prefix run once (so it is cached), then prefix + a few fresh tokens, one
  output token: only the new tokens need computing.
Each latency is the median of the job's repetitions.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

Generate = Callable[[Sequence[Sequence[int]], Sequence[int]], list[list[int]]]
"""generate(prompts, max_tokens) -> output ids per prompt (greedy, EOS ignored), in order."""


def _timed_one(generate: Generate, prompt: list[int], max_tokens: int) -> float:
    """Wall seconds of one request run alone to completion."""
    start = time.perf_counter()
    generate([prompt], [max_tokens])
    return time.perf_counter() - start


def measure(generate: Generate, job: dict[str, Any]) -> dict[str, Any]:
    """Times every column of `job` with `generate`; returns {column: value} plus raw timings."""
    out: dict[str, Any] = {}
    warm = job["warmup"]
    generate(warm, [8] * len(warm))

    offline = job["offline"]
    start = time.perf_counter()
    results = generate(offline["prompts"], offline["max_tokens"])
    seconds = time.perf_counter() - start
    produced = sum(len(r) for r in results)
    out["offline_tok_s"] = sum(offline["max_tokens"]) / seconds
    out["offline_seconds"] = seconds
    out["offline_outputs"] = results
    if produced != sum(offline["max_tokens"]):
        raise RuntimeError(f"offline run produced {produced} tokens, asked for {offline}")

    decode = job["decode"]
    n = decode["output_tokens"]
    rates = []
    for first, full in zip(decode["prompts_one"], decode["prompts_full"], strict=True):
        t1 = _timed_one(generate, first, 1)
        tn = _timed_one(generate, full, n)
        rates.append((n - 1) / max(tn - t1, 1e-9))
    out["decode_tok_s"] = statistics.median(rates)

    for column in ("ttft_short", "ttft_cold"):
        times = [_timed_one(generate, p, 1) for p in job[column]]
        out[f"{column}_ms"] = 1e3 * statistics.median(times)

    cached = job["ttft_cached"]
    prefix = cached["prefix"]
    generate([prefix + cached["warm_suffix"]], [1])
    times = [_timed_one(generate, prefix + s, 1) for s in cached["suffixes"]]
    out["ttft_cached_ms"] = 1e3 * statistics.median(times)
    return out


def _vllm_generate(job: dict[str, Any]) -> Generate:
    """vLLM's offline LLM on the job's model, as its CPU build runs best here (../shared/FACTS.md)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        gpu_memory_utilization=0.3,
        enable_prefix_caching=True,
        seed=0,
    )

    def generate(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[list[int]]:
        params = [
            SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens
        ]
        reqs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outs = llm.generate(reqs, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: peer_probe.py JOB.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    # NOTE: run as a script, this folder is sys.path[0], and bench/kernels.py would shadow the
    # `kernels` package that transformers probes for inside vLLM.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    start = time.perf_counter()
    generate = _vllm_generate(job)
    load_seconds = time.perf_counter() - start
    out = measure(generate, job)
    out["load_seconds"] = load_seconds
    import vllm

    out["version"] = f"vllm {vllm.__version__}"
    with open(argv[1], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
