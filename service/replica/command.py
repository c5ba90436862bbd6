"""`deja serve`: run one replica (gRPC server over the engine) until SIGTERM/SIGINT.

    deja serve                                   # the demo model on 127.0.0.1:50051
    deja serve --model /path/to/hf-folder --host 0.0.0.0 --port 50051 --metrics-port 9400

Every flag also reads a DEJA_* environment variable (--max-num-seqs <- DEJA_MAX_NUM_SEQS).
On SIGTERM/SIGINT the replica drains: health NOT_SERVING, new calls UNAVAILABLE, running
streams get --grace-period seconds to finish, the rest are aborted, and the disk tier's queued
writes are flushed (within the grace period) before exit.

The engine's step loop runs in a process of its own (`--engine-core process`, the default; see
engine/core/core_process.py); if that process dies, open streams end with UNAVAILABLE (and the engine-dead trailer), new calls get UNAVAILABLE,
health turns NOT_SERVING and `deja serve` exits with status 1 so an orchestrator restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from typing import TYPE_CHECKING

from service.common.engine_args import add_engine_args, engine_config_from_args
from service.common.flags import add_flag
from service.replica.agent import AgentSettings, add_replica_agent_args, agent_settings_from_args
from service.replica.config import ServiceConfig, add_service_args, service_config_from_args

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from service.replica.servicer_base import Engine

log = logging.getLogger("deja.serve")
LOG_LEVELS = ("debug", "info", "warning", "error")
ENGINE_CORE_MODES = ("process", "thread")
EXIT_ENGINE_DEAD = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_service_args(parser)
    add_replica_agent_args(parser)
    add_flag(parser, "--log-level", default="info", choices=LOG_LEVELS, help="Logging level.")
    add_flag(
        parser,
        "--engine-core",
        default="process",
        choices=ENGINE_CORE_MODES,
        help="Where the step loop runs: its own process (full speed, crash-isolated) or a "
        "thread of the server process.",
    )


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        service_config = service_config_from_args(args)
        agent_settings = agent_settings_from_args(args)
    except ValueError as e:
        print(f"deja serve: error: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    log.info("resolving model %s", args.model)
    try:
        engine_config = engine_config_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"deja serve: error: {e}", file=sys.stderr)
        return 2
    log.info("loading %s (engine core: %s)", engine_config.model.path, args.engine_core)
    try:
        engine = start_engine(
            engine_config,
            args.engine_core,
            stream_buffer=service_config.stream_buffer,
            log_level=getattr(logging, args.log_level.upper()),
        )
    except RuntimeError as e:
        print(f"deja serve: error: {e}", file=sys.stderr)
        return 2
    info = engine.model_info
    log.info(
        "loaded %s (%s, %s, max_model_len %d, %d KV blocks of %d) in %.1f s",
        info.model_id,
        info.family,
        info.dtype,
        info.max_model_len,
        info.num_device_blocks,
        info.block_size,
        time.monotonic() - t0,
    )
    try:
        return asyncio.run(serve_until_signal(service_config, engine, agent_settings))
    finally:
        engine.shutdown(service_config.grace_period_s)


def start_engine(
    config: EngineConfig, mode: str, *, stream_buffer: int, log_level: int = logging.INFO
) -> Engine:
    """Loads the model and starts the step loop (blocking): in an engine-core process, or in a
    thread of this process. Raises RuntimeError when the engine core cannot start."""
    if mode == "process":
        from engine.frontend.core_client import EngineCoreClient

        return EngineCoreClient(config, stream_buffer=stream_buffer, log_level=log_level)
    from engine.core.core_process import freeze_gc_heap
    from engine.frontend.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(config, stream_buffer=stream_buffer)
    freeze_gc_heap()  # this process keeps the engine to its end
    engine.start()
    return engine


async def serve_until_signal(
    config: ServiceConfig, engine: Engine, agent_settings: AgentSettings | None = None
) -> int:
    """Serves until SIGTERM/SIGINT (drain, exit 0) or the engine's death (exit 1)."""
    from service.common.tracing import make_tracer_provider
    from service.replica.server import serve

    provider = make_tracer_provider(
        replica_id=config.replica_id,
        otlp_endpoint=config.otlp_endpoint,
        console=config.console_tracing,
    )
    replica = await serve(config, engine, tracer_provider=provider)
    scheme = "mtls" if config.tls_client_ca else "tls" if config.tls_cert else "plaintext"
    log.info(
        "serving deja.v1.Inference on %s:%d (%s, replica %s, auth %s, reflection %s)",
        config.host,
        replica.port,
        scheme,
        replica.replica_id,
        "on" if config.auth_enabled else "off",
        "on" if config.reflection else "off",
    )
    if replica.metrics_port is not None:
        log.info("metrics on http://%s:%d/metrics", config.metrics_host, replica.metrics_port)
    agent = None
    if config.redis_url and agent_settings is not None:
        from service.replica.agent import start_replica_agent

        agent = await start_replica_agent(
            agent_settings,
            replica_id=replica.replica_id,
            host=config.host,
            port=replica.port,
            model_info=engine.model_info,
            get_stats=engine.get_stats,
            registry=replica.metrics.registry,
            kv_events=replica.servicer.kv_events.subscribe,
        )
        replica.servicer.on_finished = agent.record
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    dead = loop.create_task(_wait_engine_dead(engine))
    signalled = loop.create_task(stop.wait())
    await asyncio.wait((dead, signalled), return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if dead.done():
        log.error("the engine failed; stopping so that the replica is restarted")
        code = EXIT_ENGINE_DEAD
    else:
        dead.cancel()
        log.info("signal received; draining (grace period %.1f s)", config.grace_period_s)
    signalled.cancel()
    if agent is not None:
        await agent.stop()  # leave the registry first, so routers stop sending here
    await replica.shutdown(0.0 if code else config.grace_period_s)
    if provider is not None:
        provider.shutdown()
    log.info("stopped")
    return code


async def _wait_engine_dead(engine: Engine, interval_s: float = 0.1) -> None:
    while not engine.errored:
        await asyncio.sleep(interval_s)
