"""The event loop: arrivals, routers, replica steps and load polls on one simulated clock.

Routers decide with the real `service.router.policy.decide` over `Candidate`s built the way
`service/router/pool.py` builds them: engine load as of the last poll (every `poll_interval_s`,
so decisions see stale load, as real routers do) plus what the router itself sent and has not
seen answered (exact). Prefix and session knowledge comes from the real in-memory affinity store.
The session record is written by the real `ReplicaAgent.record_now` when a request finishes.
Prefix records come, by default (`records="events"`), from the KV events each simulated replica
emits as its tiers change: after every step the replica's batch goes to the agent's real
`KvRecordWriter`, which writes the netted changes to the store every `prefix_flush_s`, as on a
real replica. With `records="requests"` (the earlier model) `record_now` also writes the prompt's
blocks when the request finishes and removes hashes pushed out of the agent's LRU estimate.
The oracle holds every block any request ever produced (unlimited cache shared by all replicas).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from bench.sim.profile import CostModel
from bench.sim.replica import SimReplica, SimSeq
from bench.sim.workload import Session, Turn, Workload
from engine.frontend.prompt import prompt_block_hashes
from engine.kv.events import AllBlocksCleared, KVEventBuffer, snapshot_events
from engine.kv.hashing import BlockHash
from service.affinity.base import ReplicaInfo
from service.affinity.config import AffinityConfig
from service.affinity.memory import MemoryAffinityStore
from service.replica.agent import ReplicaAgent
from service.replica.kv_events import KvBatch
from service.router.cost import CostWeights
from service.router.policy import Candidate, OverloadGuard, RouteInputs, decide
from service.router.popularity import PrefixPopularity

T = TypeVar("T")
MODEL_ID = "sim-model"
RECORDS = ("events", "requests")
"""Where prefix records come from: the replicas' KV events, or each finished request."""


