"""`deja generate`: one prompt, one answer, printed as it streams.

deja generate "What is the capital of France?" --usage
deja generate --raw "The capital of France is" --max-tokens 16
echo "Once upon a time" | deja generate - --no-chat --temperature 0.8 --seed 1
deja generate "A user, as JSON" --json-schema user.schema.json --temperature 0
deja generate "Is the sky green?" --choice yes --choice no

By default the prompt is sent as a user chat message when the served model has a chat template
(GetModelInfo says so), as a plain completion prompt otherwise; --chat forces a chat message,
--raw / --no-chat a plain prompt. Client-side TTFT is the time from the call to the first message
that carries a token.

Structured output (one of --json-schema FILE, --json-object, --regex, --choice ...) constrains
the text on the server; with a JSON format the command exits 1, saying why, when the final text
does not parse (e.g. cut by --max-tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import grpc

from clients.client import DejaClient, GenerateResult, add_connection_args, client_from_args
from service.common.flags import add_bool_flag, add_flag


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    add_flag(g, "--max-tokens", type=int, default=256, help="Most tokens to generate.")
    add_flag(
        g,
        "--temperature",
        type=float,
        help="0 is greedy (default: the model's generation_config.json, else 1.0).",
    )
    add_flag(g, "--top-p", type=float, help="Default: the model's, else 1.0.")
    add_flag(g, "--top-k", type=int, help="0 keeps every token (default: the model's, else 0).")
    add_flag(g, "--seed", type=int, help="Reproducible sampling.")


def sampling_from_args(args: argparse.Namespace) -> dict[str, object]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
    }


def add_format_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("structured output (at most one)")
    fmt = g.add_mutually_exclusive_group()
    fmt.add_argument(
        "--json-schema",
        metavar="FILE",
        help="A JSON Schema file; the output is JSON that validates against it.",
    )
    fmt.add_argument("--json-object", action="store_true", help="The output is a JSON object.")
    fmt.add_argument("--regex", metavar="PATTERN", help="The whole output matches this regex.")
    fmt.add_argument(
        "--choice",
        action="append",
        metavar="TEXT",
        help="The output is exactly one of these (repeat the flag for each choice).",
    )


def format_from_args(args: argparse.Namespace) -> dict[str, object]:
    """The response_format fields for build_request; ValueError with a message for a bad file."""
    if args.json_schema is not None:
        try:
            with open(args.json_schema, encoding="utf-8") as f:
                text = f.read()
            json.loads(text)
        except OSError as e:
            raise ValueError(f"--json-schema: cannot read {args.json_schema}: {e.strerror}") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema: {args.json_schema} is not JSON: {e}") from e
        return {"json_schema": text}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": args.choice}
    return {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help='The prompt ("-" reads stdin).')
    mode = parser.add_mutually_exclusive_group()
    add_bool_flag(
        mode,
        "--chat",
        default=None,
        help="Send the prompt as a user chat message (--no-chat: plain completion). "
        "Default: chat when the model has a chat template.",
    )
    mode.add_argument(
        "--raw",
        dest="chat",
        action="store_false",
        help="Plain completion prompt, no chat template (same as --no-chat).",
    )
    add_flag(parser, "--system", help="System message (chat mode only).")
    add_bool_flag(parser, "--usage", default=False, help="Print usage and timings (stderr).")
    add_sampling_args(parser)
    add_format_args(parser)
    add_connection_args(parser)


def run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    kwargs: dict[str, object] = sampling_from_args(args)
    try:
        kwargs.update(format_from_args(args))
    except ValueError as e:
        print(f"deja generate: {e}", file=sys.stderr)
        return 2
    # Token ids make every token visible, also while the detokenizer holds text back (client TTFT).
    kwargs["return_token_ids"] = True
    with client_from_args(args) as client:
        try:
            chat = use_chat(args.chat, client)
        except grpc.RpcError as e:
            return _rpc_failed(e)
        if chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": prompt})
            kwargs["messages"] = messages
        else:
            if args.system:
                print("deja generate: --system needs chat mode", file=sys.stderr)
                return 2
            kwargs["prompt"] = prompt
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
            sys.stdout.write("\n")
            return _rpc_failed(e)
    sys.stdout.write("\n")
    sys.stdout.flush()
    status = _check_json(result) if "json_schema" in kwargs or "json_object" in kwargs else 0
    if args.usage and result.final is not None:
        u, t = result.final.usage, result.final.timings
        # No token at all (e.g. EOS first): there is no time to first token to report.
        client_ttft = "n/a" if result.ttft_s is None else f"{result.ttft_s * 1e3:.1f} ms"
        tiers = u.cached_by_tier
        print(
            f"usage: prompt {u.prompt_tokens} tokens ({u.cached_prompt_tokens} cached: "
            f"device {tiers.device}, cpu {tiers.cpu}, disk {tiers.disk}), "
            f"completion {u.completion_tokens} tokens, finish {result.finish_reason}\n"
            f"timings: queue {t.queue_s * 1e3:.1f} ms, ttft {t.ttft_s * 1e3:.1f} ms, "
            f"total {t.total_s * 1e3:.1f} ms (client ttft {client_ttft}); "
            f"replica {result.final.replica_id}",
            file=sys.stderr,
        )
    return status


def _check_json(result: GenerateResult) -> int:
    """0 when the first choice's text parses as JSON; else 1, saying why on stderr."""
    try:
        json.loads(result.text)
    except json.JSONDecodeError as e:
        hint = " (cut by --max-tokens; raise it)" if result.finish_reason == "length" else ""
        print(
            f"deja generate: the output is not valid JSON{hint}: {e}; "
            f"finish reason {result.finish_reason}",
            file=sys.stderr,
        )
        return 1
    return 0


def use_chat(flag: bool | None, client: DejaClient) -> bool:
    """--chat / --raw as given; unset: chat exactly when the served model has a chat template."""
    if flag is not None:
        return flag
    return bool(client.model_info().has_chat_template)


def _rpc_failed(e: grpc.RpcError) -> int:
    code = e.code().name if isinstance(e, grpc.Call) else "ERROR"
    details = e.details() if isinstance(e, grpc.Call) else str(e)
    print(f"deja generate: {code}: {details}", file=sys.stderr)
    return 1
