"""`deja bench soak`: hours of mixed load against a replica or a router, watching for leaks.

    # spawn one `deja serve` with small tiers (every tier churns) and soak it for 30 minutes
    deja bench soak --duration 1800 --serve-args "--num-device-blocks 256 --cpu-swap-gib 0.02 \\
        --disk-dir /tmp/deja-soak --disk-gib 0.05"

    # an already running replica or router (pass its pid to sample its memory)
    deja bench soak --target localhost:50051 --pid 12345 --metrics-url http://localhost:9400

The load mixes multi-turn sessions, shared prefixes, random prompts, n > 1 with seeds, logprobs,
pins, and deliberate cancels (the client cancels mid-stream) and deadlines (short call
deadlines). Every `--sample-interval` seconds it records the server's RSS, open fds and threads
(the process and all its child processes, via psutil), the device / CPU / disk tier blocks
(GetCacheStats) and the number of gc-tracked Python objects (from the `deja_python_objects`
metric of the process serving --metrics-url: with a separate engine-core process that is the
front-end only). At the end it stops the load, waits for the pins to expire, checks that every
block is free, prints the table and the verdict (bench/soak_report.py) and exits 0 on PASS.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import shlex
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.report import format_load, load_avg
from bench.soak_report import EndState, Sample, format_row, format_table, judge
from bench.workload import token_range
from clients.client import AsyncDejaClient, add_connection_args, build_request
from clients.testing.cluster import deja_argv, serving
from service.common.flags import add_flag
from service.common.ports import free_port

KINDS = ("random", "shared", "multi_turn", "n", "logprobs", "pin", "cancel", "deadline")
DEFAULT_MIX = "random=3,shared=3,multi_turn=4,n=1,logprobs=1,pin=1,cancel=2,deadline=2"
DELIBERATE = ("cancel", "deadline")
"""Kinds whose CANCELLED / DEADLINE_EXCEEDED ends are the point, not failures."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_args(parser)
    g = parser.add_argument_group("soak")
    add_flag(g, "--duration", type=float, default=1800.0, help="Seconds of load.")
    add_flag(g, "--warmup", type=float, default=300.0, help="Seconds before the RSS baseline.")
    add_flag(g, "--sample-interval", type=float, default=30.0, help="Seconds between samples.")
    add_flag(g, "--concurrency", type=int, default=16, help="Requests in flight.")
    add_flag(g, "--mix", default=DEFAULT_MIX, help=f"kind=weight list; kinds: {', '.join(KINDS)}.")
    add_flag(g, "--input-len", type=int, default=96, help="Mean new prompt tokens per request.")
    add_flag(g, "--output-len", type=int, default=16, help="Most tokens per request.")
    add_flag(g, "--prefix-len", type=int, default=256, help="Shared prefix tokens.")
    add_flag(g, "--num-prefixes", type=int, default=4, help="Distinct shared prefixes.")
    add_flag(g, "--num-sessions", type=int, default=16, help="Concurrent multi-turn sessions.")
    add_flag(g, "--max-pin-s", type=float, default=10.0, help="Longest pin TTL the load asks for.")
    add_flag(g, "--seed", type=int, default=0)
    add_flag(g, "--rss-limit", type=float, default=0.05, help="Allowed RSS growth after warm-up.")
    add_flag(g, "--pid", type=int, help="Server pid (--target mode; default: who listens there).")
    add_flag(g, "--metrics-url", help="The server's metrics endpoint (for Python object counts).")
    add_flag(
        g,
        "--serve-args",
        help="Spawn `deja serve` with these flags (on a free port) instead of using --target.",
    )
    add_flag(g, "--server-start-timeout", type=float, default=300.0)


# -- the load ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Job:
    kind: str
    request: Any
    """pb.GenerateRequest"""
    cancel_after_s: float | None = None
    timeout_s: float | None = None
    session: int | None = None


