"""The Grafana dashboard (deploy/grafana/dashboards/deja.json) against real processes: a
redis-server, a `deja serve` replica (a small device pool over a CPU tier, so blocks spill and
come back) and a `deja route` router, scraped by a real Prometheus (Debian's `prometheus`) under a
short multi-turn load with one bad request. Every PromQL expression of the dashboard is evaluated
through Prometheus's HTTP API: each must return at least one series and name only metrics the
services export."""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from clients.testing.cluster import (
    ProcessGroup,
    route_argv,
    serve_argv,
    wait_healthy,
    wait_router_replicas,
)
from clients.testing.polling import poll_until
from service.api.deja.v1 import inference_pb2 as pb
from service.api.deja.v1 import inference_pb2_grpc as pb_grpc
from service.common.ports import free_port
from tests.support.redis_proc import RedisProcess

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy/grafana/dashboards/deja.json"
RATE_WINDOW = "1m"
"""What the test puts for Grafana's $__rate_interval (it is at least four scrape intervals)."""
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "cats",
    "sing",
    "of",
    "stars",
    "and",
    "rivers",
]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (histogram series as their family's name)."""
    names = set(re.findall(r"\b(deja_[a-z0-9_]+|process_[a-z0-9_]+)", expr))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def test_dashboard_names_only_documented_metrics() -> None:
    """Offline: every name is in the metrics reference generated from the registries."""
    reference = (DASHBOARD.parents[3] / "docs/reference/metrics.md").read_text()
    documented = set(re.findall(r"`((?:deja|process)_[a-z0-9_]+)`", reference))
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for title, expr in exprs:
        unknown = metric_names(expr) - documented
        assert not unknown, f"{title}: {expr} names {unknown}, which no service exports"


class Prometheus:
    """`prometheus` on a free local port with its own data folder, scraping `targets` every
    second."""

    def __init__(self, workdir: Path, jobs: dict[str, list[str]]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed (Debian's `prometheus` package)")
        self.port = free_port()
        config = workdir / "prometheus.yml"
        scrape = [
            {"job_name": job, "static_configs": [{"targets": targets}]}
            for job, targets in jobs.items()
        ]
        config.write_text(
            json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": scrape})
        )
        self.log = workdir / "prometheus.log"
        self._log_file = self.log.open("wb")
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        self.proc = subprocess.Popen(argv, stdout=self._log_file, stderr=subprocess.STDOUT)

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def wait_targets_up(self, n: int, timeout_s: float = 60.0) -> None:
        def check_alive() -> None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log.read_text()[-2000:]}")

        poll_until(
            lambda: sum(t["health"] == "up" for t in self.api("targets")["activeTargets"]) >= n,
            timeout_s,
            0.5,
            check_alive=check_alive,
            timeout_error=lambda: TimeoutError(f"prometheus scrapes fewer than {n} targets"),
        )

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log_file.close()


async def _turns(stub: pb_grpc.InferenceStub, session: int) -> None:
    """Four chat turns of one session over a shared system prompt (cache hits, spills)."""
    rng = random.Random(session)
    system = "You are a helpful assistant. " + " ".join(rng.choice(WORDS) for _ in range(120))
    messages = [pb.ChatMessage(role="system", content=system)]
    for _ in range(4):
        content = " ".join(rng.choice(WORDS) for _ in range(30))
        messages.append(pb.ChatMessage(role="user", content=content))
        req = pb.GenerateRequest(
            session_id=f"s{session}",
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        )
        req.chat.messages.extend(messages)
        text = ""
        async for resp in stub.Generate(req, timeout=120):
            text += "".join(c.text for c in resp.choices)
        messages.append(pb.ChatMessage(role="assistant", content=text))


async def _load(target: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        await asyncio.gather(*(_turns(stub, s) for s in range(6)))
        bad = pb.GenerateRequest(
            text="a request the replica refuses",
            sampling=pb.SamplingParams(max_tokens=4, temperature=-1.0),
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(bad, timeout=30):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def services(
    tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Prometheus]]:
    workdir = tmp_path_factory.mktemp("dashboard")
    redis = RedisProcess()
    group = ProcessGroup(workdir)
    port, router_port, replica_metrics, router_metrics = (free_port() for _ in range(4))
    prometheus: Prometheus | None = None
    try:
        redis.start()
        # 48 device blocks of 16 tokens over a CPU tier: six sessions of ~300 tokens spill
        engine = ["--num-device-blocks", "48", "--block-size", "16", "--cpu-swap-gib", "0.05"]
        group.spawn(
            "replica",
            serve_argv(
                str(tiny_llama_path),
                port=port,
                replica_id="r0",
                redis_url=redis.url,
                extra=[*engine, "--metrics-port", str(replica_metrics), "--heartbeat", "0.5"],
            ),
        )
        group.spawn(
            "router",
            route_argv(
                port=router_port,
                redis_url=redis.url,
                policy="cost",
                model=str(tiny_llama_path),
                metrics_port=router_metrics,
                extra=["--poll-interval", "0.25"],
            ),
        )
        wait_healthy(group, "replica", f"127.0.0.1:{port}")
        wait_router_replicas(group, "router", router_metrics, 1)
        prometheus = Prometheus(
            workdir,
            {
                "deja-replica": [f"127.0.0.1:{replica_metrics}"],
                "deja-router": [f"127.0.0.1:{router_metrics}"],
            },
        )
        prometheus.wait_targets_up(2)
        yield f"127.0.0.1:{router_port}", prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
        group.stop_all()
        redis.stop()


def test_every_dashboard_query_has_data(services: tuple[str, Prometheus]) -> None:
    target, prometheus = services
    asyncio.run(_load(target))
    time.sleep(4)  # a few scrapes after the load
    exported = set(prometheus.api("label/__name__/values"))
    empty = []
    for title, expr in dashboard_exprs():
        unknown = {n for n in metric_names(expr) if not exported & {n, f"{n}_bucket", f"{n}_total"}}
        assert not unknown, f"{title}: {expr} names {unknown}, not exported by the services"
        query = expr.replace("$__rate_interval", RATE_WINDOW)
        if not prometheus.api("query", query=query)["result"]:
            empty.append(f"{title}: {query}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
    spilled = prometheus.api("query", query="sum(deja_cache_tier_spills_total)")["result"]
    assert spilled and float(spilled[0]["value"][1]) > 0, "the load should spill to the CPU tier"
