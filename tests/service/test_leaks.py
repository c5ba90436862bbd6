"""Nothing stays held once requests end: random cancels and deadlines at concurrency 64, and pins
whose TTL passes while the replica is idle (the full 1,000-request run is part of
`deja bench soak`)."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from clients.client import build_request
from tests.service.conftest import Harness

NUM_REQUESTS = 120
CONCURRENCY = 64


async def _one(h: Harness, rng: random.Random, i: int) -> str:
    prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 200))]
    req = build_request(
        prompt,
        request_id=f"chaos-{i}",
        max_tokens=rng.randint(1, 48),
        ignore_eos=True,
        n=rng.choice((1, 1, 2)),
        temperature=rng.choice((0.0, 0.8)),
        pin_ttl_s=rng.choice((0.0, 0.0, 0.3)),
    )
    mode = rng.choice(("cancel", "deadline", "complete"))
    timeout = rng.uniform(0.01, 0.5) if mode == "deadline" else None
    call = h.client.stub.Generate(req, timeout=timeout)

    async def consume() -> None:
        async for _ in call:
            pass

    try:
        if mode == "cancel":
            try:
                await asyncio.wait_for(consume(), rng.uniform(0.0, 0.3))
            except TimeoutError:
                call.cancel()
                return "CANCELLED"
        else:
            await consume()
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return "OK"


async def test_random_cancels_and_deadlines_leak_no_blocks(server: Harness) -> None:
    rng = random.Random(15)
    sem = asyncio.Semaphore(CONCURRENCY)

    async def bounded(i: int) -> str:
        async with sem:
            return await _one(server, rng, i)

    outcomes = await asyncio.gather(*(bounded(i) for i in range(NUM_REQUESTS)))
    assert set(outcomes) <= {"OK", "CANCELLED", "DEADLINE_EXCEEDED"}, outcomes
    assert outcomes.count("CANCELLED") > 10 and outcomes.count("DEADLINE_EXCEEDED") > 5
    await server.assert_clean(timeout=5.0)  # pins are 0.3 s
    stats = await server.client.cache_stats()
    assert stats.free_device_blocks == stats.total_device_blocks


@pytest.mark.parametrize("ttl", [2.0])
async def test_pins_expire_while_the_replica_is_idle(server: Harness, ttl: float) -> None:
    """An idle step loop releases pinned blocks once their TTL has passed (not at the next
    request)."""
    prompt = list(range(10, 10 + 64))  # 4 full blocks
    result = await server.client.complete(prompt, max_tokens=1, pin_ttl_s=ttl)
    assert result.final is not None and result.final.pinned
    held = await server.client.cache_stats()
    assert held.free_device_blocks < held.total_device_blocks
    waited = await server.wait_blocks_free(timeout=ttl + 2.0)
    assert waited <= ttl + 1.5
