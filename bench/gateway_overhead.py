"""`deja bench latency --gateway`: what the SMG gateway costs a caller.

One `deja serve` replica and one `deja gateway` (SMG) in front of that same replica, both started
here (prefix caching off on the replica, so that both paths can be sent the very same prompts
without one serving the other's cache). Two paths to the one replica:

- deja.v1: deja's own async gRPC client (`AsyncDejaClient`), Generate with chat messages;
- SMG: `/v1/chat/completions` through the gateway over HTTP/1.1 with server-sent events, read by
  a minimal standard-library client (bench/http_sse.py: keep-alive connections, one
  `json.loads` per chunk; no openai/pydantic models, the least client-side work).

Both get the same chat messages (random ordinary token ids decoded to text, one user message),
greedy, a fixed max_tokens with EOS ignored (deja.v1: `ignore_eos`; SMG: the `ignore_eos`
extension field of its chat request, passed to the replica as the engine's `ignore_eos`). Every
request is checked to produce exactly max_tokens tokens. The two paths run **alternately**,
request by request (one user) and run by run (load), the order flipping each time: on a machine
whose speed drifts, only alternated runs are comparable.

- One user: one request at a time. TTFT = request sent -> first output (deja.v1: the first
  message with token ids; SMG: the first chunk with text). Decode tok/s = (tokens - 1) / (last
  output - first output); SMG's chunks carry text, not ids, so a chunk counts as one token and
  the usage's completion_tokens makes up any difference at the end. Bounds: SMG / deja.v1 decode
  >= 0.95 and SMG TTFT - deja.v1 TTFT <= 10 ms (medians of the alternated pairs).
- Load (`deja bench serve`'s runner, closed loop): a single-turn random workload at each
  concurrency level, through each path in turn, --load-rounds times. Output throughput = output
  tokens / wall time, pooled over rounds. Bound: SMG / deja.v1 >= 0.95 at every level.

    deja bench latency --gateway [--model demo] [--repeats 8] [--load-concurrency 8,32] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import common, report
from bench.http_sse import ChatStream, SseClient
from bench.report import Check
from bench.router_smg import wait_models
from bench.served import GrpcBackend, MessagesOf, run_measured
from bench.workload import DatasetSpec, Record, Workload, run_one, summarize
from clients.client import AsyncDejaClient
from clients.testing.cluster import deja_argv, serving
from service.common.ports import free_port

DEJA, SMG = "deja.v1 (gRPC)", "SMG (OpenAI HTTP)"
PATHS = (DEJA, SMG)
TARGET_DECODE_RATIO = 0.95
TARGET_TTFT_EXTRA_MS = 10.0
TARGET_THROUGHPUT_RATIO = 0.95
FULL = {
    "prompt_len": 128, "new_tokens": 96, "repeats": 8, "load_concurrency": "8,32",
    "load_requests": 64, "load_input_len": 128, "load_output_len": 64, "load_rounds": 2,
}  # fmt: skip
QUICK = {
    "prompt_len": 16, "new_tokens": 8, "repeats": 2, "load_concurrency": "8,32",
    "load_requests": 8, "load_input_len": 16, "load_output_len": 8, "load_rounds": 1,
}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway target's flags (on `deja bench latency`)."""
    g = parser.add_argument_group("--gateway: SMG vs deja.v1 on one replica")
    g.add_argument("--gateway", action="store_true", help="measure the SMG gateway's overhead")
    g.add_argument("--load-concurrency", default=None, help="levels, comma-separated (8,32)")
    g.add_argument("--load-requests", type=int, default=None, help="requests per level (64)")
    g.add_argument("--load-input-len", type=int, default=None, help="prompt tokens (128)")
    g.add_argument("--load-output-len", type=int, default=None, help="output tokens (64)")
    g.add_argument("--load-rounds", type=int, default=None, help="runs of each path (2)")


# -- the processes -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Stack:
    target: str
    """The replica's gRPC address (deja.v1 and the gateway's engine protocol)."""
    http_port: int
    """The gateway's OpenAI API port."""
    model: str
    """The model id the gateway's /v1/models lists."""


