"""Simulated workloads: sessions of turns with token ids, so block hashes are the real ones.

A turn either arrives at a fixed time (open loop) or `think_s` after the session's previous turn
finished (closed loop: a user reads the answer, then types). Token ids are random per session, so
only what the workload shares on purpose (system prompts, customer prefixes, a session's own
history) can hit a cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from bench.sim.profile import CostModel


@dataclass(slots=True)
class Turn:
    prompt: list[int]
    output: list[int]
    """The tokens the replica will generate (fixed, so the next turn's prompt contains them)."""
    arrival: float | None = None
    """Open loop: arrival time (s); None: `think_s` after the previous turn finished."""
    think_s: float = 0.0


@dataclass(slots=True)
class Session:
    session_id: str
    turns: list[Turn] = field(default_factory=list)
    growing: bool = False
    """Every turn's prompt + output is a prefix of the last one's (a conversation): one hash
    chain serves all turns."""


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    sessions: list[Session]
    rate_rps: float
    """Mean request arrival rate the arrivals were drawn for."""
    description: str


_VOCAB = range(1000, 40000)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return rng.choices(_VOCAB, k=n)


def request_work_s(prompt_len: int, output_len: int, m: CostModel, ref_batch: int = 8) -> float:
    """Replica seconds one request costs with no prefix caching and `ref_batch` decodes a step."""
    prefill = prompt_len * m.prefill_token_s + prompt_len * prompt_len / 2 * m.prefill_pair_s
    prefill += (prompt_len / m.step_tokens) * m.step_overhead_s
    per_decode = m.decode_seq_s + m.step_overhead_s / ref_batch
    decode = output_len * (per_decode + m.context_token_s * (prompt_len + output_len / 2))
    return prefill + decode


def _zipf_index(rng: random.Random, n: int, s: float) -> int:
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    return rng.choices(range(n), weights=weights)[0]


def chat(
    *,
    model: CostModel,
    num_replicas: int,
    utilisation: float,
    num_sessions: int = 1024,
    num_turns: int = 6,
    system_len: int = 1024,
    num_variants: int = 4,
    user_len: int = 128,
    output_len: int = 64,
    think_s: float = 5.0,
    skew: float = 0.0,
    seed: int = 0,
) -> Workload:
    """Multi-turn chat: each session picks a system prompt variant, then every turn adds a user
    message to the history and the answer after it. Sessions start as a Poisson process at the
    rate that makes requests arrive at `utilisation` of the cluster's no-cache capacity.

    With `skew` > 0 both the variants and the sessions' lengths are Zipf-distributed (exponent
    `skew`): a few system prompts are most of the traffic, a few sessions run many turns (mean
    turns kept near `num_turns`).
    """
    rng = random.Random(seed)
    variants = [_tokens(rng, system_len) for _ in range(num_variants)]
    sessions: list[Session] = []
    turn_counts = [num_turns] * num_sessions
    if skew > 0:
        max_turns = 4 * num_turns
        raw = [1 + _zipf_index(rng, max_turns, skew) for _ in range(num_sessions)]
        scale = num_turns * num_sessions / sum(raw)
        turn_counts = [max(1, min(max_turns, round(t * scale))) for t in raw]
    works: list[float] = []
    for i in range(num_sessions):
        v = _zipf_index(rng, num_variants, skew) if skew > 0 else rng.randrange(num_variants)
        history = list(variants[v])
        s = Session(f"s{i}", growing=True)
        for _ in range(turn_counts[i]):
            history += _tokens(rng, user_len)
            out = _tokens(rng, output_len)
            s.turns.append(Turn(list(history), out, None, rng.expovariate(1.0 / think_s)))
            works.append(request_work_s(len(history), output_len, model))
            history += out
        sessions.append(s)
    capacity = num_replicas / (sum(works) / len(works))
    rate = utilisation * capacity
    session_rate = rate * num_sessions / len(works)
    t = 0.0
    for s in sessions:
        t += rng.expovariate(session_rate)
        s.turns[0].arrival = t
    desc = (
        f"{num_sessions} sessions x {num_turns} turns{' (Zipf)' if skew else ''}, system prompt "
        f"{system_len} tokens in {num_variants} variants{' (Zipf)' if skew else ''}, user "
        f"{user_len} + answer {output_len} tokens a turn, think {think_s:g} s, "
        f"{utilisation:.0%} of capacity ({rate:.2f} req/s)"
    )
    return Workload("chat-skewed" if skew else "chat", sessions, rate, desc)


def llmd(
    *,
    model: CostModel,
    num_replicas: int,
    utilisation: float,
    num_customers: int = 150,
    prefix_len: int = 6000,
    users_per_customer: int = 5,
    query_len: int = 1200,
    output_len: int = 64,
    queries_per_user: int = 2,
    seed: int = 0,
) -> Workload:
    """llm-d's precise-prefix benchmark shape: customers with a long shared prefix, users each
    sending queries on it; Poisson arrivals whose rate rises linearly from 1/3 to 4/3 of
    `utilisation` of capacity over the run (mean: `utilisation`)."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len) for _ in range(num_customers)]
    turns: list[tuple[str, Turn]] = []
    for c in range(num_customers):
        for u in range(users_per_customer):
            for _ in range(queries_per_user):
                turn = Turn(prefixes[c] + _tokens(rng, query_len), _tokens(rng, output_len))
                turns.append((f"c{c}u{u}", turn))
    rng.shuffle(turns)
    work = request_work_s(prefix_len + query_len, output_len, model)
    rate = utilisation * num_replicas / work
    n = len(turns)
    t = 0.0
    sessions: dict[str, Session] = {}
    for i, (sid, turn) in enumerate(turns):
        t += rng.expovariate(rate * (1 / 3 + i / n))
        turn.arrival = t
        sessions.setdefault(sid, Session(sid)).turns.append(turn)
    desc = (
        f"{num_customers} customers x {prefix_len}-token prefix, {users_per_customer} users "
        f"each, {query_len}-token queries, {queries_per_user} per user, rate rising to "
        f"{4 / 3 * utilisation:.0%} of capacity"
    )
    return Workload("llm-d", list(sessions.values()), rate, desc)
