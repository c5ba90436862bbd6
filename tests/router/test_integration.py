"""Acceptance: a real redis-server, three `deja serve` replicas (tiny model) and routers, each a
separate process. Replicas register in Redis; the affinity router discovers them there.

1. 16 sessions x 4 chat turns through the affinity router: turns 2+ on the session's replica
   >= 95 %, cached prompt tokens >= 90 % of the ideal; the same workload through a round-robin
   router shows the difference.
2. Killing Redis mid-run loses no request (the fallback metric counts); restarting it restores
   session routing. Killing a replica mid-run moves its sessions; every request that fails had
   already streamed a token.
3. A new session whose prompt shares a long prefix with another session's goes to the replica
   holding that prefix.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from clients.testing.cluster import (
    ProcessGroup,
    metric_value,
    route_argv,
    scrape,
    serve_argv,
    wait_healthy,
    wait_router_replicas,
)
from service.api.deja.v1 import inference_pb2 as pb
from service.api.deja.v1 import inference_pb2_grpc as pb_grpc
from service.common.ports import free_port
from tests.support.redis_proc import RedisProcess

BLOCK = 16
REPLICAS = ("r0", "r1", "r2")
_CORPUS = (
    "the quick brown fox jumps over lazy dog a journey of thousand miles begins with single step "
    "cats and dogs are common pets birds sing in morning once upon time there was little girl who "
    "lived in village near forest she liked to read books about science history music stars"
)
WORDS = _CORPUS.split()


@dataclass
class Cluster:
    group: ProcessGroup
    redis: RedisProcess
    model: str
    ports: dict[str, int]
    metrics: dict[str, int] = field(default_factory=dict)

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def restart_replica(self, name: str) -> None:
        self.group.respawn(name)
        wait_healthy(self.group, name, self.target(name))


@pytest.fixture(scope="module")
def cluster(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    redis = RedisProcess()
    redis.start()
    group = ProcessGroup(tmp_path_factory.mktemp("cluster"))
    ports = {name: free_port() for name in (*REPLICAS, "affinity", "round_robin")}
    c = Cluster(group, redis, str(tiny_llama_path), ports)
    agent = ["--heartbeat", "0.5", "--replica-ttl", "3", "--redis-timeout", "0.2"]
    engine = ["--num-device-blocks", "4096", "--max-num-seqs", "64", "--block-size", str(BLOCK)]
    try:
        for name in REPLICAS:
            argv = serve_argv(
                c.model,
                port=ports[name],
                replica_id=name,
                redis_url=redis.url,
                extra=[*engine, *agent],
            )
            group.spawn(name, argv)
        for policy in ("affinity", "round_robin"):
            c.metrics[policy] = free_port()
            argv = route_argv(
                port=ports[policy],
                # The affinity router discovers the replicas in Redis; round robin gets a list.
                replicas=() if policy == "affinity" else [c.target(n) for n in REPLICAS],
                redis_url=redis.url if policy == "affinity" else None,
                policy=policy,
                model=c.model,
                metrics_port=c.metrics[policy],
                extra=["--poll-interval", "0.25", "--replica-ttl", "3", "--redis-timeout", "0.2"],
            )
            group.spawn(policy, argv)
        for name in REPLICAS:
            wait_healthy(group, name, c.target(name))
        for policy in ("affinity", "round_robin"):
            wait_router_replicas(group, policy, c.metrics[policy], len(REPLICAS))
        yield c
    finally:
        group.stop_all()
        redis.stop()


# -- a multi-turn chat workload -------------------------------------------------------------------


@dataclass
class Turn:
    session: str
    turn: int
    replica: str = ""
    reason: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    cached: int = 0
    streamed: bool = False
    """At least one message with generated text or tokens arrived."""
    error: grpc.StatusCode | None = None


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def send(
    stub: pb_grpc.InferenceStub, turn: Turn, messages: list[dict[str, str]], max_tokens: int
) -> str:
    req = pb.GenerateRequest(
        session_id=turn.session,
        return_token_ids=True,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    text = ""
    try:
        async for resp in stub.Generate(req, timeout=120):
            if resp.prompt_token_ids:
                turn.prompt_ids = list(resp.prompt_token_ids)
            for c in resp.choices:
                text += c.text
                turn.streamed |= bool(c.token_ids)
            if resp.HasField("final"):
                turn.replica = resp.final.replica_id
                turn.reason = resp.final.route.reason
                turn.cached = resp.final.usage.cached_prompt_tokens
    except grpc.aio.AioRpcError as e:
        turn.error = e.code()
    return text


async def chat(
    stub: pb_grpc.InferenceStub,
    sid: str,
    seed: int,
    turns: range,
    out: list[Turn],
    *,
    max_tokens: int = 16,
    gates: Mapping[int, asyncio.Event] | None = None,
    history: list[dict[str, str]] | None = None,
) -> list[dict[str, str]]:
    """Runs turns of one conversation; a failed turn is sent again (as a client would). Turn t
    waits for `gates[t]` when there is one."""
    rng = random.Random(seed)
    messages = (
        history
        if history is not None
        else [{"role": "system", "content": "You are a helpful assistant. " + words(rng, 40)}]
    )
    for t in turns:
        if gates is not None and t in gates:
            await gates[t].wait()
        messages.append({"role": "user", "content": words(rng, 20)})
        for _ in range(3):
            turn = Turn(sid, t)
            reply = await send(stub, turn, messages, max_tokens)
            out.append(turn)
            if turn.error is None:
                break
        messages.append({"role": "assistant", "content": reply})
    return messages


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def affinity_stats(turns: list[Turn]) -> tuple[float, float]:
    """(share of turns 2+ on the session's first replica, cached / ideal cached tokens)."""
    by_session: dict[str, list[Turn]] = {}
    for t in sorted(turns, key=lambda t: t.turn):
        by_session.setdefault(t.session, []).append(t)
    same = later = cached = ideal = 0
    for ts in by_session.values():
        for prev, cur in itertools.pairwise(ts):
            later += 1
            same += cur.replica == ts[0].replica
            cached += cur.cached
            ideal += lcp(prev.prompt_ids, cur.prompt_ids) // BLOCK * BLOCK
    return same / later, cached / ideal


async def run_chats(target: str, prefix: str, n: int, seed: int) -> list[Turn]:
    out: list[Turn] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        await asyncio.gather(
            *(chat(stub, f"{prefix}-{i}", seed + i, range(1, 5), out) for i in range(n))
        )
    return out


# -- acceptance 1 ---------------------------------------------------------------------------------


def test_affinity_vs_round_robin(cluster: Cluster) -> None:
    aff = asyncio.run(run_chats(cluster.target("affinity"), "aff", 16, seed=100))
    rr = asyncio.run(run_chats(cluster.target("round_robin"), "rr", 16, seed=200))
    assert len(aff) == len(rr) == 64
    assert all(t.error is None for t in aff + rr)
    sticky, cached = affinity_stats(aff)
    rr_sticky, rr_cached = affinity_stats(rr)
    print(
        f"affinity: same replica {sticky:.1%}, cached/ideal {cached:.1%}; "
        f"round robin: same replica {rr_sticky:.1%}, cached/ideal {rr_cached:.1%}"
    )
    assert sticky >= 0.95
    assert cached >= 0.90
    assert {t.reason for t in aff if t.turn > 1} <= {"session"}
    assert len({t.replica for t in aff}) == 3, "sessions should spread over the replicas"
    assert rr_sticky < 0.7 and rr_cached < cached - 0.2
    assert {t.reason for t in rr} == {"round_robin"}


# -- acceptance 3 ---------------------------------------------------------------------------------


async def _prefix_sharing(target: str) -> list[tuple[str, str, str]]:
    rng = random.Random(7)
    out = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        for i in range(3):
            document = words(rng, 150)
            owner = Turn(f"owner-{i}", 1)
            await send_text(stub, owner, document + " question one", max_tokens=4)
            follower = Turn(f"follower-{i}", 1)
            await send_text(stub, follower, document + " another question", max_tokens=4)
            assert owner.error is None and follower.error is None
            out.append((owner.replica, follower.replica, follower.reason))
    return out


async def send_text(stub: pb_grpc.InferenceStub, turn: Turn, text: str, max_tokens: int) -> None:
    req = pb.GenerateRequest(
        text=text,
        session_id=turn.session,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )
    async for resp in stub.Generate(req, timeout=60):
        if resp.HasField("final"):
            turn.replica = resp.final.replica_id
            turn.reason = resp.final.route.reason
            turn.cached = resp.final.usage.cached_prompt_tokens


def test_shared_prefix_goes_to_its_holder(cluster: Cluster) -> None:
    results = asyncio.run(_prefix_sharing(cluster.target("affinity")))
    for owner, follower, reason in results:
        assert (follower, reason) == (owner, "prefix")


# -- acceptance 2 ---------------------------------------------------------------------------------


async def _redis_outage(c: Cluster) -> tuple[list[Turn], list[Turn], list[Turn]]:
    sessions = [f"outage-{i}" for i in range(8)]
    before: list[Turn] = []
    during: list[Turn] = []
    after: list[Turn] = []
    async with grpc.aio.insecure_channel(c.target("affinity")) as channel:
        stub = pb_grpc.InferenceStub(channel)
        histories = await asyncio.gather(
            *(chat(stub, s, 300 + i, range(1, 3), before) for i, s in enumerate(sessions))
        )
        c.redis.stop()
        histories = await asyncio.gather(
            *(
                chat(stub, s, 400 + i, range(3, 5), during, history=h)
                for i, (s, h) in enumerate(zip(sessions, histories, strict=True))
            )
        )
        c.redis.start()
        await asyncio.sleep(2.5)  # reconnect (1 s) and a heartbeat re-registers the replicas
        await asyncio.gather(
            *(
                chat(stub, s, 500 + i, range(5, 8), after, history=h)
                for i, (s, h) in enumerate(zip(sessions, histories, strict=True))
            )
        )
    return before, during, after


def test_redis_outage(cluster: Cluster) -> None:
    fallback_before = metric_value(
        scrape(cluster.metrics["affinity"]), "deja_router_fallback_total"
    )
    before, during, after = asyncio.run(_redis_outage(cluster))
    assert all(t.error is None for t in before + during + after)
    assert len(during) == 16 and len(after) == 24
    assert sum(t.reason == "fallback" for t in during) >= 14
    fallback = metric_value(scrape(cluster.metrics["affinity"]), "deja_router_fallback_total")
    assert fallback - fallback_before >= 14
    # Redis is back (empty): after one turn re-records them, sessions are sticky again.
    for t in after:
        if t.turn >= 6:
            assert t.reason == "session", t
    last = {t.session: t.replica for t in after if t.turn == 5}
    assert all(t.replica == last[t.session] for t in after if t.turn > 5)


async def _replica_crash(c: Cluster, victim: str) -> tuple[list[Turn], dict[str, str]]:
    out: list[Turn] = []
    homes: dict[str, str] = {}
    go, killed = asyncio.Event(), asyncio.Event()
    gates = {2: go, 3: killed}
    async with grpc.aio.insecure_channel(c.target("affinity")) as channel:
        stub = pb_grpc.InferenceStub(channel)
        tasks = [
            asyncio.create_task(
                chat(stub, f"crash-{i}", 600 + i, range(1, 5), out, max_tokens=48, gates=gates)
            )
            for i in range(12)
        ]
        while sum(t.turn == 1 and t.error is None for t in out) < 12:
            await asyncio.sleep(0.05)
        homes = {t.session: t.replica for t in out if t.turn == 1}
        go.set()
        await asyncio.sleep(0.3)  # turn 2 streams are under way on every replica
        c.group.kill(victim)
        killed.set()  # turns 3 and 4 start after the crash, whenever turn 2 finished
        await asyncio.gather(*tasks)
    return out, homes


def test_replica_crash_moves_sessions(cluster: Cluster) -> None:
    victim = "r1"
    out, homes = asyncio.run(_replica_crash(cluster, victim))
    try:
        failed = [t for t in out if t.error is not None]
        # Only requests that had streamed a token may fail; the router retried the others.
        assert all(t.streamed for t in failed), failed
        assert all(t.error == grpc.StatusCode.UNAVAILABLE for t in failed)
        done = [t for t in out if t.error is None]
        assert {t.session for t in done if t.turn == 4} == set(homes)
        moved = [s for s, home in homes.items() if home == victim]
        assert moved, "some sessions should have lived on the victim"
        for s in moved:
            later = [t for t in done if t.session == s and t.turn >= 3]
            assert later and all(t.replica != victim for t in later)
            assert later[-1].reason == "session"
        for s, home in homes.items():
            if home != victim:
                assert all(t.replica == home for t in done if t.session == s)
    finally:
        cluster.restart_replica(victim)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = scrape(cluster.metrics["affinity"])
            if metric_value(text, "deja_router_replicas", 'state="healthy"') >= 3:
                break
            time.sleep(0.25)