@contextmanager
def replica_and_gateway(
    replica_argv: Callable[[str, int], list[str]],
    model_path: str,
    args: argparse.Namespace,
    tmp: Path,
) -> Iterator[Stack]:
    """`replica_argv(model_path, port)` (a `deja serve`) healthy, then `deja gateway --worker-url` in front of
    it until its /v1/models lists the model; the gateway stopped first, then the replica."""
    port, http_port = free_port(), free_port()
    target = f"127.0.0.1:{port}"
    argv = [*replica_argv(model_path, port), "--no-prefix-caching"]
    timeout = args.server_start_timeout
    with serving(tmp, "serve", argv, target, timeout, omp_threads=args.threads) as group:
        gateway = deja_argv(
            "gateway", "--model", model_path, "--worker-url", f"grpc://{target}",
            "--port", str(http_port), "--metrics-port", str(free_port()), "--log-level", "warning",
        )  # fmt: skip
        print(f"starting gateway (log {group.log_path('gateway')})", file=sys.stderr, flush=True)
        group.spawn("gateway", gateway)
        try:
            model = wait_models(group, "gateway", http_port, timeout)
            yield Stack(target, http_port, model)
            group.check_alive("gateway")
        finally:
            group.stop("gateway")


# -- the two paths -------------------------------------------------------------------------------
class ChatMessages:
    """One user message: a token-id prompt decoded with the model's tokenizer (cached, so both
    paths get the very same text and neither pays for the decode while timed)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[tuple[int, ...], list[dict[str, str]]] = {}

    def __call__(self, prompt: list[int]) -> list[dict[str, str]]:
        key = tuple(prompt)
        if key not in self.cache:
            self.cache[key] = [{"role": "user", "content": self.tokenizer.decode(prompt)}]
        return self.cache[key]


TEXT_CHUNK_TOKEN = 0
"""What stands for a token in SMG's records: its chunks carry text, not ids, so the records count
tokens (the runner's throughput and timings need only counts) and hold this in place of ids."""


class GatewayBackend(ChatStream):
    """Streamed `/v1/chat/completions` through the gateway (the runner's Backend)."""

    async def stream(
        self, prompt: list[int], output_len: int, session_id: str
    ) -> AsyncIterator[tuple[list[int], int | None]]:
        seen = 0
        async for event in self.events(prompt, output_len):
            usage = event.get("usage")
            if usage:
                extra = max(0, usage["completion_tokens"] - seen)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                yield [TEXT_CHUNK_TOKEN] * extra, cached
            elif any(c["delta"].get("content") for c in event.get("choices", [])):
                seen += 1
                yield [TEXT_CHUNK_TOKEN], None


def _order(i: int) -> tuple[str, ...]:
    return PATHS if i % 2 == 0 else PATHS[::-1]


def _checked(rec: Record, path: str, tokens: int) -> Record:
    if rec.error is not None:
        raise RuntimeError(f"{path}: {rec.error}")
    if rec.output_tokens != tokens:
        raise RuntimeError(f"{path}: {rec.output_tokens} tokens, not {tokens} (EOS not ignored?)")
    return rec


# -- one user ------------------------------------------------------------------------------------
def decode_tok_s(rec: Record) -> float | None:
    """(tokens - 1) / (last output - first output); the gaps are the record's itl_s. None when
    every token came in one message (a loaded machine can coalesce a tiny model's deltas): such a
    stream has no decode span to measure."""
    span = sum(rec.itl_s)
    return (rec.output_tokens - 1) / span if rec.itl_s and span > 0 else None


def _measured(rates: list[float | None]) -> list[float]:
    return [r for r in rates if r is not None]


async def one_user(
    backends: dict[str, Any], prompts: list[list[int]], warmup: list[int], new_tokens: int
) -> dict[str, list[Record]]:
    """Each prompt through both paths, one request at a time, the order flipping every pair."""
    for name in PATHS:
        _checked(await run_one(backends[name], warmup, new_tokens, 0, 1, "warm"), name, new_tokens)
    out: dict[str, list[Record]] = {name: [] for name in PATHS}
    for i, prompt in enumerate(prompts):
        for name in _order(i):
            rec = await run_one(backends[name], prompt, new_tokens, i, 1, f"one-user-{i}")
            out[name].append(_checked(rec, name, new_tokens))
    return out


def one_user_checks(runs: dict[str, list[Record]]) -> list[Check]:
    """Medians over the alternated pairs of SMG's decode ratio and TTFT difference."""
    pairs = list(zip(runs[DEJA], runs[SMG], strict=True))
    rates = [(decode_tok_s(d), decode_tok_s(s)) for d, s in pairs]
    ratio = common.p50([s / d for d, s in rates if d is not None and s is not None] or [0.0])
    extra_ms = common.p50([1e3 * ((s.ttft_s or 0.0) - (d.ttft_s or 0.0)) for d, s in pairs])
    return [
        Check("SMG / deja.v1 decode tok/s", ratio, f">= {TARGET_DECODE_RATIO}",
              ratio >= TARGET_DECODE_RATIO),
        Check("SMG TTFT - deja.v1 TTFT (ms)", extra_ms, f"<= {TARGET_TTFT_EXTRA_MS}",
              extra_ms <= TARGET_TTFT_EXTRA_MS),
    ]  # fmt: skip


# -- load ----------------------------------------------------------------------------------------
async def load_level(
    backends: dict[str, Any], workload: Workload, concurrency: int, rounds: int, seed: int
) -> dict[str, list[dict[str, Any]]]:
    """The workload through each path at `concurrency`, `rounds` times, alternating (the order
    flips each round), each after `concurrency` unmeasured requests (a full batch warms the
    engine at that size); each run is summarized like `deja bench serve`'s."""
    flags = argparse.Namespace(
        max_concurrency=concurrency, warmup_requests=concurrency, request_rate=math.inf,
        dataset_seed=seed, progress=False,
    )  # fmt: skip
    want = workload.sessions[0].output_len
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in PATHS}
    for r in range(rounds):
        for name in _order(r):
            records, duration = await run_measured(backends[name], workload, flags, name)
            for rec in records:
                _checked(rec, name, want)
            out[name].append(summarize(records, duration))
    return out


