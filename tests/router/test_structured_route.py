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

from clients.client import AsyncDejaClient
from clients.testing.cluster import ProcessGroup
from tests.engine.sample.structured_cases import CHOICES, SCHEMAS, check_json
from tests.router.round_robin import REPLICAS, RoundRobinCluster


@pytest.fixture(scope="module")
def router_target(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    c = RoundRobinCluster(ProcessGroup(tmp_path_factory.mktemp("structured-route")))
    try:
        c.start(str(tiny_llama_path), ["--num-device-blocks", "512", "--max-num-seqs", "16"])
        yield c.target("router")
    finally:
        c.group.stop_all()


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
