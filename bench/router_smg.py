"""The `smg` policy of `deja bench router`: SMG's cache-aware router over the
same replicas and the same conversations as deja's policies.

`smg launch --policy cache_aware` (the `smg` beside this Python, as `deja gateway` starts it)
routes to the replicas over vLLM's engine protocol, which `deja serve` speaks beside deja.v1;
SMG subscribes to the replicas' KV events for its cache index. Its callers speak OpenAI chat over
HTTP (bench/http_sse.py).

When the policies include smg, every policy is sent chat: a turn's whole conversation so far
(the workload's token ids, the answers included) decoded to the text of one user message
(bench/gateway_overhead.ChatMessages), to deja.v1 `Generate` through `deja route` and to
`/v1/chat/completions` through SMG alike, so both routers see the same text and the replicas
the same token counts. SMG's chunks carry text: each chunk's text is encoded back to ids, which
decode to the same text, so the next turn's conversation is the same text under either router.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

from bench.http_sse import ChatStream, SseClient
from bench.served import MessagesOf, run_measured
from bench.workload import Record, Workload
from clients.client import AsyncDejaClient
from clients.testing.cluster import ProcessGroup

SMG = "smg"
SMG_ROUND_ROBIN = "smg_round_robin"
"""SMG with its round-robin policy (no cache awareness): the gateway alone, the shared tier's
case."""
SMG_POLICIES = {SMG: "cache_aware", SMG_ROUND_ROBIN: "round_robin"}
REMOTE = "+remote"
"""A policy name's suffix: its replicas share a remote KV tier (a redis-server of the run's)."""


def smg_argv(
    model_path: str,
    port: int,
    metrics_port: int,
    worker_urls: list[str],
    policy: str = "cache_aware",
) -> list[str]:
    from service.gateway.command import smg_binary

    return [
        smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--policy", policy, "--model-path", model_path, "--worker-urls", *worker_urls,
    ]  # fmt: skip


def wait_models(group: ProcessGroup, name: str, port: int, timeout_s: float) -> str:
    """Waits until SMG (process `name` of `group`) serves a model; returns the model id.

    NOTE: SMG lists the model before it has loaded the tokenizer (requests meanwhile get 503
    "retry shortly"); a one-token completion answers only once both are there.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        group.check_alive(name)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                models = json.loads(r.read())["data"]
            if models and _completes(port, str(models[0]["id"])):
                return str(models[0]["id"])
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} lists no model:\n{group.tail(name)}")
        time.sleep(0.2)


def _completes(port: int, model: str) -> bool:
    """A one-token completion through SMG answers 200."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status == 200
    except OSError:  # HTTPError (503 while the tokenizer loads) included
        return False


class SmgChatBackend(ChatStream):
    """Streamed `/v1/chat/completions` through SMG (the runner's Backend)."""

    def __init__(
        self, client: SseClient, model: str, messages_of: MessagesOf, tokenizer: Any
    ) -> None:
        super().__init__(client, model, messages_of)
        self.tokenizer = tokenizer

    async def stream(
        self, prompt: list[int], output_len: int, session_id: str
    ) -> AsyncIterator[tuple[list[int], int | None]]:
        async for event in self.events(prompt, output_len):
            usage = event.get("usage")
            if usage:
                details = usage.get("prompt_tokens_details") or {}
                yield [], int(details.get("cached_tokens") or 0)
            for choice in event.get("choices", []):
                text = (choice.get("delta") or {}).get("content")
                if text:
                    yield list(self.tokenizer.encode(text, add_special_tokens=False)), None


async def drive_smg(
    port: int,
    replica: str,
    args: Any,
    workload: Workload | None,
    messages_of: MessagesOf,
    tokenizer: Any,
    model: str,
) -> tuple[list[Record], float, Workload, Any]:
    """`run_measured` through SMG on `workload` (None: the flags' dataset, built for the model
    that `replica`, a deja.v1 address, serves); as bench.served.drive."""
    from bench.served import dataset_spec

    deja = AsyncDejaClient(replica, retries=0)
    try:
        info = await deja.model_info()
    finally:
        await deja.close()
    if workload is None:
        workload = Workload.build(dataset_spec(args), info.vocab_size, info.eos_token_ids)
    client = SseClient("127.0.0.1", port)
    try:
        backend = SmgChatBackend(client, model, messages_of, tokenizer)
        records, duration = await run_measured(backend, workload, args, SMG)
    finally:
        await client.close()
    return records, duration, workload, info
