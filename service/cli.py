"""The `deja` console script: one entry point, one subcommand per module.

Commands are registered as entry points (group `deja.commands`). Each command module exposes `add_arguments(parser)` and `run(args) -> int` and must be cheap to
import (no torch at module level), so `deja --help` stays fast. Commands whose module is not
installed (yet) are left out without breaking the others.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from types import ModuleType

from service.common.flags import EnvError

COMMAND_GROUP = "deja.commands"
"""The entry-point group that lists the commands (pyproject.toml's
`[project.entry-points."deja.commands"]`): the name is the command's words joined by dots, the
value its module. Each package registers its own commands there, so this dispatcher imports none
of the packages above it (clients/, bench/)."""


def commands() -> dict[str, str]:
    """Command words -> module, in the order the package metadata lists them."""
    return {ep.name.replace(".", " "): ep.value for ep in entry_points(group=COMMAND_GROUP)}


def _load(module_name: str) -> ModuleType | None:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            return None  # not written / not installed: no such command
        print(f"deja: command module {module_name} is unavailable: {e}", file=sys.stderr)
        return None


def _summary(module: ModuleType) -> str:
    doc = (module.__doc__ or "").strip()
    first = doc.splitlines()[0] if doc else ""
    if first.startswith("`") and "`: " in first:  # "`deja serve`: run ..." -> "run ..."
        first = first.split("`: ", 1)[1]
    return first


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deja",
        description="deja: gRPC LLM inference with a persistent, tiered prefix cache.",
        epilog="Every flag also reads a DEJA_* environment variable; see `deja COMMAND --help`.",
    )
    groups: dict[tuple[str, ...], argparse._SubParsersAction[argparse.ArgumentParser]] = {
        (): parser.add_subparsers(title="commands", metavar="COMMAND")
    }
    for name, module_name in commands().items():
        module = _load(module_name)
        if module is None:
            continue
        words = tuple(name.split())
        for i in range(1, len(words)):
            prefix = words[:i]
            if prefix not in groups:
                group_parser = groups[prefix[:-1]].add_parser(
                    prefix[-1], help=f"{' '.join(prefix)} commands"
                )
                group_parser.set_defaults(_help=group_parser.print_help)
                groups[prefix] = group_parser.add_subparsers(title="commands", metavar="COMMAND")
        sub = groups[words[:-1]].add_parser(
            words[-1],
            help=_summary(module),
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    parser.set_defaults(_help=parser.print_help)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except EnvError as e:
        print(f"deja: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        args._help()
        return 2
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        return 130


NO_FINALIZATION = frozenset({"serve"})
"""Commands that end without the interpreter's finalization (`console`)."""


def console() -> None:
    """The `deja` console script: `main`, then the exit.

    NOTE: `deja serve` closes everything it opened before `main` returns: the engine core and
    its workers, the disk tier's writes, the tracer provider's spans. The interpreter's finalization would then only print noise: triton (pulled in by
    torch._dynamo when transformers' configs load, and by xgrammar's dependencies) reports its
    nanobind objects as leaked at teardown. So a replica that stopped cleanly flushes its logs
    and leaves with `os._exit`; a failed one and the other commands exit normally."""
    code = main()
    if code == 0 and len(sys.argv) > 1 and sys.argv[1] in NO_FINALIZATION:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
