"""The router's settings: one frozen dataclass, built from flags / DEJA_* variables."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from engine.config import check, check_one_of, check_port
from service.affinity.config import AffinityConfig
from service.affinity.flags import add_affinity_args, affinity_config_from_args
from service.common.flags import (
    ConfigFlag,
    add_bool_flag,
    add_config_flags,
    add_flag,
    add_list_flag,
    config_values,
)
from service.common.server_args import ServerSettings, add_server_args, server_settings_from_args
from service.router.cost import CostWeights
from service.router.policy import POLICIES, OverloadGuard


def parse_replicas(specs: list[str]) -> tuple[str, ...]:
    """`--replicas a:1,b:2 --replicas c:3` -> ("a:1", "b:2", "c:3"), checked, without repeats."""
    out: list[str] = []
    for spec in specs:
        for part in spec.split(","):
            addr = part.strip()
            if not addr:
                continue
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"replica address must be host:port, got {addr!r}")
            if addr not in out:
                out.append(addr)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class RouterConfig(ServerSettings):
    """The router's settings; the server fields both servers share are in ServerSettings."""

    host: str = "127.0.0.1"
    port: int = 50050
    """gRPC port; 0 picks a free one."""
    router_id: str = "router"
    """Reported by GetLoad / GetCacheStats and in metrics."""
    replicas: tuple[str, ...] = ()
    """Static replica addresses (host:port), polled like discovered ones."""
    discover: bool = True
    """Also take replicas from the store's registry (needs a shared store, i.e. Redis)."""
    policy: str = "cost"
    """cost (least estimated time to first token), affinity (session, then prefix, then load),
    round_robin or prefix_only."""
    guard: OverloadGuard = field(default_factory=OverloadGuard)
    cost: CostWeights = field(default_factory=CostWeights)
    """The cost policy's credits, load bound and stickiness."""
    model: str | None = None
    """Model folder (or "demo") whose tokenizer the router hashes prompts with; None: no prefix
    routing for text and chat prompts (token-id prompts are still hashed)."""
    cache_dir: str = "~/.cache/deja"
    affinity: AffinityConfig = field(default_factory=AffinityConfig)
    poll_interval_s: float = 1.0
    """How often each replica's load and health are polled (GetLoad)."""
    poll_timeout_s: float = 2.0
    poll_failures_down: int = 3
    """Consecutive poll timeouts before a replica counts as down (refused connections: one)."""
    max_attempts: int = 3
    """Replicas tried for one Generate while they answer UNAVAILABLE before the first message."""

    def __post_init__(self) -> None:
        check_port("port", self.port)
        check_one_of("policy", self.policy, POLICIES)
        check(self.poll_interval_s > 0 and self.poll_timeout_s > 0, "poll times must be > 0")
        check(self.poll_failures_down >= 1, "poll_failures_down must be >= 1")
        check(self.max_attempts >= 1, "max_attempts must be >= 1")
        check(self.grace_period_s >= 0, "grace_period_s must be >= 0")
        check(
            bool(self.replicas) or (self.discover and self.affinity.redis_url is not None),
            "the router needs replicas: give --replicas, or --redis-url to discover them",
        )


_COST_FLAGS = (
    ConfigFlag(
        "load_bound",
        float,
        "New sessions only go to replicas within this x the mean load (0: no bound).",
    ),
    ConfigFlag(
        "prefix_bound",
        float,
        "A replica within this x the mean load still wins when its estimate is under "
        "half the best one within --load-bound (a large cached prefix; 0: off).",
    ),
    ConfigFlag(
        "holder_share",
        float,
        "A replica holding at least this share of the prompt in its cache is exempt from "
        "--load-bound, like the session's own replica, for a prefix whose share of recent "
        "traffic fits one replica (0: off).",
    ),
    ConfigFlag(
        "holder_bound",
        float,
        "The --holder-share exemption holds up to this x the mean load (0: no cap).",
    ),
    ConfigFlag(
        "stickiness_s", float, "Most seconds of estimate a session's last replica is favoured by."
    ),
    ConfigFlag(
        "recompute_weight",
        float,
        "Weight of the prefill time a request adds to a replica (the wait of the requests "
        "after it) next to its own estimated TTFT; 0: its own TTFT alone.",
    ),
    ConfigFlag(
        "packing_weight",
        float,
        "Weight of that prefill time per request still waiting for its first token there "
        "(they share its prefill step); 0 for engines whose steps cost the same with several "
        "prompts.",
    ),
)
"""The CostWeights fields set by flags (deja route and deja bench sim), in --help order."""