def _no_subscription(start: int) -> AsyncIterator[KvBatch]:
    """The agents' event source: the simulator applies batches itself and never subscribes."""
    raise RuntimeError("the simulator hands KV-event batches to the record writer directly")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine that never suspends (the in-memory store's calls) to its result."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("coroutine suspended; the simulator only drives the in-memory store")


@dataclass(slots=True)
class RequestRecord:
    session_id: str
    turn: int
    arrival: float
    prompt_tokens: int
    replica_id: str = ""
    router: int = 0
    ttft_s: float = 0.0
    cached_tokens: int = 0
    oracle_tokens: int = 0


@dataclass(slots=True)
class _Router:
    policy: str
    rr: itertools.count[int] = field(default_factory=itertools.count)
    pending: dict[str, int] = field(default_factory=dict)
    pending_requests: dict[str, int] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    popularity: PrefixPopularity = field(default_factory=PrefixPopularity)


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    queued_samples: dict[str, list[int]]
    """Replica id -> queued prefill tokens at every poll."""
    queued_token_s: dict[str, float]
    """Replica id -> queued prefill tokens integrated over the run (token-seconds, exact)."""
    outstanding_samples: dict[str, list[int]]
    """Replica id -> running + waiting requests at every poll."""
    busy_s: dict[str, float]
    end_s: float


class Cluster:
    def __init__(
        self,
        model: CostModel,
        num_replicas: int,
        policy: str,
        *,
        num_routers: int = 1,
        poll_interval_s: float = 1.0,
        guard: OverloadGuard | None = None,
        weights: CostWeights | None = None,
        seed: int = 0,
        records: str = "events",
    ) -> None:
        if records not in RECORDS:
            raise ValueError(f"records must be one of {RECORDS}, got {records!r}")
        self.m = model
        self.records_from = records
        self.clock = 0.0
        self.store = MemoryAffinityStore(clock=lambda: self.clock)
        self.affinity = AffinityConfig()
        self.guard = guard or OverloadGuard()
        self.weights = weights
        self.poll_interval_s = poll_interval_s
        self.rng = random.Random(seed)
        self.replicas: dict[str, SimReplica] = {}
        self.agents: dict[str, ReplicaAgent] = {}
        self._batches: dict[str, int] = {}
        """Replica id -> KV-event batches taken so far."""
        self._flushing: set[str] = set()
        """Replicas with a record flush scheduled."""
        events = records == "events"
        for i in range(num_replicas):
            rid = f"r{i:02d}"
            buffer = KVEventBuffer(4 * (model.device_blocks + model.cpu_blocks), model.block_size)
            self.replicas[rid] = SimReplica(
                rid, model, self._first_token, self._finished, buffer if events else None
            )
            self._batches[rid] = 0
            info = ReplicaInfo(rid, f"sim:{i}", MODEL_ID, model.block_size)
            self.agents[rid] = ReplicaAgent(
                self.store,
                info,
                lambda: None,  # type: ignore[arg-type,return-value]
                self.affinity,
                capacity_blocks=model.device_blocks + model.cpu_blocks,
                kv_events=_no_subscription if events else None,
            )
        self.routers = [_Router(policy) for _ in range(num_routers)]
        self.snapshots: dict[str, Candidate] = {}
        self.oracle: set[BlockHash] = set()
        self.records: list[RequestRecord] = []
        self.queued_samples: dict[str, list[int]] = {rid: [] for rid in self.replicas}
        self.outstanding_samples: dict[str, list[int]] = {rid: [] for rid in self.replicas}
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._by_id: dict[int, tuple[RequestRecord, Session, int, SimSeq, _Router]] = {}
        self._outstanding = 0
        self._chains: dict[tuple[str, int], tuple[list[BlockHash], list[BlockHash]]] = {}
        """(session, turn) -> (prompt chain, prompt + output chain)."""
        self._uncached: dict[int, int] = {}
        """Request -> the uncached tokens its router counted as pending on its replica."""

    # Events.

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self, workload: Workload) -> SimResult:
        for s in workload.sessions:
            self._outstanding += len(s.turns)
            for i, turn in enumerate(s.turns):
                if turn.arrival is not None:
                    self.at(turn.arrival, functools.partial(self._arrive, s, i))
        self._poll()
        if self.records_from == "events":
            self.at(self.affinity.prefix_ttl_s / 2, self._refresh)
        while self._events and self._outstanding > 0:
            t, _, fn = heapq.heappop(self._events)
            self.clock = t
            fn()
        return SimResult(
            self.records,
            self.queued_samples,
            {rid: r.queued_token_s for rid, r in self.replicas.items()},
            self.outstanding_samples,
            {rid: r.busy_s for rid, r in self.replicas.items()},
            self.clock,
        )

    def _poll(self) -> None:
        for rid, r in self.replicas.items():
            q = r.queued_prefill_tokens()
            self.queued_samples[rid].append(q)
            self.outstanding_samples[rid].append(len(r.running) + len(r.waiting))
            self.snapshots[rid] = Candidate(
                rid,
                running=len(r.running),
                waiting=len(r.waiting),
                kv_usage=r.kv_usage(),
                queued_prefill_tokens=q,
                decoding=r.decoding(),
                active_tokens=r.active_tokens(),
                prefill_tokens_per_s=r.rates.prefill_tokens_per_s,
                decode_seq_s=r.rates.decode_seq_s,
                step_tokens=self.m.step_tokens,
                block_size=self.m.block_size,
                utilisation=r.rates.utilisation(self.clock),
            )
        if self._outstanding > 0:
            self.at(self.clock + self.poll_interval_s, self._poll)

    # Requests.

    def _hashes(self, session: Session, index: int) -> tuple[list[BlockHash], list[BlockHash]]:
        key = (session.session_id, index)
        if key not in self._chains:
            bs = self.m.block_size
            turns = session.turns if session.growing else [session.turns[index]]
            last = turns[-1]
            chain = prompt_block_hashes(last.prompt + last.output, bs, MODEL_ID, None)
            for i, t in enumerate(turns):
                j = i if session.growing else index
                n = len(t.prompt)
                self._chains[(session.session_id, j)] = (
                    chain[: n // bs],
                    chain[: (n + len(t.output)) // bs],
                )
        return self._chains.pop(key)

    def _arrive(self, session: Session, index: int) -> None:
        turn: Turn = session.turns[index]
        router_i = self.rng.randrange(len(self.routers))
        router = self.routers[router_i]
        chain, full = self._hashes(session, index)
        oracle = 0
        for h in chain:
            if h not in self.oracle:
                break
            oracle += 1
        rec = RequestRecord(session.session_id, index, self.clock, len(turn.prompt))
        rec.router = router_i
        rec.oracle_tokens = min(oracle * self.m.block_size, len(turn.prompt) - 1)
        session_replica, prefix = None, None
        if router.policy != "round_robin":
            session_replica = run_sync(self.store.get_session(session.session_id))
            prefix = run_sync(self.store.longest_prefix(chain))
        candidates = []
        for rid, snap in self.snapshots.items():
            own = router.pending.get(rid, 0)
            # NOTE: the polled snapshot, with what this router knows exactly of its own sends.
            candidates.append(
                replace(
                    snap,
                    inflight=router.inflight.get(rid, 0),
                    pending_prefill_tokens=own,
                    pending_requests=router.pending_requests.get(rid, 0),
                )
            )
        shares = None
        holders = (self.weights or CostWeights()).holder_share > 0
        if router.policy == "cost" and holders:  # as `deja route` tracks it (popularity.py)
            shares = router.popularity.track(chain, self.clock)
        inputs = RouteInputs(
            session.session_id,
            session_replica,
            prefix,
            True,
            prompt_tokens=len(turn.prompt),
            prefix_shares=shares,
        )
        d = decide(router.policy, candidates, inputs, self.guard, next(router.rr), self.weights)
        rec.replica_id = d.replica_id
        seq = SimSeq(len(self.records), len(turn.prompt), len(turn.output), chain, full, self.clock)
        self.records.append(rec)
        uncached = d.uncached_tokens or len(turn.prompt)
        router.pending[d.replica_id] = router.pending.get(d.replica_id, 0) + uncached
        router.pending_requests[d.replica_id] = router.pending_requests.get(d.replica_id, 0) + 1
        router.inflight[d.replica_id] = router.inflight.get(d.replica_id, 0) + 1
        self._by_id[seq.request_id] = (rec, session, index, seq, router)
        self._uncached[seq.request_id] = uncached
        replica = self.replicas[d.replica_id]
        replica.add(seq, self.clock)
        if not replica.busy:
            self._step(replica)

    def _step(self, replica: SimReplica) -> None:
        if not replica.has_work():
            replica.busy = False
            return
        replica.busy = True
        step, dt = replica.plan(self.clock)

        def done() -> None:
            replica.finish_step(step, dt, self.clock)
            self._publish(replica)
            self._step(replica)

        self.at(self.clock + dt, done)

    # KV events.

    def _publish(self, replica: SimReplica) -> None:
        """Hands the step's KV events to the replica agent's record writer (in memory), and
        schedules the writer's flush to the store `prefix_flush_s` later, as it runs live."""
        buffer = replica.events
        if buffer is None or not buffer:
            return
        events, dropped = buffer.take()
        if dropped:
            held = [("device", list(replica.device)), ("cpu", list(replica.cpu))]
            events = [AllBlocksCleared(), *snapshot_events(self.m.block_size, held)]
        rid = replica.replica_id
        self._batches[rid] += 1
        writer = self.agents[rid].kv_records
        writer.apply(KvBatch(self._batches[rid], self.clock, events, dropped))
        if rid not in self._flushing and (writer.num_pending or dropped):
            self._flushing.add(rid)
            self.at(self.clock + self.affinity.prefix_flush_s, lambda: self._flush(rid))

    def _refresh(self) -> None:
        """Re-records every held block before its record expires, as each live agent does
        every `prefix_ttl_s / 2` (ReplicaAgent._refresh_loop)."""
        for rid, agent in self.agents.items():
            agent.kv_records.refresh()
            if agent.kv_records.num_pending and rid not in self._flushing:
                self._flushing.add(rid)
                self.at(
                    self.clock + self.affinity.prefix_flush_s, functools.partial(self._flush, rid)
                )
        if self._outstanding > 0:
            self.at(self.clock + self.affinity.prefix_ttl_s / 2, self._refresh)

    def _flush(self, rid: str) -> None:
        writer = self.agents[rid].kv_records
        run_sync(writer.flush())
        if writer.num_pending:
            self.at(self.clock + self.affinity.prefix_flush_s, lambda: self._flush(rid))
        else:
            self._flushing.discard(rid)

    # Request callbacks.

    def _first_token(self, seq: SimSeq, now: float) -> None:
        rec, _, _, _, router = self._by_id[seq.request_id]
        rec.ttft_s = now - rec.arrival
        rec.cached_tokens = seq.cached_tokens
        rid = rec.replica_id
        router.pending[rid] -= self._uncached.pop(seq.request_id)
        router.pending_requests[rid] -= 1

    def _finished(self, seq: SimSeq, now: float) -> None:
        rec, session, index, _, router = self._by_id.pop(seq.request_id)
        router.inflight[rec.replica_id] -= 1
        self._outstanding -= 1
        self.oracle.update(seq.full_hashes)
        turn = session.turns[index]
        agent = self.agents[rec.replica_id]
        if router.policy != "round_robin":
            run_sync(agent.record_now(session.session_id, turn.prompt, None))
        nxt = index + 1
        if nxt < len(session.turns) and session.turns[nxt].arrival is None:
            self.at(now + session.turns[nxt].think_s, lambda: self._arrive(session, nxt))
