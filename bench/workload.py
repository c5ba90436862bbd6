"""Benchmark workloads for `deja bench serve`: datasets, backends, the runner and its statistics.

Every dataset is a list of sessions; a session has a prefix (system prompt) and one or more user
turns, all as token ids. Turn t's prompt is

    prefix + user_1 + answer_1 + ... + user_(t-1) + answer_(t-1) + user_t

with the answers this run generated, so later turns of a conversation share their whole history
with earlier ones (what a prefix cache serves). Turns of one session run one after another;
sessions run concurrently, limited by a concurrency cap and/or a Poisson arrival rate.
Token ids are drawn from the upper part of the vocabulary, away from special tokens.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

DATASETS = ("random", "shared-prefix", "multi-turn")


@dataclass(frozen=True, slots=True)
class Session:
    prefix: list[int]
    turns: list[list[int]]
    """The user message of each turn."""
    output_len: int


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    name: str = "random"
    num_prompts: int = 64
    """random / shared-prefix: number of requests."""
    input_len: int = 256
    """random: prompt length; shared-prefix: suffix length; multi-turn: user message length."""
    output_len: int = 32
    range_ratio: float = 0.0
    """Input lengths drawn uniformly from input_len * [1 - r, 1 + r]."""
    prefix_len: int = 512
    """shared-prefix: shared prefix length; multi-turn: shared system prompt length."""
    num_groups: int = 4
    """shared-prefix: distinct prefixes."""
    num_sessions: int = 16
    num_turns: int = 4
    seed: int = 0


def token_range(
    vocab_size: int, reserved: Sequence[int]
) -> Callable[[random.Random, int], list[int]]:
    """A sampler of `n` ordinary token ids (upper 7/8 of the vocabulary, no EOS)."""
    lo = min(1000, vocab_size // 8)
    bad = set(reserved)

    def sample(rng: random.Random, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            t = rng.randrange(lo, vocab_size)
            if t not in bad:
                out.append(t)
        return out

    return sample


def build_sessions(spec: DatasetSpec, vocab_size: int, reserved: Sequence[int]) -> list[Session]:
    if spec.name not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {spec.name!r}")
    rng = random.Random(spec.seed)
    sample = token_range(vocab_size, reserved)

    def length(n: int) -> int:
        lo, hi = int(n * (1 - spec.range_ratio)), int(n * (1 + spec.range_ratio))
        return max(1, rng.randint(lo, max(lo, hi)))

    if spec.name == "random":
        return [
            Session([], [sample(rng, length(spec.input_len))], spec.output_len)
            for _ in range(spec.num_prompts)
        ]
    if spec.name == "shared-prefix":
        prefixes = [sample(rng, spec.prefix_len) for _ in range(spec.num_groups)]
        return [
            Session(
                prefixes[i % spec.num_groups],
                [sample(rng, length(spec.input_len))],
                spec.output_len,
            )
            for i in range(spec.num_prompts)
        ]
    system = sample(rng, spec.prefix_len)
    return [
        Session(
            system,
            [sample(rng, length(spec.input_len)) for _ in range(spec.num_turns)],
            spec.output_len,
        )
        for _ in range(spec.num_sessions)
    ]


@dataclass(frozen=True, slots=True)
class Workload:
    """The sessions of one benchmark, plus what is needed to make more (warmup) like them."""

    sessions: list[Session]
    vocab_size: int
    reserved: tuple[int, ...]

    @classmethod
    def build(cls, spec: DatasetSpec, vocab_size: int, reserved: Sequence[int]) -> Workload:
        return cls(build_sessions(spec, vocab_size, reserved), vocab_size, tuple(reserved))

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def warmup(self, n: int, seed: int) -> list[Session]:
        """`n` short random requests that share no prefix with the workload."""
        spec = DatasetSpec(num_prompts=n, input_len=32, output_len=4, seed=seed + 12345)
        return build_sessions(spec, self.vocab_size, self.reserved)


# -- one request ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Record:
    """What one request measured (client side)."""

    session: int
    turn: int
    """1-based."""
    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    """Gaps between consecutive messages carrying tokens."""
    error: str | None = None
    sent_at: float = 0.0
    """`time.perf_counter()` when it was sent (after any client-side wait for a slot)."""

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


class Backend(Protocol):
    """Runs one request: streams (new token ids, cached prompt tokens or None) per message."""

    def stream(
        self, prompt: list[int], output_len: int, session_id: str
    ) -> AsyncIterator[tuple[list[int], int | None]]: ...


async def run_one(
    backend: Backend, prompt: list[int], output_len: int, session: int, turn: int, session_id: str
) -> Record:
    rec = Record(session=session, turn=turn, prompt_tokens=len(prompt))
    t0 = rec.sent_at = time.perf_counter()
    last: float | None = None
    try:
        async for ids, cached in backend.stream(prompt, output_len, session_id):
            now = time.perf_counter()
            if ids:
                if rec.ttft_s is None:
                    rec.ttft_s = now - t0
                elif last is not None:
                    rec.itl_s.append(now - last)
                last = now
                rec.output_ids.extend(ids)
            if cached is not None:
                rec.cached_tokens = cached
    except Exception as e:  # a failed request is reported, not fatal
        details = e.details() if hasattr(e, "details") else str(e)
        rec.error = f"{type(e).__name__}: {details}"
    rec.e2e_s = time.perf_counter() - t0
    return rec


# -- the runner ----------------------------------------------------------------------------------


class Progress:
    """A plain-text progress bar on stderr (one line per 10 % when stderr is not a terminal)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, enabled: bool = True):
        self.total, self.label, self.done = total, label, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1

    def advance(self, failed: bool = False) -> None:
        self.done += 1
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if now - self._last_draw > 0.1 or self.done == self.total:
                self._last_draw = now
                width = 30
                filled = int(width * self.done / max(self.total, 1))
                bar = "#" * filled + "." * (width - filled)
                self.stream.write(
                    f"\r{self.label} [{bar}] {self.done}/{self.total} {now - self.t0:6.1f} s"
                )
                if self.done == self.total:
                    self.stream.write("\n")
                self.stream.flush()
        else:
            decile = 10 * self.done // max(self.total, 1)
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(
                    f"{self.label}: {self.done}/{self.total} requests, {now - self.t0:.1f} s\n"
                )
                self.stream.flush()


