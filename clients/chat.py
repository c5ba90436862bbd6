"""`deja chat`: an interactive multi-turn chat in the terminal, streaming the answer.

    deja chat --system "You are a helpful assistant." --max-tokens 256

Type a message and press Enter. Commands: /reset (forget the conversation), /usage (usage and
timings of the last answer), /quit (or Ctrl-D). Ctrl-C stops the answer being streamed.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

import grpc

from clients.client import add_connection_args, client_from_args
from clients.generate_cmd import add_sampling_args, sampling_from_args
from clients.session import ChatSession
from service.common.flags import add_flag

HELP = "commands: /reset, /usage, /quit"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--system", help="System message that opens the conversation.")
    add_flag(parser, "--session-id", help="Session id (default: a new random one).")
    add_sampling_args(parser)
    add_connection_args(parser)


def _usage_line(session: ChatSession) -> str:
    r = session.last_result
    if r is None or r.final is None:
        return "no answer yet"
    u, t = r.final.usage, r.final.timings
    return (
        f"prompt {u.prompt_tokens} tokens ({u.cached_prompt_tokens} cached), "
        f"completion {u.completion_tokens}, ttft {t.ttft_s * 1e3:.0f} ms, "
        f"total {t.total_s * 1e3:.0f} ms, replica {r.final.replica_id}"
    )


def chat_loop(session: ChatSession, stdin: TextIO, stdout: TextIO, *, prompt: str = "> ") -> int:
    """Reads messages until /quit or EOF; streams each answer to stdout."""
    interactive = stdin.isatty()
    while True:
        if interactive:
            stdout.write(prompt)
            stdout.flush()
        line = stdin.readline()
        if not line:
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return 0
        if text == "/reset":
            session.reset()
            stdout.write("(conversation reset)\n")
            continue
        if text == "/usage":
            stdout.write(_usage_line(session) + "\n")
            continue
        if text.startswith("/"):
            stdout.write(HELP + "\n")
            continue
        try:
            for piece in session.send(text):
                stdout.write(piece)
                stdout.flush()
        except KeyboardInterrupt:
            stdout.write(" [stopped]")
        except grpc.RpcError as e:
            detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.Call) else str(e)
            stdout.write(f"[error: {detail}]")
        stdout.write("\n")


def run(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        session = ChatSession(
            client, system=args.system, session_id=args.session_id, **sampling_from_args(args)
        )
        if sys.stdin.isatty():
            print(f"deja chat with {args.target} (session {session.session_id}); {HELP}")
        return chat_loop(session, sys.stdin, sys.stdout)
