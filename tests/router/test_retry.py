"""Retry before the first message (service/router/retry.py), in process, over fake replicas:
what is retried and what is not, each replica at most once, the caller's deadline kept."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from service.common.failover import engine_dead_trailer
from service.router.retry import retry_reason

from .test_router import Setup, generate, make_setup, prompt


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    async for s in make_setup(policy="round_robin", max_attempts=5):
        yield s


def _retries(setup: Setup, reason: str) -> float:
    registry = setup.router.metrics.registry
    return registry.get_sample_value("deja_router_retries_total", {"reason": reason}) or 0.0


def _retry_events(setup: Setup) -> list[dict[str, object]]:
    spans = [s for s in setup.exporter.get_finished_spans() if s.name.startswith("route")]
    return [dict(e.attributes or {}) for s in spans for e in s.events if e.name == "retry"]


@pytest.mark.parametrize(
    ("code", "details", "trailer", "reason"),
    [
        (grpc.StatusCode.UNAVAILABLE, "connection refused", (), "unavailable"),
        (grpc.StatusCode.UNAVAILABLE, "engine failed", engine_dead_trailer(0), "engine_dead"),
        # the replica had sent messages: never retried, though the status is UNAVAILABLE
        (grpc.StatusCode.UNAVAILABLE, "engine failed", engine_dead_trailer(2), None),
        (grpc.StatusCode.UNAVAILABLE, "engine failed", (("deja-engine-dead", "x"),), None),
        # replicas before UNAVAILABLE: INTERNAL with the same trailer
        (grpc.StatusCode.INTERNAL, "engine failed", engine_dead_trailer(0), "engine_dead"),
        (grpc.StatusCode.INTERNAL, "engine failed", engine_dead_trailer(2), None),
        (grpc.StatusCode.INTERNAL, "engine failed", (), None),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "4 requests are already waiting", (), "queue_full"),
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "Received message larger than max (9 vs. 4)",
            (),
            None,
        ),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "the client read the stream too slowly", (), None),
        (grpc.StatusCode.INVALID_ARGUMENT, "prompt too long", (), None),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline", (), None),
        (grpc.StatusCode.CANCELLED, "cancelled", (), None),
    ],
)
def test_retry_reason(
    code: grpc.StatusCode, details: str, trailer: tuple[tuple[str, str], ...], reason: str | None
) -> None:
    assert retry_reason(code, details, trailer) == reason


async def test_engine_death_before_output_goes_to_another_replica(setup: Setup) -> None:
    dead = setup.replicas[0]
    dead.fail_before_first = grpc.StatusCode.UNAVAILABLE
    dead.fail_trailer = engine_dead_trailer(0)
    finals = [await generate(setup.stub, prompt(i, 0), request_id=f"q{i}") for i in range(3)]
    assert all(f.replica_id != "r0" for f in finals)
    assert _retries(setup, "engine_dead") == len(dead.seen) >= 1
    events = _retry_events(setup)
    assert events[0] == {"replica_id": "r0", "code": "UNAVAILABLE", "reason": "engine_dead"}


async def test_engine_death_after_output_reaches_the_caller(setup: Setup) -> None:
    for r in setup.replicas:
        r.fail_before_first = grpc.StatusCode.UNAVAILABLE
        r.fail_trailer = engine_dead_trailer(1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(setup.stub, prompt(0, 0))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert sum(len(r.seen) for r in setup.replicas) == 1
    assert not _retry_events(setup)


async def test_each_replica_is_tried_once_within_the_deadline(setup: Setup) -> None:
    for r in setup.replicas:
        r.fail_before_first, r.delay_s = grpc.StatusCode.UNAVAILABLE, 0.3
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(setup.stub, prompt(0, 0), timeout=5.0)
    # max_attempts 5, but 3 replicas: the last one's own error reaches the caller
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "refuses" in (err.value.details() or "")
    seen = sorted(
        (s for r in setup.replicas for s in r.seen), key=lambda s: -(s.time_remaining or 0)
    )
    assert [len(r.seen) for r in setup.replicas] == [1, 1, 1]
    remaining = [s.time_remaining or 0.0 for s in seen]
    # Each attempt gets what is left of the caller's 5 s, not a fresh deadline.
    assert remaining[0] <= 5.1 and remaining[1] <= remaining[0] - 0.25
    assert remaining[2] <= remaining[1] - 0.25
    assert _retries(setup, "unavailable") == 2


async def test_oversized_request_is_not_retried(setup: Setup) -> None:
    for r in setup.replicas:  # gRPC itself refuses the message: RESOURCE_EXHAUSTED
        await r.stop()
        r.max_receive_bytes = 256
        await r.start(r.port)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(setup.stub, list(range(400)))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert sum(_retries(setup, r) for r in ("unavailable", "engine_dead", "queue_full")) == 0


async def test_full_queue_is_retried_without_marking_the_replica_down(setup: Setup) -> None:
    busy = setup.replicas[0]
    busy.fail_before_first = grpc.StatusCode.RESOURCE_EXHAUSTED
    busy.fail_details = "8 requests are already waiting on replica r0"
    finals = [await generate(setup.stub, prompt(i, 0)) for i in range(3)]
    assert all(f.replica_id != "r0" for f in finals)
    assert _retries(setup, "queue_full") == len(busy.seen) >= 1
    assert len(setup.router.pool.healthy()) == 3  # busy, not down
