"""Every `deja` command, flag and DEJA_* variable in deploy/ is accepted by deja's own parser.

Commands come from the Dockerfile's CMD, compose.yaml's `command` (a service without one runs
the image's CMD) and the Kubernetes containers' command + args; variables from the Dockerfile's
ENV, compose `environment`, container `env` and the ConfigMaps they load with `envFrom`. Each
command is parsed by `service.cli.build_parser()` with its variables set, so an unknown flag, a
bad value, or a variable naming no flag of that command fails here instead of in a deployment.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from service import cli

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@dataclass
class Command:
    where: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def _dockerfile() -> tuple[list[str], dict[str, str]]:
    """The image's CMD (exec form) and its DEJA_* ENV values."""
    text = (DEPLOY / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)  # join continuation lines
    cmd: list[str] = []
    env: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("CMD ", "ENTRYPOINT ")):
            cmd = json.loads(line.split(None, 1)[1])
        elif line.startswith("ENV "):
            for part in shlex.split(line[4:]):
                key, _, value = part.partition("=")
                if key.startswith("DEJA_"):
                    env[key] = value
    return cmd, env


def _as_argv(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(v) for v in value]


def _as_env(value: Any) -> dict[str, str]:
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    out: dict[str, str] = {}
    for item in value or []:
        key, _, v = str(item).partition("=")
        out[key] = v
    return out


def _deja_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("DEJA_")}


def compose_commands() -> Iterator[Command]:
    image_cmd, image_env = _dockerfile()
    spec = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for name, svc in spec["services"].items():
        ours = "build" in svc or str(svc.get("image", "")).startswith("deja")
        argv = _as_argv(svc.get("command")) or (image_cmd if ours else [])
        env = {**(image_env if ours else {}), **_deja_env(_as_env(svc.get("environment")))}
        if argv[:1] == ["deja"]:
            yield Command(f"compose.yaml:{name}", argv, env)
        else:
            assert not _deja_env(env) or not ours, f"{name}: DEJA_* set for a non-deja command"


def k8s_commands() -> Iterator[Command]:
    _, image_env = _dockerfile()
    docs = [
        d
        for path in sorted((DEPLOY / "k8s").glob("*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if d
    ]
    config_maps = {
        d["metadata"]["name"]: {str(k): str(v) for k, v in (d.get("data") or {}).items()}
        for d in docs
        if d.get("kind") == "ConfigMap"
    }
    for d in docs:
        if d.get("kind") not in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            argv = _as_argv(c.get("command")) + _as_argv(c.get("args"))
            env = dict(image_env) if str(c.get("image", "")).startswith("deja") else {}
            for source in c.get("envFrom") or []:
                ref = source.get("configMapRef")
                if ref is not None:
                    assert ref["name"] in config_maps, f"unknown ConfigMap {ref['name']}"
                    env.update(_deja_env(config_maps[ref["name"]]))
            env.update({e["name"]: str(e.get("value", "")) for e in c.get("env") or []})
            if argv[:1] == ["deja"]:
                yield Command(f"k8s:{d['metadata']['name']}/{c['name']}", argv, _deja_env(env))


def dockerfile_commands() -> Iterator[Command]:
    cmd, env = _dockerfile()
    yield Command("Dockerfile:CMD", cmd, env)


ALL = [*dockerfile_commands(), *compose_commands(), *k8s_commands()]


def _command_parser(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    """The parser of `deja WORDS...` (descending through nested subcommands like `bench router`)."""
    p = parser
    for w in words:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or w not in subs[0].choices:
            break
        p = subs[0].choices[w]
    return p


def test_deploy_files_hold_the_expected_commands() -> None:
    kinds = {(c.where.split(":")[0], c.argv[1]) for c in ALL}
    assert {("Dockerfile", "serve"), ("compose.yaml", "serve"), ("compose.yaml", "route")} <= kinds
    assert {("k8s", "serve"), ("k8s", "route")} <= kinds


@pytest.mark.parametrize("command", ALL, ids=[c.where for c in ALL])
def test_command_is_accepted_by_deja(command: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in [k for k in os.environ if k.startswith("DEJA_")]:
        monkeypatch.delenv(key)
    for key, value in command.env.items():
        monkeypatch.setenv(key, value)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser = cli.build_parser()  # reads (and type-checks) the DEJA_* variables
            args = parser.parse_args(command.argv[1:])
    except SystemExit as e:
        pytest.fail(f"{command.where}: `{shlex.join(command.argv)}` rejected: {err.getvalue()} {e}")
    except ValueError as e:
        pytest.fail(f"{command.where}: a DEJA_* variable is rejected: {e}")
    assert getattr(args, "_run", None) is not None, f"{command.where}: not a deja command"

    sub = _command_parser(parser, command.argv[1:3])
    known = {getattr(a, "env_var", None) for a in sub._actions}
    unknown = sorted(set(command.env) - known)
    assert not unknown, f"{command.where}: {unknown} name no flag of `deja {command.argv[1]}`"

    # The config objects check combinations a parser cannot (e.g. the router needs replicas).
    if command.argv[1] == "route":
        from service.router.config import router_config_from_args

        router_config_from_args(args)
    elif command.argv[1] == "serve":
        from service.replica.config import service_config_from_args

        service_config_from_args(args)
