"""SubscribeKvEvents over a real server and client: snapshot, live events, resume, auth."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from clients.client import AsyncDejaClient
from engine.frontend.prompt import prompt_block_hashes
from service.api.deja.v1 import inference_pb2 as pb
from tests.service.conftest import Engine, StartServer, make_engine
from tests.support.waiting import wait_until

BS = 16


@pytest.fixture(scope="module")
def tiered_engine(tiny_llama_path: Path) -> Iterator[Engine]:
    """8 device blocks over a 16-block CPU tier: a second long prompt spills the first."""
    eng = make_engine(tiny_llama_path, num_device_blocks=8, num_cpu_blocks=16, max_model_len=128)
    yield eng
    eng.shutdown()


class Collector:
    """Reads a subscription in the background into a list of messages."""

    def __init__(self, client: AsyncDejaClient, start: int = 0) -> None:
        self.messages: list[pb.KvEventBatch] = []
        self._task = asyncio.get_running_loop().create_task(self._read(client, start))

    async def _read(self, client: AsyncDejaClient, start: int) -> None:
        async for msg in client.kv_events(start):
            self.messages.append(msg)

    def events(self, kind: str, medium: str | None = None) -> list[pb.KvEvent]:
        out = []
        for m in self.messages:
            for e in m.events:
                if e.WhichOneof("event") != kind:
                    continue
                body = getattr(e, kind)
                if medium is None or body.medium == medium:
                    out.append(e)
        return out

    def hashes(self, kind: str, medium: str) -> set[bytes]:
        return {h for e in self.events(kind, medium) for h in getattr(e, kind).block_hashes}

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


@pytest.fixture
async def collectors() -> AsyncIterator[list[Collector]]:
    made: list[Collector] = []
    yield made
    for c in made:
        await c.close()


async def generate(client: AsyncDejaClient, prompt: list[int]) -> None:
    await client.complete(prompt, max_tokens=2, temperature=0.0)


async def test_snapshot_then_live_stores_with_parents(
    start_server: StartServer, collectors: list[Collector]
) -> None:
    h = await start_server()
    sub = Collector(h.client)
    collectors.append(sub)
    await wait_until(lambda: len(sub.messages) >= 1, what="the snapshot")
    snap = sub.messages[0]
    assert snap.dropped
    assert snap.events[0].WhichOneof("event") == "all_blocks_cleared"

    prompt = list(range(100, 150))  # 3 full blocks of 16
    await generate(h.client, prompt)
    chain = prompt_block_hashes(prompt, BS, h.engine.model_info.model_id, None)

    def stored_chain() -> bool:
        return set(chain) <= sub.hashes("block_stored", "device")

    await wait_until(stored_chain, what="the prompt's blocks stored")
    (first,) = [
        e.block_stored
        for e in sub.events("block_stored", "device")
        if chain[0] in e.block_stored.block_hashes
    ]
    i = list(first.block_hashes).index(chain[0])
    assert list(first.block_hashes)[i : i + 3] == chain
    if i == 0:  # a new chain: no parent, and its tokens
        assert not first.HasField("parent_block_hash")
        assert list(first.token_ids) == prompt[:48]
    assert first.block_size == BS
    seqs = [m.sequence_number for m in sub.messages]
    assert seqs == sorted(seqs) and len(set(seqs[1:])) == len(seqs) - 1


async def test_resume_from_a_sequence_number_and_snapshot_when_too_far_behind(
    start_server: StartServer, collectors: list[Collector]
) -> None:
    h = await start_server(kv_event_ring_batches=2)
    ring = h.replica.servicer.kv_events
    live = Collector(h.client)
    collectors.append(live)
    await wait_until(lambda: len(live.messages) >= 1, what="the snapshot")
    prompts = [list(range(200 + 40 * i, 240 + 40 * i)) for i in range(4)]  # 2 blocks each
    await generate(h.client, prompts[0])
    await wait_until(lambda: len(live.messages) >= 2, what="a live batch")
    resume_at = live.messages[1].sequence_number

    # Within the ring: the same batches again, from that number, no snapshot.
    again = Collector(h.client, resume_at)
    collectors.append(again)
    await wait_until(lambda: len(again.messages) >= 1, what="the resumed batch")
    assert again.messages[0] == live.messages[1]
    assert ring.num_snapshots == 1

    # Three more prompts push that batch out of a 2-batch ring: a snapshot comes first.
    for p in prompts[1:]:
        await generate(h.client, p)
    await wait_until(lambda: ring.last_sequence_number >= resume_at + 3, what="more batches")
    late = Collector(h.client, resume_at)
    collectors.append(late)
    await wait_until(lambda: len(late.messages) >= 1, what="the late subscriber's snapshot")
    first = late.messages[0]
    assert first.dropped and first.events[0].WhichOneof("event") == "all_blocks_cleared"
    assert first.sequence_number >= resume_at + 3
    snapshot_hashes = late.hashes("block_stored", "device")
    for p in prompts:
        assert set(prompt_block_hashes(p, BS, h.engine.model_info.model_id, None)) <= (
            snapshot_hashes
        )
    assert all(not e.block_stored.token_ids for e in late.events("block_stored"))

    # After the snapshot the late subscriber follows live batches like the others.
    await generate(h.client, list(range(400, 440)))
    await wait_until(
        lambda: (
            late.messages[-1].sequence_number == live.messages[-1].sequence_number
            and len(late.messages) >= 2
        ),
        what="the late subscriber to catch up",
    )
    assert late.messages[-1] == live.messages[-1]


async def test_spill_to_cpu_is_removed_on_device_and_stored_on_cpu(
    start_server: StartServer, tiered_engine: Engine, collectors: list[Collector]
) -> None:
    h = await start_server(tiered_engine)
    sub = Collector(h.client)
    collectors.append(sub)
    await wait_until(lambda: len(sub.messages) >= 1, what="the snapshot")
    model = tiered_engine.model_info.model_id
    a = list(range(10, 90))  # 5 full blocks: with the 2 generated tokens, 6 of the 8 blocks
    b = list(range(300, 380))
    await generate(h.client, a)
    await generate(h.client, b)  # reuses a's blocks: they are spilled to the CPU tier
    chain_a = prompt_block_hashes(a, BS, model, None)

    def spilled() -> bool:
        gone = sub.hashes("block_removed", "device") & set(chain_a)
        return bool(gone) and gone <= sub.hashes("block_stored", "cpu")

    await wait_until(spilled, what="a's blocks removed on device and stored on cpu")
    cpu = [e.block_stored for e in sub.events("block_stored", "cpu")]
    assert all(not s.HasField("parent_block_hash") and not s.token_ids for s in cpu)


async def test_subscribe_follows_auth_rules(
    start_server: StartServer, collectors: list[Collector]
) -> None:
    h = await start_server(auth_tokens=(("tok", "tenant-a"),), token="tok")
    anon = AsyncDejaClient(h.target, retries=0)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in anon.kv_events():
                pass
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await anon.close()
    sub = Collector(h.client)
    collectors.append(sub)
    await wait_until(lambda: len(sub.messages) >= 1, what="the snapshot")
    prompt = list(range(20, 52))
    await generate(h.client, prompt)
    chain = prompt_block_hashes(prompt, BS, h.engine.model_info.model_id, "tenant:tenant-a")
    await wait_until(lambda: bool(set(chain) & sub.hashes("block_stored", "device")), what="stores")
    assert all(not e.block_stored.token_ids for e in sub.events("block_stored"))