def pooled_throughput(runs: list[dict[str, Any]]) -> float:
    return sum(r["output_tokens"] for r in runs) / sum(r["duration_s"] for r in runs)


async def measure(
    stack: Stack,
    messages_of: MessagesOf,
    args: argparse.Namespace,
    prompts: list[list[int]],
    levels: list[int],
    vocab: tuple[int, list[int]],
) -> tuple[dict[str, list[Record]], dict[int, dict[str, list[dict[str, Any]]]]]:
    """One user on `prompts` (the first one warms up), then the load at each level; one client
    per path for all of it. `vocab`: the vocabulary size and the ids random prompts avoid."""
    deja = AsyncDejaClient(stack.target, retries=0)
    http = SseClient("127.0.0.1", stack.http_port)
    backends = {
        DEJA: GrpcBackend(deja, messages_of),
        SMG: GatewayBackend(http, stack.model, messages_of),
    }
    try:
        one = await one_user(backends, prompts[1:], prompts[0], args.new_tokens)
        print_one_user(one)
        load = {}
        for i, level in enumerate(levels):
            spec = DatasetSpec(
                num_prompts=max(args.load_requests, level), input_len=args.load_input_len,
                output_len=args.load_output_len, seed=args.seed + 1 + i,
            )  # fmt: skip
            workload = Workload.build(spec, *vocab)
            load[level] = await load_level(backends, workload, level, args.load_rounds, spec.seed)
            tok_s = {name: f"{pooled_throughput(runs):.1f}" for name, runs in load[level].items()}
            print(f"concurrency {level} done: output tok/s {tok_s}", file=sys.stderr, flush=True)
        return one, load
    finally:
        await deja.close()
        await http.close()


