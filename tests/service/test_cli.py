"""The `deja` command line: DEJA_* flags, config builders, dispatch, generate and chat."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from clients.chat import chat_loop
from clients.client import DejaClient
from clients.session import ChatSession
from service import cli
from service.common.auth import parse_auth_token
from service.common.engine_args import add_engine_args, engine_config_from_args
from service.common.flags import EnvError, add_bool_flag, add_flag, add_list_flag, env_name, to_argv
from service.replica.config import ServiceConfig, service_config_from_args
from tests.engine.sample.structured_cases import CHOICES, SCHEMAS, check_json
from tests.service.conftest import Harness


def test_env_name() -> None:
    assert env_name("--max-num-seqs") == "DEJA_MAX_NUM_SEQS"


def test_flags_read_env_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEJA_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("DEJA_PREFIX_CACHING", "off")
    monkeypatch.setenv("DEJA_AUTH_TOKEN", "a:acme, b:globex")
    p = argparse.ArgumentParser()
    add_flag(p, "--max-num-seqs", type=int, default=256)
    add_bool_flag(p, "--prefix-caching", default=True)
    add_list_flag(p, "--auth-token")
    args = p.parse_args([])
    assert (args.max_num_seqs, args.prefix_caching, args.auth_token) == (
        7,
        False,
        ["a:acme", "b:globex"],
    )
    args = p.parse_args(["--max-num-seqs", "9", "--prefix-caching", "--auth-token", "c"])
    assert (args.max_num_seqs, args.prefix_caching, args.auth_token) == (9, True, ["c"])
    assert "[env: DEJA_MAX_NUM_SEQS]" in p.format_help()


def test_bad_env_value_says_which_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEJA_PORT", "fifty")
    with pytest.raises(EnvError, match="DEJA_PORT='fifty'"):
        add_flag(argparse.ArgumentParser(), "--port", type=int, default=1)
    monkeypatch.setenv("DEJA_DTYPE", "float8")
    with pytest.raises(EnvError, match="must be one of"):
        add_flag(argparse.ArgumentParser(), "--dtype", default="float32", choices=("float32",))
    assert cli.main(["serve", "--help"]) == 2  # reported, not a traceback


def test_engine_config_from_args_and_to_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEJA_MAX_NUM_SEQS", "5")
    p = argparse.ArgumentParser()
    actions = add_engine_args(p)
    flags = ["--block-size", "32", "--no-prefix-caching", "--num-device-blocks", "64"]
    args = p.parse_args([*flags, "--kv-events-max-blocks", "128"])
    cfg = engine_config_from_args(args, model_path="/models/x")
    assert cfg.cache.kv_events_max_blocks == 128
    assert cfg.model.path == "/models/x"
    assert cfg.cache.block_size == 32 and cfg.cache.num_device_blocks == 64
    assert cfg.cache.enable_prefix_caching is False
    assert cfg.scheduler.max_num_seqs == 5
    again = p.parse_args(to_argv(actions, args))
    assert vars(again) == vars(args)
    bad = p.parse_args(["--max-pinned-fraction", "2"])
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        engine_config_from_args(bad, model_path="/models/x")


def test_activations_flag_reaches_the_model_config() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([]), model_path="/m").model.activations == "float"
    cfg = engine_config_from_args(p.parse_args(["--activations", "int8"]), model_path="/m")
    assert cfg.model.activations == "int8"
    with pytest.raises(SystemExit):
        p.parse_args(["--activations", "int4"])


def test_service_config() -> None:
    assert parse_auth_token("tok:acme") == ("tok", "acme")
    token, tenant = parse_auth_token("tok")
    assert token == "tok" and tenant.startswith("tenant-")
    p = argparse.ArgumentParser()
    from service.replica.config import add_service_args

    add_service_args(p)
    cfg = service_config_from_args(p.parse_args(["--auth-token", "t1:a", "--port", "0"]))
    assert cfg.auth_enabled and cfg.tenants == {"t1": "a"} and cfg.port == 0
    with pytest.raises(ValueError, match="TLS needs both"):
        ServiceConfig(tls_cert="cert.pem")
    with pytest.raises(ValueError, match="needs tls_cert and tls_key"):
        ServiceConfig(tls_client_ca="ca.pem")
    cfg = service_config_from_args(
        p.parse_args(["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"])
    )
    assert cfg.tls_client_ca == "ca.pem"
    with pytest.raises(ValueError, match="unique"):
        ServiceConfig(auth_tokens=(("t", "a"), ("t", "b")))


def test_cli_lists_commands_and_skips_missing_modules(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    registered = cli.commands()
    assert registered["bench serve"] == "bench.loadgen"  # from the package's entry points
    extra = {"bench nothing": "bench.no_such_module", "ghost": "no_such_package.cmd"}
    monkeypatch.setattr(cli, "commands", lambda: {**registered, **extra})
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in ("serve", "chat", "generate", "bench"):
        assert name in out
    assert "ghost" not in out
    assert cli.main(["bench"]) == 2  # a group alone prints its help
    assert "serve" in capsys.readouterr().out


def test_command_modules_are_cheap_to_import() -> None:
    code = (
        "import sys, service.cli as c; c.build_parser();"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


async def test_generate_command(server: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "The quick brown fox", "--target", server.target]
    argv += ["--max-tokens", "5", "--temperature", "0", "--usage", "--raw"]
    assert await asyncio.to_thread(cli.main, argv) == 0
    out, err = capsys.readouterr()
    expected = await server.client.complete("The quick brown fox", max_tokens=5, temperature=0)
    assert out == expected.text + "\n"
    assert "completion 5 tokens" in err
    ttft = re.search(r"client ttft (\d+\.\d) ms", err)
    assert ttft is not None and float(ttft.group(1)) > 0, err

    bad = ["generate", "", "--target", server.target, "--no-chat"]
    assert await asyncio.to_thread(cli.main, bad) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


async def test_generate_sends_chat_when_the_model_has_a_template(
    server: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    info = await server.client.model_info()
    assert info.has_chat_template  # the tiny tokenizer carries a ChatML template
    assert info.quantization == "none" and info.weight_bytes > 0
    question = "What is the capital of France?"
    argv = ["generate", question, "--target", server.target, "--max-tokens", "6"]
    argv += ["--temperature", "0", "--usage"]
    assert await asyncio.to_thread(cli.main, argv) == 0
    out, err = capsys.readouterr()
    chat = await server.client.complete(
        messages=[{"role": "user", "content": question}], max_tokens=6, temperature=0
    )
    templated = await server.client.tokenize(messages=[{"role": "user", "content": question}])
    plain = await server.client.tokenize(question)
    assert len(templated) != len(plain)
    assert out == chat.text + "\n"
    assert f"usage: prompt {len(templated)} tokens" in err  # sent as a chat message


async def test_chat_loop(server: Harness) -> None:
    def run() -> str:
        with DejaClient(server.target) as client:
            session = ChatSession(client, system="Be brief.", max_tokens=4, temperature=0.0)
            stdin = io.StringIO(
                "What is your name?\n\n/usage\nHow are you?\n/reset\n/what\n/quit\n"
            )
            stdout = io.StringIO()
            assert chat_loop(session, stdin, stdout) == 0
            assert len(session.messages) == 1  # reset kept only the system message
            return stdout.getvalue()

    out = await asyncio.to_thread(run)
    assert "completion 4" in out and "(conversation reset)" in out and "commands:" in out


async def test_generate_json_schema(
    server: Harness, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    schema = SCHEMAS[2]
    path = tmp_path / "user.schema.json"
    path.write_text(json.dumps(schema))
    base = ["generate", "Give me a user.", "--target", server.target, "--temperature", "0"]
    argv = [*base, "--json-schema", str(path), "--max-tokens", "120"]
    assert await asyncio.to_thread(cli.main, argv) == 0
    out, _ = capsys.readouterr()
    check_json(out.rstrip("\n"), schema)

    # Cut by max_tokens: the partial text is printed, and the command says why it fails.
    argv = [*base, "--json-schema", str(path), "--max-tokens", "3"]
    assert await asyncio.to_thread(cli.main, argv) == 1
    out, err = capsys.readouterr()
    assert out.startswith("{")
    assert "not valid JSON (cut by --max-tokens; raise it)" in err, err

    # A schema the compiler rejects: INVALID_ARGUMENT with its message; a file that is not JSON
    # fails before any call.
    path.write_text('{"type": "objectx"}')
    assert await asyncio.to_thread(cli.main, [*base, "--json-schema", str(path)]) == 1
    assert 'INVALID_ARGUMENT: invalid json_schema: Unsupported type "objectx"' in (
        capsys.readouterr().err
    )
    path.write_text("{not json")
    assert await asyncio.to_thread(cli.main, [*base, "--json-schema", str(path)]) == 2
    assert f"--json-schema: {path} is not JSON" in capsys.readouterr().err


async def test_generate_regex_choice_and_json_object(
    server: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["generate", "x", "--target", server.target, "--temperature", "0"]
    argv = [*base, "--regex", "[0-9]{3}-[a-z]{2}", "--max-tokens", "20"]
    assert await asyncio.to_thread(cli.main, argv) == 0
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}\n", capsys.readouterr().out)

    argv = [*base, "--temperature", "1", "--seed", "1"]
    argv += [x for c in CHOICES for x in ("--choice", c)]
    assert await asyncio.to_thread(cli.main, argv) == 0
    assert capsys.readouterr().out.rstrip("\n") in CHOICES

    argv = [*base, "--json-object", "--max-tokens", "80"]
    code = await asyncio.to_thread(cli.main, argv)
    out, err = capsys.readouterr()
    if code == 0:
        assert isinstance(json.loads(out), dict)
    else:  # a random tiny model may not close the object within 80 tokens
        assert code == 1 and "cut by --max-tokens" in err, err

    with pytest.raises(SystemExit):  # at most one format
        cli.main([*base, "--regex", "a", "--choice", "a"])
    assert "not allowed with argument" in capsys.readouterr().err