def add_cost_args(group: argparse._ArgumentGroup) -> None:
    """The cost policy's bounds, stickiness and weights (--load-bound, --prefix-bound,
    --stickiness, --recompute-weight, --packing-weight)."""
    add_config_flags(group, CostWeights(), _COST_FLAGS)


def cost_weights_from_args(args: argparse.Namespace, **given: Any) -> CostWeights:
    """The CostWeights of add_cost_args' flags, with the other weights in `given`."""
    return CostWeights(**config_values(args, _COST_FLAGS), **given)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    d = RouterConfig(replicas=("x:1",))
    g = parser.add_argument_group("router")
    add_flag(g, "--host", default=d.host, help="Interface to listen on.")
    add_flag(g, "--port", type=int, default=d.port, help="gRPC port (0: a free one).")
    add_flag(g, "--router-id", default=d.router_id, help="Name in GetLoad and metrics.")
    add_list_flag(g, "--replicas", metavar="HOST:PORT[,HOST:PORT...]", help="Static replicas.")
    add_bool_flag(
        g, "--discover", default=d.discover, help="Discover replicas in Redis (with --redis-url)."
    )
    add_flag(g, "--policy", default=d.policy, choices=POLICIES, help="Routing policy.")
    add_flag(g, "--model", help="Model folder or 'demo' for the tokenizer (prefix routing).")
    add_flag(g, "--cache-dir", default=d.cache_dir, help="Where converted models live.")
    add_flag(
        g, "--poll-interval", type=float, default=d.poll_interval_s, help="Replica load poll (s)."
    )
    add_flag(g, "--poll-timeout", type=float, default=d.poll_timeout_s, help="Poll deadline (s).")
    add_flag(g, "--max-attempts", type=int, default=d.max_attempts, help="Replicas per request.")
    add_server_args(g, d, auth_help="Replicas' tokens (for cache salts).")

    o = parser.add_argument_group("overload guard")
    gd = d.guard
    add_flag(o, "--max-waiting", type=int, default=gd.max_waiting, help="Engine queue limit.")
    add_flag(o, "--max-kv-usage", type=float, default=gd.max_kv_usage, help="KV usage limit.")
    add_flag(
        o, "--max-inflight", type=int, default=gd.max_inflight, help="Open streams (0: no limit)."
    )
    add_flag(
        o,
        "--max-imbalance",
        type=int,
        default=gd.max_imbalance,
        help="Prefix matches ignored on replicas this much busier than the least loaded.",
    )
    k = parser.add_argument_group("cost policy")
    add_cost_args(k)
    dc = d.cost
    add_flag(
        k,
        "--tier-credits",
        default=f"{dc.device_credit},{dc.cpu_credit},{dc.disk_credit},{dc.remote_credit}",
        help="Share of a block's prefill saved on device,cpu,disk[,remote] (remote: the KV tier "
        "shared by every replica, credited to all of them).",
    )
    add_affinity_args(parser, with_url=True)


def parse_tier_credits(spec: str) -> tuple[float, float, float, float]:
    """DEVICE,CPU,DISK[,REMOTE] (REMOTE defaults to CostWeights' remote_credit)."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) not in (3, 4):
        raise ValueError(f"--tier-credits takes DEVICE,CPU,DISK[,REMOTE], got {spec!r}")
    values = [float(p) for p in parts]
    if len(values) == 3:
        values.append(CostWeights().remote_credit)
    dev, cpu, disk, remote = values
    return dev, cpu, disk, remote


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    dev, cpu, disk, remote = parse_tier_credits(args.tier_credits)
    return RouterConfig(
        host=args.host,
        port=args.port,
        router_id=args.router_id,
        replicas=parse_replicas(args.replicas),
        discover=args.discover,
        policy=args.policy,
        guard=OverloadGuard(
            max_waiting=args.max_waiting,
            max_kv_usage=args.max_kv_usage,
            max_inflight=args.max_inflight,
            max_imbalance=args.max_imbalance,
        ),
        cost=cost_weights_from_args(
            args, device_credit=dev, cpu_credit=cpu, disk_credit=disk, remote_credit=remote
        ),
        model=args.model,
        cache_dir=args.cache_dir,
        affinity=affinity_config_from_args(args),
        poll_interval_s=args.poll_interval,
        poll_timeout_s=args.poll_timeout,
        max_attempts=args.max_attempts,
        **server_settings_from_args(args),
    )
