"""A session that moves replicas keeps its cache: the remote tier across a replica's crash.

Two `deja serve` replicas share one remote tier (a redis-server this command starts, or
--kv-remote). A conversation of five turns (a system prompt, then each turn the last prompt, its
answer and a new user message; the history reaches ~1.5k tokens) runs turns 1-4 on replica A;
A is then SIGKILLed (no drain: only what its writer thread had sent survives), and turn 5 goes
to replica B. B reports how much of the prompt came from the remote tier; the same turn is then
recomputed on B (another cache salt: no tier holds its blocks) for the TTFT it saves and the
answer it must equal, token for token.

    deja bench failover [--model demo] [--dtype float32] [--kv-remote redis://...] [--json F]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import common, report
from clients.client import DejaClient
from clients.testing.cluster import ProcessGroup, serve_argv, wait_healthy
from clients.testing.redis_server import redis_server
from service.common.ports import free_port

FULL: dict[str, Any] = {"system_len": 800, "user_len": 100, "answer_len": 40, "turns": 5}
QUICK: dict[str, Any] = {"system_len": 320, "user_len": 16, "answer_len": 8, "turns": 5}


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_tokens: int
    remote_tokens: int
    cached_tokens: int
    ttft_s: float
    answer: list[int]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    parser.add_argument(
        "--kv-remote", default=None, help="the shared tier's URL (default: a redis-server here)"
    )
    parser.add_argument("--server-start-timeout", type=float, default=300.0)


def ask(client: DejaClient, prompt: list[int], answer_len: int, salt: str = "") -> Turn:
    res = client.complete(
        prompt,
        max_tokens=answer_len,
        temperature=0.0,
        ignore_eos=True,
        return_token_ids=True,
        cache_salt=salt,
        timeout=600,
    )
    assert res.final is not None and res.ttft_s is not None
    usage = res.final.usage
    return Turn(
        usage.prompt_tokens,
        usage.cached_by_tier.remote,
        usage.cached_prompt_tokens,
        res.ttft_s,
        list(res.choices[0].token_ids),
    )


def failover(model_path: str, args: argparse.Namespace, url: str, workdir: Path) -> dict[str, Any]:
    """Turns 1-4 on A, A killed, turn 5 on B (remote), turn 5 again on B (recomputed)."""
    work = common.resolve_workload(args, FULL, QUICK)
    ids, _ = common.allowed_token_ids(model_path)
    rng = random.Random(args.seed)
    group = ProcessGroup(workdir, omp_threads=args.threads)
    ports = {name: free_port() for name in ("a", "b")}
    extra = [
        "--dtype", args.dtype, "--kv-remote", url, "--max-model-len", "2048",
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
    ]  # fmt: skip
    if args.num_device_blocks:
        extra += ["--num-device-blocks", str(args.num_device_blocks)]
    try:
        for name, port in ports.items():
            group.spawn(name, serve_argv(model_path, port=port, replica_id=name, extra=extra))
        for name, port in ports.items():
            wait_healthy(group, name, f"127.0.0.1:{port}", args.server_start_timeout)
        with ExitStack() as stack:
            a, b = (stack.enter_context(DejaClient(f"127.0.0.1:{p}")) for p in ports.values())
            prompt = common.random_prompt(rng, ids, work["system_len"])
            turns: list[Turn] = []
            for _ in range(work["turns"] - 1):
                prompt = prompt + common.random_prompt(rng, ids, work["user_len"])
                turns.append(ask(a, prompt, work["answer_len"]))
                prompt = prompt + turns[-1].answer
            group.kill("a")
            prompt = prompt + common.random_prompt(rng, ids, work["user_len"])
            moved = ask(b, prompt, work["answer_len"])
            recomputed = ask(b, prompt, work["answer_len"], salt="recompute")
    finally:
        group.stop_all()
    return {
        "turns_on_a": [t.prompt_tokens for t in turns],
        "prompt_tokens": moved.prompt_tokens,
        "remote_tokens": moved.remote_tokens,
        "remote_share": moved.remote_tokens / moved.prompt_tokens,
        "ttft_moved_s": moved.ttft_s,
        "ttft_recomputed_s": recomputed.ttft_s,
        "ttft_ratio": moved.ttft_s / recomputed.ttft_s,
        "recomputed_cached_tokens": recomputed.cached_tokens,
        "identical_answer": moved.answer == recomputed.answer,
    }


def run(args: argparse.Namespace) -> int:
    model_path, info = common.begin(args, "a session moves replicas: the remote tier")
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        url = args.kv_remote or stack.enter_context(redis_server())
        r = failover(model_path, args, url, Path(tmp))
    report.print_table(
        ["turn 5 on B", "prompt", "from remote", "TTFT ms", "recomputed TTFT ms", "ratio",
         "same answer"],
        [["after A's SIGKILL", r["prompt_tokens"], f"{100 * r['remote_share']:.1f}%",
          f"{1000 * r['ttft_moved_s']:.0f}", f"{1000 * r['ttft_recomputed_s']:.0f}",
          f"{r['ttft_ratio']:.2f}x", "yes" if r["identical_answer"] else "NO"]],
    )  # fmt: skip
    print(report.finish_line(info))
    report.write_json(args.json, {"failover": r, "machine": info})
    return 0 if r["identical_answer"] else 1


if __name__ == "__main__":
    raise SystemExit(common.main("deja bench failover", __doc__, add_arguments, run))
