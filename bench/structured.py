"""Structured outputs: output throughput with a JSON schema vs without, and grammar compile time.

    deja bench structured [--model demo] [--requests 64] [--batch 32] [--max-tokens 96]
                          [--reps 5] [--quick]

Runs the same prompts on one engine at batch `--batch` (max_num_seqs), constrained to a JSON
schema and free. The free baseline is length-matched: request i generates exactly as many tokens
as its constrained run did (ignore_eos), so both runs have the same batch shape step by step and
the ratio measures what the grammar costs, not that JSON answers end sooner than free text.
Steady state: the engine's grammar is compiled before the timed runs (compile times are measured
on their own). `--reps` pairs, the order alternating within pairs (schema first, then free first)
so drift on a shared machine does not favour one side; each pair's ratio is printed with the load
average, then the median and a PASS/FAIL line against the target (>= 0.9x). Output throughput =
generated tokens / wall time. Compile time: cold (a new compiler: tokenizer info + first compile),
a new spec on a warm compiler, and cached (same spec).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from bench import common, report

TARGET = 0.9
"""The bound: schema throughput >= 0.9x of free."""

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{3,10}@[a-z]{3,8}\\.com$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    parser.add_argument("--requests", type=int, default=64, help="requests per run (default 64)")
    parser.add_argument("--batch", type=int, default=32, help="max_num_seqs (default 32)")
    parser.add_argument("--max-tokens", type=int, default=96, help="cap per request (default 96)")
    parser.add_argument("--reps", type=int, default=5, help="alternating pairs (default 5)")


def run(args: argparse.Namespace) -> int:
    model_path, info = common.begin(args, "structured outputs")
    from engine.sample.sampling_params import SamplingParams
    from engine.sample.structured import ResponseFormat
    from engine.sample.structured.compiler import GrammarCompilerPool

    n_req = 8 if args.quick else args.requests
    max_tokens = 24 if args.quick else args.max_tokens
    llm = common.our_llm(
        model_path,
        args,
        device="auto",
        max_num_seqs=args.batch,
        num_device_blocks=args.num_device_blocks or None,
    )
    fmt = ResponseFormat.json_schema(SCHEMA)

    # Compile time on a fresh compiler (the engine's stays untouched until the measured run).
    pool = GrammarCompilerPool(
        llm.tokenizer, llm.engine.core.vocab_size, llm.engine.model_info.eos_token_ids
    )
    t0 = time.perf_counter()
    pool.submit(fmt).result()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    pool.submit(fmt).result()
    cached = time.perf_counter() - t0
    t0 = time.perf_counter()
    pool.submit(ResponseFormat.json_schema({**SCHEMA, "title": "other"})).result()
    warm_new = time.perf_counter() - t0
    pool.close()

    prompts = [
        [
            {
                "role": "user",
                "content": f"Invent person #{i} as JSON with name, age, email, tags and address.",
            }
        ]
        for i in range(n_req)
    ]
    ids = [llm.engine.tokenize(messages=m) for m in prompts]
    # Warm-up: every prompt prefilled once, so both measured runs find the same cached prefixes;
    # the engine's grammar compiled and its mask worker started (steady state is measured).
    llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=2))
    llm.engine.core.grammars.submit(fmt).result()
    llm.generate(ids[:2], SamplingParams(temperature=0.0, max_tokens=4, response_format=fmt))

    def timed(params: Any) -> tuple[dict[str, float], list[int]]:
        t0 = time.perf_counter()
        outs = llm.generate(ids, params)
        wall = time.perf_counter() - t0
        lens = [len(o.outputs[0].token_ids) for o in outs]
        valid = 0
        for o in outs:
            try:
                json.loads(o.outputs[0].text)
                valid += 1
            except ValueError:
                pass
        tokens = sum(lens)
        return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "json": valid}, lens

    schema_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, response_format=fmt)
    runs: dict[str, list[dict[str, float]]] = {"free": [], "json_schema": []}
    pairs: list[dict[str, Any]] = []
    lengths: list[int] = []
    same_lengths = True
    for rep in range(args.reps):
        order = ("json_schema", "free") if rep % 2 == 0 else ("free", "json_schema")
        load = report.load_avg()[:1]
        pair: dict[str, Any] = {"order": order[0] + " first", "load_avg_1m": load}
        for name in order:
            if name == "json_schema":
                r, lens = timed(schema_params)
                if lengths and lens != lengths:
                    same_lengths = False  # greedy: should not happen; the ratio uses tok/s anyway
                lengths = lens
            else:  # length-matched: the same number of tokens per request as the schema run
                r, _ = timed(
                    [
                        SamplingParams(temperature=0.0, max_tokens=max(1, n), ignore_eos=True)
                        for n in lengths
                    ]
                )
            runs[name].append(r)
            pair[name] = r
        pair["ratio"] = pair["json_schema"]["tok_s"] / pair["free"]["tok_s"]
        pairs.append(pair)
    results = {name: min(rs, key=lambda r: r["wall_s"]) for name, rs in runs.items()}
    ratios = sorted(p["ratio"] for p in pairs)
    ratio = statistics.median(ratios)

    print(
        f"{n_req} requests, batch {args.batch}, greedy, max_tokens {max_tokens}; free runs "
        f"length-matched to the schema run; {len(pairs)} pairs, order alternating"
    )
    for i, p in enumerate(pairs, 1):
        load_s = f"{p['load_avg_1m'][0]:.2f}" if p["load_avg_1m"] else "n/a"
        print(
            f"  pair {i} ({p['order']:17s}) json_schema {p['json_schema']['tok_s']:6.1f} tok/s, "
            f"free {p['free']['tok_s']:6.1f} tok/s, ratio {p['ratio']:.3f}  (load avg {load_s})"
        )
    for name, r in results.items():
        print(
            f"  best {name:12s} {r['tokens']:6.0f} tokens in {r['wall_s']:6.2f} s = "
            f"{r['tok_s']:7.1f} tok/s   ({r['json']:.0f}/{n_req} outputs parse as JSON)"
        )
    if not same_lengths:
        print("  note: the schema runs' greedy lengths differed between pairs")
    print(
        f"grammar compile: cold {cold * 1e3:.1f} ms (tokenizer info + compile), "
        f"new spec on a warm compiler {warm_new * 1e3:.1f} ms, cached {cached * 1e6:.0f} us"
    )
    print(report.finish_info(info))
    verdict = "PASS" if ratio >= TARGET else "FAIL"
    print(
        f"{verdict}: throughput json_schema / free = {ratio:.3f}x, median of {len(pairs)} pairs "
        f"[{' '.join(f'{r:.3f}' for r in ratios)}] (target >= {TARGET}x)"
    )
    report.write_json(
        args.json,
        {
            "results": results,
            "runs": runs,
            "pairs": pairs,
            "ratio": ratio,
            "verdict": verdict,
            "compile_cold_s": cold,
            "compile_warm_new_s": warm_new,
            "compile_cached_s": cached,
            "machine": info,
        },
    )
    return 0
