"""`deja route`: run the router (same deja.v1.Inference API) in front of deja replicas.

    deja route --replicas 10.0.0.1:50051,10.0.0.2:50051 --model demo
    deja route --redis-url redis://redis:6379/0 --model /models/llama   # discover replicas

Each Generate goes to the replica where its time to first token is estimated lowest (--policy cost,
the default): the prompt tokens a replica would not have to compute (its session's and prefix's
blocks, on the device or in a tier) against its queue and load, under a load bound. --policy
affinity takes the session's replica, else the one holding the longest prefix, else the least
loaded (round_robin and prefix_only are the other choices). Both skip overloaded replicas, so a hot
session or prefix cannot swamp one. With --redis-url the affinity records and the replica registry
are shared with the replicas (start them with the same --redis-url); without it the router keeps
them in memory. If Redis is down or slow, requests are routed by rendezvous hashing of the session
id and none fails. Every flag also reads a DEJA_* environment variable.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from service.common.flags import add_flag
from service.router.config import RouterConfig, add_router_args, router_config_from_args

log = logging.getLogger("deja.route")
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_router_args(parser)
    add_flag(parser, "--log-level", default="info", choices=LOG_LEVELS, help="Logging level.")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = router_config_from_args(args)
    except ValueError as e:
        print(f"deja route: error: {e}", file=sys.stderr)
        return 2
    tokenizer = None
    if config.model:
        from service.router.prompt import load_router_tokenizer

        try:
            tokenizer = load_router_tokenizer(config.model, config.cache_dir)
        except (OSError, ValueError) as e:
            print(
                f"deja route: error: cannot load the tokenizer of {config.model}: {e}",
                file=sys.stderr,
            )
            return 2
    else:
        log.warning("no --model: prefix routing only for token-id prompts")
    return asyncio.run(route_until_signal(config, tokenizer))


async def route_until_signal(config: RouterConfig, tokenizer: object | None) -> int:
    from service.affinity.factory import create_store
    from service.common.tracing import make_tracer_provider
    from service.router.server import serve_router

    provider = make_tracer_provider(
        service_name="deja-router",
        replica_id=config.router_id,
        otlp_endpoint=config.otlp_endpoint,
        console=config.console_tracing,
    )
    store = create_store(config.affinity)
    router = await serve_router(config, store=store, tokenizer=tokenizer, tracer_provider=provider)
    log.info(
        "routing deja.v1.Inference on %s:%d (policy %s, store %s, %d replicas healthy of %d)",
        config.host,
        router.port,
        config.policy,
        "redis" if config.affinity.redis_url else "memory",
        len(router.pool.healthy()),
        len(router.pool.handles()),
    )
    if router.metrics_port is not None:
        log.info("metrics on http://%s:%d/metrics", config.metrics_host, router.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received; draining (grace period %.1f s)", config.grace_period_s)
    await router.shutdown(config.grace_period_s)
    if provider is not None:
        provider.shutdown()
    log.info("stopped")
    return 0
