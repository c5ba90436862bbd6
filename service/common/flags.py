"""argparse helpers: every flag also reads a DEJA_* environment variable.

`--max-num-seqs` reads `DEJA_MAX_NUM_SEQS`; a flag on the command line wins over the variable,
the variable over the built-in default. `--help` names the variable and shows the default.
Variables are read when the flag is added (the entry point builds its parser once).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "DEJA_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class EnvError(ValueError):
    """A DEJA_* variable holds a value its flag does not accept."""


def env_name(flag: str) -> str:
    """`--max-num-seqs` -> `DEJA_MAX_NUM_SEQS`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"expected one of {_TRUE + _FALSE[:-1]}, got {text!r}")


def _help(text: str, var: str, show_default: bool) -> str:
    suffix = f"[env: {var}]"
    if show_default:
        suffix = "(default: %(default)s) " + suffix
    return f"{text} {suffix}" if text else suffix


def _convert(var: str, raw: str, convert: Callable[[str], Any]) -> Any:
    try:
        return convert(raw)
    except (TypeError, ValueError) as e:
        raise EnvError(f"{var}={raw!r} is not valid: {e}") from None


def _env(flag: str, environ: Mapping[str, str] | None) -> tuple[str, str | None]:
    """The flag's variable and its value in `environ` (default os.environ); None when unset."""
    var = env_name(flag)
    return var, (os.environ if environ is None else environ).get(var)


def _add(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, var: str, **kwargs: Any
) -> argparse.Action:
    """`parser.add_argument`, the action remembering its variable (`env_var`)."""
    action = parser.add_argument(flag, **kwargs)
    action.env_var = var  # type: ignore[attr-defined]
    return action


def add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    *,
    type: Callable[[str], Any] = str,
    default: Any = None,
    help: str = "",
    choices: Sequence[Any] | None = None,
    metavar: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> argparse.Action:
    """A flag taking one value, defaulting to $DEJA_<FLAG> when set."""
    var, raw = _env(flag, environ)
    if raw is not None:
        default = _convert(var, raw, type)
        if choices is not None and default not in choices:
            raise EnvError(f"{var}={raw!r} must be one of {list(choices)}")
    return _add(
        parser,
        flag,
        var,
        type=type,
        default=default,
        choices=choices,
        metavar=metavar,
        help=_help(help, var, show_default=default is not None),
    )


def add_bool_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    *,
    default: bool | None,
    help: str = "",
    environ: Mapping[str, str] | None = None,
) -> argparse.Action:
    """`--flag/--no-flag`, defaulting to $DEJA_<FLAG> (1/0, true/false, yes/no, on/off).

    A None default means "neither given": the command decides (e.g. from the server's answer).
    """
    var, raw = _env(flag, environ)
    if raw is not None:
        default = _convert(var, raw, parse_bool)
    return _add(
        parser,
        flag,
        var,
        action=argparse.BooleanOptionalAction,
        default=default,
        help=_help(help, var, show_default=default is not None),
    )


def add_list_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    *,
    type: Callable[[str], Any] = str,
    help: str = "",
    metavar: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> argparse.Action:
    """A repeatable flag; $DEJA_<FLAG> holds a comma-separated list used when none is given."""
    var, raw = _env(flag, environ)
    default: list[Any] = []
    if raw is not None:
        default = [_convert(var, p.strip(), type) for p in raw.split(",") if p.strip()]
    return _add(
        parser,
        flag,
        var,
        action=_ReplaceDefaultAppend,
        type=type,
        default=default,
        metavar=metavar,
        help=_help(help + " (repeatable)", var + " (comma-separated)", show_default=False),
    )


class _ReplaceDefaultAppend(argparse.Action):
    """Like action="append", but values on the command line replace the env default."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest)
        items = [] if current is self.default else list(current)
        items.append(values)
        setattr(namespace, self.dest, items)


@dataclass(frozen=True, slots=True)
class ConfigFlag:
    """A flag that sets the config field `name`; its default is the field's value in the config
    it is added for (see `add_config_flags`)."""

    name: str
    """The config field; the flag is `--name-with-dashes`, less the `_s` of a field in seconds
    (`grace_period_s`: `--grace-period`), unless `flag` is given."""
    type: Callable[[str], Any]
    """Converts the flag's text; `bool` makes a --flag/--no-flag pair."""
    help: str = ""
    choices: Sequence[Any] | None = None
    flag: str | None = None
    """The option when it is not the one named after the field (e.g. --redis-timeout)."""

    @property
    def option(self) -> str:
        return self.flag or "--" + self.name.removesuffix("_s").replace("_", "-")

    @property
    def dest(self) -> str:
        """The flag's attribute in the parsed namespace."""
        return self.option[2:].replace("-", "_")


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    config: object,
    flags: Sequence[ConfigFlag],
) -> list[argparse.Action]:
    """The `flags` of one config, in order, each defaulting to the field's value in `config`."""
    acts = []
    for f in flags:
        default = getattr(config, f.name)
        if f.type is bool:
            acts.append(add_bool_flag(parser, f.option, default=default, help=f.help))
        else:
            acts.append(
                add_flag(
                    parser, f.option, type=f.type, default=default, help=f.help, choices=f.choices
                )
            )
    return acts


def config_values(args: argparse.Namespace, flags: Sequence[ConfigFlag]) -> dict[str, Any]:
    """Config keyword arguments: each field of `flags` with its flag's parsed value."""
    return {f.name: getattr(args, f.dest) for f in flags}


def to_argv(actions: Sequence[argparse.Action], args: argparse.Namespace) -> list[str]:
    """Flags that reproduce the values of `actions` in `args` (to start a child process)."""
    argv: list[str] = []
    for action in actions:
        value = getattr(args, action.dest)
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            if value is not None:
                argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, _ReplaceDefaultAppend):
            for item in value:
                argv += [flag, str(item)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv
