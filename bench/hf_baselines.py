"""The transformers baselines: `generate` in static batches, continuous batching (the engine
behind `generate_batch`), and greedy parity against unpadded batch-1 `generate`.

`deja bench offline` runs all three against our engine; `deja bench latency` and `deja bench gpu`
load their transformers model and batches through here too.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench import common


# -- transformers generate -------------------------------------------------------------------
def load_hf_model(model_path: str, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=getattr(torch, dtype), local_files_only=True
    )
    return model.eval()


def pad_token_id(model: Any) -> int:
    for cand in (model.generation_config.pad_token_id, model.config.pad_token_id):
        if isinstance(cand, int):
            return cand
    eos = model.generation_config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return int(eos) if eos is not None else 0


def hf_generate_batch(
    model: Any, batch: list[common.Request], pad_id: int
) -> tuple[list[list[int]], int]:
    """Greedy `generate` on one left-padded batch run to its longest output.

    Returns each request's own tokens and the number of output tokens computed.
    """
    import torch

    width = max(len(r.prompt) for r in batch)
    padded = [[pad_id] * (width - len(r.prompt)) + r.prompt for r in batch]
    input_ids = torch.tensor(padded, device=model.device)
    ones = [[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch]
    mask = torch.tensor(ones, device=model.device)
    steps = max(r.max_tokens for r in batch)
    # NOTE: min_new_tokens == max_new_tokens keeps EOS from ending any row early (ignore_eos).
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=steps,
        min_new_tokens=steps,
        pad_token_id=pad_id,
    )
    outputs = [out[i, width : width + r.max_tokens].tolist() for i, r in enumerate(batch)]
    return outputs, steps * len(batch)


def run_hf_generate(
    model: Any, requests: list[common.Request], warmup: list[common.Request], batch_size: int
) -> common.SystemResult:
    pad_id = pad_token_id(model)
    hf_generate_batch(model, warmup[:batch_size], pad_id)
    outputs: list[list[int]] = []
    computed = 0
    with common.timed() as t:
        for i in range(0, len(requests), batch_size):
            rows, n = hf_generate_batch(model, requests[i : i + batch_size], pad_id)
            outputs.extend(rows)
            computed += n
    useful = sum(len(x) for x in outputs)
    return common.SystemResult(
        f"transformers generate (static batches of {batch_size})",
        t.wall,
        t.cpu,
        useful,
        computed,
        outputs,
    )


# -- transformers continuous batching ----------------------------------------------------------
def run_hf_generate_batch(
    model: Any,
    args: argparse.Namespace,
    requests: list[common.Request],
    warmup: list[common.Request],
) -> common.SystemResult:
    """transformers' continuous batching, one manager sized for the workload and reused.

    `generate_batch` itself takes one max_new_tokens for all requests and, unless told otherwise,
    sizes its cache from total memory; the manager it wraps takes per-request max_new_tokens.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    page = args.cb_page_size
    num_blocks = args.cb_num_blocks
    if num_blocks is None:
        # Room for every request at once: no request ever waits for cache space.
        num_blocks = sum(-(-(len(r.prompt) + r.max_tokens) // page) + 1 for r in requests)
    gen_config = GenerationConfig(
        max_new_tokens=max(r.max_tokens for r in requests),
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=pad_token_id(model),
    )
    cb_config = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=num_blocks,
        max_batch_tokens=args.cb_max_batch_tokens,
        max_requests_per_batch=args.cb_max_requests or len(requests),
        seed=args.seed,
    )

    def solve(reqs: list[common.Request]) -> list[list[int]]:
        # The first call builds the manager; later calls get it back (kept by stop() below).
        manager = model.init_continuous_batching(
            generation_config=gen_config, continuous_batching_config=cb_config
        )
        if not manager.warmed_up:
            manager.warmup()
        manager.start()
        try:
            ids = [
                manager.add_request(r.prompt, max_new_tokens=r.max_tokens, eos_token_id=-1)
                for r in reqs
            ]
            done: dict[str, list[int]] = {}
            while len(done) < len(ids):
                res = manager.get_result(timeout=1)
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' generation thread stopped early")
                    continue
                if res.is_finished():
                    if res.error is not None:
                        raise RuntimeError(f"transformers CB request failed: {res.error}")
                    done[res.request_id] = list(res.generated_tokens)
        finally:
            manager.stop(block=True, keep_for_next_session=True)
        return [done[i] for i in ids]

    try:
        solve(warmup)
        with common.timed() as t:
            outputs = solve(requests)
    finally:
        model.destroy_cached_continuous_batching_manager()
    n = sum(len(x) for x in outputs)
    name = f"transformers generate_batch (CB, {num_blocks}x{page} tok, {args.cb_max_batch_tokens}/step)"
    return common.SystemResult(name, t.wall, t.cpu, n, n, outputs)


# -- parity ------------------------------------------------------------------------------------
def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_parity(
    model: Any, requests: list[common.Request], ours: list[list[int]], count: int
) -> list[dict[str, Any]]:
    """Ours against unpadded batch-1 transformers `generate` on the `count` cheapest requests."""
    pad_id = pad_token_id(model)
    order = sorted(
        range(len(requests)),
        key=lambda i: (len(requests[i].prompt) + 8 * requests[i].max_tokens, i),
    )
    checks = []
    for i in sorted(order[:count]):
        rows, _ = hf_generate_batch(model, [requests[i]], pad_id)
        mismatch = first_mismatch(ours[i], rows[0])
        checks.append(
            {
                "request": i,
                "prompt_tokens": len(requests[i].prompt),
                "output_tokens": requests[i].max_tokens,
                "identical": mismatch is None,
                "first_mismatch": mismatch,
            }
        )
    return checks
