"""`deja generate`: one prompt, one answer, printed as it streams.

deja generate "The capital of France is" --max-tokens 16
deja generate --chat "What is the capital of France?" --usage
echo "Once upon a time" | deja generate - --temperature 0.8 --seed 1
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from clients.client import GenerateResult, add_connection_args, client_from_args
from service.flags import add_bool_flag, add_flag


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    add_flag(g, "--max-tokens", type=int, default=256, help="Most tokens to generate.")
    add_flag(g, "--temperature", type=float, default=0.7, help="0 is greedy.")
    add_flag(g, "--top-p", type=float, default=1.0)
    add_flag(g, "--top-k", type=int, default=0, help="0 keeps every token.")
    add_flag(g, "--seed", type=int, help="Reproducible sampling.")


def sampling_from_args(args: argparse.Namespace) -> dict[str, object]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help='The prompt ("-" reads stdin).')
    add_bool_flag(parser, "--chat", default=False, help="Send the prompt as a user chat message.")
    add_flag(parser, "--system", help="System message (with --chat).")
    add_bool_flag(parser, "--usage", default=False, help="Print usage and timings (stderr).")
    add_sampling_args(parser)
    add_connection_args(parser)


def run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    kwargs: dict[str, object] = sampling_from_args(args)
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": prompt})
        kwargs["messages"] = messages
    else:
        kwargs["prompt"] = prompt
    with client_from_args(args) as client:
        result = GenerateResult()
        t0 = time.monotonic()
        try:
            for msg in client.generate(**kwargs):  # type: ignore[arg-type]
                result.add(msg, elapsed_s=time.monotonic() - t0)
                for d in msg.choices:
                    if d.index == 0 and d.text:
                        sys.stdout.write(d.text)
                        sys.stdout.flush()
        except grpc.RpcError as e:
            code = e.code().name if isinstance(e, grpc.Call) else "ERROR"
            details = e.details() if isinstance(e, grpc.Call) else str(e)
            print(f"\ndeja generate: {code}: {details}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.usage and result.final is not None:
        u, t = result.final.usage, result.final.timings
        tiers = u.cached_by_tier
        print(
            f"usage: prompt {u.prompt_tokens} tokens ({u.cached_prompt_tokens} cached: "
            f"device {tiers.device}, cpu {tiers.cpu}, disk {tiers.disk}), "
            f"completion {u.completion_tokens} tokens, finish {result.finish_reason}\n"
            f"timings: queue {t.queue_s * 1e3:.1f} ms, ttft {t.ttft_s * 1e3:.1f} ms, "
            f"total {t.total_s * 1e3:.1f} ms (client ttft "
            f"{(result.ttft_s or 0) * 1e3:.1f} ms); replica {result.final.replica_id}",
            file=sys.stderr,
        )
    return 0