class _Arrivals:
    """Poisson arrivals: each request waits for its slot (rate = inf: no wait)."""

    def __init__(self, rate: float, seed: int) -> None:
        if not rate > 0:
            raise ValueError(f"request rate must be > 0 per second (inf: no pacing), got {rate}")
        self.rate = rate
        self.rng = random.Random(seed + 1)
        self.next_t = time.monotonic()

    async def wait(self) -> None:
        if math.isinf(self.rate):
            return
        now = time.monotonic()
        self.next_t = max(self.next_t, now) + self.rng.expovariate(self.rate)
        await asyncio.sleep(max(0.0, self.next_t - now))


async def run_workload(
    backend: Backend,
    sessions: list[Session],
    *,
    max_concurrency: int | None,
    request_rate: float = math.inf,
    seed: int = 0,
    progress: Progress | None = None,
) -> tuple[list[Record], float]:
    """Runs every session's turns; returns the records and the wall time in seconds."""
    sem = asyncio.Semaphore(max_concurrency or sys.maxsize)
    arrivals = _Arrivals(request_rate, seed)
    records: list[Record] = []
    run_tag = uuid.uuid4().hex[:8]

    async def session_task(i: int, s: Session) -> None:
        history = list(s.prefix)
        sid = f"bench-{run_tag}-{i}"
        for t, user in enumerate(s.turns, start=1):
            prompt = history + user
            await arrivals.wait()
            async with sem:
                rec = await run_one(backend, prompt, s.output_len, i, t, sid)
            records.append(rec)
            if progress is not None:
                progress.advance(failed=rec.error is not None)
            if rec.error is not None:
                return  # later turns would have no answer to build on
            history = prompt + rec.output_ids

    t0 = time.perf_counter()
    await asyncio.gather(*(session_task(i, s) for i, s in enumerate(sessions)))
    return records, time.perf_counter() - t0