# -- the command ---------------------------------------------------------------------------------
def run(args: argparse.Namespace, replica_argv: Callable[[str, int], list[str]]) -> int:
    """`deja bench latency --gateway`; `replica_argv(model_path, port)` is the `deja serve` to
    start."""
    from transformers import AutoTokenizer

    vars(args).update(common.resolve_workload(args, FULL, QUICK))
    levels = [int(x) for x in str(args.load_concurrency).split(",") if x.strip()]
    if args.new_tokens < 2 or args.repeats < 1 or args.load_output_len < 2 or not levels:
        print("deja bench latency --gateway: needs --new-tokens >= 2, --repeats >= 1, "
              "--load-output-len >= 2, --load-concurrency levels", file=sys.stderr)  # fmt: skip
        return 2
    model_path, info = common.begin(args, "SMG gateway overhead: OpenAI HTTP via SMG vs deja.v1")
    messages_of = ChatMessages(AutoTokenizer.from_pretrained(model_path, local_files_only=True))
    ids, vocab_size = common.allowed_token_ids(model_path)
    rng = random.Random(args.seed)
    prompts = [common.random_prompt(rng, ids, args.prompt_len) for _ in range(args.repeats + 1)]
    print(
        f"one user: {args.repeats} alternated pairs, one chat message of {args.prompt_len} random "
        f"tokens, {args.new_tokens} new tokens (greedy, EOS ignored); load: levels {levels}, "
        f"{args.load_requests} requests (at least the level) of {args.load_input_len} -> "
        f"{args.load_output_len} tokens, {args.load_rounds} alternated rounds; {args.dtype}"
    )
    reserved = list(messages_of.tokenizer.all_special_ids)
    with (
        tempfile.TemporaryDirectory(prefix="deja-bench-gateway-") as tmp,
        replica_and_gateway(replica_argv, model_path, args, Path(tmp)) as stack,
    ):
        one, load = asyncio.run(
            measure(stack, messages_of, args, prompts, levels, (vocab_size, reserved))
        )
    return _report(args, info, model_path, one, load)


def print_one_user(one: dict[str, list[Record]]) -> None:
    """The one-user table (printed as soon as it is measured; the load takes longer)."""
    rows = []
    for name in PATHS:
        ttft = [1e3 * (r.ttft_s or 0.0) for r in one[name]]
        decode = [decode_tok_s(r) for r in one[name]]
        rows.append([name, common.p50(ttft), common.p50(_measured(decode) or [0.0]),
                     " ".join("-" if x is None else f"{x:.1f}" for x in decode)])  # fmt: skip
    report.print_table(
        ["path", "TTFT ms (p50)", "decode tok/s (p50)", "decode tok/s per run"], rows
    )
    sys.stdout.flush()


def _report(
    args: argparse.Namespace,
    info: dict[str, Any],
    model_path: str,
    one: dict[str, list[Record]],
    load: dict[int, dict[str, list[dict[str, Any]]]],
) -> int:
    checks = one_user_checks(one)
    load_rows = []
    for level, runs in load.items():
        deja, smg = pooled_throughput(runs[DEJA]), pooled_throughput(runs[SMG])
        load_rows.append([level, deja, smg, smg / deja])
        checks.append(
            Check(f"SMG / deja.v1 output tok/s at concurrency {level}", smg / deja,
                  f">= {TARGET_THROUGHPUT_RATIO}", smg >= TARGET_THROUGHPUT_RATIO * deja)
        )  # fmt: skip
    report.print_table(
        ["concurrency", "deja.v1 output tok/s", "SMG output tok/s", "SMG / deja.v1"], load_rows
    )
    for c in checks:
        print(c.line())
    print(report.finish_line(info))
    report.write_json(
        args.json,
        {
            "machine": info,
            "model": model_path,
            "workload": {k: getattr(args, k) for k in FULL} | {"dtype": args.dtype},
            "one_user": {
                name: {
                    "ttft_ms": [1e3 * (r.ttft_s or 0.0) for r in recs],
                    "decode_tok_s": [decode_tok_s(r) for r in recs],
                    "token_messages": [len(r.itl_s) + 1 for r in recs],
                    "output_tokens": [r.output_tokens for r in recs],
                }
                for name, recs in one.items()
            },
            "load": {str(level): runs for level, runs in load.items()},
            "checks": {c.name: {"value": c.value, "target": c.target, "ok": c.ok} for c in checks},
            "load_avg_now": report.load_avg(),
        },
    )
    return 1 if args.strict and not all(c.ok for c in checks) else 0