@dataclass(slots=True)
class Tally:
    """Outcomes by kind; `failed` excludes the deliberate cancels and deadlines."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())

    def add(self, kind: str, status: str, detail: str = "") -> None:
        self.outcomes[(kind, status)] += 1
        deliberate = kind in DELIBERATE and status in ("CANCELLED", "DEADLINE_EXCEEDED")
        if status != "OK" and not deliberate:
            self.failed += 1
            if len(self.errors) < 20:
                self.errors.append(f"{kind}: {status}: {detail}")


def parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, _, weight = part.strip().partition("=")
        if name not in KINDS:
            raise ValueError(f"unknown kind {name!r} in --mix; kinds: {', '.join(KINDS)}")
        mix[name] = float(weight or 1)
    if not any(w > 0 for w in mix.values()):
        raise ValueError("--mix needs a positive weight")
    return mix


class SoakLoad:
    """Builds the requests: token-id prompts of ordinary tokens, within max_model_len."""

    def __init__(
        self,
        args: argparse.Namespace,
        vocab_size: int,
        reserved: list[int],
        max_model_len: int,
        *,
        max_n: int = 2,
    ) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.sample = token_range(vocab_size, reserved)
        self.max_len = max_model_len
        self.max_n = max_n
        self.mix = parse_mix(args.mix)
        self.prefixes = [self.sample(self.rng, args.prefix_len) for _ in range(args.num_prefixes)]
        self.sessions: list[list[int]] = [[] for _ in range(args.num_sessions)]
        self.busy: set[int] = set()

    def _tokens(self) -> list[int]:
        n = max(1, int(self.rng.uniform(0.25, 1.75) * self.args.input_len))
        return self.sample(self.rng, n)

    def _fit(self, prompt: list[int], max_tokens: int) -> list[int]:
        room = self.max_len - max_tokens
        return prompt[-room:] if len(prompt) > room else prompt

    def next(self) -> Job:
        kinds = list(self.mix)
        kind = self.rng.choices(kinds, weights=[self.mix[k] for k in kinds])[0]
        out = self.rng.randint(1, self.args.output_len)
        common: dict[str, Any] = {"max_tokens": out, "temperature": 0.0, "ignore_eos": True}
        job = Job(kind, None)
        prompt = self._tokens()
        if kind in ("shared", "pin", "cancel", "deadline"):
            prompt = self.rng.choice(self.prefixes) + prompt
        if kind == "multi_turn":
            free = [i for i in range(len(self.sessions)) if i not in self.busy]
            if free:
                job.session = self.rng.choice(free)
                self.busy.add(job.session)
                prompt = self.sessions[job.session] + prompt
                if len(prompt) + out > self.max_len // 2:  # start the conversation over
                    prompt = prompt[-self.args.input_len :]
        extra: dict[str, Any] = {}
        if kind == "n":
            common.update(n=self.rng.randint(2, self.max_n), temperature=0.8)
            common["seed"] = self.rng.randrange(2**31)
        elif kind == "logprobs":
            extra["logprobs"] = self.rng.randint(0, 5)
            common["temperature"] = 0.7
        elif kind == "pin":
            extra["pin_ttl_s"] = self.rng.uniform(0.5, self.args.max_pin_s)
        elif kind == "cancel":
            common["max_tokens"] = self.args.output_len
            job.cancel_after_s = self.rng.uniform(0.0, 0.5)
        elif kind == "deadline":
            common["max_tokens"] = self.args.output_len
            job.timeout_s = self.rng.uniform(0.02, 1.0)
        job.request = build_request(
            self._fit(prompt, common["max_tokens"]),
            return_token_ids=True,
            session_id=f"soak-{job.session}" if job.session is not None else "",
            **extra,
            **common,
        )
        return job

    def done(self, job: Job, output: list[int] | None) -> None:
        """Ends a job's turn: a successful multi-turn answer extends its session."""
        if job.session is None:
            return
        self.busy.discard(job.session)
        if output is not None:
            self.sessions[job.session] = list(job.request.token_ids.ids) + output


async def run_job(client: AsyncDejaClient, job: Job) -> tuple[str, str, list[int] | None]:
    """(status name, detail, output token ids of choice 0 when OK)."""
    import grpc

    call = client.stub.Generate(job.request, timeout=job.timeout_s)
    output: list[int] = []

    async def consume() -> None:
        async for msg in call:
            for c in msg.choices:
                if c.index == 0:
                    output.extend(c.token_ids)

    try:
        if job.cancel_after_s is not None:
            try:
                await asyncio.wait_for(consume(), job.cancel_after_s)
            except TimeoutError:
                call.cancel()
                return "CANCELLED", "", None
        else:
            await consume()
    except grpc.aio.AioRpcError as e:
        return e.code().name, e.details() or "", None
    return "OK", "", output


async def _load(
    client: AsyncDejaClient, load: SoakLoad, tally: Tally, until: float, concurrency: int
) -> None:
    async def worker() -> None:
        while time.monotonic() < until:
            job = load.next()
            status, detail, output = await run_job(client, job)
            load.done(job, output)
            tally.add(job.kind, status, detail)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


# -- sampling ----------------------------------------------------------------------------------


def process_tree_figures(pid: int) -> tuple[int, int, int, int] | None:
    """(RSS bytes, open fds, threads, RSS bytes of the children alone) of the process and all
    its children; None when gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    rss = fds = threads = children = 0
    for p in procs:
        try:
            with p.oneshot():
                r = p.memory_info().rss
                rss += r
                children += r if p is not root else 0
                fds += p.num_fds()
                threads += p.num_threads()
        except psutil.Error:  # a child that just exited
            continue
    return rss, fds, threads, children


def listening_pid(target: str) -> int | None:
    """The local process listening on the target's port (None when not found or not allowed)."""
    import psutil

    host, _, port = target.rpartition(":")
    if host not in ("localhost", "127.0.0.1", "0.0.0.0", "[::1]", "[::]") or not port.isdigit():
        return None
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == int(port):
                return c.pid
    except psutil.Error:
        return None
    return None