def oracle_cached_tokens(
    sessions: Sequence[Session], records: Sequence[Record], block_size: int
) -> int:
    """Prompt tokens an ideal cluster would have served from cache for these records: one
    replica with an unlimited prefix cache, taking the turns in order (every session's turn 1,
    then every turn 2, ...). A prompt reuses every full block an earlier request computed (its
    prompt and all its output but the last token, whose KV is never written), and, as in the
    engine, at least its last token is computed. No routing policy caches more; `deja bench sim`
    reports the same bound. `records` are one run's (session and turn index them); failed ones
    and the turns after them are left out, as they are of the hit rate."""
    by_turn = {(r.session, r.turn): r for r in records if r.error is None}
    histories = [list(s.prefix) for s in sessions]
    seen: set[int] = set()
    cached = 0
    for turn in range(1, max((len(s.turns) for s in sessions), default=0) + 1):
        for i, s in enumerate(sessions):
            rec = by_turn.get((i, turn))
            if rec is None or turn > len(s.turns):
                continue
            prompt = histories[i] + s.turns[turn - 1]
            if len(prompt) != rec.prompt_tokens:
                raise ValueError(
                    f"session {i} turn {turn}: the record's prompt has {rec.prompt_tokens} "
                    f"tokens, its history and turn {len(prompt)}: not this workload's record"
                )
            keys = _block_keys(prompt + rec.output_ids[:-1], block_size)
            usable = (len(prompt) - 1) // block_size
            hits = next((n for n, k in enumerate(keys[:usable]) if k not in seen), usable)
            cached += hits * block_size
            seen.update(keys)
            histories[i] = prompt + rec.output_ids
    return cached


def _block_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained keys of the full blocks of `tokens` (a block's key covers all tokens before it)."""
    keys: list[int] = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        keys.append(parent)
    return keys


# -- statistics ----------------------------------------------------------------------------------


def percentiles(values: Sequence[float], ps: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    """mean and pXX (linear interpolation) in milliseconds."""
    if not values:
        return {}
    v = sorted(values)
    out = {"mean": 1e3 * sum(v) / len(v)}
    for p in ps:
        k = (len(v) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{p}"] = 1e3 * (v[lo] + (v[hi] - v[lo]) * (k - lo))
    return out


def summarize(records: Sequence[Record], duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": output / duration_s if duration_s else 0.0,
        "total_token_throughput": (prompt + output) / duration_s if duration_s else 0.0,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_prompt_tokens": cached,
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": percentiles([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itl_s]),
        "e2e_ms": percentiles([r.e2e_s for r in ok]),
    }
    errors = sorted({r.error for r in records if r.error})
    if errors:
        out["errors"] = errors[:5]
    return out


def summarize_by_turn(records: Sequence[Record], duration_s: float) -> dict[str, Any]:
    """The whole run, plus turn 1 and turns 2+ separately (when there are later turns), and
    the TTFT percentiles of each turn (`ttft_ms_by_turn`, turn -> percentiles)."""
    out = summarize(records, duration_s)
    ttfts = [(r.turn, r.ttft_s) for r in records if r.error is None and r.ttft_s is not None]
    out["ttft_ms_by_turn"] = {
        str(t): percentiles([s for turn, s in ttfts if turn == t])
        for t in sorted({turn for turn, _ in ttfts})
    }
    later = [r for r in records if r.turn > 1]
    if later:
        out["turn_1"] = summarize([r for r in records if r.turn == 1], duration_s)
        out["turns_2plus"] = summarize(later, duration_s)
    return out
