"""`deja bench quant --llama-server PATH`: a GGUF file served as it is, by deja (a replica keeping
its weights quantized, behind the SMG gateway) and by llama.cpp's OpenAI server, under the same
streamed chat workload at one concurrency, in one run.

The workload is the shared-prefix one (`--served-prefix-len` tokens shared by each of 4 groups of
prompts, `--served-input-len` more each, `--served-output-len` greedy tokens with EOS ignored),
as token ids decoded into one user message by the file's tokenizer, so both servers get the same
text. The servers run one at a time (rounds alternate which goes first), each with `--threads`
threads: llama-server with `--parallel` = the concurrency, `--cont-batching` and a context of
2,048 tokens a slot. Printed: each server's output throughput and TTFT p50, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.gateway_overhead import ChatMessages, GatewayBackend, pooled_throughput
from bench.http_sse import SseClient
from bench.router_smg import wait_models
from bench.served import run_measured
from bench.workload import DatasetSpec, Workload, summarize
from clients.testing.cluster import deja_argv, serving
from service.common.ports import free_port

DEJA, LLAMA = "deja (SMG gateway)", "llama.cpp server"
TARGET_RATIO = 1.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("served comparison (with --llama-server)")
    g.add_argument("--llama-server", default=None, help="a llama.cpp build's llama-server")
    g.add_argument("--served-concurrency", type=int, default=8)
    g.add_argument("--served-requests", type=int, default=64)
    g.add_argument("--served-prefix-len", type=int, default=512)
    g.add_argument("--served-input-len", type=int, default=64)
    g.add_argument("--served-output-len", type=int, default=64)
    g.add_argument("--served-rounds", type=int, default=2)


def compare(args: argparse.Namespace, file: Path, dtype: str) -> dict[str, Any]:
    """Both servers up on `file`, the workload through each; their summaries and the ratio."""
    from engine.worker.model_loader import load_tokenizer

    tokenizer = load_tokenizer(str(file))
    conc = args.served_concurrency
    spec = DatasetSpec(
        name="shared-prefix", num_prompts=max(args.served_requests, conc),
        input_len=args.served_input_len, output_len=args.served_output_len,
        prefix_len=args.served_prefix_len, seed=args.seed,
    )  # fmt: skip
    workload = Workload.build(spec, len(tokenizer), list(tokenizer.all_special_ids))
    with tempfile.TemporaryDirectory(prefix="deja-bench-quant-served-") as tmp_name:
        tmp = Path(tmp_name)
        tok_dir = tmp / "tokenizer"  # SMG reads a folder's tokenizer, not a GGUF file
        tokenizer.save_pretrained(str(tok_dir))
        port, http_port, llama_port = free_port(), free_port(), free_port()
        target = f"127.0.0.1:{port}"
        serve = deja_argv(
            "serve", "--model", str(file), "--dtype", dtype, "--port", str(port),
            "--threads", str(args.threads), "--max-num-seqs", str(max(conc, 16)),
        )  # fmt: skip
        timeout = 300.0
        with serving(tmp, "serve", serve, target, timeout, omp_threads=args.threads) as group:
            group.spawn("gateway", deja_argv(
                "gateway", "--model", str(tok_dir), "--worker-url", f"grpc://{target}",
                "--port", str(http_port), "--metrics-port", str(free_port()),
                "--log-level", "warning",
            ))  # fmt: skip
            group.spawn("llama", [
                args.llama_server, "-m", str(file), "--port", str(llama_port),
                "--parallel", str(conc), "-c", str(2048 * conc), "--cont-batching",
                "--no-webui", "-t", str(args.threads),
            ])  # fmt: skip
            try:
                models = {
                    DEJA: (http_port, wait_models(group, "gateway", http_port, timeout)),
                    LLAMA: (llama_port, wait_models(group, "llama", llama_port, timeout)),
                }
                runs = asyncio.run(_measure(models, workload, ChatMessages(tokenizer), args))
            finally:
                group.stop("gateway")
                group.stop("llama")
    out: dict[str, Any] = {"workload": dataclasses.asdict(spec), "concurrency": conc, "runs": runs}
    tput = {name: pooled_throughput(r) for name, r in runs.items()}
    out["output_tok_s"] = tput
    out["ratio"] = tput[DEJA] / tput[LLAMA] if tput[LLAMA] else math.nan
    return out


async def _measure(
    models: dict[str, tuple[int, str]], workload: Workload, messages: Any, args: argparse.Namespace
) -> dict[str, list[dict[str, Any]]]:
    clients = {name: SseClient("127.0.0.1", port) for name, (port, _) in models.items()}
    backends = {
        name: GatewayBackend(clients[name], model, messages) for name, (_, model) in models.items()
    }
    flags = argparse.Namespace(
        max_concurrency=args.served_concurrency, warmup_requests=args.served_concurrency,
        request_rate=math.inf, dataset_seed=args.seed, progress=False,
    )  # fmt: skip
    names = list(models)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    try:
        for r in range(args.served_rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                records, duration = await run_measured(backends[name], workload, flags, name)
                bad = [rec.error for rec in records if rec.error]
                if bad:
                    raise RuntimeError(f"{name}: {len(bad)} requests failed, first: {bad[0]}")
                runs[name].append(summarize(records, duration))
                print(f"round {r}: {name} done", file=sys.stderr, flush=True)
    finally:
        for c in clients.values():
            await c.close()
    return runs


def print_result(res: dict[str, Any]) -> None:
    w = res["workload"]
    print(
        f"served, concurrency {res['concurrency']}: {w['num_prompts']} chat requests, "
        f"{w['num_groups']} shared prefixes of {w['prefix_len']} tokens + {w['input_len']}, "
        f"{w['output_len']} tokens out (greedy, EOS ignored)"
    )
    for name, runs in res["runs"].items():
        ttft = sorted(r["ttft_ms"]["p50"] for r in runs)
        print(
            f"  {name}: output {res['output_tok_s'][name]:.1f} tok/s, TTFT p50 "
            f"{ttft[len(ttft) // 2]:.0f} ms ({len(runs)} rounds)"
        )
    print(f"  deja / llama.cpp output throughput: {res['ratio']:.2f}x (target >= {TARGET_RATIO}x)")
