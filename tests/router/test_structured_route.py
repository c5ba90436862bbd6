"""Structured outputs through the router: two `deja serve` replicas (tiny model) behind a real
round-robin `deja route`, each a separate process. The router forwards `response_format` as
part of the request and relays the replica's INVALID_ARGUMENT for a bad spec unchanged."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from bench.router_cluster import (
    ProcessGroup,
    free_port,
    route_argv,
    serve_argv,
    wait_healthy,
    wait_router_replicas,
)
from clients.client import AsyncDejaClient
from tests.engine.structured_cases import CHOICES, SCHEMAS, check_json

REPLICAS = ("r0", "r1")


@pytest.fixture(scope="module")
def router_target(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    group = ProcessGroup(tmp_path_factory.mktemp("structured-route"))
    ports = {name: free_port() for name in (*REPLICAS, "router")}
    targets = [f"127.0.0.1:{ports[name]}" for name in REPLICAS]
    metrics_port = free_port()
    try:
        for name in REPLICAS:
            argv = serve_argv(
                str(tiny_llama_path),
                port=ports[name],
                replica_id=name,
                extra=["--num-device-blocks", "512", "--max-num-seqs", "16"],
            )
            group.spawn(name, argv)
        argv = route_argv(
            port=ports["router"],
            replicas=targets,
            policy="round_robin",
            model=str(tiny_llama_path),
            metrics_port=metrics_port,
            extra=["--poll-interval", "0.25"],
        )
        group.spawn("router", argv)
        for name, target in zip(REPLICAS, targets, strict=True):
            wait_healthy(group, name, target)
        wait_router_replicas(group, "router", metrics_port, len(REPLICAS))
        yield f"127.0.0.1:{ports['router']}"
    finally:
        group.stop_all()


async def test_schema_request_through_the_router(router_target: str) -> None:
    schema = SCHEMAS[2]
    async with AsyncDejaClient(router_target, retries=0) as client:
        # Round robin: four requests reach both replicas; every one is constrained.
        results = await asyncio.gather(
            *(
                client.complete(
                    "Give me a user.", json_schema=schema, max_tokens=120, temperature=0.0
                )
                for _ in range(2)
            ),
            *(
                client.complete(
                    "Give me a user.", json_schema=schema, max_tokens=120, temperature=1.0, seed=s
                )
                for s in range(2)
            ),
            client.complete("y", choice=CHOICES, max_tokens=20, temperature=1.0, seed=3),
        )
    *json_results, choice = results
    replicas = set()
    for res in json_results:
        assert res.finish_reason == "stop", res
        check_json(res.text, schema)
        assert res.parse() == json.loads(res.text)
        assert res.final is not None
        replicas.add(res.final.route.replica_id)
    assert replicas == set(REPLICAS)
    assert json_results[0].text == json_results[1].text  # greedy: same output on either replica
    assert choice.text in CHOICES


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"json_schema": '{"type": "objectx"}'}, 'invalid json_schema: Unsupported type "objectx"'),
        ({"regex": "a(b"}, "invalid regex: Regex parsing error"),
    ],
)
async def test_bad_spec_through_the_router_is_invalid_argument(
    router_target: str, fields: dict[str, object], message: str
) -> None:
    async with AsyncDejaClient(router_target, retries=0) as client:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.complete("x", max_tokens=4, **fields)  # type: ignore[arg-type]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (info.value.details() or ""), info.value.details()
