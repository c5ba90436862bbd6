"""`deja bench router --overhead`: the router's own time per request, before it sends upstream.

    deja bench router --overhead --model demo --history-tokens 8192 --overhead-requests 300

The router's real code, in process, over replicas that are only handles (no process, no
polling; their load is set once): for each request it times what `deja route` does between
receiving a Generate and opening the upstream stream, that is `RouterServicer.route()`:
tokenizing the chat history (in a worker thread, as the servicer does), hashing its block
chain, looking the chain up in the affinity store (in memory, or Redis with `--redis-url`) and
the policy's decision. Phases are timed separately too, and the record written after a stream
(`record`, not on the path to the first token) is timed on its own, as is the whole history
tokenized with nothing cached (`cold`: what a conversation the router has not seen costs; chat
pieces are cached by service/router/chat_tokens.py).

Each request is one turn of its own conversation: a chat history of about `--history-tokens`
tokens, whose earlier turn the store already records on one replica (so the lookup walks a long
held chain, as a real turn 2+ does).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

from bench.workload import percentiles
from engine.frontend.prompt import tokenize_prompt
from service.affinity.config import AffinityConfig
from service.affinity.factory import create_store
from service.api.deja.v1 import inference_pb2 as pb
from service.router.config import RouterConfig
from service.router.metrics import RouterMetrics
from service.router.policy import decide
from service.router.pool import ReplicaPool
from service.router.prompt import PromptChains, PromptHasher, load_router_tokenizer
from service.router.servicer import RouterServicer

_VOCAB = (
    "the model cache router replica token prefix block session turn answer question system user "
    "assistant request stream latency budget memory device queue policy hash store load first "
    "second later again because while where which about under over into through"
)
BLOCK_SIZE = 16


def _text(rng: random.Random, words: int) -> str:
    vocab = _VOCAB.split()
    return " ".join(rng.choice(vocab) for _ in range(words))


def _conversation(rng: random.Random, tokenizer: Any, history_tokens: int) -> pb.GenerateRequest:
    """A chat request whose messages come to about `history_tokens` tokens."""
    messages = [pb.ChatMessage(role="system", content=_text(rng, 200))]
    n = 0
    while n < history_tokens:
        messages.append(pb.ChatMessage(role="user", content=_text(rng, 300)))
        messages.append(pb.ChatMessage(role="assistant", content=_text(rng, 300)))
        n += len(tokenizer.encode(messages[-1].content + " " + messages[-2].content))
    messages.append(pb.ChatMessage(role="user", content=_text(rng, 40)))
    req = pb.GenerateRequest(session_id=f"s{rng.getrandbits(48):x}")
    req.chat.messages.extend(messages)
    return req


def _pool(config: RouterConfig, store: Any, metrics: RouterMetrics, model_id: str) -> ReplicaPool:
    """A pool whose replicas are healthy handles with a set load (never polled)."""
    pool = ReplicaPool(config, store, metrics)
    for i, h in enumerate(pool.handles()):
        h.replica_id, h.model_id, h.block_size, h.healthy = f"r{i}", model_id, BLOCK_SIZE, True
        h.load = pb.Load(
            running=4 + i,
            waiting=i % 3,
            queued_prefill_tokens=512 * (i % 4),
            decoding=4,
            prefill_tokens_per_s=4000.0,
            decode_seq_s=0.002,
            step_tokens=2048,
            utilisation=0.5,
        )
    return pool


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = load_router_tokenizer(args.model, "~/.cache/deja")
    if tokenizer is None:
        raise RuntimeError("--overhead needs --model (the tokenizer the router hashes with)")
    model_id = str(args.model).rstrip("/").rsplit("/", 1)[-1]
    replicas = tuple(f"127.0.0.1:{9 + i}" for i in range(args.num_replicas))  # never dialled
    config = RouterConfig(port=0, replicas=replicas, policy=args.overhead_policy)
    store = create_store(AffinityConfig(redis_url=args.redis_url))
    metrics = RouterMetrics()
    pool = _pool(config, store, metrics, model_id)
    hasher = PromptHasher(tokenizer)
    servicer = RouterServicer(config, pool, store, hasher, metrics)
    rng = random.Random(0)
    requests = [
        _conversation(rng, tokenizer, args.history_tokens) for _ in range(args.overhead_requests)
    ]
    phases: dict[str, list[float]] = {
        k: [] for k in ("route", "tokenize", "hash", "lookup", "decide", "record", "cold")
    }
    prompt_tokens: list[int] = []
    try:
        for i, req in enumerate(requests):
            # The conversation's previous turn (all but the last message) is held by one replica.
            earlier = pb.GenerateRequest(session_id=req.session_id)
            earlier.chat.messages.extend(req.chat.messages[:-1])
            holder = f"r{i % args.num_replicas}"
            await servicer.record(earlier, holder, PromptChains(hasher, earlier, None))

            t0 = time.perf_counter()
            prompt = PromptChains(hasher, req, None)
            prompt.start()
            decision, handle = await servicer.route(req, req.session_id, prompt, set())
            phases["route"].append(time.perf_counter() - t0)
            handle.inflight -= 1
            handle.end_pending(decision.uncached_tokens)

            t0 = time.perf_counter()
            ids = await asyncio.to_thread(hasher.token_ids, req)
            t1 = time.perf_counter()
            assert ids is not None
            chain = hasher.chain(ids, model_id, BLOCK_SIZE, None)
            t2 = time.perf_counter()
            await store.longest_prefix_tiers(chain)
            t3 = time.perf_counter()
            inputs = await servicer.lookup(req, req.session_id, prompt, set())
            candidates = [h.candidate() for h in pool.healthy()]
            t4 = time.perf_counter()
            decide(config.policy, candidates, inputs, config.guard, i, config.cost)
            t5 = time.perf_counter()
            await servicer.record(req, decision.replica_id, prompt)
            t6 = time.perf_counter()
            messages = [{"role": m.role, "content": m.content} for m in req.chat.messages]
            tokenize_prompt(tokenizer, messages=messages)
            phases["cold"].append(time.perf_counter() - t6)
            phases["tokenize"].append(t1 - t0)
            phases["hash"].append(t2 - t1)
            phases["lookup"].append(t3 - t2)
            phases["decide"].append(t5 - t4)
            phases["record"].append(t6 - t5)
            prompt_tokens.append(len(ids))
    finally:
        await pool.close()
        await store.close()
    return {
        "policy": config.policy,
        "store": "redis" if args.redis_url else "memory",
        "num_replicas": args.num_replicas,
        "requests": len(requests),
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens),
        "ms": {k: percentiles(xs, (50, 99)) | {"max": 1e3 * max(xs)} for k, xs in phases.items()},
    }


def format_overhead(r: dict[str, Any]) -> str:
    lines = [
        f"== router overhead per request: {r['requests']} chat requests of "
        f"~{r['prompt_tokens_mean']:.0f} prompt tokens, policy {r['policy']}, "
        f"store {r['store']}, {r['num_replicas']} replicas (ms) ==",
        f"{'phase':<10}{'p50':>9}{'p99':>9}{'max':>9}",
    ]
    for phase, ms in r["ms"].items():
        name = "route()" if phase == "route" else phase
        lines.append(f"{name:<10}{ms['p50']:9.2f}{ms['p99']:9.2f}{ms['max']:9.2f}")
    lines.append(
        "route(): all the router does before the upstream call (tokenize in a worker thread, "
        "hash, look up, decide); record: after the stream, off the path to the first token; "
        "cold: the whole history tokenized with nothing cached (a conversation the router has "
        "not seen before)"
    )
    return "\n".join(lines)


def run_overhead(args: argparse.Namespace) -> int:
    if args.history_tokens < 1 or args.overhead_requests < 1:
        print("deja bench router: --history-tokens and --overhead-requests must be >= 1")
        return 2
    try:
        result = asyncio.run(_measure(args))
    except RuntimeError as e:
        print(f"deja bench router: {e}", file=sys.stderr)
        return 1
    print(format_overhead(result))
    return 0