_PY_OBJECTS = re.compile(r"^deja_python_objects(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)


def python_objects(metrics_url: str | None) -> int | None:
    if not metrics_url:
        return None
    url = metrics_url if metrics_url.endswith("/metrics") else metrics_url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    m = _PY_OBJECTS.search(text)
    return int(float(m.group(1))) if m else None


async def take_sample(
    client: AsyncDejaClient, pid: int | None, metrics_url: str | None, t_s: float, tally: Tally
) -> Sample:
    figures = process_tree_figures(pid) if pid is not None else None
    rss, fds, threads, children = figures if figures is not None else (None, None, None, None)
    tiers: dict[str, Any] = {}
    dev_free = dev_total = buffers = None
    try:
        stats = await client.cache_stats()
        dev_free, dev_total = stats.free_device_blocks, stats.total_device_blocks
        tiers = {t.name: t for t in stats.tiers}
        buffers = sum(b.bytes for b in stats.buffers if b.name.startswith("disk_"))
    except Exception:  # a sample never stops the soak
        pass
    objects = await asyncio.to_thread(python_objects, metrics_url)

    def used(name: str) -> tuple[int | None, int | None]:
        t = tiers.get(name)
        return (t.used_blocks, t.num_blocks) if t is not None else (None, None)

    cpu_used, cpu_total = used("cpu")
    disk_used, disk_total = used("disk")
    return Sample(
        t_s, tally.requests, tally.failed, rss, fds, threads, dev_free, dev_total,
        cpu_used, cpu_total, disk_used, disk_total, objects, children, buffers,
    )  # fmt: skip


async def end_state(client: AsyncDejaClient, timeout_s: float) -> EndState | None:
    """Waits (up to `timeout_s`) for every device block to be free; the state it ends in."""
    deadline = time.monotonic() + timeout_s
    state: EndState | None = None
    while True:
        try:
            s = await client.cache_stats()
            cpu = next((t for t in s.tiers if t.name == "cpu"), None)
            held = (cpu.used_blocks - cpu.cached_blocks) if cpu is not None else 0
            state = EndState(s.free_device_blocks, s.total_device_blocks, held)
            if state.device_free == state.device_total and held == 0:
                return state
        except Exception:
            pass
        if time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.5)


# -- the command -------------------------------------------------------------------------------


async def soak(
    args: argparse.Namespace, target: str, pid: int | None, metrics_url: str | None
) -> int:
    client = AsyncDejaClient(target, token=args.token, tls=args.tls, retries=0)
    try:
        await client.wait_ready(30)
        info = await client.model_info()
        load = SoakLoad(args, info.vocab_size, list(info.eos_token_ids), info.max_model_len)
        tally = Tally()
        warmup = min(args.warmup, args.duration / 3)
        print(
            f"soak {target} ({info.model_id}, pid {pid or 'unknown'}): {args.duration:.0f} s, "
            f"concurrency {args.concurrency}, warm-up {warmup:.0f} s, mix {args.mix}",
            flush=True,
        )
        print(format_table([]), flush=True)
        t0 = time.monotonic()
        runner = asyncio.create_task(
            _load(client, load, tally, t0 + args.duration, args.concurrency)
        )
        samples: list[Sample] = []
        while True:
            sample = await take_sample(client, pid, metrics_url, time.monotonic() - t0, tally)
            samples.append(sample)
            print(format_row(sample), flush=True)
            if runner.done():
                break
            rest = t0 + args.duration - time.monotonic()
            wait = min(args.sample_interval, rest) if rest > 0.5 else args.sample_interval
            await asyncio.wait({runner}, timeout=wait)
        await runner
        end = await end_state(client, timeout_s=args.max_pin_s + 30)
        final = await take_sample(client, pid, metrics_url, time.monotonic() - t0, tally)
        samples.append(final)
    finally:
        await client.close()
    verdict = judge(samples, end, warmup_s=warmup, rss_limit=args.rss_limit)
    print()
    print(format_table(samples))
    print("outcomes: " + ", ".join(f"{k}/{s} {n}" for (k, s), n in sorted(tally.outcomes.items())))
    for err in tally.errors:
        print(f"  failed: {err}")
    print(verdict.format())
    print(f"load average: {format_load(load_avg())}")
    return 0 if verdict.ok else 1


def run(args: argparse.Namespace) -> int:
    if not args.serve_args:
        pid = args.pid or listening_pid(args.target)
        return asyncio.run(soak(args, args.target, pid, args.metrics_url))
    port, mport = free_port(), free_port()
    target, metrics_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{mport}/metrics"
    argv = deja_argv(
        "serve", "--host", "127.0.0.1", "--port", str(port), "--metrics-host", "127.0.0.1",
        "--metrics-port", str(mport), *shlex.split(args.serve_args),
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="deja-soak-") as tmp:
        try:
            with serving(Path(tmp), "serve", argv, target, args.server_start_timeout) as group:
                proc = group.procs["serve"]
                code = asyncio.run(soak(args, target, proc.pid, metrics_url))
        except BaseException:
            print((Path(tmp) / "serve.log").read_text(errors="replace")[-4000:], file=sys.stderr)
            raise
        if proc.returncode not in (0, None):
            print(f"`deja serve` exited with {proc.returncode}", file=sys.stderr)
            return 1
        return code
