"""Structured outputs over gRPC: a real server on a free port, a real client."""

from __future__ import annotations

import asyncio
import json

import grpc
import pydantic
import pytest

from tests.engine.sample.structured_cases import CHOICES, SCHEMAS, check_json
from tests.service.conftest import Harness


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)


async def test_json_schema_dict_and_n2(server: Harness) -> None:
    schema = SCHEMAS[2]
    res = await server.client.complete(
        "Give me a user.", json_schema=schema, n=2, max_tokens=120, temperature=1.0, seed=5
    )
    assert len(res.choices) == 2
    for i, c in enumerate(res.choices):
        assert c.finish_reason == "stop", c
        check_json(c.text, schema)
        assert res.parse(i) == json.loads(c.text)
    await server.assert_clean()


async def test_pydantic_model_is_parsed(server: Harness) -> None:
    res = await server.client.complete(
        "A person:", json_schema=Person, max_tokens=60, temperature=0.0
    )
    person = res.parse()
    assert isinstance(person, Person) and 0 <= person.age <= 120


async def test_regex_choice_and_json_object(server: Harness) -> None:
    regex, choice, obj = await asyncio.gather(
        server.client.complete("x", regex="[0-9]{3}-[a-z]{2}", max_tokens=20, temperature=0.0),
        server.client.complete("y", choice=CHOICES, max_tokens=20, temperature=1.0, seed=1),
        server.client.complete("z", json_object=True, max_tokens=80, temperature=0.0),
    )
    assert regex.finish_reason == "stop" and len(regex.text) == 6 and regex.text[3] == "-"
    assert choice.text in CHOICES
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.finish_reason == "length" and obj.text.startswith("{")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"json_schema": '{"type": "objectx"}'}, 'invalid json_schema: Unsupported type "objectx"'),
        ({"json_schema": "{not json"}, "invalid json_schema"),
        ({"regex": "a(b"}, "invalid regex: Regex parsing error"),
        ({"grammar": 'root ::= "a" |'}, "invalid grammar: EBNF parser error"),
        ({"choice": []}, "at least one choice"),
        (
            {"choice": ["yes", "no"], "min_tokens": 4},
            "min_tokens (4) cannot be met by a choice response_format",
        ),
    ],
)
async def test_bad_spec_is_invalid_argument(
    server: Harness, fields: dict[str, object], message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await server.client.complete("x", max_tokens=4, **fields)  # type: ignore[arg-type]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (info.value.details() or ""), info.value.details()
    await server.assert_clean()
